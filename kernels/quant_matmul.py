"""Weight-only quantized matmul: y = x @ W.T + bias with W [N, K] stored as int4 or int8 codes and a scale per group of
`group_size` consecutive input features of one output row (K % group_size == 0).

    int4  qweight uint8 [N, K // 2], byte (n, j) = q[n, 2j] | q[n, 2j + 1] << 4, codes 0..15;
          scales [K // group_size, N, 2] (scale, zero);  w = (q - 8) * scale + zero.
          This is the tinygemm / gpt-fast convention: the same scales tensor is what
          torch.ops.aten._weight_int4pack_mm_for_cpu takes.
    int8  qweight int8 [N, K], codes -127..127;  scales [K // group_size, N];  w = q * scale (symmetric).
          group_size == K is one scale per output channel.

`quantize` / `dequantize` / `quant_matmul_ref` are plain torch and never import triton (the CPU engine uses them);
`quant_matmul_triton` launches the fused kernel, which dequantizes tiles of W in registers and never writes the
dequantized W to memory; `quant_matmul` picks one of the two (kernels/dispatch.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from offload.common import environment
from offload.kernels.dispatch import use_triton

BITS = (4, 8)
INT4_MID = 8  # int4 codes are stored offset by 8: code 8 reads back as `zero`
INT4_MIN_SCALE = 1e-6  # floor of an int4 group's range (max - min), so a constant group divides by nonzero
INT8_MIN_ABSMAX = 1e-8  # floor of an int8 group's absmax: an all-zero group gets codes 0, not 0 / 0
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernel multiplies
DECODE_ROWS = 16  # up to this many rows of x take the decode configuration
PROGRAMS_PER_SM = 2  # split-K aims at this many programs per multiprocessor
INTERPRETER_PROGRAMS = 8  # ... and at this many in Triton's CPU interpreter, where there is no device to ask


CLIP_GRID = tuple(1.0 - 0.025 * i for i in range(13))  # an int4 group's range shrunk by these factors (1.0 .. 0.7)
QUANT_METHODS = ("rtn", "search")  # round to nearest over each group's range; or the range and fit of least error


def quantize(
    w: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype | None = None, method: str = "rtn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] floating -> (qweight, scales) in the layout of the module docstring; parameters are computed in
    float32 and stored in `dtype` (w's dtype by default). Codes are rounded half to even.

    method "search" (int4): each group's codes come from the range of CLIP_GRID whose codes, with the scale and zero
    fitted to them by least squares, leave the least squared error; the grid holds the full range, so no group's
    error (before `dtype` rounds the parameters) exceeds round to nearest's."""
    _check_bits(bits)
    if not w.is_floating_point() or w.dim() != 2:
        raise ValueError(f"quantize takes a floating weight [N, K], got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    if group_size < 1 or k % group_size:
        raise ValueError(f"K {k} is not a multiple of group_size {group_size}")
    if bits == 4 and k % 2:
        raise ValueError(f"int4 packs two input features per byte: K must be even, got {k}")
    dtype = dtype or w.dtype
    if not dtype.is_floating_point:
        raise ValueError(f"scales are stored in a floating dtype, got {dtype}")
    if method not in QUANT_METHODS:
        raise ValueError(f"method must be one of {', '.join(QUANT_METHODS)}, got {method!r}")
    g = w.float().view(n, k // group_size, group_size)  # [N, groups, group_size]
    if bits == 4 and method == "search":
        q, scale, zero = _int4_search(g)
        qweight = q[:, 0::2] | (q[:, 1::2] << 4)
        scales = torch.stack((scale, zero), -1).transpose(0, 1).to(dtype).contiguous()
    elif bits == 4:
        mn, mx = g.amin(-1), g.amax(-1)  # [N, groups]
        scale = (mx - mn).clamp(min=INT4_MIN_SCALE) / 15
        zero = mn + INT4_MID * scale
        q = ((g - mn[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.uint8).view(n, k)
        qweight = q[:, 0::2] | (q[:, 1::2] << 4)  # [N, K // 2], even k in the low nibble
        scales = torch.stack((scale, zero), -1).transpose(0, 1).to(dtype).contiguous()  # [groups, N, 2]
    else:
        scale = g.abs().amax(-1).clamp(min=INT8_MIN_ABSMAX) / 127  # [N, groups]
        qweight = (g / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(n, k)
        scales = scale.t().to(dtype).contiguous()  # [groups, N]
    return qweight.contiguous(), scales


def _int4_search(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g [N, groups, S] float32 -> (codes uint8 [N, groups * S] in 0..15, scale [N, groups], zero [N, groups]) of the
    least squared error over CLIP_GRID's ranges, each refitted: for fixed codes q, w ~ a * q + b by least squares,
    stored as scale a and zero b + 8a."""
    n, groups, size = g.shape
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)  # [N, groups, 1]
    best_err = torch.full((n, groups), float("inf"))
    best_q = torch.zeros_like(g, dtype=torch.uint8)
    best_a, best_b = torch.zeros(n, groups), torch.zeros(n, groups)
    for f in CLIP_GRID:
        lo, hi = mn * f, mx * f
        step = (hi - lo).clamp(min=INT4_MIN_SCALE) / 15
        q = ((g - lo) / step).round_().clamp_(0, 15)  # [N, groups, S]
        a = _slope(q, g, step[..., 0])
        b = (g - a[..., None] * q).mean(-1)  # the least-squares offset for that slope
        err = (a[..., None] * q + b[..., None] - g).square_().sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_q = torch.where(better[..., None], q.to(torch.uint8), best_q)
        best_a, best_b = torch.where(better, a, best_a), torch.where(better, b, best_b)
    return best_q.view(n, groups * size), best_a, best_b + INT4_MID * best_a


def _slope(q: torch.Tensor, g: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Least-squares a of g ~ a * q + b along the last axis; `step` where the codes do not vary."""
    dq = q - q.mean(-1, keepdim=True)
    var = dq.square().sum(-1)
    return torch.where(var > 0, (dq * g).sum(-1) / var.clamp(min=1e-30), step)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """(qweight, scales) -> W [N, K] in scales' dtype, computed in float32 and rounded once."""
    n, k, group_size = _check_weights(qweight, scales, bits)
    if bits == 4:
        q = torch.stack((qweight & 15, qweight >> 4), -1).view(n, k).float() - INT4_MID  # [N, K]
        params = scales.float().repeat_interleave(group_size, 0)  # [K, N, 2]
        w = q * params[..., 0].t() + params[..., 1].t()
    else:
        w = qweight.float() * scales.float().repeat_interleave(group_size, 0).t()
    return w.to(scales.dtype)


def quant_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] -> x @ W.T (+ bias) [M, N] in x's dtype, W dequantized whole first."""
    w = dequantize(qweight, scales, bits).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def quant_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] -> x @ W.T (+ bias) [M, N]: the fused Triton kernel on a CUDA device, the reference elsewhere (and for
    group sizes the kernel's tiles cannot follow, not a multiple of 16)."""
    n, k, group_size = _check_weights(qweight, scales, bits)
    if group_size % 16 == 0 and use_triton("quant_matmul", x.device):
        return quant_matmul_triton(x, qweight, scales, bits, bias)
    return quant_matmul_ref(x, qweight, scales, bits, bias)


def quant_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float16 / bfloat16 / float32 -> x @ W.T (+ bias) [M, N] in x's dtype, by the fused kernel."""
    n, k, group_size = _check_weights(qweight, scales, bits)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if scales.dtype != x.dtype:
        raise ValueError(f"scales must have x's dtype {x.dtype}, got {scales.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit stride along K, got strides {x.stride()}")
    if not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous (row-major), got strides {qweight.stride()}")
    if not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous (row-major), got strides {scales.stride()}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    for name, t in (("qweight", qweight), ("scales", scales), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if group_size % 16:
        raise ValueError(f"the Triton kernel needs group_size a multiple of 16, got {group_size}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = _launch_config(m, n, k, group_size, x.device)
    split = cfg.split_k > 1
    # split-K: each split writes float32 partial sums [split_k, M, N], added up here (in a fixed order: the result
    # does not depend on scheduling)
    partial = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if split else out
    blocks_per_split = -(-(k // cfg.block_k) // cfg.split_k)
    grid = (_cdiv(m, cfg.block_m), _cdiv(n, cfg.block_n), cfg.split_k)
    _kernel()[grid](
        x,
        qweight,
        scales,
        bias if bias is not None and not split else x,  # a placeholder pointer when HAS_BIAS is False
        partial,
        m,
        n,
        k,
        x.stride(0),
        blocks_per_split,
        GROUP=group_size,
        BITS=bits,
        HAS_BIAS=bias is not None and not split,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        # Triton's CPU interpreter gets tl.dot on bfloat16 operands wrong: there the kernel multiplies float32
        # operands (the same values: bfloat16 widens exactly)
        DOT_F32=x.dtype == torch.float32 or environment.interpreting(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        acc = partial.sum(0)
        if bias is not None:
            acc += bias.float()
        out.copy_(acc)
    return out


class LaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int  # divides group_size: one scale per output row and K tile
    split_k: int  # programs along K, each summing blocks_per_split K tiles
    num_warps: int
    num_stages: int


def _launch_config(m: int, n: int, k: int, group_size: int, device: torch.device) -> LaunchConfig:
    """Tiles for x [m, k] @ W.T [k, n]. Decode (m <= 16) is bound by reading W: one 16-row tile of x, wide tiles of
    W, and K split across programs when the N tiles alone cannot fill the device. Prefill (more rows) is bound by
    the multiply: square-ish tiles."""
    pow2_divisor = group_size & -group_size  # largest power of two dividing group_size (>= 16)
    if m <= DECODE_ROWS:
        block_n = min(64, max(16, _next_pow2(n)))
        block_k = min(128, pow2_divisor)
        tiles = _cdiv(n, block_n)
        programs = _target_programs(device)
        k_blocks = k // block_k
        split_k = max(1, min(k_blocks, programs // tiles))
        split_k = _cdiv(k_blocks, _cdiv(k_blocks, split_k))  # no split left without K tiles
        return LaunchConfig(16, block_n, block_k, split_k, num_warps=4, num_stages=3)
    block_m = 128 if m >= 256 else 64
    return LaunchConfig(block_m, 64, min(64, pow2_divisor), 1, num_warps=8 if block_m == 128 else 4, num_stages=3)


def _target_programs(device: torch.device) -> int:
    """Programs that fill `device`."""
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")


def _check_weights(qweight: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[int, int, int]:
    """(N, K, group_size) of a quantized weight, or a ValueError naming what is off."""
    _check_bits(bits)
    if not scales.is_floating_point():
        raise ValueError(f"scales must be floating, got {scales.dtype}")
    if bits == 4:
        if qweight.dtype != torch.uint8 or qweight.dim() != 2:
            raise ValueError(f"int4 qweight must be uint8 [N, K // 2], got {tuple(qweight.shape)} {qweight.dtype}")
        n, k = qweight.shape[0], 2 * qweight.shape[1]
        if scales.dim() != 3 or scales.shape[1:] != (n, 2):
            raise ValueError(f"int4 scales must be [K // group_size, {n}, 2], got {tuple(scales.shape)}")
    else:
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"int8 qweight must be int8 [N, K], got {tuple(qweight.shape)} {qweight.dtype}")
        n, k = qweight.shape
        if scales.dim() != 2 or scales.shape[1] != n:
            raise ValueError(f"int8 scales must be [K // group_size, {n}], got {tuple(scales.shape)}")
    groups = scales.shape[0]
    if groups < 1 or k % groups:
        raise ValueError(f"scales hold {groups} groups, which do not divide K {k}")
    return n, k, k // groups


@functools.cache
def _kernel():
    """The @triton.jit kernel, defined on first use so that importing this module never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def quant_matmul_kernel(
        x_ptr,  # [M, K], unit stride along K
        w_ptr,  # int4: uint8 [N, K // 2]; int8: int8 [N, K]
        s_ptr,  # int4: [K // GROUP, N, 2]; int8: [K // GROUP, N]
        bias_ptr,  # [N]
        out_ptr,  # [M, N], or float32 [split_k, M, N] partial sums
        M,
        N,
        K,
        stride_xm,
        blocks_per_split,  # K tiles each program along axis 2 sums
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,  # divides GROUP
        DOT_F32: tl.constexpr,  # multiply float32 operands (IEEE) instead of x's dtype
    ):
        pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        dtype = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = pid_s * blocks_per_split
        last = tl.minimum(first + blocks_per_split, K // BLOCK_K)
        for kb in range(first, last):
            k0 = kb * BLOCK_K
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
            group = k0 // GROUP  # the whole tile lies in one group
            if BITS == 4:
                rj = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                packed = tl.load(w_ptr + rn[None, :] * (K // 2) + rj[:, None], mask=n_ok[None, :], other=0)
                # [BLOCK_K // 2, BLOCK_N, 2] (low, high nibble) -> [BLOCK_K // 2, 2, BLOCK_N] -> [BLOCK_K, BLOCK_N]:
                # row 2j + 1 follows row 2j, as input feature 2j + 1 follows 2j
                q = tl.reshape(tl.permute(tl.join(packed & 15, packed >> 4), (0, 2, 1)), (BLOCK_K, BLOCK_N))
                params = s_ptr + (group * N + rn) * 2
                scale = tl.load(params, mask=n_ok, other=0.0).to(tl.float32)
                zero = tl.load(params + 1, mask=n_ok, other=0.0).to(tl.float32)
                w = (q.to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]  # [BLOCK_K, BLOCK_N]
            else:
                q = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=n_ok[None, :], other=0)
                scale = tl.load(s_ptr + group * N + rn, mask=n_ok, other=0.0).to(tl.float32)
                w = q.to(tl.float32) * scale[None, :]
            # the values dequantize() gives (Triton's CPU interpreter truncates to bfloat16 where a GPU rounds)
            w = w.to(dtype)
            if DOT_F32:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return quant_matmul_kernel
