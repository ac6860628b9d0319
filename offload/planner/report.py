"""`offload plan`: what fits where and how fast it will run, before anything is loaded or bought.

Reads a model's shape (a public name or a local directory) and a hardware profile, asks the cost model
(scheduler/cost.py) for every policy, and prints the best ones, why the others lose and what does not fit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import defaultdict
from dataclasses import asdict

from offload.common.config import BLOCK_SIZE
from offload.common.errors import OffloadError
from offload.common.hardware import HardwareProfile
from offload.common.model_config import ModelSpec
from offload.scheduler.cost import Budgets, Candidate, Prediction, Workload, capacity
from offload.scheduler.queueing import ARRIVALS
from offload.scheduler.search import best, search

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
    p.add_argument(
        "--quantize", action="store_true", help="also consider 8- and 4-bit weights and KV cache (FlexGen-style)"
    )
    p.add_argument("--top", type=int, default=5, metavar="N", help="policies to list (default 5)")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw predicted throughput against batch size per placement")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> None:
    from offload.common.sizes import parse_size
    from offload.planner.models import load_model_spec
    from offload.planner.profiles import with_overrides

    shape = load_model_spec(args.model)
    options = _hardware_options(args.hardware)
    if args.disk is not None:
        if args.disk not in DISK_CLASSES:
            raise OffloadError(f"--disk {args.disk!r}: one of {', '.join(DISK_CLASSES)}")
        read, write = DISK_CLASSES[args.disk][:2]
        options = [with_overrides(hw, disk_read=read * GB, disk_write=write * GB) for hw in options]
    if args.disk_read is not None:
        if not args.disk_read > 0:
            raise OffloadError(f"--disk-read must be a positive number of GB/s, got {args.disk_read}")
        options = [with_overrides(hw, disk_read=args.disk_read * GB) for hw in options]
    prices = _prices(options, args.price, args.purchase, args.amortize_hours)
    budgets = Budgets(
        device=None if args.device_memory is None else parse_size(args.device_memory, "--device-memory"),
        host=None if args.host_memory is None else parse_size(args.host_memory, "--host-memory"),
    )
    if args.top < 1:
        raise OffloadError(f"--top must be at least 1, got {args.top}")
    workload = Workload(args.prompt_len, args.gen_len, args.requests)
    if len(options) > 1:
        rows = [
            _option_row(shape, hw, workload, args.dtype, budgets, args.quantize, prices.get(hw.name)) for hw in options
        ]
        if args.json:
            print(json.dumps({"model": shape.name, "workload": asdict(workload), "options": rows}, indent=1))
        else:
            print(comparison(shape, workload, rows, args.amortize_hours))
        return
    (hw,) = options
    dtype = args.dtype or _default_dtype(shape, hw)
    if args.qps is not None:
        if not args.qps > 0:
            raise OffloadError(f"--qps must be a positive number of requests/s, got {args.qps}")
        predictions = search(shape, hw, workload, dtype=dtype, budgets=budgets, quantized=args.quantize)
        rows = latency_rows(shape, hw, workload, dtype, budgets, predictions, args)
        if args.json:
            print(json.dumps({"model": shape.name, "hardware": hw.name, "qps": args.qps, "policies": rows}, indent=1))
        else:
            print(latency_report(shape, hw, workload, dtype, rows, args))
        return
    predictions = search(shape, hw, workload, dtype=dtype, budgets=budgets, quantized=args.quantize)
    if args.plot:
        plot(predictions, args.plot, f"{shape.name} on {hw.name}")
    if args.json:
        print(json.dumps(report_json(shape, hw, workload, dtype, predictions, args.top, budgets, args.model), indent=1))
    else:
        print(report(shape, hw, workload, dtype, budgets, predictions, args.top, args.model))


AMORTIZE_HOURS = 3 * 365 * 24.0
# NVMe and SATA classes to combine with a profile (--disk): read and write GB/s, 0.85 x a typical drive's sequential
# spec, as the shipped profiles derate theirs, and the drive
DISK_CLASSES = {
    "sata": (0.47, 0.44, "a SATA SSD: 550 / 520 MB/s sequential (the interface's ceiling)"),
    "pcie3": (2.98, 2.81, "a PCIe Gen3 x4 NVMe SSD: 3.5 / 3.3 GB/s sequential (Samsung 970 EVO Plus)"),
    "pcie4": (6.33, 5.87, "a PCIe Gen4 x4 NVMe SSD: 7.45 / 6.9 GB/s sequential (Samsung 990 PRO)"),
    "pcie5": (12.3, 10.8, "a PCIe Gen5 x4 NVMe SSD: 14.5 / 12.7 GB/s sequential (Crucial T705)"),
}


def _hardware_options(spec: str) -> list[HardwareProfile]:
    """The profiles --hardware names: one, several comma-separated, or every .json file of a folder."""
    from pathlib import Path

    if os.path.isdir(spec):
        files = sorted(Path(spec).glob("*.json"))
        if not files:
            raise OffloadError(f"--hardware {spec}: a folder with no .json profile in it")
        return [_hardware(str(f)) for f in files]
    names = [n.strip() for n in spec.split(",")]
    if not all(names):
        raise OffloadError(f"--hardware {spec!r}: an empty name in the list")
    return [_hardware(n) for n in names]


def _prices(options: list[HardwareProfile], rents: list[str], purchases: list[str], hours: float) -> dict[str, float]:
    """Option name -> USD per hour: --price (per hour), --purchase (spread over `hours`), else the profile's own."""
    if not hours > 0:
        raise OffloadError(f"--amortize-hours must be positive, got {hours}")
    by_key = {}
    for hw in options:
        by_key[hw.name.lower()] = hw.name
    out = {hw.name: hw.price_per_hour for hw in options if hw.price_per_hour is not None}
    for flag, given, scale in (("--price", rents, 1.0), ("--purchase", purchases, 1.0 / hours)):
        for item in given:
            key, sep, value = item.partition("=")
            try:
                usd = float(value)
            except ValueError:
                usd = -1.0
            if not sep or usd < 0:
                raise OffloadError(f"{flag} {item!r}: give PROFILE=USD, a number of dollars")
            name = by_key.get(key.strip().lower()) or _stem_match(options, key.strip())
            if name is None:
                raise OffloadError(f"{flag} {item!r}: {key!r} is none of the --hardware options")
            out[name] = usd * scale
    return out


def _stem_match(options: list[HardwareProfile], key: str) -> str | None:
    """The option whose profile is the shipped file `key` (t4-16gb names the profile called T4-16GB)."""
    from offload.planner.profiles import PROFILE_DIR, load_profile

    path = PROFILE_DIR / f"{key.lower()}.json"
    if not path.exists():
        return None
    name = load_profile(path).name
    return name if any(hw.name == name for hw in options) else None


def _option_row(
    shape: ModelSpec,
    hw: HardwareProfile,
    workload: Workload,
    dtype: str | None,
    budgets: Budgets,
    quantized: bool,
    usd_per_hour: float | None,
) -> dict:
    """One hardware option: its best runnable policy and what a million tokens cost on it."""
    try:
        dtype = dtype or _default_dtype(shape, hw)
        predictions = search(shape, hw, workload, dtype=dtype, budgets=budgets, quantized=quantized)
        chosen = best(predictions, runnable_only=True)
    except OffloadError as exc:
        return {"hardware": hw.name, "fits": False, "why": str(exc), "usd_per_hour": usd_per_hour}
    if chosen is None:
        return {"hardware": hw.name, "fits": False, "why": "no policy fits", "usd_per_hour": usd_per_hour}
    tps = chosen.tokens_per_second
    per_million = None if usd_per_hour is None else usd_per_hour / (tps * 3600) * 1e6
    return {
        "hardware": hw.name,
        "fits": True,
        "dtype": dtype,
        "policy": _candidate_json(chosen.candidate),
        "tokens_per_second": tps,
        "ttft_seconds": chosen.ttft_seconds,
        "bound": chosen.bound,
        "busy_seconds": chosen.resources,
        "usd_per_hour": usd_per_hour,
        "usd_per_million_tokens": per_million,
        "not_run": hw.not_run,
    }


def comparison(shape: ModelSpec, workload: Workload, rows: list[dict], hours: float) -> str:
    """The hardware options side by side, cheapest per token first (then fastest); what binds each."""
    lines = [
        f"model     {shape.name}: {shape.total_params / 1e9:.2f} B parameters",
        f"workload  prompt {workload.prompt_len} tokens, {workload.gen_len} new tokens, "
        + (f"{workload.requests} requests" if workload.requests else "one batch of any size"),
        "",
        f"{'hardware':<22} {'tok/s':>9} {'batch':>6} {'layers dev/host/disk':>21} {'bound':<8} {'$/h':>7} "
        f"{'$ per M tokens':>14}",
    ]

    def order(r: dict) -> tuple:
        cost = r.get("usd_per_million_tokens")
        return (not r["fits"], cost is None, cost or 0.0, -r.get("tokens_per_second", 0.0))

    for r in sorted(rows, key=order):
        price = "-" if r["usd_per_hour"] is None else f"{r['usd_per_hour']:.2f}"
        if not r["fits"]:
            lines.append(f"{r['hardware']:<22} {'-':>9} {'-':>6} {'-':>21} {'-':<8} {price:>7} {'-':>14}  {r['why']}")
            continue
        layers = "/".join(map(str, r["policy"]["layers"]))
        cost = "-" if r["usd_per_million_tokens"] is None else f"{r['usd_per_million_tokens']:.3g}"
        lines.append(
            f"{r['hardware']:<22} {r['tokens_per_second']:>9.3g} {r['policy']['batch']:>6} {layers:>21} "
            f"{r['bound']:<8} {price:>7} {cost:>14}" + ("  (planning only: not run)" if r["not_run"] else "")
        )
    if any(r["usd_per_hour"] is None for r in rows):
        lines += ["", "$: give --price PROFILE=USD (per hour) or --purchase PROFILE=USD (spread over --amortize-hours)"]
    lines += [
        "",
        f"bound: the busiest resource over a round (disk, link, compute, host); purchases spread over {hours:.0f} h",
    ]
    return "\n".join(lines)


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
    what it misses), and the `offload serve` command that runs it. Those that meet come first, the most headroom
    (sustainable rate over the rate asked) first; then the rest, the nearest first."""
    from offload.planner.commands import command, planned_config
    from offload.scheduler.cost import make_context
    from offload.scheduler.queueing import simulate

    ctx = make_context(shape, hw, dtype, BLOCK_SIZE)
    rows = []
    for p in _per_batch(predictions).values():
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
                "policy": _candidate_json(p.candidate),
                "ttft_p50_seconds": lat.ttft_p50,
                "ttft_p90_seconds": lat.ttft_p90,
                "stream_tokens_per_second": lat.stream_tps_p50,
                "throughput_tokens_per_second": lat.throughput,
                "max_rate": lat.max_rate,
                "mean_batch": lat.mean_batch,
                "meets": not misses,
                "misses": misses,
                "command": command(args.model, config, "serve", p.candidate.weight_bits),
            }
        )
    rows.sort(key=lambda r: (not r["meets"], len(r["misses"]), -r["max_rate"], r["ttft_p90_seconds"]))
    return rows


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
        "",
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


def _hardware(name: str) -> HardwareProfile:
    from offload.planner.profiles import load_profile

    if name != "probe":
        return load_profile(name)
    from offload.planner.probe import local_profile

    return local_profile()


def _default_dtype(shape: ModelSpec, hw: HardwareProfile) -> str:
    """The model's dtype when the device multiplies it, else float16 (a T4 has no bfloat16 units)."""
    if shape.dtype in hw.device.matmul_flops or shape.dtype in hw.device.matmul_curve:
        return shape.dtype
    return "float16"


# ---- the report ----------------------------------------------------------------------------------------------


def _gb(nbytes: float) -> str:
    """Decimal units, as datasheets and `--device-memory 600MB` spell them."""
    if nbytes < GB:
        return f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e6 or nbytes == 0 else f"{nbytes / 1e3:.0f} kB"
    return f"{nbytes / GB:.2f} GB" if nbytes < 100 * GB else f"{nbytes / GB:.0f} GB"


def _policy(p: Prediction) -> str:
    c = p.candidate
    dev, host, disk = c.policy.counts
    bits = "" if c.weight_bits == c.kv_bits >= 16 else f" w{c.weight_bits}/kv{c.kv_bits}"
    disk_part = f"{disk}{'+E' if c.expert_cache else ''}{'*' if c.policy.embed_tier == 'nvme' else ''}"
    weights = f"{dev:>4}/{host:>4}/{disk_part:<4}".ljust(14)
    return f"{c.batch:>5} {c.micro_batches:>3}  {weights} {c.kv_tier:<6}{bits}"


def _per_batch(predictions: list[Prediction]) -> dict[int, Prediction]:
    """The best prediction at each batch size: fitting ones first (they come first in `predictions`)."""
    out: dict[int, Prediction] = {}
    for p in predictions:
        out.setdefault(p.candidate.batch, p)
    return out


def report(
    shape: ModelSpec,
    hw: HardwareProfile,
    workload: Workload,
    dtype: str,
    budgets: Budgets,
    predictions: list[Prediction],
    top: int,
    model: str | None = None,
) -> str:
    """The plan as text; `model` (the --model given): each runnable policy's command is printed after the table."""
    from offload.planner.models import estimate_sizes

    cap = capacity(hw, budgets)
    lines = [
        f"model     {shape.name} ({shape.architecture}): {shape.num_layers} layers, "
        f"{shape.total_params / 1e9:.2f} B parameters, computed in {dtype}",
        "sizes     "
        + " | ".join(
            f"{e.dtype} {_gb(e.total_bytes)} (largest layer {_gb(e.largest_layer_bytes)}, {e.largest_layer_name})"
            for e in estimate_sizes(shape)
        ),
        f"hardware  {hw.name} ({hw.device_kind}): device {_gb(cap['device'])}, "
        f"host {_gb(cap['host'])}, disk reads {hw.disk_read / GB:.2f} GB/s"
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
    fitting = [p for p in _per_batch(predictions).values() if p.fits]
    fitting.sort(key=lambda p: -p.tokens_per_second)
    if shape.num_experts:
        lines[-1:-1] = _experts_lines(shape, hw, workload, dtype, winner)
    stored = any(p.candidate.policy.embed_tier == "nvme" for p in fitting[:top])
    lines.append(
        "best policies (predicted; weights: decoder layers on device/host/disk"
        + ("; +E: routed experts read when chosen, through an expert cache" if shape.num_experts else "")
        + ("; *: the embedding left on disk, each step reading its tokens' rows" if stored else "")
        + ")"
    )
    lines.append(
        f"{'#':>2} {'batch':>5} {'mb':>3}  {'weights':<14} {'KV':<6} {'tok/s':>9} {'TTFT':>9} "
        f"{'device':>10} {'host':>10}  {'bound':<7} runs here"
    )
    for i, p in enumerate(fitting[:top], 1):
        lines.append(
            f"{i:>2} {_policy(p)} {p.tokens_per_second:>9.3g} {p.ttft_seconds:>8.3g}s "
            f"{_gb(p.memory['device']):>10} {_gb(p.memory['host']):>10}  {p.bound:<7} " + _runs_here(p)
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


def _command(
    shape: ModelSpec, hw: HardwareProfile, workload: Workload, dtype: str, budgets: Budgets, p: Prediction, model: str
) -> str:
    from offload.planner.commands import command, planned_config

    config = planned_config(shape, hw, dtype, p, workload, budgets)
    return command(model, config, "batch", p.candidate.weight_bits)


def _runs_here(p: Prediction) -> str:
    if p.unsupported:
        return "needs " + ", ".join(p.unsupported)
    c, how = p.candidate, []
    if c.weight_bits in (4, 8):
        how.append(f"converted: offload convert --quant int{c.weight_bits}")
    if c.expert_cache:
        how.append(f"--expert-cache-memory {c.expert_cache / 1e6:.0f}MB")
    return "yes" + (", " + ", ".join(how) if how else "")


def _experts_lines(
    shape: ModelSpec, hw: HardwareProfile, workload: Workload, dtype: str, winner: Prediction
) -> list[str]:
    """What a step touches of a mixture's experts, and what the best policy's expert cache holds."""
    from offload.scheduler.cost import make_context
    from offload.scheduler.moe_cost import distinct_experts, expert_params, hit_rate, sparse_layers

    c = winner.candidate
    ctx = make_context(shape, hw, dtype, BLOCK_SIZE)
    one = ctx.weight_bytes(expert_params(shape), c.weight_bits)
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
    per_batch = _per_batch(predictions)
    for batch, p in sorted(per_batch.items()):
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
) -> dict:
    from offload.planner.models import estimate_sizes

    def row(p: Prediction) -> dict:
        runs = model is not None and p.fits and not p.unsupported
        return {
            "command": _command(shape, hw, workload, dtype, budgets or Budgets(), p, model) if runs else None,
            "policy": _candidate_json(p.candidate),
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

    per_batch = _per_batch(predictions)
    return {
        "model": asdict(shape),
        "sizes": [asdict(e) for e in estimate_sizes(shape)],
        "hardware": hw.name,
        "dtype": dtype,
        "workload": asdict(workload),
        "best": [row(p) for p in predictions if p.fits][:top],
        "per_batch": [row(p) for _, p in sorted(per_batch.items())],
    }


def _candidate_json(c: Candidate) -> dict:
    """The candidate with its placement as layer counts on device / host / disk, as the report prints it."""
    return {
        "batch": c.batch,
        "micro_batches": c.micro_batches,
        "layers": list(c.policy.counts),
        "embedding": c.policy.embed_tier,
        "kv_tier": c.kv_tier,
        "weight_bits": c.weight_bits,
        "kv_bits": c.kv_bits,
        "expert_cache_bytes": c.expert_cache,
    }


def plot(predictions: list[Prediction], path: str, title: str) -> None:
    """Predicted tokens/s against batch size, one line per placement (KV tier and precision), fitting points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OffloadError("--plot needs matplotlib (pip install matplotlib)") from None
    lines: dict[str, dict[int, float]] = defaultdict(dict)
    for p in predictions:
        if not p.fits:
            continue
        c = p.candidate
        label = f"KV on {c.kv_tier}" + ("" if c.weight_bits == c.kv_bits >= 16 else f", w{c.weight_bits}/kv{c.kv_bits}")
        lines[label][c.batch] = max(lines[label].get(c.batch, 0.0), p.tokens_per_second)
    if not lines:
        raise OffloadError("--plot: no policy fits, nothing to draw")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(lines.items()):
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences per step)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = f"{path}.partial"
    try:  # written whole or not at all
        fig.savefig(tmp, dpi=120, format=os.path.splitext(path)[1].lstrip(".") or "png")
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OffloadError(f"--plot {path}: cannot write it ({getattr(exc, 'strerror', None) or exc})") from None
    finally:
        plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)
