"""Quantized weights against bf16 on a decode-heavy streaming workload: tokens/s, bytes read, the limit of each.

    python benchmarks/quantized.py [--work-dir ~/.cache/offload/bench] [--layers 22] [--budget 600MB]
                                   [--formats bf16,int8,int4] [--repeats 2]

The checkpoint is the peer benchmark's random bf16 Llama of TinyLlama-1.1B's shape (benchmarks/peer_engines.py),
converted once per format by `offload convert` (int4: groups of 128, int8: one scale per output channel, both in
the cpu layout). The workload: 8 prompts of 32 random token ids, 64 new tokens each, greedy, the whole batch in one
step, a weight budget of --budget (the KV cache on top). Every format runs once per round, in rotating order, in a
fresh interpreter, after the page cache is dropped; the median of the rounds is its result.

The physical limit of each format: per pass, max(its streamed bytes at the best read rate measured on exactly those
bytes (re-read with O_DIRECT) or reached by its own reads in any round, that pass's compute time with every weight
of that format resident, the fastest of the rounds). A format faster than its limit is reported as proof the
limit is wrong, never as a ratio under 1. Prints a table and the goals and writes benchmarks/results/quantized.json
with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench_common import ensure_checkpoint, machine, timestamp, write_report
from offload_vs_peers import fastest_passes, median_run, physical_limit, rounds, spread, streamed_read
from peer_engines import (
    SHAPE,
    EngineResult,
    Workload,
    drop_page_cache,
    files_under,
    peers_checkpoint,
    run_isolated,
    run_ours,
)

RESULTS = Path(__file__).parent / "results" / "quantized.json"
WORKLOAD = Workload(prompts=8, prompt_tokens=32, new_tokens=64)
FORMATS = {  # name -> (bits, group size, layout); bf16 is the checkpoint itself
    "bf16": None,
    "int8": (8, 0, "cpu"),
    "int4": (4, 128, "cpu"),
}
QUICK_SHAPE = {  # --quick: a small Llama whose layers stream under a 4 MB budget
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
}
GOALS = {"int4": (2.5, 1.25), "int8": (1.6, 1.25)}  # (tokens/s over bf16, or at most this many times its limit)


def format_dir(base: Path, name: str, work_dir: Path) -> tuple[Path, float | None]:
    """The checkpoint of format `name`, converted from `base` once; returns it and the conversion's seconds."""
    if FORMATS[name] is None:
        return base, None
    from offload.common.quant import WeightQuant
    from offload.convert.quantize import convert

    quant = WeightQuant(*FORMATS[name])
    out = work_dir / f"{base.name}-{quant.name}"
    if (out / "config.json").exists():
        return out, None
    start = time.perf_counter()
    convert(base, out, quant)
    return out, time.perf_counter() - start


def worker_main(args: argparse.Namespace) -> None:
    budget = None if args.resident else args.budget_bytes
    result = run_ours(args.model, budget, args.workload, args.work_dir)
    args.result.write_text(json.dumps(asdict(result)))


def run_worker(name: str, model_dir: Path, args: argparse.Namespace, resident: bool) -> EngineResult:
    """Drop the page cache, run one format in a fresh interpreter, read back its result."""
    out = args.work_dir / f"result-quantized-{name}.json"
    method = drop_page_cache(files_under(model_dir))
    cmd = [sys.executable, __file__, "--worker", "--model", str(model_dir), "--result", str(out)]
    cmd += ["--work-dir", str(args.work_dir), "--budget", args.budget, "--layers", str(args.layers)]
    cmd += ["--workload", json.dumps(asdict(args.workload))] + (["--resident"] if resident else [])
    label = f"{name} ({'all resident' if resident else 'streamed'})"
    log = args.work_dir / f"quantized-{name}{'-resident' if resident else ''}.log"
    return run_isolated(name, label, cmd, out, log, method)


def limit_of(name: str, model_dir: Path, streamed: list[EngineResult], resident: list[EngineResult]) -> dict:
    """The format's physical limit (seconds for its run) and what binds it."""
    run = median_run(streamed)
    if run.status != "ok" or not any(r.status == "ok" for r in resident):
        return {}
    compute = fastest_passes(resident)
    if not run.streamed_bytes_per_pass:
        return {"seconds": sum(compute), "read_gbps": None, "binds": "compute", "io_seconds": 0.0}
    same = streamed_read(model_dir, run.extra["layer_tiers"], passes=min(run.passes, 4))
    engine_gbps = [r.extra["read_gbps"] for r in streamed if r.status == "ok"]
    gbps = max(same["best_gbps"], *engine_gbps)
    io = run.streamed_bytes_per_pass * run.passes / (gbps * 1e9)
    return {
        "seconds": physical_limit(run.streamed_bytes_per_pass, gbps, compute),
        "read_gbps": gbps,
        "raw_reread_gbps": same["runs_gbps"],
        "io_seconds": io,
        "compute_seconds": sum(compute),
        "binds": "disk" if io > sum(compute) else "compute",
    }


def table(rows: dict[str, dict]) -> str:
    head = (
        f"{'format':<6} {'weights':>9} {'streamed/pass':>13} {'layers dev/disk':>15} {'tok/s':>7} {'(min-max)':>13} "
        f"{'vs bf16':>7} {'limit tok/s':>11} {'x limit':>7} {'binds':>7} {'tokens = bf16':>13}"
    )
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        if r["status"] != "ok":
            lines.append(f"{name:<6} {r['status']}")
            continue
        lim = r["limit"]
        lines.append(
            f"{name:<6} {r['weight_bytes'] / 1e6:>7.0f}MB {r['streamed_bytes_per_pass'] / 1e6:>11.0f}MB "
            f"{r['layers_resident']:>7}/{r['layers_streamed']:<7} {r['tokens_per_second']:>7.2f} "
            f"({r['min_tokens_per_second']:>5.2f}-{r['max_tokens_per_second']:<5.2f}) {r['speedup_vs_bf16']:>6.2f}x "
            f"{lim.get('tokens_per_second', float('nan')):>11.2f} {_times(r.get('x_limit')):>7} "
            f"{lim.get('binds', '?'):>7} {r['token_agreement_with_bf16']:>12.0%}"
        )
    return "\n".join(lines)


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def main_run(args: argparse.Namespace) -> dict:
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    bad = [n for n in names if n not in FORMATS]
    if bad or "bf16" not in names:
        raise SystemExit(f"--formats: a subset of {', '.join(FORMATS)} including bf16, got {args.formats!r}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.quick:
        base = ensure_checkpoint(args.work_dir / "llama-quick-h256-bf16", QUICK_SHAPE)
    else:
        base = peers_checkpoint(args.work_dir, args.layers)
    dirs, converted = {}, {}
    for name in names:
        dirs[name], seconds = format_dir(base, name, args.work_dir)
        if seconds is not None:
            converted[name] = seconds
            print(f"converted {name} in {seconds:.0f} s -> {dirs[name]}", flush=True)
    streamed: dict[str, list[EngineResult]] = {n: [] for n in names}
    resident: dict[str, list[EngineResult]] = {n: [] for n in names}
    for i, order in enumerate(rounds(names, args.repeats)):
        print(f"round {i + 1} of {args.repeats}: {', '.join(order)}", flush=True)
        for name in order:
            streamed[name].append(run_worker(name, dirs[name], args, resident=False))
    for name in names:  # the compute half of each limit: every weight resident (the fastest pass of the rounds)
        for _ in range(args.resident_repeats):
            resident[name].append(run_worker(name, dirs[name], args, resident=True))
    bf16 = median_run(streamed["bf16"])
    rows = {}
    for name in names:
        run = median_run(streamed[name])
        rows[name] = _row(name, run, streamed[name], resident[name], dirs[name], bf16)
    print()
    print(table(rows))
    print()
    goal_rows = []
    for name, (speedup, within) in GOALS.items():
        if name not in rows or rows[name]["status"] != "ok":
            continue
        r = rows[name]
        # a run under its limit proves the limit wrong: it meets nothing
        met = r["speedup_vs_bf16"] >= speedup or (r["x_limit"] is not None and 1 <= r["x_limit"] <= within)
        goal = f"{name}: tokens/s at least {speedup}x bf16, or within {within}x of its physical limit"
        value = f"{r['speedup_vs_bf16']:.2f}x bf16, {_times(r['x_limit'])} its limit"
        goal_rows.append({"goal": goal, "measured": value, "verdict": "met" if met else "not met"})
        print(f"{'met' if met else 'NOT MET':<7} {goal}: {value}")
    for name, r in rows.items():
        if r["status"] == "ok" and r["x_limit"] is not None and r["x_limit"] < 1:
            print(f"{name} ran faster than its physical limit: the limit is wrong")
    report = {
        "benchmark": "quantized",
        "date": timestamp(),
        "machine": machine(args.work_dir),
        "checkpoint": {"dir": str(base), **(QUICK_SHAPE if args.quick else SHAPE | {"layers": args.layers})},
        "formats": {
            n: FORMATS[n] and dict(zip(("bits", "group_size", "layout"), FORMATS[n], strict=True)) for n in names
        },
        "conversion_seconds": converted,
        "budget_bytes": args.budget_bytes,
        "workload": asdict(args.workload),
        "repeats": args.repeats,
        "clock": "harness perf_counter around each generate call, every format in its own process, page cache dropped",
        "results": rows,
        "goals": goal_rows,
    }
    write_report(args.out, report)
    return report


def _row(
    name: str, run: EngineResult, runs: list[EngineResult], resident: list[EngineResult], model_dir: Path, bf16
) -> dict:
    if run.status != "ok":
        return {"status": run.status}
    limit = limit_of(name, model_dir, runs, resident)
    if limit:
        limit["tokens_per_second"] = run.generated_tokens / limit["seconds"]
    walls = spread(runs)
    same = [a == b for x, y in zip(run.token_ids, bf16.token_ids, strict=False) for a, b in zip(x, y, strict=False)]
    weight_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return {
        "status": "ok",
        "weight_bytes": weight_bytes,
        "streamed_bytes_per_pass": run.streamed_bytes_per_pass,
        "storage_bytes_read": run.storage_bytes_read,
        "engine_bytes_read": run.extra["engine_bytes_read"],
        "passes": run.passes,
        "layers_resident": run.layers_resident,
        "layers_streamed": run.layers_streamed,
        "wall_seconds": run.wall_seconds,
        "tokens_per_second": run.tokens_per_second,
        "min_tokens_per_second": run.generated_tokens / walls["max_wall_seconds"],
        "max_tokens_per_second": run.generated_tokens / walls["min_wall_seconds"],
        "speedup_vs_bf16": run.tokens_per_second / bf16.tokens_per_second if bf16.status == "ok" else None,
        "limit": limit,
        "x_limit": run.wall_seconds / limit["seconds"] if limit else None,
        "read_gbps": run.extra["read_gbps"],
        "stall_seconds": run.extra["stall_seconds"],
        "peak_rss_bytes": run.peak_rss_bytes,
        "token_agreement_with_bf16": sum(same) / len(same) if same else 0.0,
        "spread": walls,
        "resident_wall_seconds": [r.wall_seconds for r in resident if r.status == "ok"],
        "resident_failures": [r.status for r in resident if r.status != "ok"],
    }


def main(argv: list[str] | None = None) -> dict | None:
    from offload.common.sizes import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"))
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--budget", default="600MB", help="RAM for weights (the KV cache comes on top)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="a subset of bf16,int8,int4 (bf16 included)")
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds: every format once per round")
    parser.add_argument("--resident-repeats", type=int, default=1, help="all-resident runs per format (the limit)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a tiny model and workload (a smoke test)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resident", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.work_dir = args.work_dir.expanduser()
    args.budget_bytes = parse_size(args.budget, "--budget")
    args.workload = Workload(**json.loads(args.workload)) if args.workload else WORKLOAD
    if args.repeats < 1 or args.resident_repeats < 1:
        raise SystemExit("--repeats and --resident-repeats must be at least 1")
    if args.worker:
        worker_main(args)
        return None
    if args.quick:
        args.workload = replace(WORKLOAD, prompts=2, prompt_tokens=8, new_tokens=4)
        args.budget, args.budget_bytes = "4MB", parse_size("4MB", "--budget")
    return main_run(args)


if __name__ == "__main__":
    main()
