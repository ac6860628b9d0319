"""Our weight streaming vs Accelerate disk offload vs DeepSpeed ZeRO-Inference: one checkpoint, budget and workload.

    python benchmarks/offload_vs_peers.py [--work-dir ~/.cache/offload/bench] [--engines ours,accelerate,zero]
                                          [--layers 22] [--budget 600MB] [--prompts 8] [--repeats 3]

Builds (once, in the work dir) a random bf16 Llama checkpoint shaped like TinyLlama-1.1B, then runs 8 prompts
of 128 random token ids, 16 new tokens each, greedy, through every engine, each in its own subprocess so that
its storage reads (/proc/self/io read_bytes) and peak RSS are its own (benchmarks/peer_engines.py). Every
engine runs once per round, for --repeats rounds in rotating order; each engine's median, min and max are
reported, and the median run is its result. One clock for all: the harness's perf_counter around the
generate call; the page cache is dropped before every run, and the peers (which read through it) get the
checkpoint's pages evicted before every forward pass, that eviction's time left out of their wall time.

Every engine reads weight files written just before its run: ZeRO-Inference writes its swap files at startup, and
ours and Accelerate (which read the checkpoint in place) are each given a fresh copy of it before theirs, because
a virtual disk can serve recently written files faster than old ones (--no-fresh-copy reads the one checkpoint).
The raw reads of the limit below read a fresh copy too.

The physical limit of the workload: per pass, max(streamed bytes / the best read rate measured, that pass's
compute time with every weight resident, the fastest of the rounds). The read rate is the best of a cold
sequential read of the checkpoint (its fresh copy), of re-reading exactly the bytes our engine streams, as many
times as a run reads them, with O_DIRECT (a virtual disk serves repeated reads faster than cold ones), and of the
rate our engine's own reads reached in any round. An engine faster than that is reported as proof the limit is
wrong, never as a ratio under 1. Prints a table and the goals and writes benchmarks/results/offload_vs_peers.json
with the machine it ran on. GB/s is 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from bench_common import machine, timestamp, write_report
from peer_engines import (
    SHAPE,
    WORKERS,
    EngineResult,
    Workload,
    drop_page_cache,
    files_under,
    fresh_copy,
    peers_checkpoint,
)

__all__ = ["SHAPE", "EngineResult", "Workload", "files_under", "peers_checkpoint", "physical_limit", "run_worker"]

RESULTS = Path(__file__).parent / "results" / "offload_vs_peers.json"
ENGINES = ("ours", "accelerate", "zero")
MiB = 1 << 20
READS_CHECKPOINT = ("ours", "accelerate")  # the engines that read the checkpoint's files while they generate
FRESH = "each engine reads files written just before its run (ZeRO its swap files, ours and Accelerate a copy)"
GOALS = {
    "speedup_vs_accelerate": 1.25,  # tokens/s, medians
    "speedup_vs_zero": 1.1,
    "limit": 1.0,  # no engine's fastest run under the physical limit
    "overlap_efficiency": 0.8,
    "read_fraction_of_raw": 0.85,  # ours' read rate over the same bytes read raw
}


# ---- raw bandwidth -----------------------------------------------------------------------------------------


def raw_bandwidth(files: list[Path], request: int = 64 * MiB, depth: int = 4, repeats: int = 3) -> dict:
    """O_DIRECT sequential reads of every file through our pread backend, cold; median and runs in GB/s."""
    from offload.tiers.io.backends import make_backend
    from offload.tiers.io.base import aligned_buffer

    rates = []
    for _ in range(repeats):
        drop_page_cache(files)
        backend = make_backend("pread")
        bufs = [aligned_buffer(request) for _ in range(depth)]
        start = time.perf_counter()
        done = 0
        for path in files:
            size = backend.file_size(path)
            in_flight = []
            for i, offset in enumerate(range(0, size, request)):
                if len(in_flight) == depth:
                    done += in_flight.pop(0).wait().numel()
                in_flight.append(backend.submit(path, offset, min(request, size - offset), bufs[i % depth]))
            done += sum(r.wait().numel() for r in in_flight)
        rates.append(done / (time.perf_counter() - start) / 1e9)
        direct = all(backend.is_direct(p) for p in files)
        backend.close()
    return {"median_gbps": statistics.median(rates), "runs_gbps": rates, "o_direct": direct, "bytes": done}


def streamed_read(model_dir: Path, layer_tiers: list[str], passes: int, depth: int = 4, repeats: int = 2) -> dict:
    """The bytes our engine streams (the "nvme" layers' read runs, as tiers/weights/layout.py plans them) read with
    O_DIRECT `passes` times in the engine's cyclic order, `depth` layers in flight; the best of `repeats`, in GB/s."""
    from offload.model.loader import load_spec
    from offload.model.registry import model_tensors
    from offload.tiers.io.backends import make_backend
    from offload.tiers.io.base import aligned_buffer
    from offload.tiers.io.buffered import BufferedReader
    from offload.tiers.weights.checkpoint import Checkpoint
    from offload.tiers.weights.layout import model_layout

    spec, family = load_spec(model_dir)
    with BufferedReader() as reader:
        layout = model_layout(Checkpoint(model_dir, reader), model_tensors(family, spec))
    groups = [g for g, tier in zip(layout.layers, layer_tiers, strict=True) if tier == "nvme"]
    if not groups:
        return {"best_gbps": 0.0, "runs_gbps": [], "bytes": 0}
    bufs = [aligned_buffer(max(g.slot_bytes for g in groups)) for _ in range(depth)]
    rates = []
    for _ in range(repeats):
        drop_page_cache(files_under(model_dir))
        backend = make_backend("pread")
        start = time.perf_counter()
        done, in_flight = 0, []
        for n, group in enumerate(g for _ in range(passes) for g in groups):
            if len(in_flight) == depth:  # the oldest group's buffer is the one this group takes
                done += sum(r.wait().numel() for r in in_flight.pop(0))
            buf = bufs[n % depth]
            in_flight.append([backend.submit(r.path, r.offset, r.nbytes, buf[r.slot_offset :]) for r in group.runs])
        done += sum(r.wait().numel() for reads in in_flight for r in reads)
        rates.append(done / (time.perf_counter() - start) / 1e9)
        backend.close()
    return {"best_gbps": max(rates), "runs_gbps": rates, "bytes": done, "passes": passes, "depth": depth}


# ---- running the engines -----------------------------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> None:
    budget = None if args.worker == "resident" else args.budget_bytes
    try:
        result = WORKERS[args.worker](args.model, budget, Workload(prompts=args.prompts), args.work_dir)
    except Exception as exc:  # a peer that cannot run here is a result, not a crash of the benchmark
        traceback.print_exc()
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result = EngineResult(engine=args.worker, status=f"failed: {type(exc).__name__}: {reason}"[:300])
    args.result.write_text(json.dumps(asdict(result)))


def run_worker(
    name: str, model_dir: Path, args: argparse.Namespace, cache_paths: list[Path], fresh: bool = False
) -> EngineResult:
    """Drop the page cache, run one engine in a fresh interpreter, read back its result; with `fresh`, an engine that
    reads the checkpoint while it generates reads a copy written just before."""
    out = args.work_dir / f"result-{name}.json"
    out.unlink(missing_ok=True)
    if fresh and name in READS_CHECKPOINT:
        model_dir = fresh_copy(model_dir, args.work_dir / "fresh-copy")
        cache_paths = [*cache_paths, *files_under(model_dir)]
    method = drop_page_cache(cache_paths)
    cmd = [sys.executable, __file__, "--worker", name, "--model", str(model_dir), "--result", str(out)]
    cmd += ["--work-dir", str(args.work_dir), "--budget", args.budget, "--prompts", str(args.prompts)]
    print(f"running {name} (page cache: {method}) ...", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(f"  {name} done in {time.perf_counter() - start:.0f} s", flush=True)
    if not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return EngineResult(engine=name, status=f"failed: {tail[0]}"[:300])
    result = EngineResult(**json.loads(out.read_text()))
    if result.status != "ok":
        (args.work_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    result.extra["page_cache"] = method
    return result


def readable(model_dir: Path, args: argparse.Namespace) -> Path:
    """The checkpoint as the engines read it: a copy written now, or the checkpoint itself with --no-fresh-copy."""
    return fresh_copy(model_dir, args.work_dir / "fresh-copy") if args.fresh_copy else model_dir


def rounds(names: list[str], repeats: int) -> list[list[str]]:
    """The order of each round: every engine once, the order rotated by one each round so that no engine always
    runs first (or last) in the machine's drift."""
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(repeats)]


def median_run(runs: list[EngineResult]) -> EngineResult:
    """The run with the median wall time (the upper median of an even count); failed runs are not timed."""
    ok = sorted((r for r in runs if r.status == "ok"), key=lambda r: r.wall_seconds)
    return ok[len(ok) // 2] if ok else runs[-1]


def spread(runs: list[EngineResult]) -> dict:
    walls = [r.wall_seconds for r in runs if r.status == "ok"]
    if not walls:
        return {"runs": len(runs), "ok": 0}
    return {
        "runs": len(runs),
        "ok": len(walls),
        "median_wall_seconds": statistics.median(walls),
        "min_wall_seconds": min(walls),
        "max_wall_seconds": max(walls),
        "wall_seconds": walls,
    }


# ---- the report --------------------------------------------------------------------------------------------


def physical_limit(streamed_bytes: int, raw_gbps: float, compute_seconds: list[float]) -> float:
    """Seconds: every pass takes at least its reads at raw bandwidth and its compute with all weights resident."""
    io = streamed_bytes / (raw_gbps * 1e9)
    return sum(max(io, c) for c in compute_seconds)


def fastest_passes(resident_runs: list[EngineResult]) -> list[float]:
    """Per pass, the least compute time any all-resident run took: the compute half of the limit."""
    runs = [r.pass_seconds for r in resident_runs if r.status == "ok"]
    return [min(times) for times in zip(*runs, strict=True)] if runs else []


def over_budget(r: EngineResult, budget: int, kv_bytes: int) -> int:
    """Bytes of peak RSS beyond what the weight budget allows: the libraries' own RSS, the budget, and the KV cache
    the workload needs (the same for every engine); activations and buffers an engine keeps count against it."""
    return max(r.peak_rss_bytes - r.baseline_rss_bytes - budget - kv_bytes, 0)


def workload_kv_bytes(workload: Workload, layers: int) -> int:
    """K and V of every sequence at its longest, in bf16."""
    per_token = 2 * layers * SHAPE["num_key_value_heads"] * SHAPE["hidden_size"] // SHAPE["num_attention_heads"] * 2
    return workload.prompts * workload.max_tokens * per_token


def goals(
    results: dict[str, EngineResult], fastest: dict[str, float], limit: float | None, read_fraction: float | None
) -> list[tuple[str, str, str]]:
    """(goal, measured, PASS / FAIL / n/a / INVALID) for each goal; medians for speed, fastest runs for the limit."""
    ours = results.get("ours")
    ok = {k: r for k, r in results.items() if r.status == "ok"}
    rows = []

    def check(goal: str, value: float | None, target: float, higher: bool, fmt: str = "{:.2f}") -> None:
        if value is None:
            rows.append((goal, "-", "n/a"))
            return
        passed = value >= target if higher else value <= target
        rows.append((goal, fmt.format(value), "PASS" if passed else "FAIL"))

    have_ours = ours is not None and "ours" in ok
    for peer, key in (("accelerate", "speedup_vs_accelerate"), ("zero", "speedup_vs_zero")):
        speedup = ours.tokens_per_second / ok[peer].tokens_per_second if have_ours and peer in ok else None
        check(f"tokens/s >= {GOALS[key]}x {peer}", speedup, GOALS[key], True)
    if limit:
        if any(w < limit for w in fastest.values()):
            said = ", ".join(f"{k} {w:.2f}" for k, w in fastest.items() if w < limit)
            rows.append(("no engine under the physical limit", f"ran faster than {limit:.2f} s: {said} s", "INVALID"))
        else:
            ratio = min(fastest.values()) / limit
            check(f"no engine under {GOALS['limit']}x the physical limit (fastest run)", ratio, GOALS["limit"], True)
    else:
        rows.append(("no engine under the physical limit", "-", "n/a"))
    overlap = ours.extra["overlap_efficiency"] if have_ours else None
    check(f"overlap efficiency >= {GOALS['overlap_efficiency']}", overlap, GOALS["overlap_efficiency"], True)
    target = GOALS["read_fraction_of_raw"]
    check(f"read bandwidth >= {target:.0%} of the same bytes read raw", read_fraction, target, True)
    return rows


def table(results: dict[str, EngineResult], runs: dict[str, list[EngineResult]], budget: int, kv_bytes: int) -> str:
    ours = results.get("ours")
    head = (
        f"{'engine':<20} {'wall s (median, min-max)':>25} {'tok/s':>7} {'ours is':>8} {'layers res/str':>14} "
        f"{'read GB':>8} {'peak RSS MB':>11} {'over budget MB':>14}"
    )
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        if r.status != "ok":
            lines.append(f"{name:<20} {r.status}")
            continue
        s = spread(runs[name])
        walls = f"{s['median_wall_seconds']:.2f} ({s['min_wall_seconds']:.2f}-{s['max_wall_seconds']:.2f})"
        vs = ours.tokens_per_second / r.tokens_per_second if ours and ours.status == "ok" else float("nan")
        lines.append(
            f"{r.engine:<20} {walls:>25} {r.tokens_per_second:7.2f} {vs:7.2f}x "
            f"{f'{r.layers_resident}/{r.layers_streamed}':>14} {r.storage_bytes_read / 1e9:8.3f} "
            f"{r.peak_rss_bytes / 1e6:11.0f} {over_budget(r, budget, kv_bytes) / 1e6:14.0f}"
        )
    return "\n".join(lines)


def token_agreement(results: dict[str, EngineResult]) -> dict[str, float]:
    """Fraction of generated tokens equal to ours, position by position (bf16 numerics differ; a sanity check)."""
    ours = results.get("ours")
    if not ours or ours.status != "ok":
        return {}
    flat = [t for seq in ours.token_ids for t in seq]
    out = {}
    for name, r in results.items():
        if name != "ours" and r.status == "ok":
            other = [t for seq in r.token_ids for t in seq]
            out[name] = sum(a == b for a, b in zip(flat, other, strict=False)) / max(len(flat), 1)
    return out


def main_run(args: argparse.Namespace) -> None:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"--engines: {bad[0]!r} is not one of {', '.join(ENGINES)}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = peers_checkpoint(args.work_dir, args.layers)
    checkpoint = sorted(model_dir.glob("*.safetensors"))
    cache_paths = files_under(model_dir, args.work_dir / "accelerate_offload")
    raw = raw_bandwidth(sorted(readable(model_dir, args).glob("*.safetensors")))
    workload = Workload(prompts=args.prompts)
    names = (["resident"] if "ours" in engines else []) + engines
    runs: dict[str, list[EngineResult]] = {n: [] for n in names}
    for i, order in enumerate(rounds(names, args.repeats)):
        print(f"round {i + 1} of {args.repeats}: {', '.join(order)}", flush=True)
        for name in order:
            runs[name].append(run_worker(name, model_dir, args, cache_paths, args.fresh_copy))
    results = {n: median_run(runs[n]) for n in engines}
    resident_runs = runs.get("resident", [])
    ours = results.get("ours")
    limit = same_bytes = read_fraction = best_gbps = None
    if ours and ours.status == "ok" and any(r.status == "ok" for r in resident_runs):
        same_bytes = streamed_read(readable(model_dir, args), ours.extra["layer_tiers"], ours.passes)
        # the best rate any reader reached on these bytes: the raw reads, or our engine's own reads in any round
        # (an achieved rate is a measured capability of the disk, and no engine can then beat the read half)
        engine_gbps = [r.extra["read_gbps"] for r in runs["ours"] if r.status == "ok"]
        best_gbps = max(same_bytes["best_gbps"], *raw["runs_gbps"], *engine_gbps)
        limit = physical_limit(ours.streamed_bytes_per_pass, best_gbps, fastest_passes(resident_runs))
        read_fraction = ours.extra["read_gbps"] / same_bytes["best_gbps"] if same_bytes["best_gbps"] else None
    fastest = {n: spread(runs[n])["min_wall_seconds"] for n in engines if spread(runs[n])["ok"]}
    kv_bytes = workload_kv_bytes(workload, args.layers)
    shown = results | ({"ours (all resident)": median_run(resident_runs)} if resident_runs else {})
    runs_shown = runs | {"ours (all resident)": resident_runs}
    print()
    print(table(shown, runs_shown, args.budget_bytes, kv_bytes))
    direct = "O_DIRECT" if raw["o_direct"] else "buffered: the filesystem refused O_DIRECT"
    print(f"weight files: {FRESH if args.fresh_copy else 'ours and Accelerate read the checkpoint itself'}")
    print(f"cold sequential read ({direct}): {', '.join(f'{x:.3f}' for x in raw['runs_gbps'])} GB/s")
    if same_bytes:
        runs_said = ", ".join(f"{x:.3f}" for x in same_bytes["runs_gbps"])
        print(f"the bytes ours streams, re-read {same_bytes['passes']} times with O_DIRECT: {runs_said} GB/s")
    if limit:
        print(
            f"physical limit: {limit:.2f} s over {ours.passes} passes (the best read rate measured, "
            f"{best_gbps:.3f} GB/s, and the fastest compute)"
        )
        for name, wall in fastest.items():
            verdict = f"{wall / limit:.2f}x the limit" if wall >= limit else "UNDER the limit: the limit is wrong"
            print(f"  {name}: fastest run {wall:.2f} s = {verdict}")
    print(
        f"over budget: peak RSS beyond the engine's libraries ({args.budget} of weights + {kv_bytes / 1e6:.0f} MB of "
        "KV cache allowed); the peers' eviction of the page cache is not in their wall time"
    )
    print()
    goal_rows = goals(results, fastest, limit, read_fraction)
    for goal, value, verdict in goal_rows:
        print(f"{verdict:<7} {goal}: {value}")
    agreement = token_agreement(results)
    if agreement:
        print("greedy tokens equal to ours: " + ", ".join(f"{k} {v:.0%}" for k, v in agreement.items()))
    report = {
        "benchmark": "offload_vs_peers",
        "date": timestamp(),
        "machine": machine(args.work_dir),
        "checkpoint": {
            "dir": str(model_dir),
            "layers": args.layers,
            **SHAPE,
            "dtype": "bfloat16",
            "bytes": sum(p.stat().st_size for p in checkpoint),
        },
        "budget_bytes": args.budget_bytes,
        "kv_bytes": kv_bytes,
        "workload": asdict(workload),
        "repeats": args.repeats,
        "clock": "harness perf_counter around each generate call; the peers' page-cache eviction left out",
        "weight_files": FRESH if args.fresh_copy else "ours and Accelerate read the checkpoint written at its build",
        "raw_read": raw,
        "streamed_read": same_bytes,
        "physical_limit_seconds": limit,
        "limit_read_gbps": best_gbps,
        "results": {
            k: asdict(r)
            | {
                "tokens_per_second": r.tokens_per_second,
                "over_budget_bytes": over_budget(r, args.budget_bytes, kv_bytes),
            }
            | {"spread": spread(runs_shown[k])}
            for k, r in shown.items()
        },
        "goals": [{"goal": g, "measured": v, "verdict": x} for g, v, x in goal_rows],
        "token_agreement_with_ours": agreement,
    }
    write_report(args.out, report)


def main() -> None:
    from offload.common.sizes import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"))
    parser.add_argument("--engines", default=",".join(ENGINES), help="a subset of ours,accelerate,zero")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--budget", default="600MB", help="RAM for weights (the KV cache comes on top)")
    parser.add_argument("--prompts", type=int, default=8, help="requests in the batch")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds: every engine runs once per round")
    parser.add_argument(
        "--no-fresh-copy",
        dest="fresh_copy",
        action="store_false",
        help="ours and Accelerate read the checkpoint itself, not a copy written just before their run",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work_dir = args.work_dir.expanduser()
    args.budget_bytes = parse_size(args.budget, "--budget")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.worker:
        worker_main(args)
    else:
        main_run(args)


if __name__ == "__main__":
    main()
