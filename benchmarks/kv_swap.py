"""Preemption by swap against preemption by recompute, on the mixed-length workload under a KV budget that forces
preemptions.

    python benchmarks/kv_swap.py [--kv-positions 3072] [--repeats 3] [--work-dir ~/.cache/offload/bench] [--quick]
                                 [--out PATH]

mixed_lengths.py's checkpoint (a random bf16 Llama of 155M parameters, every weight resident) and workload (64
requests, prompts of 16..512 tokens, 8..128 new tokens each, greedy, eos ignored), with a device KV cache of
--kv-positions token slots: a fraction of what the batch wants at once, so running sequences are preempted.

  recompute   --no-prefix-cache: a preempted sequence's blocks are freed and it recomputes its prompt and outputs
  swap        the prefix cache with --kv-host-memory: a running sequence that would be preempted moves down instead
              (its blocks copied to the host part of the pool, where it keeps running and attending), new sequences
              that do not fit the device part start there, and cached prefix blocks evicted from the device go there

Both runs are the same engine, batch limits and workload, in this process, alternating for --repeats rounds.
Reported: tokens/s over the whole call, preemptions, sequences moved down, prefill tokens computed beyond the
prompts (recomputation), KV bytes moved down and back up, and whether both give the same tokens (greedy bf16: a
different batch composition can flip a near-tie, so agreement is reported, not assumed). Prints a table and writes
benchmarks/results/kv_swap.json with the machine it ran on.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from bench_common import ensure_checkpoint, kv_block_bytes, machine, timestamp, write_report
from mixed_lengths import FULL_SHAPE, FULL_WORKLOAD, QUICK_SHAPE, QUICK_WORKLOAD

RESULTS = Path(__file__).parent / "results" / "kv_swap.json"
MODES = ("recompute", "swap")


def run(model_dir: Path, requests, mode: str, kv_positions: int, block: int = 16) -> dict:
    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams

    per_block = kv_block_bytes(model_dir, block)
    config = dict(block_size=block, kv_cache_bytes=kv_positions // block * per_block, max_num_seqs=len(requests))
    if mode == "recompute":
        config["prefix_cache"] = False
    else:
        config["kv_host_memory"] = 4 * sum(len(r.prompt_ids) + r.new_tokens for r in requests) // block * per_block
    params = [SamplingParams(max_new_tokens=r.new_tokens, ignore_eos=True) for r in requests]
    with LLM(model_dir, EngineConfig(**config)) as llm:
        llm.generate_ids([[5, 6, 7, 8]], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        out = llm.generate_ids([list(r.prompt_ids) for r in requests], params)
        wall = time.perf_counter() - start
        s = llm.last_run
        host = llm.stats().kv_host
        host_peak = host.peak if host is not None else 0
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    return {
        "mode": mode,
        "wall_s": wall,
        "tokens_per_s": s.generated_tokens / wall,
        "generated_tokens": s.generated_tokens,
        "preemptions": s.preemptions,
        "moved_down": s.moved_down,
        "recomputed_tokens": s.prefill_tokens - prompt_tokens,
        "hit_tokens": s.prefix_hit_tokens,
        "kv_bytes_down": s.kv_bytes_down,
        "kv_bytes_up": s.kv_bytes_up,
        "kv_cache_bytes": config["kv_cache_bytes"],
        "kv_host_budget": config.get("kv_host_memory", 0),
        "kv_host_peak": host_peak,
        "tokens": [list(c.token_ids) for c in out],
    }


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-positions", type=int, default=3072, help="token slots of the device KV cache")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench").expanduser())
    p.add_argument("--quick", action="store_true", help="a small model and workload (the tests)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    shape, workload = (QUICK_SHAPE, QUICK_WORKLOAD) if args.quick else (FULL_SHAPE, FULL_WORKLOAD)
    if args.quick:
        args.kv_positions, args.repeats = 64, 1
    model_dir = ensure_checkpoint(args.work_dir / shape.name, asdict(shape))
    requests = workload.make(shape.vocab_size)
    rounds = [{mode: run(model_dir, requests, mode, args.kv_positions) for mode in MODES} for _ in range(args.repeats)]
    agree = [
        sum(a == b for a, b in zip(r["swap"]["tokens"], r["recompute"]["tokens"], strict=True)) / len(requests)
        for r in rounds
    ]
    for r in rounds:
        for mode in MODES:
            r[mode].pop("tokens")
    med = {
        mode: {k: statistics.median(r[mode][k] for r in rounds) for k in rounds[0][mode] if k != "mode"}
        for mode in MODES
    }
    speedup = statistics.median(r["swap"]["tokens_per_s"] / r["recompute"]["tokens_per_s"] for r in rounds)
    report = {
        "benchmark": "kv_swap",
        "time": timestamp(),
        "machine": machine(args.work_dir),
        "settings": {
            "model": str(model_dir),
            "workload": asdict(workload),
            "kv_positions": args.kv_positions,
            "repeats": args.repeats,
        },
        "medians": med,
        "swap_over_recompute_tokens_per_s": speedup,
        "same_tokens_share": agree,
        "rounds": rounds,
    }
    print(table(report))
    write_report(args.out, report)
    return report


def table(report: dict) -> str:
    med = report["medians"]
    lines = [
        f"{'mode':<10} {'tokens/s':>9} {'preemptions':>12} {'moved down':>11} {'recomputed':>11} {'KV down':>10} "
        f"{'KV up':>10}",
        *(
            f"{m:<10} {med[m]['tokens_per_s']:>9.1f} {med[m]['preemptions']:>12.0f} {med[m]['moved_down']:>11.0f} "
            f"{med[m]['recomputed_tokens']:>11.0f} {med[m]['kv_bytes_down'] / 2**20:>8.1f}Mi "
            f"{med[m]['kv_bytes_up'] / 2**20:>8.1f}Mi"
            for m in MODES
        ),
        "",
        f"swap / recompute tokens/s: {report['swap_over_recompute_tokens_per_s']:.2f}x (median of rounds); "
        f"requests with the same tokens: {', '.join(f'{a:.0%}' for a in report['same_tokens_share'])}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
