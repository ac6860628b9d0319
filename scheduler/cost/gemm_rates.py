"""What the cost model asks of the machine: a GEMM's rate at a number of rows, from the hardware profile's measured
curves or its flat figures, and a GEMM's time as the slower of its FLOPs and its weight bytes."""

from __future__ import annotations

import bisect
import math

from offload.common.dtypes import DTYPE_BYTES
from offload.common.errors import OffloadError
from offload.common.hardware import ComputeUnit


def curve_rate(curve: tuple[tuple[int, float], ...], size: int) -> float:
    """The rate of a measured curve at `size`, interpolated in log(size). Below the first point the time stays
    that of the first point (a small call costs its fixed overhead), so the rate scales with size; above the last
    point the rate stays flat."""
    xs = [math.log(x) for x, _ in curve]
    x = math.log(max(size, 1))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return curve[0][1] * size / curve[0][0]
    if i == len(xs):
        return curve[-1][1]
    f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return curve[i - 1][1] + f * (curve[i][1] - curve[i - 1][1])


def matmul_rate(unit: ComputeUnit, dtype: str, rows: int, packed: bool = False) -> float:
    """FLOP/s of a GEMM with `rows` rows: the measured curve (for weights packed for the CPU's GEMM where `packed`
    and the profile has that curve), else the flat rate."""
    if packed and (curve := unit.packed_matmul_curve.get(dtype)):
        return curve_rate(curve, rows)
    if curve := unit.matmul_curve.get(dtype):
        return curve_rate(curve, rows)
    if dtype not in unit.matmul_flops:
        known = ", ".join(sorted(unit.matmul_flops)) or "none"
        raise OffloadError(f"the hardware profile gives no {dtype} matmul rate (it has: {known}); pick another dtype")
    return unit.matmul_flops[dtype]


def gemm_seconds(
    unit: ComputeUnit,
    dtype: str,
    params: int,
    weight_bytes: float,
    rows: int,
    packed: bool = False,
    kernel: str | None = None,
) -> float:
    """[rows, k] x [k, n] products over `params` = k * n weights: compute- or memory-bound, whichever is slower.
    `packed`: weights the engine keeps packed for the CPU's GEMM (resident ones on a CPU device).

    Quantized weights (`weight_bytes` under the compute dtype's) in a `kernel` ("int4", "gguf") whose curve the
    profile measured, at rows it covers (a few: the kernel decoding codes in registers): that curve. Else the
    measured dense rate at a few rows is mostly the dense weight's memory traffic, and the
    quantized kernels read the codes instead, so that time scales with the bytes; the curve's peak rate still
    bounds the FLOPs (at many rows the codes are dequantized for the dense GEMM)."""
    rate = matmul_rate(unit, dtype, rows, packed)
    flops, dense = 2.0 * params * rows, params * DTYPE_BYTES[dtype]
    if 0 < weight_bytes < dense and (curve := quantized_curve(unit, dtype, kernel)) and rows <= curve[-1][0]:
        return flops / curve_rate(curve, rows)
    if 0 < weight_bytes < dense:
        compute = max(flops / rate * weight_bytes / dense, flops / peak_rate(unit, dtype, packed))
        return max(compute, weight_bytes / unit.memory_bandwidth)
    return max(flops / rate, weight_bytes / unit.memory_bandwidth)


def quantized_curve(unit: ComputeUnit, dtype: str, kernel: str | None) -> tuple[tuple[int, float], ...] | None:
    """The profile's measured curve of a quantized `kernel` ("int4", "gguf") on rows of `dtype`, if it has one."""
    return getattr(unit, f"{kernel}_matmul_curve").get(dtype) if kernel else None


def peak_rate(unit: ComputeUnit, dtype: str, packed: bool = False) -> float:
    """The highest FLOP/s the unit's curve for `dtype` reaches (its flat rate where it has no curve)."""
    curve = (unit.packed_matmul_curve.get(dtype) if packed else None) or unit.matmul_curve.get(dtype)
    return max(r for _, r in curve) if curve else matmul_rate(unit, dtype, 1, packed)


def elementwise_bytes(hidden: int, q: int, kv: int, intermediate: int, dtype_bytes: int) -> int:
    """Memory traffic of one token's non-GEMM work in one layer (bytes): two RMS norms computed in float32 (about
    7 passes of 4 bytes each over the hidden state), rotary embedding of q and k (widths `q` and `kv`), the KV
    write, two residual adds, and SiLU(gate) * up over the MLP width. The probe measures its rate in these units."""
    norms = 2 * 7 * 4 * hidden
    rope = 5 * (q + kv) * dtype_bytes
    kv_write = 2 * kv * dtype_bytes
    residual = 2 * 3 * hidden * dtype_bytes
    mlp = 5 * intermediate * dtype_bytes
    return norms + rope + kv_write + residual + mlp
