"""`offload plan --hardware a,b,c`: hardware options side by side, each at its best runnable policy for the workload,
with what binds it and, given prices, what a million tokens cost; and the disk classes `--disk` puts under them."""

from __future__ import annotations

import os
from pathlib import Path

from offload.common.errors import OffloadError
from offload.common.hardware import HardwareProfile
from offload.common.model_config import ModelSpec
from offload.planner.rows import candidate_json
from offload.scheduler.cost.predict import Budgets, Workload
from offload.scheduler.cost.search import best, search

AMORTIZE_HOURS = 3 * 365 * 24.0
# NVMe and SATA classes to combine with a profile (--disk): read and write GB/s, 0.85 x a typical drive's sequential
# spec, as the shipped profiles derate theirs, and the drive
DISK_CLASSES = {
    "sata": (0.47, 0.44, "a SATA SSD: 550 / 520 MB/s sequential (the interface's ceiling)"),
    "pcie3": (2.98, 2.81, "a PCIe Gen3 x4 NVMe SSD: 3.5 / 3.3 GB/s sequential (Samsung 970 EVO Plus)"),
    "pcie4": (6.33, 5.87, "a PCIe Gen4 x4 NVMe SSD: 7.45 / 6.9 GB/s sequential (Samsung 990 PRO)"),
    "pcie5": (12.3, 10.8, "a PCIe Gen5 x4 NVMe SSD: 14.5 / 12.7 GB/s sequential (Crucial T705)"),
}


def _hardware_options(spec: str) -> dict[str, HardwareProfile]:
    """The profiles --hardware names, by the name given (a folder's files by their stems): one, several
    comma-separated, or every .json file of a folder."""
    if os.path.isdir(spec):
        files = sorted(Path(spec).glob("*.json"))
        if not files:
            raise OffloadError(f"--hardware {spec}: a folder with no .json profile in it")
        return {f.stem: _hardware(str(f)) for f in files}
    names = [n.strip() for n in spec.split(",")]
    if not all(names):
        raise OffloadError(f"--hardware {spec!r}: an empty name in the list")
    return {n: _hardware(n) for n in names}


def _prices(
    options: dict[str, HardwareProfile], rents: list[str], purchases: list[str], hours: float
) -> dict[str, float]:
    """Option name -> USD per hour: --price (per hour), --purchase (spread over `hours`), else the profile's own. A
    price names its option as --hardware did, or by the profile's name."""
    if not hours > 0:
        raise OffloadError(f"--amortize-hours must be positive, got {hours}")
    by_key = {key.lower(): hw.name for given, hw in options.items() for key in (given, hw.name)}
    out = {hw.name: hw.price_per_hour for hw in options.values() if hw.price_per_hour is not None}
    for flag, given, scale in (("--price", rents, 1.0), ("--purchase", purchases, 1.0 / hours)):
        for item in given:
            key, sep, value = item.partition("=")
            try:
                usd = float(value)
            except ValueError:
                usd = -1.0
            if not sep or usd < 0:
                raise OffloadError(f"{flag} {item!r}: give PROFILE=USD, a number of dollars")
            name = by_key.get(key.strip().lower())
            if name is None:
                raise OffloadError(f"{flag} {item!r}: {key!r} is none of the --hardware options")
            out[name] = usd * scale
    return out


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
        "policy": candidate_json(chosen.candidate),
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
