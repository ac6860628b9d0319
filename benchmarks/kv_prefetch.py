"""Cached KV blocks read from disk while a step computes, against reading them at admission (--no-kv-prefetch).

    python benchmarks/kv_prefetch.py [--requests 64] [--history 1024] [--question 16] [--new-tokens 8]
                                     [--max-num-seqs 8] [--repeats 3] [--work-dir ~/.cache/offload/bench]
                                     [--quick] [--out PATH]

The workload is resumed conversations after a restart: each of --requests requests has its own --history-token
history, whose KV blocks an earlier process (`seed`, not timed) computed and wrote through to the disk tier
(--kv-disk-memory in a fresh --offload-dir per round), and asks a --question-token follow-up for --new-tokens
(greedy, eos ignored). All requests are submitted at once to the engine core of a fresh process, at most
--max-num-seqs running: the rest wait, and their histories come from disk when they are admitted (`admission`,
--no-kv-prefetch) or while the steps before compute (`prefetch`, the default). Both read the same block files
with O_DIRECT (the store writes them with fsync and drops them from the page cache). The model is a random bf16
Llama of SmolLM2-135M's shape, every weight resident. Each process first runs one short request of tokens no
prompt shares (not timed).

Reported per run (medians over --repeats alternating rounds): wall time of the whole submission, mean time to first
token, blocks read ahead and at admission, the seconds spent reading blocks (in the reader thread with prefetch:
off the step's path), prompt tokens computed. Both runs must give every request the same tokens (the same bytes
come from disk either way). Prints a table and writes benchmarks/results/kv_prefetch.json with the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
from pathlib import Path

from bench_common import machine, timestamp, write_report
from prefix_cache import add_run_args, bench_model, run_child

RESULTS = Path(__file__).parent / "results" / "kv_prefetch.json"
RUNS = ("admission", "prefetch")


def workload(args: argparse.Namespace, tail_seed: int) -> list[list[int]]:
    """Each request's own history (always the same), then a tail drawn from `tail_seed`."""
    rng = random.Random(0)
    histories = [[rng.randrange(3, args.vocab) for _ in range(args.history)] for _ in range(args.requests)]
    rng = random.Random(tail_seed)
    return [h + [rng.randrange(3, args.vocab) for _ in range(args.question)] for h in histories]


def child(args: argparse.Namespace) -> None:
    """One run in this process; prints one JSON line."""
    import time

    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams

    seed = args.run == "seed"
    prompts = workload(args, 2 if seed else 1)  # the seed's tails differ: what persists is the histories
    config = dict(
        kv_cache_bytes=args.kv_cache << 20,
        max_step_tokens=4096,
        offload_dir=args.kv_dir,
        kv_disk_memory=args.kv_disk << 20,
        max_num_seqs=16 if seed else args.max_num_seqs,
        kv_prefetch=args.run != "admission",
    )
    params = SamplingParams(max_new_tokens=1 if seed else args.new_tokens, ignore_eos=True)
    with LLM(args.model, EngineConfig(**config)) as llm:
        llm.generate_ids([[args.vocab - 1 - i for i in range(24)]], SamplingParams(max_new_tokens=2, ignore_eos=True))
        core = llm.core
        before, moved_before = core.counters(), llm.stats().kv_tiers
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
        core.flush_kv()  # what the last step computed goes through to disk (not timed)
        kv = llm.parts.kv
        moved = llm.stats().kv_tiers
        ahead = after.kv_blocks_prefetched - before.kv_blocks_prefetched
        result = {
            "run": args.run,
            "wall_s": wall,
            "mean_ttft_s": statistics.fmean(ttft.values()),
            "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
            "hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
            "blocks_read_ahead": ahead,
            "blocks_read_at_admission": moved.promoted_disk - moved_before.promoted_disk - ahead,
            "disk_read_s": moved.disk_seconds - moved_before.disk_seconds,
            "disk_blocks": kv.tiers.disk.blocks,
            "tokens": [tokens[r] for r in rids],
        }
    print(json.dumps(result))


CHILD_FLAGS = ("requests", "history", "question", "new_tokens", "max_num_seqs", "kv_cache", "kv_disk", "vocab")


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--history", type=int, default=1024)
    p.add_argument("--question", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache", type=int, default=1024, help="MiB of device KV cache")
    p.add_argument("--kv-disk", type=int, default=4096, help="MiB of disk for KV blocks")
    add_run_args(p, RUNS, RESULTS)
    args = p.parse_args(argv)
    if args.child:
        args.run = args.child
        return child(args)
    if args.quick:
        args.requests, args.history, args.question, args.new_tokens, args.repeats = 8, 128, 8, 4, 1
        args.max_num_seqs, args.kv_cache, args.kv_disk = 2, 64, 64
    shape = bench_model(args)
    rounds: list[dict[str, dict]] = []
    for i in range(args.repeats):
        kv_dir = Path(tempfile.mkdtemp(prefix="prefetch-kv-", dir=args.work_dir))
        try:
            seeded = run_child(args, "seed", kv_dir, CHILD_FLAGS, __file__)["disk_blocks"]
            order = RUNS if i % 2 == 0 else RUNS[::-1]
            round_ = {run: run_child(args, run, kv_dir, CHILD_FLAGS, __file__) for run in order}
            round_["seeded_blocks"] = seeded
        finally:
            shutil.rmtree(kv_dir, ignore_errors=True)
        rounds.append(round_)
    report = summarize(args, shape, rounds)
    print(table(report))
    write_report(args.out, report)
    return report


def summarize(args: argparse.Namespace, shape: dict, rounds: list[dict]) -> dict:
    keys = ("wall_s", "mean_ttft_s", "prefill_tokens", "blocks_read_ahead", "blocks_read_at_admission", "disk_read_s")
    med = {run: {k: statistics.median(r[run][k] for r in rounds) for k in keys} for run in RUNS}
    same = all(r["admission"]["tokens"] == r["prefetch"]["tokens"] for r in rounds)
    for r in rounds:
        for run in RUNS:
            r[run].pop("tokens")
    return {
        "benchmark": "kv_prefetch",
        "time": timestamp(),
        "machine": machine(args.work_dir),
        "settings": {
            "model_shape": shape,
            "requests": args.requests,
            "history_tokens": args.history,
            "question_tokens": args.question,
            "new_tokens": args.new_tokens,
            "max_num_seqs": args.max_num_seqs,
            "repeats": args.repeats,
            "kv_cache_mib": args.kv_cache,
            "kv_disk_mib": args.kv_disk,
        },
        "medians": med,
        "measured": {
            "wall_speedup": med["admission"]["wall_s"] / med["prefetch"]["wall_s"],
            "ttft_speedup": med["admission"]["mean_ttft_s"] / med["prefetch"]["mean_ttft_s"],
        },
        "same_tokens": same,
        "rounds": rounds,
    }


def table(report: dict) -> str:
    med, m = report["medians"], report["measured"]
    head = f"{'run':<10} {'wall s':>7} {'mean TTFT s':>12} {'read ahead':>11} {'at admission':>13} {'read s':>7}"
    lines = [
        head,
        *(
            f"{run:<10} {med[run]['wall_s']:>7.2f} {med[run]['mean_ttft_s']:>12.3f} "
            f"{med[run]['blocks_read_ahead']:>11.0f} {med[run]['blocks_read_at_admission']:>13.0f} "
            f"{med[run]['disk_read_s']:>7.2f}"
            for run in RUNS
        ),
        "",
        f"wall, admission / prefetch       {m['wall_speedup']:.2f}x",
        f"mean TTFT, admission / prefetch  {m['ttft_speedup']:.2f}x",
        f"every request the same tokens both ways: {'yes' if report['same_tokens'] else 'NO'}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
