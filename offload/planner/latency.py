"""`offload plan --qps R`: each batch size's best policy at a request rate, its latency as the simulation of the
engine's continuous batching predicts it (scheduler/cost/queueing.py), the targets it meets or misses, and the `offload
serve` command that runs it, ranked by what the endpoint's users feel: time to first token, then each stream's rate."""

from __future__ import annotations

import argparse

from offload.common.config import BLOCK_SIZE
from offload.common.hardware import HardwareProfile
from offload.common.model_config import ModelSpec
from offload.planner.commands import command, planned_config
from offload.planner.rows import candidate_json, per_batch
from offload.scheduler.cost.predict import Budgets, Prediction, Workload, make_context
from offload.scheduler.cost.queueing import simulate


def latency_rows(
    shape: ModelSpec,
    hw: HardwareProfile,
    workload: Workload,
    dtype: str,
    budgets: Budgets,
    predictions: list[Prediction],
    args: argparse.Namespace,
) -> list[dict]:
    """Each batch size's best runnable policy at the request rate: its latency, whether it meets the targets (and by
    what it misses), and the `offload serve` command that runs it, in the order `ranking` states."""
    ctx = make_context(shape, hw, dtype, BLOCK_SIZE)
    rows = []
    for p in per_batch(predictions).values():
        if not p.fits or p.unsupported:
            continue
        lat = simulate(ctx, p, workload.prompt_len, workload.gen_len, args.qps, args.arrival)
        misses = []
        if lat.saturated:
            misses.append(f"sustains {lat.max_rate:.3g} requests/s, under the {args.qps:g} asked")
        if args.max_ttft is not None and lat.ttft_p90 > args.max_ttft:
            misses.append(
                f"p90 TTFT {lat.ttft_p90:.3g} s, over {args.max_ttft:g} s by {lat.ttft_p90 - args.max_ttft:.3g}"
            )
        if args.min_stream_tps is not None and lat.stream_tps_p50 < args.min_stream_tps:
            gap = args.min_stream_tps - lat.stream_tps_p50
            misses.append(f"streams {lat.stream_tps_p50:.3g} tokens/s, under {args.min_stream_tps:g} by {gap:.3g}")
        config = planned_config(shape, hw, dtype, p, workload, budgets)
        rows.append(
            {
                "policy": candidate_json(p.candidate),
                "ttft_p50_seconds": lat.ttft_p50,
                "ttft_p90_seconds": lat.ttft_p90,
                "stream_tokens_per_second": lat.stream_tps_p50,
                "throughput_tokens_per_second": lat.throughput,
                "max_rate": lat.max_rate,
                "mean_batch": lat.mean_batch,
                "sustains": not lat.saturated,
                "meets": not misses,  # sustains the rate and meets the targets
                "misses": misses,
                "command": command(args.model, config, "serve", p.candidate.weight_bits),
            }
        )
    rows.sort(key=_rank)
    return rows


def _rank(row: dict) -> tuple:
    """Those that sustain the rate and meet the targets first: the soonest p90 first token, then the fastest stream
    (each as the table prints it, to 3 figures, so that a difference it does not show does not decide), then the
    most headroom; then the rest, the fewest misses and the most headroom first."""
    if row["meets"]:
        ttft, stream = (float(f"{row[k]:.3g}") for k in ("ttft_p90_seconds", "stream_tokens_per_second"))
        return (0, ttft, -stream, -row["max_rate"], row["policy"]["batch"])
    return (1, len(row["misses"]), -row["max_rate"], row["ttft_p90_seconds"], row["policy"]["batch"])


def ranking(args: argparse.Namespace) -> str:
    """How latency_rows orders its rows, in a line."""
    targets = " and meet the targets" if args.max_ttft is not None or args.min_stream_tps is not None else ""
    return (
        f"ranked by p90 time to first token, then tokens/s a stream, among those that sustain {args.qps:g} "
        f"requests/s{targets}; then the rest, the nearest first"
    )


def _served_line(hw: HardwareProfile) -> str:
    if s := hw.served_step:
        return (
            f"serving   the engine's own cost from the profile: {s.step * 1e3:.3g} ms a step, {s.per_stream * 1e3:.3g} "
            f"ms a stream in it, {s.per_prompt_token * 1e6:.3g} us a prompt token, {s.request * 1e3:.3g} ms a request"
        )
    return "serving   not in this profile (`offload probe` measures it): steps priced by their layers and head alone"


def latency_report(
    shape: ModelSpec, hw: HardwareProfile, workload: Workload, dtype: str, rows: list[dict], args: argparse.Namespace
) -> str:
    targets = [f"p90 TTFT <= {args.max_ttft:g} s" for _ in [0] if args.max_ttft is not None]
    targets += [f"streams >= {args.min_stream_tps:g} tokens/s" for _ in [0] if args.min_stream_tps is not None]
    lines = [
        f"model     {shape.name}, computed in {dtype}, on {hw.name}",
        f"requests  {args.qps:g}/s ({args.arrival}) of {workload.prompt_len}-token prompts, {workload.gen_len} new "
        "tokens each; predicted by simulating the engine's continuous batching over the cost model",
        f"targets   {', '.join(targets) or 'none (--max-ttft, --min-stream-tps)'}",
        _served_line(hw),
        "",
        ranking(args),
        f"{'#':>2} {'batch':>5} {'weights':>12} {'TTFT p50':>9} {'p90':>8} {'stream tok/s':>12} {'max req/s':>9} "
        f"{'mean batch':>10}  meets",
    ]
    for i, r in enumerate(rows, 1):
        c = r["policy"]
        layers = "/".join(map(str, c["layers"]))
        lines.append(
            f"{i:>2} {c['batch']:>5} {layers:>12} {r['ttft_p50_seconds']:>8.3g}s {r['ttft_p90_seconds']:>7.3g}s "
            f"{r['stream_tokens_per_second']:>12.3g} {r['max_rate']:>9.3g} {r['mean_batch']:>10.3g}  "
            + ("yes" if r["meets"] else "no: " + "; ".join(r["misses"]))
        )
    if rows:
        lines += ["", f"run the first: {rows[0]['command']}"]
    return "\n".join(lines)
