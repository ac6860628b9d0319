"""y = x @ W.T + b with W stored as int4 or int8 codes (weight-only quantization), in the layout its matmul reads.

The codes and scales follow kernels/quant_matmul.py: int4 is asymmetric per group of `group` input features
(w = (q - 8) * scale + zero, scales_and_zeros [K / group, N, 2]), int8 symmetric (w = q * scale, scales
[K / group, N]). Two layouts of the same codes, so that no pass repacks a weight:

- "cpu": what torch's own CPU kernels consume. int4 codes packed by `_convert_weight_to_int4pack_for_cpu`
  (multiplied by `_weight_int4pack_mm_for_cpu`, which reads the packed codes and dequantizes in registers); int8 per
  output channel only, the one scale per row `_weight_int8pack_mm` takes.
- "triton": int4 two codes a byte, even input features in the low nibble ([N, K / 2] uint8); int8 [N, K]. Read by
  the fused Triton kernel on CUDA; elsewhere dequantized, then multiplied (the reference, slow on a CPU).

On the CPU int4 packing is part of torch's kernel contract, not of this engine: `cpu_pack_probe` digests the packing
of a fixed matrix, and a checkpoint converted under one packing refuses to run under another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kernels.dispatch import record

SCALES_SUFFIX = ".scales"  # the short name of a quantized weight's scales: "<weight short name>.scales"
BITS = (4, 8)
LAYOUTS = ("cpu", "triton")
GROUP_SIZES = (32, 64, 128)
MIN_GROUP = 32  # an input width no group size divides down to this stays unquantized


@dataclass(frozen=True, slots=True)
class WeightQuant:
    """How a checkpoint's linear weights are quantized (config.json's quantization_config)."""

    bits: int  # 4 | 8
    group_size: int  # input features sharing a scale: 32 | 64 | 128, or 0 for one scale per output channel
    layout: str  # "cpu" | "triton"

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.group_size not in (0, *GROUP_SIZES):
            raise ValueError(f"group_size must be one of {GROUP_SIZES} (or 0: per channel), got {self.group_size!r}")
        if self.bits == 4 and self.group_size == 0:
            raise ValueError("int4 needs a group size (32, 64 or 128): one scale per channel loses too much")
        if self.bits == 8 and self.layout == "cpu" and self.group_size != 0:
            raise ValueError(
                "int8 in the cpu layout has one scale per output channel (torch's int8 CPU matmul takes one per row); "
                "use the triton layout for group-wise int8"
            )

    @property
    def name(self) -> str:
        group = "channel" if self.group_size == 0 else f"g{self.group_size}"
        return f"int{self.bits}-{group}-{self.layout}"

    @property
    def code_dtype(self) -> str:
        """The safetensors dtype code of the stored codes."""
        return "U8" if self.bits == 4 else "I8"

    def group(self, in_features: int) -> int | None:
        """The group size used for a weight with `in_features` inputs: the configured one, halved until it divides
        them (down to MIN_GROUP); None when none does (the weight stays in its float dtype)."""
        if self.group_size == 0:
            return in_features
        g = self.group_size
        while g >= MIN_GROUP:
            if in_features % g == 0:
                return g
            g //= 2
        return None

    def codes_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        return (out_features, in_features // 2) if self.bits == 4 else (out_features, in_features)

    def scales_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        groups = in_features // self.group(in_features)
        return (groups, out_features, 2) if self.bits == 4 else (groups, out_features)


def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: WeightQuant,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [tokens, K], codes and scales of W [N, K] in `fmt` -> [tokens, N] in x's dtype."""
    x = x.contiguous()
    if fmt.layout == "cpu":
        if x.device.type != "cpu":
            raise ValueError(f"weights in the cpu layout multiply on the CPU, not on {x.device}")
        record("quant_matmul", "torch")
        if fmt.bits == 4:
            group = codes.shape[1] * 2 // scales.shape[0]
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, group, scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, codes, scales[0])
    else:
        from kernels.quant_matmul import quant_matmul

        y = quant_matmul(x, codes, scales, fmt.bits)
    return y if bias is None else y + bias


def to_cpu_layout(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in the triton layout (kernels/quant_matmul.py's) -> the cpu layout. int8 codes are the same bytes."""
    if bits == 8:
        return codes
    q = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(1).to(torch.int32)  # [N, K] in 0..15
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)


def cpu_pack_probe() -> str:
    """A digest of how this torch packs int4 codes for its CPU matmul (a fixed 64 x 64 matrix)."""
    q = (torch.arange(64 * 64, dtype=torch.int32).view(64, 64) * 7919 % 16).contiguous()
    return hashlib.sha256(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).numpy().tobytes()).hexdigest()[:16]
