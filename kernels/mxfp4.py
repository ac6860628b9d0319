"""MXFP4 weights (the OCP microscaling format gpt-oss's experts are published in): blocks of 32 values, each value a
4-bit float (E2M1: sign, two exponent bits, one mantissa bit), the block sharing one 8-bit exponent (E8M0, bias
127). 4.25 bits a weight. Stored as transformers and the published checkpoints store them:

    blocks [rows, K / 32, 16] uint8   two values a byte, the even one in the low nibble
    scales [rows, K / 32] uint8       the block's exponent + 127

`dequantize_mxfp4` gives W [rows, K] (exactly: every E2M1 value times a power of two is representable in bfloat16
and float32); `quantize_mxfp4` writes the format from float weights (each block's exponent the smallest that keeps
its largest magnitude within 6, each value rounded to the nearest E2M1 value).
"""

from __future__ import annotations

import torch

BLOCK = 32  # values sharing one exponent
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by code
BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., K / 32, 16] uint8 and scales [..., K / 32] uint8 -> W [..., K] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks [..., K/32, 16] and scales [..., K/32] uint8, got {blocks.dtype} {tuple(blocks.shape)} "
            f"and {scales.dtype} {tuple(scales.shape)}"
        )
    lut = torch.tensor(E2M1, dtype=dtype, device=blocks.device)
    values = torch.stack((lut[(blocks & 0xF).int()], lut[(blocks >> 4).int()]), dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, (scales.int() - BIAS)[..., None].to(dtype))
    return values.flatten(-2)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., K] float (K a multiple of 32) -> (blocks [..., K / 32, 16], scales [..., K / 32]) uint8."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs an input width that 32 divides, got {w.shape[-1]}")
    g = w.float().reshape(*w.shape[:-1], -1, BLOCK)  # [..., G, 32]
    top = g.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-BIAS, BIAS)  # the largest magnitude within 6 after scaling
    scaled = g / torch.exp2(exponent)[..., None]
    lut = torch.tensor(E2M1[:8])  # the magnitudes, by code
    code = (scaled.abs()[..., None] - lut).abs().argmin(-1).to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + BIAS).to(torch.uint8)
