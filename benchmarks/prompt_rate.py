"""A long prompt through the 1.1B checkpoint's layers, against this machine's own bfloat16 GEMM rate.

A prompt's work is GEMMs and attention, so a prefill can run near the rate of torch's bfloat16 GEMM (oneDNN: AMX
tiles where the CPU has them, AVX-512 BF16 elsewhere) only if every part of it takes the fastest path this CPU has.
This runs one prompt of --prompt-tokens (default 2047: the checkpoint's 2048 positions hold it and its one new
token) through every layer of offload_vs_peers.py's 1.1B-shaped
checkpoint (TinyLlama's shape, random bfloat16 weights, every weight in RAM) and counts the FLOP of its layers:
the seven projections (2 x tokens x their weights) and causal attention (4 x heads x head_dim x tokens x (tokens + 1)
/ 2). Its rate, FLOP over the prefill's seconds (RunStats: the step's wall time, embedding and head included), is
set against torch's bfloat16 GEMM measured in the same process just before: F.linear of [tokens, 2048] by the MLP's
[5632, 2048] weight, packed for oneDNN as the engine packs resident weights, the best of five.

Two ways of choosing the CPU kernels, each in processes of its own, taken in turn repeat by repeat: "timed" (the
default: kernels/choice.py's timings on this machine) and "native" (OFFLOAD_KERNELS=native: every native kernel at
thresholds fixed on a Zen 4 EPYC). Each process prefills once untimed, then once timed. Prints a table and writes
benchmarks/results/prompt_rate.json with the machine.

    python benchmarks/prompt_rate.py [--layers 22] [--prompt-tokens 2047] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import machine, timestamp, write_report
from peer_engines import SHAPE, peers_checkpoint

MODES = {"timed": "", "native": "native"}  # mode -> OFFLOAD_KERNELS


def layer_flop(tokens: int, layers: int) -> float:
    """FLOP of `layers` decoder layers of SHAPE over one causal prompt of `tokens` tokens."""
    hidden, ffn = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    head_dim = hidden // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * head_dim
    weights = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * ffn  # q, k, v, o, gate, up, down
    attention = 4 * SHAPE["num_attention_heads"] * head_dim * tokens * (tokens + 1) / 2
    return layers * (2 * tokens * weights + attention)


def gemm_rate(tokens: int) -> float:
    """torch's bfloat16 GEMM in FLOP/s: [tokens, hidden] by the MLP's weight, packed as the engine packs it (else
    dense, where this torch cannot pack), the best of five after a warm-up."""
    import torch

    from offload.kernels.linear import linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    hidden, ffn = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w = torch.randn(ffn, hidden, generator=gen).div(45).to(torch.bfloat16)
    best = {}
    for name, weight in (("dense", w), ("packed", _packed(pack_weight, w))):
        if weight is None:
            continue
        linear(x, weight)
        took = []
        for _ in range(5):
            start = time.perf_counter()
            linear(x, weight)
            took.append(time.perf_counter() - start)
        best[name] = 2 * tokens * hidden * ffn / min(took)
    return max(best.values())


def _packed(pack, w):
    try:
        return pack(w)
    except RuntimeError:  # this CPU's oneDNN cannot pack bfloat16
        return None


def worker(model_dir: Path, tokens: int) -> dict:
    """Load the checkpoint (every weight in RAM), prefill one prompt untimed and one timed; the GEMM rate just
    before the timed one."""
    import torch

    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams
    from offload.kernels import choice

    gen = torch.Generator().manual_seed(1)
    # two prompts: the timed one shares no block with the warm-up's (no prefix cache hit)
    warmup, prompt = (torch.randint(3, SHAPE["vocab_size"], (tokens,), generator=gen).tolist() for _ in range(2))
    config = EngineConfig(dtype="bfloat16", max_step_tokens=max(tokens, 4096), micro_batch_tokens=max(tokens, 2048))
    with LLM(model_dir, config) as llm:
        params = SamplingParams(max_new_tokens=1, ignore_eos=True)
        llm.generate([warmup], params)  # warm-up: kernels chosen, pages faulted in
        rate = gemm_rate(tokens)
        llm.generate([prompt], params)
        stats = llm.last_run
    assert stats.prefill_tokens == tokens, f"{stats.prefill_tokens} of {tokens} prompt tokens computed"
    flop = layer_flop(tokens, SHAPE_LAYERS[0])
    return {
        "prefill_seconds": stats.prefill_seconds,
        "steps": stats.steps,
        "layer_flop": flop,
        "prefill_flop_per_s": flop / stats.prefill_seconds,
        "gemm_flop_per_s": rate,
        "of_gemm": flop / stats.prefill_seconds / rate,
        "cpu_paths": choice.summary(),
        "threads": torch.get_num_threads(),
    }


SHAPE_LAYERS = [0]  # the checkpoint's layer count, set by main and by --worker


def run(mode: str, model_dir: Path, layers: int, tokens: int) -> dict:
    env = dict(os.environ)
    env.pop("OFFLOAD_KERNELS", None)
    if MODES[mode]:
        env["OFFLOAD_KERNELS"] = MODES[mode]
    cmd = [sys.executable, __file__, "--worker", str(model_dir), "--layers", str(layers)]
    proc = subprocess.run([*cmd, "--prompt-tokens", str(tokens)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} worker failed (exit status {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path.home() / ".cache/offload/bench")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--prompt-tokens", type=int, default=2047)
    p.add_argument("--repeats", type=int, default=2, help="processes per mode, taken in turn")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prompt_rate.json")
    args = p.parse_args()
    SHAPE_LAYERS[0] = args.layers
    if args.worker:
        print(json.dumps(worker(args.worker, args.prompt_tokens)))
        return
    model_dir = peers_checkpoint(args.work_dir, args.layers)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            print(f"prefilling {args.prompt_tokens} tokens, {mode} ...", flush=True)
            runs[mode].append(run(mode, model_dir, args.layers, args.prompt_tokens))
    rows = {}
    for mode, rs in runs.items():
        rows[mode] = {
            "prefill_seconds": statistics.median(r["prefill_seconds"] for r in rs),
            "prefill_gflop_per_s": statistics.median(r["prefill_flop_per_s"] for r in rs) / 1e9,
            "gemm_gflop_per_s": statistics.median(r["gemm_flop_per_s"] for r in rs) / 1e9,
            "of_gemm": statistics.median(r["of_gemm"] for r in rs),
        }
    print(f"\n{'kernels':<8} {'prefill s':>10} {'GFLOP/s':>9} {'GEMM GFLOP/s':>13} {'of GEMM':>8}")
    for mode, r in rows.items():
        print(
            f"{mode:<8} {r['prefill_seconds']:>10.2f} {r['prefill_gflop_per_s']:>9.0f} {r['gemm_gflop_per_s']:>13.0f} "
            f"{r['of_gemm']:>7.0%}"
        )
    print(f"timed paths: {runs['timed'][-1]['cpu_paths']}")
    report = {"benchmark": "prompt_rate", "date": timestamp(), "machine": machine(args.work_dir)}
    report |= {"checkpoint": str(model_dir), "layers": args.layers, "prompt_tokens": args.prompt_tokens}
    report |= {"repeats": args.repeats, "rows": rows, "runs": runs}
    report["clock"] = "RunStats.prefill_seconds of the timed prefill (the second in its process); medians of repeats"
    write_report(args.out, report)


if __name__ == "__main__":
    main()
