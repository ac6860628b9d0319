"""Throughput at equal memory, the metric FlexGen made its case with: under a cap on the whole process's peak RSS,
each engine runs at the largest batch that stays under it.

    python benchmarks/same_memory.py [--caps 2GiB,4GiB] [--batches 8,16,32,64,128,256] [--engines ours,accelerate,zero]
                                     [--work-dir ~/.cache/offload/bench] [--layers 22] [--peer-budget 600MB]
                                     [--out benchmarks/results/same_memory.json]

The checkpoint is offload_vs_peers.py's (a random bf16 Llama of TinyLlama-1.1B's shape), the workload 128-token
prompts with 16 new tokens each, greedy, one round. Every run is its own subprocess through offload_vs_peers.py's
worker: peak RSS is the worker's VmHWM, bytes read its /proc/self/io read_bytes, the page cache is dropped before
it and the peers' checkpoint pages are evicted before every forward pass.

The peers get --peer-budget of RAM for weights (Accelerate's max_memory, ZeRO's max_in_cpu) and try the batches in
ascending order: their best is the largest whose peak RSS stays under the cap, and the first run over the cap (or
failed) ends their trials, since RSS only grows with batch (a batch already run for a smaller cap is not rerun).
Ours gets the cap alone (EngineConfig(memory=cap)): the cost model picks its batch for the largest of --batches
candidate requests, and it runs one batch of that size; a peak over the cap is reported as over, never hidden.
Prints a table per cap and the goals, and writes every run tried, with the machine, to --out. MB and GB are 1e6
and 1e9 bytes.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_common import machine, timestamp, write_report
from offload_vs_peers import run_worker
from peer_engines import SHAPE, EngineResult, Workload, files_under, peers_checkpoint

RESULTS = Path(__file__).parent / "results" / "same_memory.json"
ENGINES = ("ours", "accelerate", "zero")
GOAL_CAP = 2 << 30  # bytes: the cap the goals are judged at
GOAL_SPEEDUP = 2.0  # ours' tokens/s over each peer's, each at its own best batch under GOAL_CAP


@dataclass(frozen=True, slots=True)
class Trial:
    """One run of one engine under one cap. batch: requests run at once (ours: what the cost model chose; None
    when it failed before choosing)."""

    engine: str
    cap: int  # bytes of peak RSS allowed
    batch: int | None
    result: EngineResult

    @property
    def under_cap(self) -> bool:
        return self.result.status == "ok" and self.result.peak_rss_bytes <= self.cap

    @property
    def verdict(self) -> str:
        if self.result.status != "ok":
            return self.result.status
        return "under the cap" if self.under_cap else "OVER the cap"


def try_batches(engine: str, cap: int, batches: list[int], run: Callable[[int], EngineResult]) -> list[Trial]:
    """Run `engine` at each batch in ascending order until a run is over the cap or fails (that run is the last)."""
    trials = []
    for batch in sorted(batches):
        trials.append(Trial(engine, cap, batch, run(batch)))
        if not trials[-1].under_cap:
            break
    return trials


def best_trial(trials: list[Trial]) -> Trial | None:
    """The trial with the largest batch whose peak RSS stayed under its cap; None when none did."""
    return max((t for t in trials if t.under_cap), key=lambda t: t.batch, default=None)


def shown_trial(engine: str, trials: list[Trial]) -> Trial | None:
    """What stands for `engine` at a cap: ours' one run, over the cap or not; a peer's best trial."""
    if engine == "ours":
        return trials[-1] if trials else None
    return best_trial(trials)


def speedup(ours: Trial | None, other: Trial | None) -> float | None:
    """Ours' tokens/s over `other`'s, where both ran under the cap."""
    if ours is None or other is None or not ours.under_cap or not other.under_cap:
        return None
    return ours.result.tokens_per_second / other.result.tokens_per_second


def table(cap: int, trials: dict[str, list[Trial]]) -> str:
    """Each engine at its best batch under `cap` (ours at its one batch, over the cap or not), then the runs that
    ended each peer's trials."""
    ours = shown_trial("ours", trials.get("ours", []))
    head = f"{'engine':<12} {'batch':>5} {'tok/s':>7} {'peak RSS MB':>11} {'GB read':>8} {'ours/engine':>11}  verdict"
    lines = [head, "-" * len(head)]
    ended = []
    for engine, runs in trials.items():
        shown = shown_trial(engine, runs)
        if engine != "ours" and runs and not runs[-1].under_cap:
            ended.append(runs[-1])
        if shown is None:
            lines.append(f"{engine:<12} {'-':>5} no batch of {min(t.batch for t in runs)} or more under the cap")
            continue
        r = shown.result
        if r.status != "ok":
            lines.append(f"{engine:<12} {'-':>5} {r.status}")
            continue
        ratio = speedup(ours, shown)
        said = f"{ratio:.2f}x" if ratio is not None else "-"
        lines.append(
            f"{engine:<12} {shown.batch:>5} {r.tokens_per_second:7.2f} {r.peak_rss_bytes / 1e6:11.0f} "
            f"{r.storage_bytes_read / 1e9:8.2f} {said:>11}  {shown.verdict}"
        )
    for t in ended:
        peak = f"peak RSS {t.result.peak_rss_bytes / 1e6:.0f} MB" if t.result.status == "ok" else t.result.status
        lines.append(f"  {t.engine} stopped at batch {t.batch}: {peak} ({t.verdict})")
    return "\n".join(lines)


def goals(cap: int, trials: dict[str, list[Trial]]) -> list[tuple[str, str, str]]:
    """(goal, measured, PASS / FAIL / n/a) for ours against each peer at `cap`. A peer with no batch under the cap
    has no tokens/s to divide by: n/a, with the reason."""
    rows = []
    ours = shown_trial("ours", trials.get("ours", []))
    for peer in ("accelerate", "zero"):
        goal = f"tokens/s >= {GOAL_SPEEDUP:g}x {peer} at its best batch under {cap / (1 << 30):g} GiB"
        best = best_trial(trials.get(peer, []))
        if ours is None or peer not in trials:
            rows.append((goal, "-", "n/a"))
        elif not ours.under_cap:
            rows.append((goal, f"ours {ours.verdict} (peak RSS {ours.result.peak_rss_bytes / 1e6:.0f} MB)", "FAIL"))
        elif best is None:
            last = trials[peer][-1]
            why = f"peak RSS {last.result.peak_rss_bytes / 1e6:.0f} MB" if last.result.status == "ok" else last.verdict
            rows.append((goal, f"{peer} ran no batch under the cap (batch {last.batch}: {why})", "n/a"))
        else:
            ratio = speedup(ours, best)
            measured = f"{ratio:.2f} (ours batch {ours.batch}, {peer} batch {best.batch})"
            rows.append((goal, measured, "PASS" if ratio >= GOAL_SPEEDUP else "FAIL"))
    return rows


def trial_record(t: Trial) -> dict:
    return (
        {"engine": t.engine, "cap_bytes": t.cap, "batch": t.batch, "under_cap": t.under_cap}
        | asdict(t.result)
        | {"tokens_per_second": t.result.tokens_per_second, "token_ids": None}  # 4096 ids a run: not a result
    )


def best_records(trials: dict[str, list[Trial]]) -> dict[str, dict | None]:
    """Each engine's shown trial at one cap, as the report records it."""
    shown = {engine: shown_trial(engine, runs) for engine, runs in trials.items()}
    return {engine: None if t is None else trial_record(t) for engine, t in shown.items()}


def main_run(args: argparse.Namespace) -> None:
    from offload.common.sizes import format_size

    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = peers_checkpoint(args.work_dir, args.layers)
    cache_paths = files_under(model_dir, args.work_dir / "accelerate_offload")
    if "ours" in args.engines:  # measured here, not in a worker, where the probe's own memory would count
        from offload.planner.probe import local_profile

        local_profile()
    workload = Workload()  # 128-token prompts, 16 new tokens; the batch is each run's
    candidates = max(args.batches)

    @functools.cache  # a peer's run does not depend on the cap: a larger cap reuses the smaller one's runs
    def worker(name: str, budget: str, prompts: int) -> EngineResult:
        plumbing = argparse.Namespace(work_dir=args.work_dir, budget=budget, prompts=prompts)
        return run_worker(name, model_dir, plumbing, cache_paths)

    per_cap: dict[int, dict[str, list[Trial]]] = {}
    for cap in args.caps:
        print(f"cap {format_size(cap)}", flush=True)
        trials: dict[str, list[Trial]] = {}
        for engine in args.engines:
            if engine == "ours":
                r = worker("ours-capped", str(cap), candidates)
                trials[engine] = [Trial(engine, cap, r.extra.get("batch"), r)]
            else:
                run = functools.partial(worker, engine, args.peer_budget)  # run(batch)
                trials[engine] = try_batches(engine, cap, args.batches, run)
        per_cap[cap] = trials
    goal_rows = goals(GOAL_CAP, per_cap[GOAL_CAP]) if GOAL_CAP in per_cap else []
    for cap, trials in per_cap.items():
        print(f"\npeak RSS cap {format_size(cap)} ({cap / 1e6:.0f} MB)")
        print(table(cap, trials))
    print(
        f"\npeers: {args.peer_budget} of RAM for weights (Accelerate's max_memory, ZeRO's max_in_cpu), batches tried "
        f"from {min(args.batches)} up; ours: the cap alone (EngineConfig(memory=cap)), the cost model choosing among "
        f"{candidates} candidate requests; {workload.prompt_tokens}-token prompts, {workload.new_tokens} new tokens"
    )
    print()
    for goal, value, verdict in goal_rows or [(f"the goals at {format_size(GOAL_CAP)}", "cap not run", "n/a")]:
        print(f"{verdict:<7} {goal}: {value}")
    report = {
        "benchmark": "same_memory",
        "date": timestamp(),
        "machine": machine(args.work_dir),
        "checkpoint": {"dir": str(model_dir), "layers": args.layers, **SHAPE, "dtype": "bfloat16"},
        "workload": {"prompt_tokens": workload.prompt_tokens, "new_tokens": workload.new_tokens, "seed": workload.seed},
        "caps_bytes": args.caps,
        "batches": args.batches,
        "peer_weight_budget_bytes": args.peer_budget_bytes,
        "ours_candidate_requests": candidates,
        "runs": [trial_record(t) for trials in per_cap.values() for runs in trials.values() for t in runs],
        "best": {str(cap): best_records(trials) for cap, trials in per_cap.items()},
        "goals": [{"goal": g, "measured": v, "verdict": x} for g, v, x in goal_rows],
    }
    write_report(args.out, report)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from offload.common.sizes import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", default="2GiB,4GiB", help="caps on each run's peak RSS, comma-separated")
    parser.add_argument("--batches", default="8,16,32,64,128,256", help="the peers' batches to try, ascending")
    parser.add_argument("--engines", default=",".join(ENGINES), help="a subset of ours,accelerate,zero")
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"))
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--peer-budget", default="600MB", help="RAM for the peers' weights (Accelerate, ZeRO)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.work_dir = args.work_dir.expanduser()
    args.caps = [parse_size(c, "--caps") for c in args.caps.split(",") if c.strip()]
    args.batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.peer_budget_bytes = parse_size(args.peer_budget, "--peer-budget")
    bad = [e for e in args.engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"--engines: {bad[0]!r} is not one of {', '.join(ENGINES)}")
    if not args.caps or not args.batches or min(args.batches) < 1:
        raise SystemExit("--caps and --batches need at least one value each, batches positive")
    return args


if __name__ == "__main__":
    main_run(parse_args())
