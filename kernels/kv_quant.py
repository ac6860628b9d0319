"""Quantized KV cache formats: int8, int4 and fp8 (e4m3), with a scale per group of values along head_dim.

Each token's key (or value) vector of one head, [head_dim] values, is stored as one record of
`KVQuantFormat.record_bytes` bytes:

    scales   [groups] float16
    zeros    [groups] float16            int4 only
    codes    int8 / fp8: [head_dim] bytes; int4: [ceil(head_dim / 2)] bytes, element 2i in the low nibble
    padding  one zero byte when the above is odd, so every record's scales start 2-byte aligned

and reads back as  int8: code * scale (codes -127..127, symmetric);  fp8: code * scale (codes within +-448);
int4: code * scale + zero (codes 0..15, `zero` the group's minimum: asymmetric). The scale is rounded *up* to
float16 (and int4's zero down), so a group's extreme values still land on the code range and the rounding error is at
most half a step (int8, int4) or half an e4m3 spacing (fp8). Values past what float16 scales reach saturate:
|x| beyond 65504 * 127 (int8) or 65504 * 448 (fp8); int4's zero, below -65504 or above 65504.

Why float16 scales: they cost 2 bytes per group (int8 at group 32 stores 34 bytes per 32 values, against 36 with
float32 scales), and their rounding (2^-11 relative) is far below a quantization step (int8: 1/254 of the range),
so they add no error that matters. bfloat16 scales would be as small but round 8x coarser.

`quantize_kv` / `dequantize_kv` check shapes and dtypes and run the Triton kernels on a CUDA device
(`quantize_kv_triton` / `dequantize_kv_triton`: the same records and values, bit for bit), the pure-torch references
`quantize_kv_ref` / `dequantize_kv_ref` elsewhere. tiers/kv/kv_cache.py's `QuantizedKV` holds one layer's records and
reads like the cache tensor paged attention gathers from, dequantizing only the blocks gathered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from offload.common import environment
from offload.common.config import KV_GROUP_SIZE, KV_GROUP_SIZES
from offload.kernels.dispatch import record, use_triton

QUANT_KINDS = ("int8", "int4", "fp8")
GROUP_SIZES, GROUP_SIZE = KV_GROUP_SIZES, KV_GROUP_SIZE  # values along head_dim sharing one scale (the config's)
HALF_MAX = torch.finfo(torch.float16).max  # 65504
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_CODE_MAX = {"int8": 127.0, "int4": 15.0, "fp8": FP8_MAX}
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels read and write
ROWS_PER_PROGRAM = 64  # records (token-head vectors) one Triton program quantizes or reads back, one group each


@dataclass(frozen=True, slots=True)
class KVQuantFormat:
    """How one head's [head_dim] key or value vector is stored: `kind` codes with a scale per group of values."""

    kind: str  # "int8", "int4" or "fp8"
    head_dim: int
    group_size: int = GROUP_SIZE

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise ValueError(f"quantized KV cache format must be one of {', '.join(QUANT_KINDS)}, got {self.kind!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"{self.kind} KV cache: group size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        if self.head_dim < 1 or self.head_dim % self.group:
            raise ValueError(
                f"{self.kind} KV cache: head_dim {self.head_dim} is not a multiple of the group {self.group}"
            )
        if self.kind == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(f"fp8 KV cache: needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")

    @property
    def group(self) -> int:
        """Values sharing one scale: `group_size`, or the whole head_dim when that is shorter."""
        return min(self.group_size, self.head_dim)

    @property
    def groups(self) -> int:
        return self.head_dim // self.group

    @property
    def param_bytes(self) -> int:
        """Bytes of a record's float16 scales (and int4's zeros)."""
        return 2 * self.groups * (2 if self.kind == "int4" else 1)

    @property
    def code_bytes(self) -> int:
        return -(-self.head_dim // 2) if self.kind == "int4" else self.head_dim

    @property
    def record_bytes(self) -> int:
        """Bytes of one head's vector: parameters, codes, and a pad byte to an even length."""
        used = self.param_bytes + self.code_bytes
        return used + used % 2

    @property
    def name(self) -> str:
        """What a record's bytes mean, e.g. "int8-g32"; keys persisted blocks, so any change to the record layout
        above must change it."""
        return f"{self.kind}-g{self.group}"


def quantize_kv(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """x [..., head_dim] floating -> [..., record_bytes] uint8 records."""
    if not x.is_floating_point() or x.dim() < 1 or x.shape[-1] != fmt.head_dim:
        raise ValueError(f"{fmt.name} quantizes [..., {fmt.head_dim}] floats, got {tuple(x.shape)} {x.dtype}")
    if x.dtype in KERNEL_DTYPES and not _unproven(fmt, x.device) and use_triton("kv_quant", x.device):
        return quantize_kv_triton(x, fmt)
    return quantize_kv_ref(x, fmt)


def _unproven(fmt: KVQuantFormat, device: torch.device) -> bool:
    """int4 on CUDA runs the torch code: on an H200 the compiled int4 records differed from the reference's."""
    if fmt.kind == "int4" and device.type == "cuda":
        record("kv_quant", "torch")
        return True
    return False


def dequantize_kv(records: torch.Tensor, fmt: KVQuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """records [..., record_bytes] uint8 -> [..., head_dim] in `dtype` (a floating dtype)."""
    if records.dtype != torch.uint8 or records.dim() < 1 or records.shape[-1] != fmt.record_bytes:
        raise ValueError(
            f"{fmt.name} reads [..., {fmt.record_bytes}] uint8 records, got {tuple(records.shape)} {records.dtype}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"{fmt.name} dequantizes to a floating dtype, got {dtype}")
    if dtype in KERNEL_DTYPES and not _unproven(fmt, records.device) and use_triton("kv_quant", records.device):
        return dequantize_kv_triton(records, fmt, dtype)
    return dequantize_kv_ref(records, fmt, dtype)


def quantize_kv_ref(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    g = x.float().unflatten(-1, (fmt.groups, fmt.group))  # [..., groups, group]
    if fmt.kind == "int4":
        zero = _round_half(g.amin(-1), up=False)  # [..., groups], <= the minimum
        scale = _round_half((g.amax(-1) - zero.float()) / 15, up=True)
        params = torch.cat((scale, zero), -1)
        g = g - zero.float()[..., None]
    else:
        scale = _round_half(g.abs().amax(-1) / _CODE_MAX[fmt.kind], up=True)
        params = scale
    # an all-equal group has scale 0: divide by 1 instead, which leaves int8/fp8 codes 0 and int4 codes clamped
    # to the zero; either way code * 0 (+ zero) reads back the group's value
    t = (g / scale.float().masked_fill(scale == 0, 1.0)[..., None]).flatten(-2)  # [..., head_dim], fresh: in place
    out = torch.zeros(*x.shape[:-1], fmt.record_bytes, dtype=torch.uint8, device=x.device)  # zeros: the pad byte
    out[..., : fmt.param_bytes] = params.view(torch.uint8)
    codes = out[..., fmt.param_bytes : fmt.param_bytes + fmt.code_bytes]
    if fmt.kind == "int8":
        codes.view(torch.int8).copy_(t.round_().clamp_(-127, 127))
    elif fmt.kind == "fp8":
        codes.view(torch.float8_e4m3fn).copy_(t.clamp_(-FP8_MAX, FP8_MAX))
    else:
        q = t.round_().clamp_(0, 15).to(torch.uint8)
        codes.copy_(q[..., 0::2])  # element 2i in the low nibble, 2i + 1 in the high one
        codes[..., : fmt.head_dim // 2] |= q[..., 1::2] << 4
    return out


def dequantize_kv_ref(records: torch.Tensor, fmt: KVQuantFormat, dtype: torch.dtype) -> torch.Tensor:
    params = records[..., : fmt.param_bytes].view(torch.float16).float()  # [..., groups] or int4's [..., 2 * groups]
    codes = records[..., fmt.param_bytes : fmt.param_bytes + fmt.code_bytes]
    if fmt.kind == "int8":
        x = codes.view(torch.int8).float()
    elif fmt.kind == "fp8" and codes.device.type == "cpu":
        # torch's float8 -> float32 conversion is not vectorized on a CPU: indexing a 256-entry table is faster
        x = torch.take(_fp8_values(), codes.long())
    elif fmt.kind == "fp8":
        x = codes.view(torch.float8_e4m3fn).float()
    else:
        x = torch.empty(*codes.shape, 2, device=codes.device)  # [..., code_bytes, low and high nibble]
        x[..., 0] = codes & 15
        x[..., 1] = codes >> 4
        x = x.flatten(-2)[..., : fmt.head_dim].contiguous()  # contiguous: a copy only for an odd head_dim
    # in place on the fresh float32 tensor: out-of-place products took twice as long (512 blocks of head_dim 128)
    groups = x.view(*x.shape[:-1], fmt.groups, fmt.group)  # [..., groups, group]
    groups.mul_(params[..., : fmt.groups, None])
    if fmt.kind == "int4":
        groups.add_(params[..., fmt.groups :, None])
    return x.to(dtype)


def quantize_kv_triton(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """x [..., head_dim] float16 / bfloat16 / float32 -> [..., record_bytes] uint8 records, by the Triton kernel: the
    same bytes as quantize_kv_ref (every division is IEEE-rounded and rounding is half to even, as in torch)."""
    if x.dtype not in KERNEL_DTYPES or x.dim() < 1 or x.shape[-1] != fmt.head_dim:
        raise ValueError(
            f"{fmt.name} kernel quantizes [..., {fmt.head_dim}] float16, bfloat16 or float32, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    rows = x.reshape(-1, fmt.head_dim)  # [R, head_dim]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.zeros(rows.shape[0], fmt.record_bytes, dtype=torch.uint8, device=x.device)  # zeros: the pad byte
    if rows.shape[0]:
        grid = (-(-rows.shape[0] // ROWS_PER_PROGRAM), fmt.groups)
        kernel = _kv_kernels().quantize
        kernel[grid](rows, out, out.view(torch.int16), rows.shape[0], rows.stride(0), **_kernel_format(fmt))
    return out.view(*x.shape[:-1], fmt.record_bytes)


def dequantize_kv_triton(records: torch.Tensor, fmt: KVQuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """records [..., record_bytes] uint8 -> [..., head_dim] in `dtype` (float16, bfloat16 or float32), by the Triton
    kernel: the same values as dequantize_kv_ref."""
    if records.dtype != torch.uint8 or records.dim() < 1 or records.shape[-1] != fmt.record_bytes:
        raise ValueError(
            f"{fmt.name} reads [..., {fmt.record_bytes}] uint8 records, got {tuple(records.shape)} {records.dtype}"
        )
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"{fmt.name} kernel dequantizes to float16, bfloat16 or float32, got {dtype}")
    rows = records.reshape(-1, fmt.record_bytes).contiguous()  # [R, record_bytes]
    out = torch.empty(rows.shape[0], fmt.head_dim, dtype=dtype, device=records.device)
    if rows.shape[0]:
        grid = (-(-rows.shape[0] // ROWS_PER_PROGRAM), fmt.groups)
        # no fused multiply-add: code * scale + zero is rounded twice, as the reference rounds it
        kernel = _kv_kernels().dequantize
        # Triton's CPU interpreter truncates float32 to bfloat16, where the GPU (and torch) round to nearest even
        round_bf16 = dtype == torch.bfloat16 and environment.interpreting()
        args = (rows, rows.view(torch.int16), out, rows.shape[0])
        kernel[grid](*args, ROUND_BF16=round_bf16, enable_fp_fusion=False, **_kernel_format(fmt))
    return out.view(*records.shape[:-1], fmt.head_dim)


def _kernel_format(fmt: KVQuantFormat) -> dict[str, int]:
    """The format as the kernels' constexpr arguments."""
    pairs = -(-fmt.group // 2)  # (even, odd) element pairs of one group
    return dict(
        KIND=QUANT_KINDS.index(fmt.kind),
        HEAD_DIM=fmt.head_dim,
        GROUP=fmt.group,
        GROUPS=fmt.groups,
        PARAM_BYTES=fmt.param_bytes,
        RECORD_BYTES=fmt.record_bytes,
        PAIRS=1 << (pairs - 1).bit_length(),
        BLOCK_R=ROWS_PER_PROGRAM,
    )


@functools.cache
def _fp8_values() -> torch.Tensor:
    """The float32 value of each of the 256 e4m3 codes (NaN codes included)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _round_half(t: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 `t` -> float16, rounded up (or down) instead of to nearest, saturating at +-HALF_MAX."""
    h = t.half()
    off = h.float() < t if up else h.float() > t
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(off, torch.nextafter(h, toward), h).clamp(-HALF_MAX, HALF_MAX)


class _KVKernels(NamedTuple):
    quantize: Callable
    dequantize: Callable


@functools.cache
def _kv_kernels() -> _KVKernels:
    """The @triton.jit kernels, defined on first use so that importing this module never imports triton.

    One program handles BLOCK_R records and one group `g` of each, as a [BLOCK_R, PAIRS, 2] tile: element 2j + i of
    the group at [:, j, i], so that int4's byte j gathers [:, j, 0] (low nibble) and [:, j, 1] (high nibble).
    KIND is the index in QUANT_KINDS (0 int8, 1 int4, 2 fp8). Each record's float16 parameters are read and written
    through an int16 view of the records (`par_ptr`; records are an even number of bytes).

    The kernels repeat small pieces of code (rounding up to float16, twice) instead of calling @triton.jit helpers:
    Triton's CPU interpreter resolves names through the module's globals, where helpers defined here are not.

    fp8 codes are encoded and decoded on the bits of float32 rather than by a float8 conversion, so every device
    (and the interpreter) gives the same codes as torch's conversion: round to nearest, ties to even. Integer
    rounding is (t + 1.5 * 2^23) - 1.5 * 2^23, which for |t| < 2^22 leaves the nearest integer, ties to even, as
    torch.round; divisions are IEEE-rounded (div_rn) as torch's are."""
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_kernel(
        x_ptr,  # [R, HEAD_DIM], unit stride along HEAD_DIM
        rec_ptr,  # [R, RECORD_BYTES] uint8, zeroed
        par_ptr,  # the same records as int16 [R, RECORD_BYTES // 2]
        R,
        stride_x,
        KIND: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        GROUP: tl.constexpr,
        GROUPS: tl.constexpr,
        PARAM_BYTES: tl.constexpr,
        RECORD_BYTES: tl.constexpr,
        PAIRS: tl.constexpr,  # a power of two >= ceil(GROUP / 2)
        BLOCK_R: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        g = tl.program_id(1)
        row_ok = rows < R
        pair = tl.arange(0, PAIRS)[None, :, None]
        nibble = tl.arange(0, 2)[None, None, :]
        col = 2 * pair + nibble  # [1, PAIRS, 2] element of the group
        has = col < GROUP
        ok = row_ok[:, None, None] & has
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None, None] * stride_x + g * GROUP + col, mask=ok, other=0.0).to(tl.float32)
        params = par_ptr + rows64 * (RECORD_BYTES // 2)  # [BLOCK_R]
        if KIND == 1:
            # zero: the float16 at or below the minimum, -(the float16 at or above -minimum)
            t = -tl.min(tl.min(tl.where(has, x, float("inf")), 2), 1)
            h = t.to(tl.float16)
            bits = h.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended: negative values have negative bits
            # one float16 step up: +1 on the bits of a positive value, -1 on a negative one's, +-0 to 0x0001
            up = tl.where((bits & 0x7FFF) == 0, 1, tl.where(bits >= 0, bits + 1, bits - 1))
            h = tl.where(h.to(tl.float32) < t, up, bits).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            zero = -tl.minimum(tl.maximum(h, -65504.0), 65504.0)
            tl.store(params + GROUPS + g, zero.to(tl.float16).to(tl.int16, bitcast=True), mask=row_ok)
            t = tl.math.div_rn(tl.max(tl.max(tl.where(has, x, -float("inf")), 2), 1) - zero, 15.0)
            x = x - zero[:, None, None]
            low, high = 0.0, 15.0
        else:
            if KIND == 2:
                low, high = -448.0, 448.0
            else:
                low, high = -127.0, 127.0
            t = tl.math.div_rn(tl.max(tl.max(tl.abs(x), 2), 1), high)  # masked elements read 0
        # scale: the float16 at or above t, as the zero above
        h = t.to(tl.float16)
        bits = h.to(tl.int16, bitcast=True).to(tl.int32)
        up = tl.where((bits & 0x7FFF) == 0, 1, tl.where(bits >= 0, bits + 1, bits - 1))
        h = tl.where(h.to(tl.float32) < t, up, bits).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        scale = tl.minimum(tl.maximum(h, -65504.0), 65504.0)
        tl.store(params + g, scale.to(tl.float16).to(tl.int16, bitcast=True), mask=row_ok)
        # an all-equal group has scale 0: divide by 1, as the reference does; clamping before rounding gives what
        # rounding then clamping gives, the bounds being integers (or 448, an e4m3 value)
        t = tl.math.div_rn(x, tl.where(scale == 0, 1.0, scale)[:, None, None])
        t = tl.minimum(tl.maximum(t, low), high)
        codes = rec_ptr + rows64[:, None, None] * RECORD_BYTES + PARAM_BYTES
        if KIND == 2:
            a = tl.abs(t)
            bits = a.to(tl.int32, bitcast=True)
            # normal: keep 3 mantissa bits, rounding the 20 dropped ones to nearest even, and rebias the exponent
            # from 127 to 7 (a carry out of the mantissa rounds up into the exponent); below 2^-6, subnormal steps
            # of 2^-9 (code 8 is 2^-6, the first normal)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
            code = tl.where(a < 0.015625, ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32), normal)
            code = code | (((t.to(tl.int32, bitcast=True) >> 31) & 1) << 7)  # the sign, of -0 too
        else:
            code = ((t + 12582912.0) - 12582912.0).to(tl.int32)
        if KIND == 1:
            # an odd group's last byte holds one code: its high nibble stays 0
            byte = tl.sum(tl.where(has, code << (4 * nibble), 0), 2, keep_dims=True)  # [BLOCK_R, PAIRS, 1]
            tl.store(codes + g * GROUP // 2 + pair, byte.to(tl.uint8), mask=row_ok[:, None, None] & (2 * pair < GROUP))
        else:
            tl.store(codes + g * GROUP + col, (code & 0xFF).to(tl.uint8), mask=ok)

    @triton.jit
    def dequantize_kernel(
        rec_ptr,  # [R, RECORD_BYTES] uint8
        par_ptr,  # the same records as int16 [R, RECORD_BYTES // 2]
        out_ptr,  # [R, HEAD_DIM]
        R,
        KIND: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        GROUP: tl.constexpr,
        GROUPS: tl.constexpr,
        PARAM_BYTES: tl.constexpr,
        RECORD_BYTES: tl.constexpr,
        PAIRS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        ROUND_BF16: tl.constexpr,  # round float32 to bfloat16 on the bits, to nearest even
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        g = tl.program_id(1)
        row_ok = rows[:, None, None] < R
        pair = tl.arange(0, PAIRS)[None, :, None]
        nibble = tl.arange(0, 2)[None, None, :]
        col = 2 * pair + nibble  # [1, PAIRS, 2] element of the group
        ok = row_ok & (col < GROUP)
        rows64 = rows[:, None, None].to(tl.int64)
        params = par_ptr + rows64 * (RECORD_BYTES // 2)  # [BLOCK_R, 1, 1]
        scale = tl.load(params + g, mask=row_ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        codes = rec_ptr + rows64 * RECORD_BYTES + PARAM_BYTES
        if KIND == 1:
            byte = tl.load(codes + g * GROUP // 2 + pair, mask=row_ok & (2 * pair < GROUP), other=0)
            code = (byte.to(tl.int32) >> (4 * nibble)) & 15  # [BLOCK_R, PAIRS, 2]
            zero = tl.load(params + GROUPS + g, mask=row_ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            value = code.to(tl.float32) * scale + zero
        else:
            code = tl.load(codes + g * GROUP + col, mask=ok, other=0).to(tl.int32)
            if KIND == 2:
                exp, man = (code >> 3) & 15, code & 7
                normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
                a = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2^-9
                a = tl.where((code & 0x7F) == 0x7F, float("nan"), a)
                q = tl.where((code & 0x80) != 0, -a, a)
            else:  # bytes 128..255 are int8 codes -128..-1
                q = tl.where(code > 127, code - 256, code).to(tl.float32)
            value = q * scale
        if ROUND_BF16:
            bits = value.to(tl.int32, bitcast=True)
            bits = tl.where(value != value, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))  # NaN stays NaN
            value = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        out = out_ptr + rows64 * HEAD_DIM + g * GROUP + col
        tl.store(out, value.to(out_ptr.dtype.element_ty), mask=ok)

    return _KVKernels(quantize_kernel, dequantize_kernel)
