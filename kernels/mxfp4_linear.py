"""y = x @ W.T + bias with W in MXFP4 as stored (kernels/mxfp4.py): the Triton kernel reads the 4-bit codes and the
blocks' exponents and decodes each block of 32 input features in registers, so the dequantized W never exists in
memory and a weight costs 4.25 bits of reads.

One program computes a [BLOCK_M, BLOCK_N] tile of y over every block of K: it loads the tile's codes (each byte
holds two values, the even feature in the low nibble), decodes E2M1 arithmetically (sign, two exponent bits, one
mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), scales by 2^(exponent - 127) and multiplies with a tile of x on the
tensor cores in x's dtype (every E2M1 value times a power of two is exact in bfloat16 and float16), accumulating in
float32.

`mxfp4_linear` dispatches: the kernel on CUDA, `mxfp4_linear_ref` (dequantize, then F.linear) elsewhere.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from offload.kernels.dispatch import use_triton
from offload.kernels.mxfp4 import BLOCK, dequantize_mxfp4

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def mxfp4_linear_ref(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K], blocks [N, K / 32, 16], scales [N, K / 32] -> [M, N] in x's dtype: W dequantized whole."""
    return F.linear(x, dequantize_mxfp4(blocks, scales, x.dtype), bias)


def mxfp4_linear(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T + bias for W in MXFP4: the Triton kernel on CUDA, the reference elsewhere."""
    if use_triton("mxfp4_linear", x.device):
        return mxfp4_linear_triton(x, blocks, scales, bias)
    return mxfp4_linear_ref(x, blocks, scales, bias)


def mxfp4_linear_triton(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's launcher: checks the operands, then one program per [BLOCK_M, BLOCK_N] tile of the output."""
    import triton

    _check(x, blocks, scales, bias)
    m, k = x.shape
    n = blocks.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    interpreting = x.device.type == "cpu"
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _kernel()[grid](
        x,
        blocks,
        scales,
        x if bias is None else bias,
        out,
        m,
        n,
        k // BLOCK,
        x.stride(0),
        blocks.stride(0),
        blocks.stride(1),
        scales.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
        DOT_F32=interpreting or x.dtype == torch.float32,  # the interpreter gets half-precision dots wrong
    )
    return out


def _check(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype not in DTYPES or x.stride(1) != 1:
        raise ValueError(
            f"x must be [M, K] float16, bfloat16 or float32, contiguous in K; got {tuple(x.shape)} {x.dtype}"
        )
    k = x.shape[1]
    if blocks.dtype != torch.uint8 or blocks.shape[1:] != (k // BLOCK, BLOCK // 2) or k % BLOCK:
        raise ValueError(
            f"blocks must be [N, {k // BLOCK}, 16] uint8 for K {k}, got {tuple(blocks.shape)} {blocks.dtype}"
        )
    if scales.dtype != torch.uint8 or scales.shape != blocks.shape[:2]:
        raise ValueError(f"scales must be [N, {k // BLOCK}] uint8, got {tuple(scales.shape)} {scales.dtype}")
    if blocks.stride(2) != 1 or scales.stride(1) != 1:
        raise ValueError("blocks and scales must be contiguous in their last dimension")
    if bias is not None and (bias.shape != (blocks.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be [{blocks.shape[0]}] and contiguous, got {tuple(bias.shape)}")
    for name, t in (("blocks", blocks), ("scales", scales), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


@functools.cache
def _kernel():
    """The @triton.jit kernel, defined on first use so that importing this module never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def mxfp4_linear_kernel(
        x_ptr,  # [M, K]
        blocks_ptr,  # [N, G, 16] uint8, G = K / 32
        scales_ptr,  # [N, G] uint8
        bias_ptr,  # [N], read when HAS_BIAS
        out_ptr,  # [M, N]
        m,
        n,
        groups,
        stride_xm,
        stride_bn,
        stride_bg,
        stride_sn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, 32)  # one block of input features
        m_mask, n_mask = offs_m < m, offs_n < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(groups):
            x = tl.load(
                x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (g * 32 + offs_k)[None, :],
                mask=m_mask[:, None],
                other=0.0,
            )  # [BLOCK_M, 32]
            # feature k of the block is byte k // 2's low nibble (k even) or high nibble (k odd)
            byte = tl.load(
                blocks_ptr + offs_n[:, None].to(tl.int64) * stride_bn + g * stride_bg + (offs_k // 2)[None, :],
                mask=n_mask[:, None],
                other=0,
            ).to(tl.int32)  # [BLOCK_N, 32]
            code = (byte >> ((offs_k % 2) * 4)[None, :]) & 0xF
            exponent = (code >> 1) & 3
            mantissa = (code & 1).to(tl.float32) * 0.5
            magnitude = tl.where(exponent == 0, mantissa, (1.0 + mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
            value = tl.where((code & 8) != 0, -magnitude, magnitude)
            scale = tl.load(scales_ptr + offs_n.to(tl.int64) * stride_sn + g, mask=n_mask, other=127).to(tl.float32)
            w = value * tl.exp2(scale - 127.0)[:, None]  # [BLOCK_N, 32], exact
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    return mxfp4_linear_kernel
