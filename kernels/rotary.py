"""Rotary position embedding of queries and keys, the non-interleaved ("neox") form of offload/model/rope.apply_rope:

    out = x * cos + rotate_half(x) * sin,    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

for q [tokens, Hq, D] and k [tokens, Hkv, D], with cos/sin [tokens, D] in the compute dtype (q's). Each product and
the sum are rounded to the compute dtype as torch's eager operations round them, so the kernel and the reference
agree bit for bit (on a GPU, float32 may differ in the last place where the compiler fuses a multiply-add).

`rotary` is the Triton launcher (shape, stride, dtype and device checks; new output tensors, inputs untouched),
`rotary_ref` the torch reference, and `apply_rotary` picks between them (kernels/dispatch.py).
"""

from __future__ import annotations

import torch

from offload.common import environment
from offload.kernels import choice, native
from offload.kernels.dispatch import load_triton, record, use_triton
from offload.kernels.rms_norm import DTYPES, rounded

# None where no Triton kernel can run (no CUDA device, no interpreter): the torch path runs, the launcher says why
triton, tl = load_triton()

HEADS_PER_PROGRAM = 16  # heads of one token rotated by one program: [16, head_dim] tiles, cos/sin read once


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,  # elements between tokens and between heads of x; head_dim is contiguous
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,  # of cos and sin
    stride_st,
    heads,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # power of two >= HALF; the tail is masked
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    col = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    col_mask = col < HALF
    mask = (head < heads)[:, None] & col_mask[None, :]  # [BLOCK_H, BLOCK_HALF]
    dtype = x_ptr.dtype.element_ty

    c1 = tl.load(cos_ptr + token * stride_ct + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + token * stride_ct + HALF + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + token * stride_st + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + token * stride_st + HALF + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]

    x_row = x_ptr + token * stride_xt + head[:, None].to(tl.int64) * stride_xh + col[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)  # first half of each head
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)  # second half
    # out[:half] = x1 * c1 + (-x2) * s1;  out[half:] = x2 * c2 + x1 * s2; each term and sum rounded as in torch
    o1 = rounded(rounded(x1 * c1, dtype) + rounded(-x2 * s1, dtype), dtype)
    o2 = rounded(rounded(x2 * c2, dtype) + rounded(x1 * s2, dtype), dtype)

    o_row = out_ptr + token * stride_ot + head[:, None].to(tl.int64) * stride_oh + col[None, :]
    tl.store(o_row, o1.to(dtype), mask=mask)
    tl.store(o_row + HALF, o2.to(dtype), mask=mask)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, Hq, D], k [tokens, Hkv, D], cos/sin [tokens, D] -> (q rotated, k rotated), new contiguous tensors.

    q and k may be strided views (of a fused qkv projection, say) as long as head_dim is contiguous; all four
    tensors share one dtype and device, and D is even."""
    if triton is None:
        raise RuntimeError("rotary needs triton and a CUDA device (or TRITON_INTERPRET=1 for its CPU interpreter)")
    _check(q, k, cos, sin)
    return _launch(q, cos, sin), _launch(k, cos, sin)


def rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `rotary` computes, in torch: offload/model/rope.apply_rope's formula on q and on k."""
    return _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by cos/sin: the Triton kernel on a CUDA device, the torch reference elsewhere."""
    return apply_rotary_heads(q, cos, sin), apply_rotary_heads(k, cos, sin)


def apply_rotary_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Every head of x [tokens, heads, D] rotated (queries and keys side by side in one tensor: one pass for both),
    as `apply_rotary` rotates each: the Triton kernel on a CUDA device, the torch reference elsewhere."""
    if use_triton("rotary", x.device):
        _check(x, x, cos, sin)
        return _launch(x, cos, sin)
    if native.rotary_fits(x, cos, sin) and choice.native("rotary", x.shape[0]):  # bit for bit the reference's
        record("rotary", "native")
        return native.rotary(x, cos, sin)
    return _rotate_ref(x, cos, sin)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    half = head_dim // 2
    block_h = min(HEADS_PER_PROGRAM, triton.next_power_of_2(heads))
    grid = (tokens, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](
        x,
        out,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        sin.stride(0),
        heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dtype not in DTYPES:
        raise ValueError(f"rotary: q must be float32, bfloat16 or float16, got {q.dtype}")
    if q.dim() != 3:
        raise ValueError(f"rotary: q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"rotary: head_dim must be even, got {head_dim}")
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"rotary: k must be [{tokens}, kv_heads, {head_dim}] like q, got {tuple(k.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (tokens, head_dim):
            raise ValueError(f"rotary: {name} must be [{tokens}, {head_dim}], got {tuple(t.shape)}")
    if q.device.type != "cuda" and not environment.interpreting():
        raise ValueError(f"rotary: q is on {q.device}; the kernel runs on a CUDA device (or in TRITON_INTERPRET=1)")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype != q.dtype:
            raise ValueError(f"rotary: {name} is {t.dtype}, q is {q.dtype}: cos/sin come in the compute dtype")
        if t.device != q.device:
            raise ValueError(f"rotary: {name} is on {t.device}, q on {q.device}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"rotary: {name}'s last dim must be contiguous, got strides {t.stride()}")
