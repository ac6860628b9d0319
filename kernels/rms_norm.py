"""Residual add fused with RMSNorm: h = x + residual, then rms_norm(h), in one pass over the row.

A decoder layer adds each block's output to the residual stream and normalizes the sum for the next block; fused,
the sum is read and written once instead of three times. The numerics are Hugging Face Llama's (and
offload/model/llama.rms_norm's), so either path gives the model the same values:

    h      = x + residual                       in x's dtype (one rounding, as torch adds)
    normed = h32 * rsqrt(mean(h32^2) + eps)     in float32, h32 = h as float32
    out    = weight * normed.to(x.dtype)        in torch.promote_types(weight.dtype, x.dtype)

Only the order in which the float32 sum of squares is accumulated differs from torch, so results agree to float32
rounding before the cast (one unit in the last place of a half-precision output, where a value sits on a boundary).

`rms_norm_residual` is the Triton launcher (shape, stride, dtype and device checks), `rms_norm_residual_ref` the
torch reference, and `fused_rms_norm` picks between them (kernels/dispatch.py), or, for bfloat16 rows on a CPU that
runs it, kernels/native.py's C kernel of the same numerics.
"""

from __future__ import annotations

import torch

from offload.common import environment
from offload.kernels import choice, native
from offload.kernels.dispatch import load_triton, record, use_triton

# None where no Triton kernel can run (no CUDA device, no interpreter): the torch path runs, the launcher says why
triton, tl = load_triton()

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HIDDEN = 1 << 16  # one program holds a whole row in registers: 64K float32 values is past any model's hidden


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def rounded(x, dtype: tl.constexpr):
    """float32 `x` rounded to the nearest `dtype` value (ties to even), returned as float32.

    bfloat16 rounds by its bits: Triton's CPU interpreter truncates float32 -> bfloat16 casts, and rounding here
    makes the kernels agree with torch bit for bit there as on a GPU (where the final cast is then exact). float16
    passes through its bits too, so that no compiler folds the round trip away: on an H200 the rotary kernel's
    float16 results differed from torch's in the last place in a fifth of the values, as a sum computed without
    its terms' roundings (a fused multiply-add) would."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return x.to(dtype).to(tl.float32)


@_jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    stride_x,  # elements between rows of x (and of residual: stride_r)
    stride_r,
    stride_out,
    stride_h,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= hidden; the tail is masked
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = rounded(h + r, dtype)  # one rounding, as torch's x + residual
        tl.store(h_ptr + row * stride_h + cols, h.to(dtype), mask=mask)
    mean_sq = tl.sum(h * h, axis=0) / hidden  # masked lanes hold 0 and add nothing
    normed = rounded(h * tl.rsqrt(mean_sq + eps), dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    y = rounded(w * normed, out_dtype)  # exact in float32 for half-precision operands, then rounded once
    tl.store(out_ptr + row * stride_out + cols, y.to(out_dtype), mask=mask)


def rms_norm_residual(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hidden] (+ residual, same shape and dtype) -> (normed [..., hidden], h [..., hidden]).

    h = x + residual in x's dtype (x itself when there is no residual); normed is in
    torch.promote_types(weight.dtype, x.dtype). Rows must be contiguous (last stride 1); rows may be strided."""
    if triton is None:
        raise RuntimeError("rms_norm_residual needs triton and a CUDA device (or TRITON_INTERPRET=1: the interpreter)")
    _check(x, weight, residual)
    hidden = x.shape[-1]
    rows_x = _rows(x, "x")
    rows_r = _rows(residual, "residual") if residual is not None else rows_x
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else x
    rows_out = out.view(-1, hidden)
    rows_h = h.view(-1, hidden) if residual is not None else rows_x
    if rows_x.shape[0] == 0:
        return out, h
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows_x.shape[0],)](
        rows_x,
        rows_r,
        weight,
        rows_out,
        rows_h,
        rows_x.stride(0),
        rows_r.stride(0),
        rows_out.stride(0),
        rows_h.stride(0),
        hidden,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, h


def rms_norm_residual_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `rms_norm_residual` computes, in torch: the same formula as offload/model/llama.rms_norm."""
    h = x if residual is None else x + residual
    h32 = h.float()
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h32.to(h.dtype), h


def fused_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the Triton kernel on a CUDA device, the torch reference elsewhere."""
    if use_triton("rms_norm", x.device):
        return rms_norm_residual(x, weight, eps, residual)
    if native.rms_norm_fits(x, weight, residual) and choice.native("rms_norm", x.numel() // x.shape[-1]):
        record("rms_norm", "native")
        return native.rms_norm(x, weight, eps, residual)
    return rms_norm_residual_ref(x, weight, eps, residual)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dtype not in DTYPES:
        raise ValueError(f"rms_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"rms_norm: x must be [..., hidden] with hidden >= 1, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden {hidden} exceeds the kernel's {MAX_HIDDEN} values per row")
    if weight.dtype not in DTYPES:
        raise ValueError(f"rms_norm: weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(f"rms_norm: weight must be a contiguous [{hidden}], got {tuple(weight.shape)}")
    if x.device.type != "cuda" and not environment.interpreting():
        raise ValueError(f"rms_norm: x is on {x.device}; the kernel runs on a CUDA device (or in TRITON_INTERPRET=1)")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device}, x on {x.device}")
    if residual is None:
        return
    if residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"rms_norm: residual is {residual.dtype}, x is {x.dtype}")
    if residual.device != x.device:
        raise ValueError(f"rms_norm: residual is on {residual.device}, x on {x.device}")


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t [..., hidden] as [rows, hidden] without a copy: the last dim contiguous, the rows one stride apart."""
    if t.stride(-1) != 1:
        raise ValueError(f"rms_norm: {name} rows must be contiguous (last stride 1), got strides {t.stride()}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"rms_norm: {name} {tuple(t.shape)} with strides {t.stride()} is not [rows, hidden] with one row stride"
        ) from None
