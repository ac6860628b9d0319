"""Shared-prefix reuse: 64 requests with one 1,024-token system prompt, each with its own 32-token question.

    python benchmarks/prefix_cache.py [--requests 64] [--system 1024] [--question 32] [--new-tokens 8]
                                      [--repeats 3] [--work-dir ~/.cache/offload/bench] [--quick] [--out PATH]

Builds (once, in the work dir) a random bf16 Llama of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV
heads, intermediate 1536, vocab 49152), every weight resident, and submits all requests at once to the engine core
(seeded random token ids; greedy, --new-tokens each, eos ignored). Three runs, each in a fresh process:

  cold      --no-prefix-cache: every prompt token computed
  reuse     the prefix cache on a fresh engine: the first request computes the system prompt, the rest share it
  restart   a fresh engine whose --offload-dir holds the KV blocks a previous process wrote through to disk
            (--kv-disk-memory): the system prompt's blocks come from disk, read with O_DIRECT

Each process first runs one short request of tokens no prompt shares (not timed), so none pays the first
step's one-time costs in its times. The restart run's previous process (`seed`, not timed) runs the same system prompt
with other questions, with the disk tier, and exits cleanly (its write-through queue drained): what the restart
finds on disk is the shared prefix, not the questions it is asked. Reported per run: prefill tokens computed,
mean and p50 time to first token (request submitted to its first token, from the core's per-request metrics), wall
time, KV bytes read back from disk. Every run must give the same tokens for every request (prefix hits give what
misses give) in exact arithmetic; in bf16 a prefix computed in another batch can differ in its last bits, so the
share of requests with the cold run's tokens is reported. Runs alternate for --repeats rounds; medians are
reported.

Goals (issue 15): reuse computes at least 10x fewer prefill tokens than cold and has at least 5x lower mean time
to first token; after a restart at least 90% of that gain remains (cold TTFT / restart TTFT >= 0.9 x cold TTFT /
reuse TTFT). Prints a table and writes benchmarks/results/prefix_cache.json with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import ensure_checkpoint, machine, timestamp, write_report

RESULTS = Path(__file__).parent / "results" / "prefix_cache.json"
SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
)
QUICK_SHAPE = SHAPE | dict(num_hidden_layers=4, hidden_size=192, intermediate_size=384, num_attention_heads=3)
GOALS = {"prefill_reduction": 10.0, "ttft_speedup": 5.0, "restart_share": 0.9}
RUNS = ("cold", "reuse", "restart")


def workload(requests: int, system: int, question: int, vocab: int, questions_seed: int = 1) -> list[list[int]]:
    """One system prompt (always the same) followed by each request's question (drawn from `questions_seed`)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(system)]
    rng = random.Random(questions_seed)
    return [shared + [rng.randrange(3, vocab) for _ in range(question)] for _ in range(requests)]


def child(args: argparse.Namespace) -> None:
    """One run in this process; prints one JSON line."""
    import time

    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams

    # the process before a restart saw the system prompt with other questions: what persists is the shared part
    prompts = workload(args.requests, args.system, args.question, args.vocab, 2 if args.run == "seed" else 1)
    config = dict(kv_cache_bytes=args.kv_cache << 20, max_step_tokens=4096)
    if args.run == "cold":
        config["prefix_cache"] = False
    if args.run in ("restart", "seed"):
        config |= dict(offload_dir=args.kv_dir, kv_disk_memory=args.kv_disk << 20)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    with LLM(args.model, EngineConfig(**config)) as llm:
        # warm-up: one short request of tokens no prompt has, so that no run pays the first step's one-time costs
        llm.generate_ids([[args.vocab - 1 - i for i in range(24)]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        core = llm.core
        before = core.counters()
        start = time.perf_counter()
        rids = [core.add_request(p, params, stream_text=False) for p in prompts]
        tokens: dict[int, list[int]] = {r: [] for r in rids}
        ttft: dict[int, float] = {}
        while core.has_work:
            for d in core.step():
                tokens[d.request_id].extend(d.token_ids)
                if d.metrics is not None:
                    ttft[d.request_id] = d.metrics.time_to_first_token
        wall = time.perf_counter() - start
        after = core.counters()
        disk = llm.stats().kv_disk
        result = {
            "run": args.run,
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
            "hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
            "mean_ttft_s": statistics.fmean(ttft.values()),
            "p50_ttft_s": statistics.median(ttft.values()),
            "wall_s": wall,
            "kv_bytes_up": after.kv_bytes_up - before.kv_bytes_up,
            "disk_blocks": None if disk is None else disk.blocks,
            "disk_bytes_read": None if disk is None else disk.bytes_read,
            "tokens": [tokens[r] for r in rids],
        }
    print(json.dumps(result))


CHILD_FLAGS = ("requests", "system", "question", "new_tokens", "kv_cache", "kv_disk", "vocab")


def run_child(
    args: argparse.Namespace, run: str, kv_dir: Path, flags: tuple[str, ...] = CHILD_FLAGS, script: str = __file__
) -> dict:
    """`script --child run` in a fresh process with `args`' values of `flags`; its last line of output, as JSON."""
    cmd = [sys.executable, script, "--child", run, "--model", str(args.model), "--kv-dir", str(kv_dir)]
    for flag in flags:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=args.timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_model(args: argparse.Namespace) -> dict:
    """The model's shape (QUICK_SHAPE with --quick), its checkpoint built once in the work dir as `args.model`, and
    its vocabulary size as `args.vocab`."""
    shape = QUICK_SHAPE if args.quick else SHAPE
    name = "llama-{num_hidden_layers}L-{hidden_size}-bf16".format(**shape)
    args.model = ensure_checkpoint(args.work_dir / name, shape)
    args.vocab = shape["vocab_size"]
    return shape


def add_run_args(p: argparse.ArgumentParser, runs: tuple[str, ...], results: Path) -> None:
    """The options of a benchmark whose runs are child processes (`--child RUN`), and the children's own."""
    p.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench").expanduser())
    p.add_argument("--quick", action="store_true", help="a small model and workload (the tests)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=results)
    p.add_argument("--child", choices=(*runs, "seed"), help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--kv-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"], help=argparse.SUPPRESS)


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache", type=int, default=1024, help="MiB of device KV cache")
    p.add_argument("--kv-disk", type=int, default=2048, help="MiB of disk for KV blocks (restart run)")
    add_run_args(p, RUNS, RESULTS)
    args = p.parse_args(argv)
    if args.child:
        args.run = args.child
        return child(args)
    if args.quick:
        args.requests, args.system, args.question, args.new_tokens, args.repeats = 8, 128, 16, 4, 1
        args.kv_cache, args.kv_disk = 64, 64
    shape = bench_model(args)
    rounds: list[dict[str, dict]] = []
    for _ in range(args.repeats):
        kv_dir = Path(tempfile.mkdtemp(prefix="prefix-kv-", dir=args.work_dir))
        try:
            round_ = {"cold": run_child(args, "cold", kv_dir), "reuse": run_child(args, "reuse", kv_dir)}
            seed = run_child(args, "seed", kv_dir)
            round_["restart"] = run_child(args, "restart", kv_dir)
            round_["restart"]["seeded_blocks"] = seed["disk_blocks"]
        finally:
            shutil.rmtree(kv_dir, ignore_errors=True)
        rounds.append(round_)
    report = summarize(args, shape, rounds)
    print(table(report))
    write_report(args.out, report)
    return report


def summarize(args: argparse.Namespace, shape: dict, rounds: list[dict[str, dict]]) -> dict:
    def median(run: str, key: str) -> float:
        return statistics.median(r[run][key] for r in rounds)

    # share of requests whose tokens equal the cold run's, per run (bf16: a prefix computed in another batch can
    # differ in its last bits, which flips near-tied greedy tokens of a random-weight model)
    same = {
        run: statistics.fmean(
            a == b for r in rounds for a, b in zip(r[run]["tokens"], r["cold"]["tokens"], strict=True)
        )
        for run in RUNS
    }
    med = {run: {k: median(run, k) for k in ("prefill_tokens", "mean_ttft_s", "p50_ttft_s", "wall_s")} for run in RUNS}
    reduction = med["cold"]["prefill_tokens"] / max(med["reuse"]["prefill_tokens"], 1)
    speedup = med["cold"]["mean_ttft_s"] / med["reuse"]["mean_ttft_s"]
    restart_speedup = med["cold"]["mean_ttft_s"] / med["restart"]["mean_ttft_s"]
    measured = {
        "prefill_reduction": reduction,
        "ttft_speedup": speedup,
        "restart_share": restart_speedup / speedup,
        "restart_ttft_speedup": restart_speedup,
        "restart_prefill_reduction": med["cold"]["prefill_tokens"] / max(med["restart"]["prefill_tokens"], 1),
    }
    verdicts = {k: measured[k] >= goal for k, goal in GOALS.items()}
    for r in rounds:
        for run in RUNS:
            r[run].pop("tokens")
    return {
        "benchmark": "prefix_cache",
        "time": timestamp(),
        "machine": machine(args.work_dir),
        "settings": {
            "model_shape": shape,
            "requests": args.requests,
            "system_tokens": args.system,
            "question_tokens": args.question,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "kv_cache_mib": args.kv_cache,
            "kv_disk_mib": args.kv_disk,
        },
        "medians": med,
        "measured": measured,
        "goals": GOALS,
        "verdicts": verdicts,
        "same_tokens": same,
        "rounds": rounds,
    }


def table(report: dict) -> str:
    med, m, v = report["medians"], report["measured"], report["verdicts"]
    lines = [
        f"{'run':<9} {'prefill tokens':>15} {'mean TTFT s':>12} {'p50 TTFT s':>11} {'wall s':>8}",
        *(
            f"{run:<9} {med[run]['prefill_tokens']:>15.0f} {med[run]['mean_ttft_s']:>12.3f} "
            f"{med[run]['p50_ttft_s']:>11.3f} {med[run]['wall_s']:>8.2f}"
            for run in RUNS
        ),
        "",
        f"prefill tokens, cold / reuse   {m['prefill_reduction']:6.1f}x  (goal >= {GOALS['prefill_reduction']:.0f}x: "
        f"{'PASS' if v['prefill_reduction'] else 'FAIL'})",
        f"mean TTFT, cold / reuse        {m['ttft_speedup']:6.1f}x  (goal >= {GOALS['ttft_speedup']:.0f}x: "
        f"{'PASS' if v['ttft_speedup'] else 'FAIL'})",
        f"mean TTFT, cold / restart      {m['restart_ttft_speedup']:6.1f}x  = {m['restart_share']:.0%} of the gain "
        f"(goal >= {GOALS['restart_share']:.0%}: {'PASS' if v['restart_share'] else 'FAIL'})",
        "requests with the cold run's tokens: "
        + ", ".join(f"{run} {share:.0%}" for run, share in report["same_tokens"].items()),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
