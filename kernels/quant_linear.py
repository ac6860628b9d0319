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

import functools
import hashlib

import torch

from offload.common.quant import WeightQuant
from offload.kernels.dispatch import record
from offload.kernels.linear import linear

# rows from which int8 codes converted to the compute dtype (exact: |code| <= 127) and one dense GEMM beat torch's
# int8 CPU kernel: 256 x 2048 -> 5632 in bf16, 18 ms against 44; 64 rows, 5.8 against 10.7; 32 rows, 9.2 against 5.5
INT8_DENSE_MIN_ROWS = 64
SCALES_SUFFIX = ".scales"  # the short name of a quantized weight's scales: "<weight short name>.scales"


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
        elif x.shape[0] >= INT8_DENSE_MIN_ROWS:  # one scale per row factors out of the sum: scale the product
            y = linear(x, codes.to(x.dtype)) * scales[0]
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, codes, scales[0])
    else:
        from offload.kernels.quant_matmul import quant_matmul

        y = quant_matmul(x, codes, scales, fmt.bits)
    return y if bias is None else y + bias


def stack_outputs(codes: list[torch.Tensor], scales: list[torch.Tensor], fmt: WeightQuant) -> tuple | None:
    """Codes and scales of the matrix whose output features are the parts' one after another (their products,
    concatenated), or None where the layout cannot stack these parts as stored: torch's CPU int4 packing, which
    blocks rows, stacks only parts whose packing equals that of their stacked rows (`_int4_rows_stack`)."""
    if fmt.layout == "cpu" and fmt.bits == 4 and not _int4_rows_stack(tuple(c.shape[0] for c in codes)):
        return None
    return torch.cat(codes), torch.cat(scales, dim=1)  # scales: [K / group, N(, 2)], output features on dim 1


@functools.cache
def _int4_rows_stack(rows: tuple[int, ...]) -> bool:
    """Whether this torch packs int4 codes of parts with `rows` output features each into the bytes of their
    stacked codes (true where each part fills whole row blocks of its CPU kernel), tried on codes of 64 inputs."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 16, (r, 64), generator=gen, dtype=torch.int32) for r in rows]
    try:
        packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(p, 1) for p in parts]
        whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.cat(parts), 1)
    except RuntimeError:  # a row count the packing refuses
        return False
    return torch.equal(torch.cat(packed), whole)


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
