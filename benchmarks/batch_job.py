"""A batch job against LLM.generate on the same prompts: what the job's files and bookkeeping cost.

    python benchmarks/batch_job.py [--requests 1000] [--max-tokens 32] [--rounds 4] [--model DIR]
                                   [--out benchmarks/results/batch_job.json]

After a warm-up, each round, in this process, with one LLM (the engine's default settings, the demo model
unless --model): `LLM.generate` on every prompt in one call, and `run_job` on a JSONL file of the same prompts
(plain form, greedy, --max-tokens each) into a fresh output, the two in alternating order; each timed by one wall
clock around the whole call (tokenizing, and for the job reading the input, fingerprinting and appending every
result). Tokens/s is generated tokens over that time; the goal is the job's median within 10% of generate's
(ratio >= 0.9). Both must generate the same tokens (greedy), which the script checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import machine, timestamp, write_report

RESULTS = Path(__file__).parent / "results" / "batch_job.json"
GOAL = 0.9  # the job's tokens/s over generate's


def prompts(n: int) -> list[str]:
    """`n` distinct prompts of mixed lengths from the demo model's own prompts."""
    from offload.demo import DEMO_PROMPTS

    base = list(DEMO_PROMPTS)
    return [" ".join(base[(i + k) % len(base)] for k in range(1 + i % 3)) + f" ({i})" for i in range(n)]


def main(argv: list[str] | None = None) -> dict:
    from offload.api import LLM
    from offload.batch.job import run_job
    from offload.common.config import EngineConfig, SamplingParams
    from offload.demo import ensure_demo_model

    args = parse_args(argv)
    model = args.model.expanduser() if args.model else ensure_demo_model()
    texts = prompts(args.requests)
    llm = LLM(model, EngineConfig())
    params = SamplingParams(max_new_tokens=args.max_tokens)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="batch_job-") as tmp:
        src = Path(tmp) / "in.jsonl"
        src.write_text(
            "".join(
                json.dumps({"id": f"q{i}", "prompt": t, "max_tokens": args.max_tokens}) + "\n"
                for i, t in enumerate(texts)
            )
        )
        llm.generate(texts[:64], params)  # warm-up: first calls pick kernels and fault in pages, for neither side
        for r in range(args.rounds):
            out = Path(tmp) / f"out-{r}.jsonl"
            # alternate which side goes first, so that a drift of the shared machine falls on both
            sides = ("generate", "job") if r % 2 == 0 else ("job", "generate")
            for side in sides:
                llm.reset_prefix_cache()  # neither side finds the other's (or the warm-up's) prompts cached
                start = time.perf_counter()
                if side == "generate":
                    completions = llm.generate(texts, params)
                    generate_s = time.perf_counter() - start
                else:
                    summary = run_job(llm, src, out, progress=False)
                    job_s = time.perf_counter() - start
            generated = sum(len(c.token_ids) for c in completions)
            results = {json.loads(line)["id"]: json.loads(line) for line in out.read_text().splitlines()}
            same = all(results[f"q{i}"]["text"] == c.text for i, c in enumerate(completions))
            rounds.append(
                {
                    "first": sides[0],
                    "generate_seconds": generate_s,
                    "job_seconds": job_s,
                    "generate_tokens": generated,
                    "job_tokens": summary.generated_tokens,
                    "same_text": same,
                    "generate_tokens_per_second": generated / generate_s,
                    "job_tokens_per_second": summary.generated_tokens / job_s,
                }
            )
            print(
                f"round {r + 1} ({sides[0]} first): generate {generated / generate_s:.1f} tokens/s, "
                f"job {summary.generated_tokens / job_s:.1f} tokens/s, same text {same}",
                flush=True,
            )
    gen = statistics.median(r["generate_tokens_per_second"] for r in rounds)
    job = statistics.median(r["job_tokens_per_second"] for r in rounds)
    ratio = job / gen
    same = all(r["same_text"] and r["job_tokens"] == r["generate_tokens"] for r in rounds)
    print()
    print(f"{'engine':<22} {'tokens/s (median)':>18}")
    print(f"{'LLM.generate':<22} {gen:>18.1f}")
    print(f"{'offload batch job':<22} {job:>18.1f}")
    print(f"job / generate {ratio:.2f} (goal >= {GOAL}: {'PASS' if ratio >= GOAL else 'FAIL'}); same results: {same}")
    report = {
        "benchmark": "batch_job",
        "date": timestamp(),
        "machine": machine(Path(tempfile.gettempdir())),
        "settings": {
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "model": str(model),
        },
        "rounds": rounds,
        "generate_tokens_per_second": gen,
        "job_tokens_per_second": job,
        "ratio": ratio,
        "goal": GOAL,
        "pass": ratio >= GOAL and same,
        "same_results": same,
    }
    write_report(args.out, report)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", type=Path, help="model directory (default: the demo model)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if min(args.requests, args.max_tokens, args.rounds) < 1:
        raise SystemExit("--requests, --max-tokens and --rounds must be at least 1")
    return args


if __name__ == "__main__":
    main()
