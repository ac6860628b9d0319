"""Hardware profiles as files: the JSON form, the shipped cards, reading, writing, overriding and printing.

A profile is a JSON file (configs/hardware/*.json for published cards, or what `offload probe` measured on
this machine). Sizes are bytes, bandwidths bytes/s, compute FLOP/s; the JSON spells them in GB, GB/s and
TFLOP/s so a person can read and edit it:

    {"name": "T4-16GB", "source": "...",
     "device": {"kind": "cuda", "memory_gb": 16, "memory_bandwidth_gbps": 272,
                "matmul_tflops": {"float16": 45.5, "float32": 5.67},
                "matmul_curve": {"float16": [[1, 0.2], [8, 1.5], ...]}},     (optional; [rows, TFLOP/s])
     "host": {"memory_gb": 208, "memory_bandwidth_gbps": 72.5, "matmul_tflops": {...}},
     "links": {"host_to_device_gbps": 12, "device_to_host_gbps": 12},
     "disk": {"read_gbps": 2.0, "write_gbps": 1.0,
              "read_gbps_by_backend": {"pread": 2.0, "aio": 1.8}}}       (optional; `offload probe`'s, per backend)

GB is 1e9 bytes and TFLOP/s 1e12 FLOP/s. Shipped profiles live in configs/hardware/ and are loaded by name
(the file's stem, any case); `offload probe` writes one for this machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from offload.common.config import READ_BACKENDS
from offload.common.errors import OffloadError
from offload.common.hardware import CURVES, DEVICE_KINDS, DTYPES, GB, TFLOP, ComputeUnit, HardwareProfile, ServedStep
from offload.common.paths import cache_dir

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


def known_profiles() -> list[str]:
    """Names of the shipped profiles (the stems of configs/hardware/*.json), sorted."""
    return sorted(path.stem for path in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """The profile in a .json file, or the shipped one called `name_or_path` (case-insensitive)."""
    text = str(name_or_path)
    if text.endswith(".json") or os.sep in text or (os.altsep and os.altsep in text):
        return _read(Path(text).expanduser())
    shipped = {path.stem.lower(): path for path in PROFILE_DIR.glob("*.json")}
    path = shipped.get(text.lower())
    if path is None:
        known = ", ".join(known_profiles()) or "none"
        raise OffloadError(f"hardware profile {text!r}: unknown; known: {known} (or give a path to a .json file)")
    return _read(path)


def local_profile_path() -> Path:
    """Where `offload probe` saves this machine's profile."""
    return cache_dir() / "hardware" / "local.json"


def saved_read_rates() -> dict[str, float]:
    """Read backend -> bytes/s, as this machine's saved profile holds them; {} without one (nothing is measured)."""
    path = local_profile_path()
    return load_profile(path).disk_read_by_backend if path.exists() else {}


def parse_profile(data: Any, where: str = "hardware profile") -> HardwareProfile:
    """A profile from its JSON object (human units); errors name `where` (the file) and the field."""
    top = _fields(
        data, where, "", ("name", "source", "device", "host", "links", "disk"), ("price", "not_run", "serving")
    )
    for key in ("name", "source"):
        if not isinstance(top[key], str) or not top[key].strip():
            raise OffloadError(f"{where}: {key}: must be a non-empty string, got {top[key]!r}")
    device = _fields(top["device"], where, "device", ("kind", *_UNIT_FIELDS), (*CURVES, "layer_floor_us"))
    kind = device["kind"]
    if kind not in DEVICE_KINDS:
        raise OffloadError(f"{where}: device.kind: unknown kind {kind!r} (known: {', '.join(DEVICE_KINDS)})")
    links = _fields(top["links"], where, "links", ("host_to_device_gbps", "device_to_host_gbps"))
    disk = _fields(top["disk"], where, "disk", ("read_gbps", "write_gbps"), ("read_gbps_by_backend", "small_read_gbps"))
    # a cuda device reaches host memory only over the link; a cpu "device" is host RAM itself (links 0)
    link_min = 0.0 if kind == "cpu" else None
    return HardwareProfile(
        name=top["name"],
        device_kind=kind,
        device=_unit(device, where, "device"),
        host=_unit(top["host"], where, "host"),
        host_to_device=_number(links, where, "links", "host_to_device_gbps", minimum=link_min) * GB,
        device_to_host=_number(links, where, "links", "device_to_host_gbps", minimum=link_min) * GB,
        disk_read=_number(disk, where, "disk", "read_gbps") * GB,
        disk_write=_number(disk, where, "disk", "write_gbps") * GB,
        source=top["source"],
        disk_read_by_backend=_by_backend(disk, where),
        disk_read_small=_number(disk, where, "disk", "small_read_gbps") * GB if "small_read_gbps" in disk else None,
        price_per_hour=_price(top.get("price"), where),
        not_run=_text(top, where, "not_run"),
        served_step=_served_step(top.get("serving"), where),
    )


def _served_step(data: Any, where: str) -> ServedStep | None:
    """The optional "serving": {"step_us": .., "per_stream_us": .., "per_prompt_token_us": .., "request_us": ..}
    `offload probe` measures."""
    if data is None:
        return None
    fields = ("step_us", "per_stream_us", "per_prompt_token_us", "request_us")
    served = _fields(data, where, "serving", fields)
    return ServedStep(*(_number(served, where, "serving", f, minimum=0.0) / 1e6 for f in fields))


def _text(data: dict, where: str, key: str) -> str | None:
    value = data.get(key)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise OffloadError(f"{where}: {key}: must be a non-empty string, got {value!r}")
    return value


def _price(data: Any, where: str) -> float | None:
    """The optional "price": {"usd_per_hour": X, "source": "..."} of a profile (a machine's rent, or its purchase
    spread over the hours it serves), in USD per hour."""
    if data is None:
        return None
    price = _fields(data, where, "price", ("usd_per_hour",), ("source",))
    return _number(price, where, "price", "usd_per_hour", minimum=0.0)


def profile_to_json(p: HardwareProfile) -> dict:
    """The JSON object of `p` in human units (GB, GB/s, TFLOP/s), rates to 6 significant digits."""
    by_backend = p.disk_read_by_backend
    return {
        "name": p.name,
        "source": p.source,
        "device": {"kind": p.device_kind, **_unit_to_json(p.device)},
        "host": _unit_to_json(p.host),
        "links": {
            "host_to_device_gbps": _human(p.host_to_device / GB),
            "device_to_host_gbps": _human(p.device_to_host / GB),
        },
        "disk": {
            "read_gbps": _human(p.disk_read / GB),
            "write_gbps": _human(p.disk_write / GB),
            **({"read_gbps_by_backend": {b: _human(r / GB) for b, r in by_backend.items()}} if by_backend else {}),
            **({"small_read_gbps": _human(p.disk_read_small / GB)} if p.disk_read_small else {}),
        },
        **({"price": {"usd_per_hour": p.price_per_hour}} if p.price_per_hour is not None else {}),
        **({"not_run": p.not_run} if p.not_run else {}),
        **({"serving": _served_step_json(p.served_step)} if p.served_step else {}),
    }


def _served_step_json(s: ServedStep) -> dict:
    return {
        "step_us": _human(s.step * 1e6),
        "per_stream_us": _human(s.per_stream * 1e6),
        "per_prompt_token_us": _human(s.per_prompt_token * 1e6),
        "request_us": _human(s.request * 1e6),
    }


def save_profile(p: HardwareProfile, path: str | Path) -> None:
    """Write `p` to `path` atomically: a temporary file in the same directory, fsynced, then renamed over it."""
    path = Path(path).expanduser()
    text = _dumps(profile_to_json(p))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OffloadError(f"{path}: cannot write the profile ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp creates 0o600; a profile is meant to be read and shared
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OffloadError(f"{path}: cannot write the profile ({exc.strerror})") from None
        raise


def with_overrides(
    p: HardwareProfile,
    host_memory: int | None = None,
    device_memory: int | None = None,
    disk_read: float | None = None,
    disk_write: float | None = None,
    host_to_device: float | None = None,
    device_to_host: float | None = None,
) -> HardwareProfile:
    """`p` with the given facts replaced (bytes, bytes/s), as `offload plan`'s flags set them; `source` says so."""
    given = {
        "host_memory": host_memory,
        "device_memory": device_memory,
        "disk_read": disk_read,
        "disk_write": disk_write,
        "host_to_device": host_to_device,
        "device_to_host": device_to_host,
    }
    given = {k: v for k, v in given.items() if v is not None}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise OffloadError(f"{key.replace('_', '-')}: must be a positive number, got {value!r}")
    if not given:
        return p
    changes: dict[str, Any] = {k: v for k, v in given.items() if not k.endswith("_memory")}
    if "host_memory" in given:
        changes["host"] = dataclasses.replace(p.host, memory=int(given["host_memory"]))
    if "device_memory" in given:
        changes["device"] = dataclasses.replace(p.device, memory=int(given["device_memory"]))
    said = ", ".join(
        f"{k.replace('_', ' ')} {_human(v / GB)} {'GB' if k.endswith('memory') else 'GB/s'}" for k, v in given.items()
    )
    return dataclasses.replace(p, **changes, source=f"{p.source}; overridden: {said}")


_UNIT_FIELDS = ("memory_gb", "memory_bandwidth_gbps", "matmul_tflops")


def _read(path: Path) -> HardwareProfile:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise OffloadError(f"{path}: hardware profile not found") from None
    except OSError as exc:
        raise OffloadError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OffloadError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    return parse_profile(data, str(path))


def _fields(data: Any, where: str, field_path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """`data` checked to be an object with every `required` key and no key outside `required` + `optional`."""
    name = field_path or "the top level"
    if not isinstance(data, dict):
        raise OffloadError(f"{where}: {name}: must be a JSON object, got {type(data).__name__}")
    prefix = f"{field_path}." if field_path else ""
    for key in required:
        if key not in data:
            raise OffloadError(f"{where}: {prefix}{key}: missing")
    for key in data:
        if key not in required and key not in optional:
            expected = ", ".join((*required, *optional))
            raise OffloadError(f"{where}: {prefix}{key}: unknown field (expected: {expected})")
    return data


def _number(data: dict, where: str, field_path: str, key: str, minimum: float | None = None) -> float:
    """data[key] as a float: a finite number, positive (or at least `minimum` when that is given)."""
    value = data[key]
    name = f"{field_path}.{key}" if field_path else key
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OffloadError(f"{where}: {name}: must be a number, got {value!r}")
    if value < 0:
        raise OffloadError(f"{where}: {name}: must not be negative, got {value!r}")
    if minimum is None and value == 0:
        raise OffloadError(f"{where}: {name}: must be positive, got {value!r}")
    return float(value)


def _dtype_map(data: Any, where: str, name: str) -> dict:
    if not isinstance(data, dict) or not data:
        raise OffloadError(f"{where}: {name}: must be a non-empty object of dtype -> value, got {data!r}")
    for dtype in data:
        if dtype not in DTYPES:
            raise OffloadError(f"{where}: {name}.{dtype}: unknown dtype (known: {', '.join(DTYPES)})")
    return data


def _unit(data: dict, where: str, field_path: str) -> ComputeUnit:
    optional = (*CURVES, "layer_floor_us", "kind") if field_path == "device" else (*CURVES, "layer_floor_us")
    data = _fields(data, where, field_path, _UNIT_FIELDS, optional)
    flops_name = f"{field_path}.matmul_tflops"
    flops = _dtype_map(data["matmul_tflops"], where, flops_name)
    curves: dict[str, dict[str, tuple[tuple[int, float], ...]]] = {key: {} for key in CURVES}
    for key in CURVES:
        if key in data:
            curve_name = f"{field_path}.{key}"
            for dtype, points in _dtype_map(data[key], where, curve_name).items():
                curves[key][dtype] = _curve(points, where, f"{curve_name}.{dtype}", *CURVES[key])
    return ComputeUnit(
        memory=round(_number(data, where, field_path, "memory_gb") * GB),
        memory_bandwidth=_number(data, where, field_path, "memory_bandwidth_gbps") * GB,
        matmul_flops={dtype: _number(flops, where, flops_name, dtype) * TFLOP for dtype in flops},
        **curves,
        layer_floor=_layer_floor(data, where, field_path),
    )


def _by_backend(disk: dict, where: str) -> dict[str, float]:
    if "read_gbps_by_backend" not in disk:
        return {}
    name = "disk.read_gbps_by_backend"
    rates = disk["read_gbps_by_backend"]
    if not isinstance(rates, dict) or not rates:
        raise OffloadError(f"{where}: {name}: must be a non-empty object of backend -> GB/s, got {rates!r}")
    for backend in rates:
        if backend not in READ_BACKENDS:
            raise OffloadError(f"{where}: {name}.{backend}: unknown backend (known: {', '.join(READ_BACKENDS)})")
    return {backend: _number(rates, where, name, backend) * GB for backend in rates}


def _layer_floor(data: dict, where: str, field_path: str) -> dict[str, float]:
    if "layer_floor_us" not in data:
        return {}
    name = f"{field_path}.layer_floor_us"
    floors = _dtype_map(data["layer_floor_us"], where, name)
    return {dtype: _number(floors, where, name, dtype) * 1e-6 for dtype in floors}


def _curve(points: Any, where: str, name: str, x: str, unit: str, scale: float) -> tuple[tuple[int, float], ...]:
    """[[x, rate], ...] with x ascending, the rate in `unit` -> ((x, rate * scale), ...)."""
    pair = f"[{x}, {unit}]"
    if not isinstance(points, list) or not points:
        raise OffloadError(f"{where}: {name}: must be a non-empty list of {pair} pairs, got {points!r}")
    curve = []
    for i, point in enumerate(points):
        if not isinstance(point, list) or len(point) != 2:
            raise OffloadError(f"{where}: {name}[{i}]: must be a {pair} pair, got {point!r}")
        size = point[0]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise OffloadError(f"{where}: {name}[{i}]: {x} must be a positive integer, got {size!r}")
        if curve and size <= curve[-1][0]:
            raise OffloadError(f"{where}: {name}[{i}]: {x} must ascend, got {size} after {curve[-1][0]}")
        label = {"TFLOP/s": "tflops", "GB/s": "gbps", "thousand rows/s": "krows"}[unit]  # the number's name in errors
        curve.append((size, _number({label: point[1]}, where, f"{name}[{i}]", label) * scale))
    return tuple(curve)


def _unit_to_json(unit: ComputeUnit) -> dict:
    out: dict[str, Any] = {
        "memory_gb": _human(unit.memory / GB, digits=12),  # 12 digits: whole bytes survive the round trip
        "memory_bandwidth_gbps": _human(unit.memory_bandwidth / GB),
        "matmul_tflops": {d: _human(f / TFLOP) for d, f in unit.matmul_flops.items()},
    }
    for key, (_, _, scale) in CURVES.items():
        if curves := getattr(unit, key):
            out[key] = {d: [[size, _human(rate / scale)] for size, rate in curve] for d, curve in curves.items()}
    if unit.layer_floor:
        out["layer_floor_us"] = {d: _human(seconds * 1e6) for d, seconds in unit.layer_floor.items()}
    return out


def _human(x: float, digits: int = 6) -> int | float:
    """`x` to `digits` significant digits, as an int when it is whole (16, not 16.0)."""
    rounded = float(f"{x:.{digits}g}")
    return int(rounded) if rounded.is_integer() else rounded


def _dumps(data: dict) -> str:
    """Indented JSON with each [rows, TFLOP/s] pair on one line."""
    text = json.dumps(data, indent=2)
    return re.sub(r"\[\s+(-?[\d.e+-]+),\s+(-?[\d.e+-]+)\s+\]", r"[\1, \2]", text) + "\n"
