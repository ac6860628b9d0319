"""y = x @ W.T + b with W stored as int4 or int8 codes (weight-only quantization), in the layout its matmul reads.

The codes and scales follow kernels/quant_matmul.py: int4 is asymmetric per group of `group` input features
(w = (q - 8) * scale + zero, scales_and_zeros [K / group, N, 2]), int8 symmetric (w = q * scale, scales
[K / group, N]). Two layouts of the same codes, so that no pass repacks a weight:

- "cpu": what torch's own CPU kernels consume. int4 codes packed by `_convert_weight_to_int4pack_for_cpu`
  (multiplied by kernels/native.py's `int4_mm` in bfloat16, by `_weight_int4pack_mm_for_cpu` (both read the packed
  codes and dequantize in registers), or, for a prefill's many rows, dequantized a slice at a time for the dense
  GEMM: where the native kernels run, each range of rows takes the path kernels/choice.py timed fastest on this
  machine; elsewhere torch's kernel up to INT4_DENSE_MIN_ROWS rows, the dense GEMM from there); int8 per output
  channel only, the one scale per row `_weight_int8pack_mm` takes.
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
from offload.kernels import choice, native
from offload.kernels.dispatch import record
from offload.kernels.linear import linear

# rows from which int8 codes converted to the compute dtype (exact: |code| <= 127) and one dense GEMM beat torch's
# int8 CPU kernel: 256 x 2048 -> 5632 in bf16, 18 ms against 44; 64 rows, 5.8 against 10.7; 32 rows, 9.2 against 5.5
INT8_DENSE_MIN_ROWS = 64
# rows from which int4 codes dequantized to the compute dtype and one dense GEMM beat torch's int4 CPU kernel, in
# bf16 on a 2-core EPYC (576 -> 3072, SmolLM2's gate and up): 512 rows 6.4 ms against 10.7, 2048 rows 23 against 43;
# at 256 rows the two were even (4.7 against 5.4 there, 1.8 against 1.7 for 576 -> 960)
INT4_DENSE_MIN_ROWS = 512
DEQUANT_ROWS = 1024  # output features dequantized at a time: scratch of DEQUANT_ROWS x K values, not of the matrix
# native dequantization (kernels/native.py) writes bfloat16 directly, no float32 temporaries: slices up to this many
# bytes, whole matrices of small models (SmolLM2's 3072 x 576 in one GEMM instead of three and their copies)
NATIVE_DEQUANT_BYTES = 32 << 20
CPU_INT4_BLOCK = native.INT4_BLOCK  # output features in one block of torch's CPU int4 packing (`unpack_cpu_int4`)
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
            blocks = codes.shape[0] % CPU_INT4_BLOCK == 0 and _unpacks_cpu_int4()  # codes this file can unpack
            fast = blocks and native.int4_fits(x, codes, scales, group)  # kernels/native.py's, for either path
            if fast:  # the path timed fastest here for these rows (kernels/choice.py)
                way = choice.path("int4", x.shape[0], (codes.shape[0], x.shape[1]))
            else:
                way = choice.DENSE if blocks and x.shape[0] >= INT4_DENSE_MIN_ROWS else choice.TORCH
            if way == choice.DENSE:
                y = _dense_int4(x, codes, scales, group, fast)  # native dequantizes 5x faster than torch
            elif way == choice.NATIVE:
                record("quant_matmul", "native")
                y = native.int4_mm(x, codes, scales, group)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, group, scales)
        elif x.shape[0] >= INT8_DENSE_MIN_ROWS:  # one scale per row factors out of the sum: scale the product
            y = linear(x, codes.to(x.dtype)) * scales[0]
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, codes, scales[0])
    else:
        from offload.kernels.quant_matmul import quant_matmul

        y = quant_matmul(x, codes, scales, fmt.bits)
    return y if bias is None else y + bias


def _dense_int4(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int, fast: bool) -> torch.Tensor:
    """x @ W.T for W in torch's CPU int4 packing, a slice of output features at a time dequantized to x's dtype
    (w = (q - 8) * scale + zero in float32, then rounded once; in bfloat16 by kernels/native.py's C, 5x faster, where
    it runs: `fast`) and multiplied by the dense GEMM."""
    n, k = codes.shape[0], codes.shape[1] * 2
    # native: as many features as NATIVE_DEQUANT_BYTES of bfloat16 hold (often the whole matrix: one GEMM, no copy)
    rows = (
        max(DEQUANT_ROWS, NATIVE_DEQUANT_BYTES // (2 * k) // CPU_INT4_BLOCK * CPU_INT4_BLOCK) if fast else DEQUANT_ROWS
    )
    out = None if rows >= n else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, rows):
        end = min(start + rows, n)
        if fast:
            w = native.int4_dequant(codes[start:end], scales[:, start:end].contiguous(), group, into_scratch=True)
        else:
            w = dequantize_cpu_int4(codes[start:end], scales[:, start:end], group).to(x.dtype)
        if out is None:
            return linear(x, w)
        out[:, start:end] = linear(x, w)
    return out


def dequantize_cpu_int4(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """W [N, K] in float32 from int4 codes in torch's CPU packing and their scales and zeros [K / group, N, 2]: the
    values torch's int4 kernel multiplies, bit for bit (one fused multiply-add, rounded once)."""
    q = unpack_cpu_int4(codes)
    n, k = q.shape
    scale, zero = (scales[..., i].t().float()[..., None] for i in (0, 1))  # [N, K / group, 1]
    return torch.addcmul(zero, q.view(n, k // group, group).float() - 8, scale).reshape(n, k)


def unpack_cpu_int4(codes: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] uint8 (0..15) that torch's CPU int4 packing holds: per block of CPU_INT4_BLOCK output
    features, K rows of CPU_INT4_BLOCK / 2 bytes, the low nibble of byte j feature j, the high one feature j + 32 (as
    this torch packs on an AVX-512 CPU: `_unpacks_cpu_int4` checks it once per process)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    half = CPU_INT4_BLOCK // 2
    b = codes.view(n // CPU_INT4_BLOCK, k, half)
    return torch.cat((b & 0xF, b >> 4), dim=2).permute(0, 2, 1).reshape(n, k)


@functools.cache
def _unpacks_cpu_int4() -> bool:
    """Whether `unpack_cpu_int4` inverts this torch's packing on this CPU (else its int4 kernel does every product)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (2 * CPU_INT4_BLOCK, 96), generator=gen, dtype=torch.int32)
    try:
        return torch.equal(unpack_cpu_int4(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)).int(), q)
    except RuntimeError:  # a packing of another shape
        return False


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
