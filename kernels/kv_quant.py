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

`quantize_kv` / `dequantize_kv` are the launchers (shape and dtype checks); `quantize_kv_ref` / `dequantize_kv_ref`
the pure-torch references. `QuantizedKV` holds one layer's K or V records and reads like the cache tensor paged
attention gathers from (kernels/paged_attention.py), dequantizing only the blocks gathered.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

QUANT_KINDS = ("int8", "int4", "fp8")
GROUP_SIZES = (32, 64)  # values along head_dim sharing one scale
GROUP_SIZE = 32
HALF_MAX = torch.finfo(torch.float16).max  # 65504
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_CODE_MAX = {"int8": 127.0, "int4": 15.0, "fp8": FP8_MAX}
# values dequantized at a time when gathering blocks: a float32 scratch of 2 MiB stays in cache, where dequantizing
# 512 blocks (16 tokens, 8 heads, head_dim 128) at once took 2-4x longer on a 2-core VM
DEQUANT_SLICE = 1 << 19


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
    return quantize_kv_ref(x, fmt)


def dequantize_kv(records: torch.Tensor, fmt: KVQuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """records [..., record_bytes] uint8 -> [..., head_dim] in `dtype` (a floating dtype)."""
    if records.dtype != torch.uint8 or records.dim() < 1 or records.shape[-1] != fmt.record_bytes:
        raise ValueError(
            f"{fmt.name} reads [..., {fmt.record_bytes}] uint8 records, got {tuple(records.shape)} {records.dtype}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"{fmt.name} dequantizes to a floating dtype, got {dtype}")
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


@dataclass(frozen=True, slots=True)
class QuantizedKV:
    """One layer's K or V, quantized: `records` [num_blocks, block_size, kv_heads, record_bytes] uint8.

    Paged attention reads it like the cache tensor it stands for, [num_blocks, block_size, kv_heads, head_dim] in
    `dtype` (`shape`, `dtype`, `element_size`, `index_select` along blocks); only the blocks gathered are
    dequantized, never the whole cache."""

    records: torch.Tensor
    fmt: KVQuantFormat
    dtype: torch.dtype  # the compute dtype reads return

    def __post_init__(self) -> None:
        if self.records.dim() != 4 or self.records.shape[3] != self.fmt.record_bytes:
            raise ValueError(
                f"{self.fmt.name} records must be [blocks, block_size, kv_heads, {self.fmt.record_bytes}], "
                f"got {tuple(self.records.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.records.shape[:3], self.fmt.head_dim))

    @property
    def device(self) -> torch.device:
        return self.records.device

    def dim(self) -> int:
        return 4

    def element_size(self) -> int:
        """Bytes of one value as read (dequantized), not as stored."""
        return self.dtype.itemsize

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Blocks `index` [n], dequantized: [n, block_size, kv_heads, head_dim] in `dtype`."""
        if dim != 0:
            raise ValueError(f"a quantized KV cache is gathered along blocks (dim 0), not dim {dim}")
        out = torch.empty((len(index), *self.shape[1:]), dtype=self.dtype, device=self.device)
        step = max(1, DEQUANT_SLICE // self.shape[1:].numel())  # blocks per slice
        for start in range(0, len(index), step):
            records = self.records.index_select(0, index[start : start + step])
            out[start : start + step] = dequantize_kv(records, self.fmt, self.dtype)
        return out

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [tokens, kv_heads, head_dim] into cache `slots` [tokens] (block * block_size + offset)."""
        self.records.view(-1, *self.records.shape[2:])[slots] = quantize_kv(x, self.fmt)
