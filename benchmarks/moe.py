"""Mixture-of-experts streaming: by expert (with the expert cache) against by whole layer against Accelerate.

    python benchmarks/moe.py [--family mixtral|deepseek_v3|gpt_oss] [--work-dir ~/.cache/offload/bench]
                             [--batches 1,8] [--new-tokens 32] [--repeats 4] [--quick]

The checkpoint is one of benchmarks/moe_checkpoint.py's synthetic ones (random bf16 weights): by default a Mixtral
(8 experts, top-2, about 3 GB), or DeepSeek-V3 (256 fine-grained experts, 8 a token, a shared expert, multi-head
latent attention, 1.95 GB) or gpt-oss (32 experts, 4 a token, 1.35 GB) scaled down with their expert counts kept; the
weight budget is a quarter of its bytes (the KV cache comes on top). Each engine runs greedy generation
of --new-tokens tokens for prompts of 32 random token ids, at each batch of --batches, in its own process after the
page cache is dropped (Accelerate's checkpoint and offload folder are evicted before every forward pass, that
eviction's time left out of its wall time, as in benchmarks/offload_vs_peers.py):

  experts     this engine, --expert-cache-memory: the dense part of every layer resident, the rest of the budget
              an expert cache; only the experts the router chooses are read; the next layer's experts are
              guessed by its router on the current hidden state and prefetched (--expert-prefetch router, the
              default)
  experts-frequency  the same with --expert-prefetch frequency: the next layer's most often chosen experts
  layers      this engine streaming whole layers (every expert of a layer read on every pass)
  accelerate  transformers + Accelerate, device_map="auto" with max_memory={"cpu": budget} and an offload folder
  experts-cold-device, experts-cold-cpu  (named in --engines, on a CUDA machine) "experts" with every expert not in
              the device slots copied there, or run on the CPU from pinned host RAM, instead of the cost model's
              choice for each (--cold-experts auto)

Every engine runs --repeats rounds, in the order above and then reversed, alternately (the virtual disk serves
bytes read moments ago faster, so the engine that runs second after a similar one gains; alternating gives each
engine both places); the row of each engine and batch is its median round by tokens/s, the lower middle of an even
count, with the min and max beside it (four rounds by default: of two, the lower would decide a row, and one slow
round of the disk with it). Reported per engine and batch: tokens/s, bytes read from storage
per generated token (/proc/self/io), and the physical limit of the run: its own bytes at the best read rate
measured (see best_read_rate), or (for this engine's runs) its time with every weight resident, whichever is
larger. Beside this engine's rows, the planner's prediction (`offload plan`'s cost model on this machine's profile,
its compute and disk rates measured again at the start of the run) for the same budget, expert cache and workload:
tokens/s, and the bytes read per token of expert streaming. Prints a table and the goals and writes
benchmarks/results/moe.json (moe-<family>.json for the others) with the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bench_common import machine, timestamp, write_report
from moe_checkpoint import FAMILIES, ensure_moe
from offload_vs_peers import raw_bandwidth
from peer_engines import (
    EngineResult,
    Workload,
    drop_page_cache,
    files_under,
    generate_ours,
    ours_config,
    rss_bytes,
    run_isolated,
)

RESULTS = Path(__file__).parent / "results" / "moe.json"
ENGINES = ("experts", "experts-frequency", "layers", "accelerate")
# on CUDA only (--engines): "experts" with every cold expert copied to the device, or run on the CPU, instead of the
# cost model's choice per expert (--cold-experts auto); on a CPU device there is nothing to choose
COLD = {"experts-cold-device": "device", "experts-cold-cpu": "cpu"}
# at batch 1, per family; "planner_error": the planner's tokens/s against the measured, by expert (the policy the
# planner picks for a mixture under a quarter budget; every row of ours carries its own error beside it)
GOALS = {
    "mixtral": {"bytes_fraction": 0.40, "speedup_vs_layers": 2.0, "speedup_vs_accelerate": 6.0},
    "deepseek_v3": {"speedup_vs_layers": 5.0, "planner_error": 0.25},
    "gpt_oss": {"planner_error": 0.25},
}
PROMPT_TOKENS = 32
MARGIN = 16  # a 16th of the budget (at most 16 MiB) is left beside the resident dense parts and the expert cache


def checkpoint_bytes(model_dir: Path) -> tuple[int, int]:
    """(bytes of the routed experts' tensors, bytes of every other tensor) from the safetensors headers."""
    from offload.tiers.io.buffered import BufferedReader
    from offload.tiers.weights.checkpoint import Checkpoint

    with BufferedReader() as reader:
        extents = Checkpoint(model_dir, reader).extents.values()
    experts = sum(e.nbytes for e in extents if ".experts." in e.name)
    return experts, sum(e.nbytes for e in extents) - experts


def run_engine(name: str, model_dir: Path, budget: int | None, workload: Workload, scratch: Path) -> EngineResult:
    """One engine in this process (the worker side)."""
    if name == "accelerate":
        from peer_engines import run_accelerate

        return run_accelerate(model_dir, budget, workload, scratch)
    config = ours_config(model_dir, budget, workload)
    if name.startswith("experts"):
        from offload.model.loader import load_spec

        spec, _ = load_spec(model_dir)
        experts, dense = checkpoint_bytes(model_dir)
        per_expert = experts // (spec.num_layers * spec.num_experts)
        margin = min(budget // MARGIN, 16 << 20)
        cache = max(budget - dense - margin, per_expert)  # dense parts resident, the rest caches experts
        prefetch = "frequency" if name == "experts-frequency" else "router"
        cold = COLD.get(name, "auto")
        config = replace(config, expert_cache_memory=cache, expert_prefetch=prefetch, cold_experts=cold)
    baseline = rss_bytes()
    result = generate_ours(model_dir, config, workload)
    result.engine, result.baseline_rss_bytes = name, baseline
    result.extra["expert_cache_memory"] = config.expert_cache_memory
    result.extra["expert_prefetch"] = config.expert_prefetch
    result.extra["cold_experts"] = config.cold_experts
    return result


def run_worker(name: str, model_dir: Path, args: argparse.Namespace, batch: int, budget: int | None) -> EngineResult:
    """Drop the page cache, run one engine in a fresh interpreter, read back its result."""
    out = args.work_dir / f"result-moe-{name}.json"
    method = drop_page_cache(files_under(model_dir, args.work_dir / "accelerate_offload"))
    workload = Workload(prompts=batch, prompt_tokens=PROMPT_TOKENS, new_tokens=args.new_tokens)
    cmd = [sys.executable, __file__, "--worker", name, "--model", str(model_dir), "--result", str(out)]
    cmd += ["--work-dir", str(args.work_dir), "--workload", json.dumps(asdict(workload))]
    cmd += ["--budget-bytes", str(budget)] if budget is not None else []
    log = args.work_dir / f"moe-{name}-{batch}.log"
    return run_isolated(name, f"{name} at batch {batch}", cmd, out, log, method)


def best_read_rate(raw: dict, runs: list[EngineResult]) -> float:
    """GB/s: the best rate this disk was measured to deliver: a cold sequential read of the checkpoint, or any run's
    own reads (its bytes over its wall time, or over the time this engine had reads in flight). A virtual disk serves
    repeated reads faster than cold ones, so an engine re-reading layers can beat the cold rate; an achieved rate is
    a measured capability, so no run can come out under a limit built on the best of them."""
    rates = list(raw["runs_gbps"])
    for r in runs:
        if r.status == "ok" and r.wall_seconds:
            rates.append(r.storage_bytes_read / r.wall_seconds / 1e9)
            rates.append(r.extra.get("read_gbps") or 0.0)
    return max(rates)


def median_round(rounds: list[EngineResult]) -> tuple[EngineResult, list[float]]:
    """The round of median tokens/s (the lower middle of an even count) and every round's tokens/s; a failed round
    makes the row that failure."""
    failed = [r for r in rounds if r.status != "ok"]
    if failed:
        return failed[0], []
    ranked = sorted(rounds, key=lambda r: r.tokens_per_second)
    return ranked[(len(ranked) - 1) // 2], [r.tokens_per_second for r in rounds]


def row(rounds: list[EngineResult], limit_gbps: float, resident: EngineResult | None) -> dict:
    """`resident`: this engine's run with every weight resident (its compute); None for a peer, whose limit is then
    its bytes at the raw read rate only."""
    r, per_round = median_round(rounds)
    if r.status != "ok":
        return {"status": r.status}
    io = r.storage_bytes_read / (limit_gbps * 1e9)
    compute = resident.wall_seconds if resident is not None and resident.status == "ok" else 0.0
    limit = max(io, compute)
    out = {
        "status": "ok",
        "tokens_per_second": r.tokens_per_second,
        "rounds_tokens_per_second": per_round,
        "wall_seconds": r.wall_seconds,
        "generated_tokens": r.generated_tokens,
        "storage_bytes_read": r.storage_bytes_read,
        "bytes_per_token": r.storage_bytes_read / max(r.generated_tokens, 1),
        "limit_seconds": limit,
        "limit_binds": "disk" if io >= compute else "compute",
        "x_limit": r.wall_seconds / limit if limit else None,
        "peak_rss_bytes": r.peak_rss_bytes,
        "baseline_rss_bytes": r.baseline_rss_bytes,
        "layers_streamed": r.layers_streamed,
        "token_ids": r.token_ids,
    }
    experts = r.extra.get("experts")
    if experts:
        out["experts"] = experts
    out["expert_cache_memory"] = r.extra.get("expert_cache_memory")
    return out


def predicted_bytes_per_token(model_dir: Path, cache_bytes: int, batch: int, prompt: int, new_tokens: int) -> float:
    """The cost model's bytes read per generated token for expert streaming with a cache of `cache_bytes`
    (scheduler/cost/moe_cost.py: uniform routing, the cache's share of every expert as its hit rate): a prefill step of
    batch * prompt tokens, then new_tokens - 1 decode steps of `batch` tokens."""
    from offload.model.loader import load_spec
    from offload.scheduler.cost.moe_cost import expert_params, read_bytes, sparse_layers

    spec, _ = load_spec(model_dir)
    one = expert_params(spec) * 2  # bf16
    slots = cache_bytes // one
    per_layer = read_bytes(spec, batch * prompt, slots, one) + (new_tokens - 1) * read_bytes(spec, batch, slots, one)
    return per_layer * sparse_layers(spec) / (batch * new_tokens)


def table(rows: dict[str, dict[int, dict]]) -> str:
    head = f"{'engine':<18} {'batch':>5} {'tok/s':>8} {'min-max':>11} {'planned':>8} {'MB read/token':>13} "
    head += f"{'(predicted)':>11} {'limit tok/s':>11} {'x limit':>7} {'binds':>7}"
    lines = [head, "-" * len(head)]
    for name, by_batch in rows.items():
        for batch, r in by_batch.items():
            if r["status"] != "ok":
                lines.append(f"{name:<18} {batch:>5} {r['status']}")
                continue
            lim = r["generated_tokens"] / r["limit_seconds"] if r["limit_seconds"] else float("nan")
            per_round = r["rounds_tokens_per_second"]
            spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
            planned = r.get("planned_tokens_per_second")
            planned = f"{planned:>8.2f}" if planned is not None else " " * 8
            predicted = r.get("predicted_bytes_per_token")
            predicted = f"{predicted / 1e6:>11.1f}" if predicted is not None else " " * 11
            lines.append(
                f"{name:<18} {batch:>5} {r['tokens_per_second']:>8.2f} {spread:>11} {planned} "
                f"{r['bytes_per_token'] / 1e6:>13.1f} {predicted} "
                f"{lim:>11.2f} {r['x_limit']:>6.2f}x {r['limit_binds']:>7}"
            )
    return "\n".join(lines)


def this_machine(work_dir: Path, quick: bool = False):
    """This machine's hardware profile (the saved `offload probe` one, or measured), its compute and disk rates
    measured again now: a shared VM's speed drifts by a fifth within minutes. The disk: the median of three reads of
    the full probe's file in the work dir (`quick`: one read of the quick probe's)."""
    import dataclasses

    from offload.planner.probe import ProbeSizes, local_profile, remeasure

    if quick:
        return remeasure(local_profile(), sizes=ProbeSizes.quick(), disk_dir=work_dir)
    sizes = dataclasses.replace(ProbeSizes.quick(), disk_bytes=ProbeSizes().disk_bytes)
    return remeasure(local_profile(), sizes=sizes, disk_dir=work_dir, disk_reads=3)


def planned_tokens_per_second(model_dir: Path, hw, batch: int, new_tokens: int, budget: int, cache: int) -> float:
    """The planner's tokens/s for this engine at `batch` under the device budget the run had (`budget` plus the KV
    cache), its experts streamed through a cache of `cache` bytes (0: with their layers)."""
    from offload.planner.models import load_model_spec
    from offload.scheduler.cost.predict import Budgets
    from offload.scheduler.cost.predict import Workload as PlanWorkload
    from offload.scheduler.cost.search import search

    config = ours_config(model_dir, budget, Workload(prompts=batch, prompt_tokens=PROMPT_TOKENS, new_tokens=new_tokens))
    spec = load_model_spec(str(model_dir))
    preds = search(
        spec,
        hw,
        PlanWorkload(PROMPT_TOKENS, new_tokens, batch),
        dtype="bfloat16",
        budgets=Budgets(device=config.device_memory, host=0),
        batches=[batch],
        micro_batches=[1],
        kv_tiers=("device",),
        expert_caches=[cache],
    )
    fit = next((p for p in preds if p.fits and not p.unsupported), None)
    return float("nan") if fit is None else fit.tokens_per_second


def main_run(args: argparse.Namespace) -> dict:
    model_dir = ensure_moe(args.work_dir, args.family, args.quick)
    shape = FAMILIES[args.family][1 if args.quick else 0]
    files = sorted(model_dir.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in files)
    budget = total // (2 if args.quick else 4)  # a tiny model's embedding and head alone take a quarter
    hw = this_machine(args.work_dir, args.quick)
    raw = raw_bandwidth(files)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    engines = [e for e in (*ENGINES, *COLD) if e in args.engines.split(",")]
    runs: dict[str, dict[int, list[EngineResult]]] = {e: {} for e in engines}
    resident: dict[int, EngineResult] = {}
    for batch in batches:
        resident[batch] = run_worker("layers", model_dir, args, batch, None)  # every weight resident: the compute
    for round_ in range(args.repeats):
        for batch in batches:
            for name in engines if round_ % 2 == 0 else engines[::-1]:
                if name == "accelerate" and batch not in (1, batches[0]):
                    continue
                runs[name].setdefault(batch, []).append(run_worker(name, model_dir, args, batch, budget))
    best_gbps = best_read_rate(raw, [r for by_batch in runs.values() for rs in by_batch.values() for r in rs])
    rows = {
        name: {b: row(rs, best_gbps, resident[b] if name != "accelerate" else None) for b, rs in by_batch.items()}
        for name, by_batch in runs.items()
    }
    for name, by_batch in rows.items():  # what the cost model (offload plan) expects of this engine's runs
        for b, r in by_batch.items():
            if name == "accelerate" or r["status"] != "ok":
                continue
            cache = r["expert_cache_memory"] or 0
            r["planned_tokens_per_second"] = planned_tokens_per_second(model_dir, hw, b, args.new_tokens, budget, cache)
            r["planner_error"] = r["planned_tokens_per_second"] / r["tokens_per_second"] - 1
            if name.startswith("experts"):
                r["predicted_bytes_per_token"] = predicted_bytes_per_token(
                    model_dir, cache, b, PROMPT_TOKENS, args.new_tokens
                )
    print()
    print(table(rows))
    print()
    goal_rows = goals(rows, args.family, engines)
    for g in goal_rows:
        print(f"{'met' if g['verdict'] == 'met' else 'NOT MET':<7} {g['goal']} at batch 1: {g['measured']:.2f} "
              f"(target {g['target']})")  # fmt: skip
    for r in (x for by_batch in rows.values() for x in by_batch.values()):
        if r.get("x_limit") is not None and r["x_limit"] < 1:
            print("a run was faster than its physical limit: the limit is wrong")
    report = {
        "benchmark": "moe",
        "family": args.family,
        "date": timestamp(),
        "machine": machine(args.work_dir),
        "checkpoint": {"dir": str(model_dir), **shape, "bytes": total},
        "budget_bytes": budget,
        "raw_read": raw,
        "limit_read_gbps": best_gbps,
        "planner_profile": {
            "disk_read_gbps": hw.disk_read / 1e9,
            "small_read_gbps": (hw.disk_read_small or 0) / 1e9,
            "read_by_backend": hw.disk_read_by_backend,
        },
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "results": {name: {str(b): r for b, r in by_batch.items()} for name, by_batch in rows.items()},
        "goals": goal_rows,
    }
    out = args.out or (RESULTS if args.family == "mixtral" else RESULTS.with_name(f"moe-{args.family}.json"))
    write_report(out, report)
    return report


def goals(rows: dict[str, dict[int, dict]], family: str, engines: list[str]) -> list[dict]:
    """The family's goals (GOALS) at batch 1, where the rows they compare ran."""
    one = {name: rows[name].get(1, {}) for name in engines}
    if not {"experts", "layers"} <= set(engines) or not all(r.get("status") == "ok" for r in one.values()):
        return []
    ex, la, ac = (one.get(n, {}) for n in ("experts", "layers", "accelerate"))
    measured = {
        "bytes_fraction": ex["bytes_per_token"] / la["bytes_per_token"],
        "speedup_vs_layers": ex["tokens_per_second"] / la["tokens_per_second"],
        "speedup_vs_accelerate": ex["tokens_per_second"] / ac["tokens_per_second"] if ac else None,
        "planner_error": abs(ex["planner_error"]),
    }
    out = []
    for goal, target in GOALS[family].items():
        value = measured[goal]
        if value is None:
            continue
        met = value <= target if goal in ("bytes_fraction", "planner_error") else value >= target
        out.append({"goal": goal, "target": target, "measured": value, "verdict": "met" if met else "not met"})
    return out


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"))
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (Accelerate: the first only)")
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help=f"a subset of {','.join(ENGINES)} (on CUDA also: {','.join(COLD)})"
    )
    parser.add_argument("--repeats", type=int, default=4, help="rounds of every engine (each row: the median round)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mixtral", help="which synthetic checkpoint")
    parser.add_argument("--out", type=Path, help="the results file (default: benchmarks/results/moe[-<family>].json)")
    parser.add_argument("--quick", action="store_true", help="a tiny checkpoint of the family (a smoke test)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.work_dir = args.work_dir.expanduser()
    if args.worker:
        workload = Workload(**json.loads(args.workload))
        result = run_engine(args.worker, args.model, args.budget_bytes, workload, args.work_dir)
        args.result.write_text(json.dumps(asdict(result)))
        return None
    return main_run(args)


if __name__ == "__main__":
    main()
