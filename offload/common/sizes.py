"""Memory sizes as users write them: "8GiB", "500MB", "1.5G", or a plain number of bytes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from decimal import Decimal

from offload.common.errors import OffloadError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes in `text`. Decimal units (MB, GB) are powers of 10, binary ones (MiB, GiB, and bare G) of 2."""
    if isinstance(text, int):
        if text < 0:
            raise OffloadError(f"{what}: {text} is negative")
        return text
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise OffloadError(f"{what}: cannot read {text!r} as a size (examples: 512MiB, 8GiB, 2GB)")
    return int(Decimal(match.group(1)) * _UNITS[unit])  # Decimal: "4.1GB" is exactly 4100000000


def format_size(nbytes: int) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if round(size, 1) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# the units typed_size writes, in the order it prefers them where two read alike; "" is bytes, exact for any size
_TYPED_UNITS = (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6))
_TYPED_UNITS += (("KiB", 2**10), ("kB", 10**3), ("", 1))


def typed_size(nbytes: int, spare: int | None = None) -> str:
    """`nbytes` as a user types it on the command line ("16.17GiB", "137.4GB", "68MiB"), rounded down: of the texts
    parse_size reads back as no more than `nbytes` and at most `spare` bytes less (default, and never more than, 0.1%
    of `nbytes`), the one with the fewest digits, then the nearest. spare=0: exactly `nbytes`."""
    if nbytes <= 0:
        return str(nbytes)
    allowed = nbytes // 1000 if spare is None else min(max(spare, 0), nbytes // 1000)  # bytes it may lose
    fits = []  # (digits, bytes lost, decimals, text)
    for digits, decimals, text in _rounded_down(nbytes):
        lost = nbytes - parse_size(text)
        if 0 <= lost <= allowed:
            fits.append((digits, lost, decimals, text))
    return min(fits, key=lambda fit: fit[:3])[3]  # bytes always fit; a tie goes to the unit listed first


def _rounded_down(nbytes: int) -> Iterator[tuple[int, int, str]]:
    """`nbytes` in each unit it holds one of, to 0-3 decimals, rounded down, and up where the text still reads back
    as no more (parse_size drops a fraction of a byte: 5.65GiB is 6066641305.6): (digits, decimals, text)."""
    for unit, scale in _TYPED_UNITS:
        if nbytes < scale:
            continue
        for decimals in range(4 if scale > 1 else 1):
            down = nbytes * 10**decimals // scale  # the value in units of 10**-decimals
            for steps in (down, down + 1):
                whole, frac = divmod(steps, 10**decimals)
                yield len(str(steps)), decimals, (f"{whole}.{frac:0{decimals}d}" if decimals else str(whole)) + unit


_TIER_KEYS = {"device": "device", "gpu": "device", "cuda": "device", "host": "host", "cpu": "host", "disk": "disk"}
_TIER_KEYS |= {"nvme": "disk"}


def parse_max_memory(max_memory: dict) -> dict[str, int]:
    """Accelerate-style budgets -> bytes per tier: {0: "10GiB", "cpu": "30GiB", "disk": "200GB"} gives
    {"device": ..., "host": ..., "disk": ...}. Keys: a GPU index, "cuda[:N]", "gpu" or "device"; "cpu" or "host";
    "disk" or "nvme". Values: sizes as parse_size reads them, or bytes."""
    out: dict[str, int] = {}
    for key, value in max_memory.items():
        name = str(key).lower()
        tier = "device" if isinstance(key, int) or name.startswith("cuda:") else _TIER_KEYS.get(name)
        if tier is None:
            raise OffloadError(f"max_memory: unknown tier {key!r} (use a GPU index, 'cuda', 'cpu' or 'disk')")
        if tier in out:
            raise OffloadError(f"max_memory: {key!r} names the {tier} tier a second time")
        out[tier] = parse_size(value, f"max_memory[{key!r}]")
    return out
