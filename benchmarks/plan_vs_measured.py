"""The planner's latency at a request rate against the served engine's: `offload plan --qps` checked by measurement.

    python benchmarks/plan_vs_measured.py [--models demo,streamed] [--requests N] [--work-dir ~/.cache/offload/bench]
                                          [--out benchmarks/results/plan_vs_measured.json]

For each model, the policy at batch 8 that `offload plan` would print for this machine (its saved `offload probe`
profile, measured now if there is none, its rates measured again just before: offload/planner/probe.py's
remeasure) is served with the flags it prints (offload/planner/commands.py), and
requests arrive at three rates, Poisson with a fixed seed: a light one (a fifth of the policy's predicted largest
sustainable rate), one near saturation (four fifths of it) and one over it (twice it). Each request is a streamed
completion of a token-id prompt of its own (the prefix cache would otherwise prefill only their last block, where
the plan prices whole prompts) with a fixed number of new tokens (eos ignored), sent at its arrival time by
served.py's at_rate (a thread and a plain http.client connection each: the lightest client, on the server's cores).
Measured, client-side (served.py's rate_stats): time to first token (send to the first chunk with a token) and each
stream's decode tokens/s (its tokens after the first over the time from its first chunk to its last), p50 over the
requests after the first quarter, as the simulation reports them; and, over capacity, the completion rate while the
queue is full: the largest rate the server sustains. Predicted: scheduler/cost/queueing.py's simulation at the same
rates and arrival times, with the served engine's own step, stream, prompt-token and request costs that `offload
probe` measured (the profile's "serving"); for the streamed model also at the disk rate the engine's weight reads
had during that rate's run (/metrics: bytes read from disk over the seconds reads were in flight), which tells the
planner's error from the disk's drift (a shared VM's virtual disk).

Models: `demo`, the embedded demo model all in memory (128-token prompts, 32 new tokens, 80 requests a rate);
`streamed`, the peer benchmark's random 1.1B checkpoint (TinyLlama's shape) under its 600 MB weight budget, most
layers read from disk every step (128-token prompts, 16 new tokens, 40 requests a rate: a step takes about a
second), the page cache dropped before each rate's run. --requests sets the count for both. The demo model runs
three times (each with its own remeasure, server and three rates: on a shared 2-core VM one run's steps can be a
fifth slower than the next's), the streamed one once (about 13 minutes); --runs sets it for both. Goal: each
predicted value within 25% of the measured one, the median over runs. Prints a table and writes the JSON with the
machine it ran on.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from pathlib import Path

from bench_common import machine, timestamp, write_report
from peer_engines import drop_page_cache, files_under, peers_checkpoint
from served import at_rate, rate_stats, scrape, serving

RESULTS = Path(__file__).parent / "results" / "plan_vs_measured.json"
BATCH = 8
GOAL = 0.25  # relative error allowed
DISK_READ = 'offload_weight_bytes_read_total{tier="nvme"}'  # /metrics samples
READ_SECONDS = "offload_weight_read_seconds_total"
VOCAB = {"demo": 1024, "streamed": 32000}  # prompt token ids are drawn below these
SETTINGS = {  # model -> (prompt tokens, new tokens, device budget or None, requests a rate, runs)
    "demo": (128, 32, None, 80, 3),
    "streamed": (128, 16, 600_000_000, 40, 1),
}


def plan(model: Path, prompt_len: int, gen_len: int, budget: int | None, work_dir: Path):
    """(the prediction at batch 8, its EngineConfig, the cost model's context, the profile) on this machine's
    profile, its rates measured again now (a shared VM's speed drifts by a fifth within minutes): the compute rates,
    the served engine's step costs and, for the streamed model, the disk."""
    from offload.planner.commands import planned_config
    from offload.planner.models import load_model_spec
    from offload.planner.probe import ProbeSizes, local_profile, remeasure
    from offload.scheduler.cost.predict import Budgets, Workload, make_context
    from offload.scheduler.cost.search import search

    # the disk, for the streamed model: the median of three reads of the full probe's 1 GiB file (single reads of
    # this VM's virtual disk differ widely within minutes)
    disk = work_dir if budget is not None else None
    sizes = dataclasses.replace(ProbeSizes.quick(), disk_bytes=ProbeSizes().disk_bytes)
    hw = remeasure(local_profile(), sizes=sizes, disk_dir=disk, served=True, disk_reads=3)
    spec = load_model_spec(str(model))
    # streamed: no host tier, so that what the device budget leaves out streams from disk (a whole-RAM host tier
    # would keep every layer in memory, as the planner rightly prefers)
    workload = Workload(prompt_len, gen_len, BATCH)
    budgets = Budgets(device=budget, host=None if budget is None else 0)
    dtype = "bfloat16"
    preds = search(spec, hw, workload, dtype=dtype, budgets=budgets, batches=[BATCH], kv_tiers=("device",))
    chosen = next(p for p in preds if p.fits and not p.unsupported)
    config = planned_config(spec, hw, dtype, chosen, workload, budgets)
    return chosen, config, make_context(spec, hw, dtype, 16), hw


def run_model(name: str, args: argparse.Namespace) -> dict:
    from offload.common.config import EngineConfig
    from offload.common.knobs import to_flags
    from offload.demo import ensure_demo_model
    from offload.scheduler.cost.predict import make_context
    from offload.scheduler.cost.queueing import arrival_times, max_rate, simulate

    prompt_len, gen_len, budget, requests, _ = SETTINGS[name]
    requests = args.requests or requests
    model = ensure_demo_model() if name == "demo" else peers_checkpoint(args.work_dir, 22)
    chosen, config, ctx, hw = plan(model, prompt_len, gen_len, budget, args.work_dir)
    capacity = max_rate(ctx, chosen, prompt_len, gen_len)  # the simulation's, the served step's costs included
    out = {"policy": str(chosen.candidate), "config": to_flags(EngineConfig, config), "requests": requests}
    out |= {"served_step": dataclasses.asdict(hw.served_step) if hw.served_step else None}
    out["predicted_max_rate"] = capacity
    flags = ["--served-model-name", "m", *to_flags(EngineConfig, config)]
    rates = {"light": 0.2 * capacity, "near saturation": 0.8 * capacity, "over": 2.0 * capacity}
    with serving(model, flags, args.work_dir / f"plan_vs_measured-{name}.log", bound=900) as server:
        # a prompt of its own for each request: the prefix cache would otherwise prefill only their last block,
        # and the plan prices whole prompts
        rng = random.Random(0)
        prompts = [[rng.randrange(5, VOCAB[name]) for _ in range(prompt_len)] for _ in range(requests)]
        for label, rate in rates.items():
            arrivals = arrival_times(rate, requests, "poisson", seed=1)
            if budget is not None:
                drop_page_cache(files_under(model))
            before = scrape(server)
            seen = at_rate(server, prompts, gen_len, arrivals, bound=3600)
            lat = simulate(ctx, chosen, prompt_len, gen_len, rate, requests=requests, seed=1)
            got = rate_stats(seen)
            predicted = {"ttft_p50": lat.ttft_p50, "ttft_p90": lat.ttft_p90, "stream_tps_p50": lat.stream_tps_p50}
            out[label] = {"rate": rate, "measured": got, "predicted": predicted}
            if budget is not None:  # the disk rate the engine's reads had during the run, and the plan given it
                after = scrape(server)
                read = after[DISK_READ] - before[DISK_READ]
                achieved = read / (after[READ_SECONDS] - before[READ_SECONDS])
                ctx_run = make_context(ctx.shape, dataclasses.replace(hw, disk_read=achieved), ctx.dtype, 16)
                given = simulate(ctx_run, chosen, prompt_len, gen_len, rate, requests=requests, seed=1)
                out[label]["engine_read_gbps"] = achieved / 1e9
                out[label]["predicted_at_that_disk_rate"] = {
                    "ttft_p50": given.ttft_p50,
                    "stream_tps_p50": given.stream_tps_p50,
                }
            print(f"{name} {label} ({rate:.3g}/s): {out[label]}", flush=True)
    out["measured_max_rate"] = out["over"]["measured"]["completion_rate"]
    return out


def errors(result: dict) -> dict:
    """Relative error of each predicted value against the measured one."""
    out = {}
    for label in ("light", "near saturation"):
        r = result[label]
        for key in ("ttft_p50", "stream_tps_p50"):
            out[f"{label} {key}"] = r["predicted"][key] / r["measured"][key] - 1
        for key in ("ttft_p50", "stream_tps_p50") if "predicted_at_that_disk_rate" in r else ():
            out[f"{label} {key}, engine's disk rate"] = r["predicted_at_that_disk_rate"][key] / r["measured"][key] - 1
    out["max_rate"] = result["predicted_max_rate"] / result["measured_max_rate"] - 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,streamed")
    parser.add_argument("--requests", type=int, help="requests a rate, for every model (default: 80 demo, 40 streamed)")
    parser.add_argument("--runs", type=int, help="runs of each model, median error kept (default: 3 demo, 1 streamed)")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "offload" / "bench")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    report: dict = {"machine": machine(args.work_dir), "time": timestamp(), "models": {}}
    rows = [f"{'model':<10} {'value':<50} predicted/measured - 1: median (each run)  within {GOAL:.0%}"]
    for name in args.models.split(","):
        runs = [run_model(name, args) for _ in range(args.runs or SETTINGS[name][4])]
        for run in runs:
            run["errors"] = errors(run)
        median = {key: statistics.median(r["errors"][key] for r in runs) for key in runs[0]["errors"]}
        report["models"][name] = {"runs": runs, "median_errors": median}
        for key, err in median.items():
            each = ", ".join(f"{r['errors'][key]:+.0%}" for r in runs)
            rows.append(f"{name:<10} {key:<50} {err:>+9.1%} ({each})  {'yes' if abs(err) <= GOAL else 'no'}")
    print("\n".join(rows))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
