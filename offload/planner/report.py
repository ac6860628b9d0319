"""`offload plan`: what fits where and how fast it will run, before anything is loaded or bought.

Reads a model's shape (a public name or a local directory) and a hardware profile, asks the cost model
(scheduler/cost/predict.py) for every policy, and prints the best ones, why the others lose and what does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from dataclasses import asdict

from offload.common.config import BLOCK_SIZE
from offload.common.errors import OffloadError
from offload.common.hardware import HardwareProfile
from offload.common.model_config import ModelSpec
from offload.common.tier import Tier
from offload.planner.compare import (
    AMORTIZE_HOURS,
    DISK_CLASSES,
    _default_dtype,
    _hardware_options,
    _option_row,
    _prices,
    comparison,
)
from offload.planner.latency import latency_report, latency_rows, ranking
from offload.planner.models import StoredWeights
from offload.planner.routing import with_measured_routing
from offload.planner.rows import candidate_json, per_batch
from offload.planner.rows import decimal_size as _gb
from offload.planner.speculation import add_plan_flags, plan_section
from offload.scheduler.cost.predict import Budgets, Prediction, Workload, capacity
from offload.scheduler.cost.queueing import ARRIVALS
from offload.scheduler.cost.search import best, search

GB = 1e9


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="predict the best policy (batch, placement of weights and KV) for a model on a machine",
        description="Search the policies for the highest predicted throughput that fits every memory budget, "
        "print the best ones, why the others lose, and what does not fit. Nothing is loaded.",
    )
    p.add_argument("--model", required=True, metavar="DIR|NAME", help="model directory or a name in configs/models")
    p.add_argument(
        "--hardware",
        default="probe",
        metavar="PROFILE[,PROFILE...]|DIR|probe",
        help="a name in configs/hardware, a profile JSON file, or 'probe': the profile `offload probe` saved for "
        "this machine (measured now, quickly, when there is none); several, comma-separated, or a folder of profile "
        "files: one row per option, with its best throughput and cost per million tokens",
    )
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="PROFILE=USD",
        help="an option's price per hour (cloud rent); repeatable. A profile file may state its own ('price')",
    )
    p.add_argument(
        "--purchase",
        action="append",
        default=[],
        metavar="PROFILE=USD",
        help="an option's purchase price, spread over --amortize-hours; repeatable",
    )
    p.add_argument(
        "--amortize-hours",
        type=float,
        default=AMORTIZE_HOURS,
        metavar="H",
        help=f"hours a purchase is spread over (default {AMORTIZE_HOURS:.0f}: three years, always on)",
    )
    p.add_argument("--qps", type=float, metavar="R", help="requests/s arriving: predict each policy's latency at it")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="how requests arrive (default poisson)")
    p.add_argument("--max-ttft", type=float, metavar="S", help="target: p90 time to first token at most S seconds")
    p.add_argument("--min-stream-tps", type=float, metavar="X", help="target: each stream at least X tokens/s")
    p.add_argument("--disk", metavar="CLASS", help=f"the disk, one of the shipped classes ({', '.join(DISK_CLASSES)})")
    p.add_argument("--prompt-len", type=int, default=512, metavar="TOKENS")
    p.add_argument("--gen-len", type=int, default=32, metavar="TOKENS")
    p.add_argument("--requests", type=int, metavar="N", help="requests to serve (default: one batch, any size)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="compute dtype (default: the model's)")
    p.add_argument("--device-memory", metavar="SIZE", help="device budget (default: the profile's device memory)")
    p.add_argument("--host-memory", metavar="SIZE", help="host RAM budget (default: the profile's host memory)")
    p.add_argument("--disk-read", type=float, metavar="GB/s", help="disk read bandwidth (default: the profile's)")
    p.add_argument("--quantize", action="store_true", help="also consider 8- and 4-bit weights and KV cache, FlexGen's")
    p.add_argument("--top", type=int, default=5, metavar="N", help="policies to list (default 5)")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw predicted throughput against batch size per placement")
    add_plan_flags(p)
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> None:
    from offload.common.sizes import parse_size
    from offload.planner.models import load_model_spec
    from offload.planner.profiles import with_overrides

    # a GGUF file: its shape and weights as stored, read from its header by offload/cli.py's main (no import)
    shape, _ = with_measured_routing(getattr(args, "shape", None) or load_model_spec(args.model), args.model)
    stored = getattr(args, "stored", None)
    options = list(_hardware_options(args.hardware).items())
    if args.disk is not None:
        if args.disk not in DISK_CLASSES:
            raise OffloadError(f"--disk {args.disk!r}: one of {', '.join(DISK_CLASSES)}")
        read, write = DISK_CLASSES[args.disk][:2]
        options = [(n, with_overrides(hw, disk_read=read * GB, disk_write=write * GB)) for n, hw in options]
    if args.disk_read is not None:
        if not args.disk_read > 0:
            raise OffloadError(f"--disk-read must be a positive number of GB/s, got {args.disk_read}")
        options = [(n, with_overrides(hw, disk_read=args.disk_read * GB)) for n, hw in options]
    prices = _prices(dict(options), args.price, args.purchase, args.amortize_hours)
    budgets = Budgets(
        device=None if args.device_memory is None else parse_size(args.device_memory, "--device-memory"),
        host=None if args.host_memory is None else parse_size(args.host_memory, "--host-memory"),
    )
    if args.top < 1:
        raise OffloadError(f"--top must be at least 1, got {args.top}")
    workload = Workload(args.prompt_len, args.gen_len, args.requests)
    if len(options) > 1:
        rows = [
            _option_row(shape, hw, workload, args.dtype, budgets, args.quantize, prices.get(hw.name))
            for _, hw in options
        ]
        if args.json:
            print(json.dumps({"model": shape.name, "workload": asdict(workload), "options": rows}, indent=1))
        else:
            print(comparison(shape, workload, rows, args.amortize_hours))
        return
    ((_, hw),) = options
    dtype = args.dtype or _default_dtype(shape, hw)
    # a quantized checkpoint (an imported GGUF among them) runs at its own width; else the widths --quantize asks
    widths = {"weight_bits": (shape.quant.bits,)} if shape.quant is not None else {"quantized": args.quantize}
    if args.qps is not None:
        if not args.qps > 0:
            raise OffloadError(f"--qps must be a positive number of requests/s, got {args.qps}")
        predictions = search(shape, hw, workload, dtype=dtype, budgets=budgets, **widths)
        rows = latency_rows(shape, hw, workload, dtype, budgets, predictions, args)
        if args.json:
            targets = {"max_ttft_p90_seconds": args.max_ttft, "min_stream_tokens_per_second": args.min_stream_tps}
            out = {"model": shape.name, "hardware": hw.name, "qps": args.qps, "targets": targets}
            print(json.dumps(out | {"ranked_by": ranking(args), "policies": rows}, indent=1))
        else:
            print(latency_report(shape, hw, workload, dtype, rows, args))
        return
    predictions = search(shape, hw, workload, dtype=dtype, budgets=budgets, **widths)
    if args.plot:
        from offload.planner.plot import plot

        plot(predictions, args.plot, f"{shape.name} on {hw.name}")
    speculation, spec_rows = plan_section(args, shape, hw, dtype, workload, predictions)  # --speculate's
    if args.json:
        out = report_json(shape, hw, workload, dtype, predictions, args.top, budgets, args.model, stored, spec_rows)
        print(json.dumps(out, indent=1, default=sorted))  # a quantized model's unquantized names: a frozenset
    else:
        print(report(shape, hw, workload, dtype, budgets, predictions, args.top, args.model, stored) + speculation)


def _policy(p: Prediction) -> str:
    c = p.candidate
    dev, host, disk = c.policy.counts
    bits = "" if c.weight_bits == c.kv_bits >= 16 else f" w{c.weight_bits}/kv{c.kv_bits}"
    disk_part = f"{disk}{'+E' if c.expert_cache else ''}{'*' if c.policy.embed_tier == Tier.NVME else ''}"
    weights = f"{dev:>4}/{host:>4}/{disk_part:<4}".ljust(14)
    return f"{c.batch:>5} {c.micro_batches:>3}  {weights} {c.kv_tier:<6}{bits}"


def report(
    shape: ModelSpec,
    hw: HardwareProfile,
    workload: Workload,
    dtype: str,
    budgets: Budgets,
    predictions: list[Prediction],
    top: int,
    model: str | None = None,
    stored: StoredWeights | None = None,
) -> str:
    """The plan as text; `model` (the --model given): each runnable policy's command is printed after the table;
    `stored`: a model file's weights as it stores them, printed under the sizes."""
    from offload.planner.models import estimate_sizes

    cap = capacity(hw, budgets)
    lines = [
        f"model     {shape.name} ({shape.architecture}): {shape.num_layers} layers, "
        f"{shape.total_params / 1e9:.2f} B parameters, computed in {dtype}",
        "sizes     "
        + " | ".join(
            f"{e.dtype} {_gb(e.total_bytes)} (largest layer {_gb(e.largest_layer_bytes)}, {e.largest_layer_name})"
            for e in estimate_sizes(shape)
        )
        + ("" if stored is None else "\n          " + _stored(stored)),
        f"hardware  {hw.name} ({hw.device_kind}): device {_gb(cap[Tier.DEVICE])}, "
        f"host {_gb(cap[Tier.HOST])}, disk reads {hw.disk_read / GB:.2f} GB/s"
        + (f", host->device {hw.host_to_device / GB:.0f} GB/s" if hw.host_to_device else ""),
        f"workload  prompt {workload.prompt_len} tokens, {workload.gen_len} new tokens, "
        + (f"{workload.requests} requests" if workload.requests else "one batch of any size"),
        "",
    ]
    if hw.not_run:
        lines.insert(3, f"          planning only: {hw.not_run}")
    winner = best(predictions)
    if winner is None:
        smallest = predictions[0]
        lines.append(
            "nothing fits: the smallest policy (batch 1, every layer streamed) is over by "
            + ", ".join(f"{t} {_gb(b)}" for t, b in smallest.overflow.items())
        )
        return "\n".join(lines)
    fitting = [p for p in per_batch(predictions).values() if p.fits]
    fitting.sort(key=lambda p: -p.tokens_per_second)
    if shape.num_experts:
        lines[-1:-1] = _experts_lines(shape, hw, workload, dtype, winner)
    stored = any(p.candidate.policy.embed_tier == Tier.NVME for p in fitting[:top])
    lines.append(
        "best policies (predicted; weights: decoder layers on device/host/disk"
        + ("; +E: routed experts read when chosen, through an expert cache" if shape.num_experts else "")
        + ("; *: the embedding left on disk, each step reading its tokens' rows" if stored else "")
        + ")"
    )
    lines.append(
        f"{'#':>2} {'batch':>5} {'mb':>3}  {'weights':<14} {'KV':<6} {'tok/s':>9} {'TTFT':>9} "
        f"{Tier.DEVICE:>10} {Tier.HOST:>10}  {'bound':<7} runs here"
    )
    for i, p in enumerate(fitting[:top], 1):
        lines.append(
            f"{i:>2} {_policy(p)} {p.tokens_per_second:>9.3g} {p.ttft_seconds:>8.3g}s "
            f"{_gb(p.memory[Tier.DEVICE]):>10} {_gb(p.memory[Tier.HOST]):>10}  {p.bound:<7} "
            + _runs_here(p, shape, hw, dtype)
        )
    runnable = best(predictions, runnable_only=True)
    if runnable is not None and runnable is not winner:
        lines.append(
            f"   this engine today: batch {runnable.candidate.batch}, {runnable.tokens_per_second:.3g} tok/s "
            f"({runnable.tokens_per_second / winner.tokens_per_second:.2f}x the best)"
        )
    if model is not None:
        lines += ["", "commands that run them (the engine places and batches as planned)"]
        for i, p in enumerate(fitting[:top], 1):
            if not p.unsupported:
                lines.append(f"{i:>2} {_command(shape, hw, workload, dtype, budgets, p, model)}")
        if not os.path.isdir(model):
            lines.append(f"   MODEL_DIR: a local copy of {model} in Hugging Face layout (config.json, *.safetensors)")
    lines += ["", "why the others lose"]
    lines += _explain(winner, predictions)
    return "\n".join(lines)


def _stored(s: StoredWeights) -> str:
    kinds = ", ".join(f"{t.name} {_gb(t.nbytes)} at {t.bits:.3g}" for t in s.types)
    return (
        f"as stored in {s.file}: {_gb(s.nbytes)} at {s.bits:.3g} bits a weight ({kinds}; largest layer "
        f"{_gb(s.largest_layer_bytes)}, {s.largest_layer_name}), "
        + (f"{_gb(s.imported_bytes)} once imported" if s.imported_bytes else "read in place, nothing imported")
    )


def _command(
    shape: ModelSpec, hw: HardwareProfile, workload: Workload, dtype: str, budgets: Budgets, p: Prediction, model: str
) -> str:
    from offload.planner.commands import command, planned_config

    config = planned_config(shape, hw, dtype, p, workload, budgets)
    return command(model, config, "batch", p.candidate.weight_bits)


def _runs_here(p: Prediction, shape: ModelSpec, hw: HardwareProfile, dtype: str) -> str:
    from offload.common.sizes import typed_size
    from offload.planner.commands import expert_cache_size

    if p.unsupported:
        return "needs " + ", ".join(p.unsupported)
    c, how = p.candidate, []
    if c.weight_bits in (4, 8) and shape.quant is None:  # a quantized checkpoint runs as it is
        how.append(f"converted: offload convert --quant int{c.weight_bits}")
    if c.expert_cache:  # as its command gives it
        how.append(f"--expert-cache-memory {typed_size(expert_cache_size(shape, hw, dtype, c), 0)}")
    return "yes" + (", " + ", ".join(how) if how else "")


def _experts_lines(
    shape: ModelSpec, hw: HardwareProfile, workload: Workload, dtype: str, winner: Prediction
) -> list[str]:
    """What a step touches of a mixture's experts, and what the best policy's expert cache holds."""
    from offload.scheduler.cost.moe_cost import distinct_experts, hit_rate, sparse_layers
    from offload.scheduler.cost.predict import make_context

    c = winner.candidate
    ctx = make_context(shape, hw, dtype, BLOCK_SIZE)
    one = ctx.expert_bytes(c.weight_bits)
    touched = ", ".join(f"batch {b}: {distinct_experts(shape, b):.1f}" for b in (1, 8, 64) if b <= max(c.batch, 8))
    lines = [
        f"experts   {shape.num_experts} routed per layer in {sparse_layers(shape)} layers, top "
        f"{shape.experts_per_token}, {_gb(one)} each: a decode step touches per layer (uniform routing) {touched}"
    ]
    slots = ctx.expert_slots(c)
    if slots is not None:
        lines.append(
            f"          the best policy caches {slots} of {sparse_layers(shape) * shape.num_experts} experts "
            f"({_gb(c.expert_cache)}): a chosen expert is cached with chance {hit_rate(shape, slots):.0%}"
            + (
                ""
                if shape.expert_hit_exponent == 1
                else f", its share ** {shape.expert_hit_exponent:.3g} as runs measured"
            )
        )
    return lines


def _explain(winner: Prediction, predictions: list[Prediction]) -> list[str]:
    out = []
    w = winner.candidate
    res = winner.resources
    out.append(
        f"  the best is {winner.bound}-bound: per batch, disk {res['disk']:.3g} s, host->device {res['link']:.3g} s, "
        f"compute {res['compute']:.3g} s" + (f", CPU attention {res['host']:.3g} s" if res["host"] else "")
    )
    by_batch = per_batch(predictions)
    for batch, p in sorted(by_batch.items()):
        if batch == w.batch:
            continue
        if not p.fits:
            over = ", ".join(f"{t} by {_gb(b)}" for t, b in p.overflow.items())
            out.append(f"  batch {batch:>5}: does not fit, over {over} (smallest overflow over every placement)")
        else:
            ratio = p.tokens_per_second / winner.tokens_per_second
            why = "weights are read once per step for fewer tokens" if batch < w.batch else f"{p.bound}-bound"
            out.append(f"  batch {batch:>5}: {ratio:.2f}x the best throughput: {why}")
    if any(p.candidate.expert_cache for p in predictions):
        other = [p for p in predictions if bool(p.candidate.expert_cache) != bool(w.expert_cache)]
        b = best(other)
        what = "experts with their layers" if w.expert_cache else "experts through an expert cache"
        if b is None:
            out.append(f"  {what}: nothing fits")
        else:
            ratio = b.tokens_per_second / winner.tokens_per_second
            out.append(f"  {what}: at best {ratio:.2f}x (batch {b.candidate.batch}, {b.bound}-bound)")
    by_kv = defaultdict(list)
    for p in predictions:
        by_kv[p.candidate.kv_tier].append(p)
    for tier, preds in sorted(by_kv.items()):
        if tier != w.kv_tier:
            b = best(preds)
            if b is None:
                out.append(f"  KV on {tier}: nothing fits")
            else:
                ratio = b.tokens_per_second / winner.tokens_per_second
                out.append(f"  KV on {tier}: at best {ratio:.2f}x (batch {b.candidate.batch}, {b.bound}-bound)")
    return out


def report_json(
    shape: ModelSpec,
    hw: HardwareProfile,
    workload: Workload,
    dtype: str,
    predictions: list[Prediction],
    top: int,
    budgets: Budgets | None = None,
    model: str | None = None,
    stored: StoredWeights | None = None,
    speculation: list[dict] | None = None,  # `offload plan --speculate`'s rows, where it was asked
) -> dict:
    from offload.planner.models import estimate_sizes

    def row(p: Prediction) -> dict:
        runs = model is not None and p.fits and not p.unsupported
        return {
            "command": _command(shape, hw, workload, dtype, budgets or Budgets(), p, model) if runs else None,
            "policy": candidate_json(p.candidate),
            "tokens_per_second": p.tokens_per_second,
            "ttft_seconds": p.ttft_seconds,
            "prefill_seconds": p.prefill_seconds,
            "decode_seconds": p.decode_seconds,
            "rounds": p.rounds,
            "memory_bytes": p.memory,
            "overflow_bytes": p.overflow,
            "busy_seconds": p.resources,
            "bound": p.bound,
            "fits": p.fits,
            "unsupported": list(p.unsupported),
        }

    by_batch = per_batch(predictions)
    return {
        "model": asdict(shape),
        "sizes": [asdict(e) for e in estimate_sizes(shape)],
        "stored": None if stored is None else asdict(stored),
        "hardware": hw.name,
        "dtype": dtype,
        "workload": asdict(workload),
        "best": [row(p) for p in predictions if p.fits][:top],
        "per_batch": [row(p) for _, p in sorted(by_batch.items())],
    } | ({"speculation": speculation} if speculation else {})
