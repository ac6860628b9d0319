"""Native CPU kernels: C sources in kernels/csrc/, compiled once per machine with the system's C compiler and called
through ctypes, for what torch's CPU operators leave slow. docs/benchmarks.md ("Native CPU kernels") times each
against the torch path it replaces (benchmarks/native_cpu.py).

`int4_mm`: x @ W.T for bfloat16 rows and W as int4 codes in torch's CPU packing (the "cpu" layout of
kernels/quant_linear.py). kernels/csrc/int4_mm.c decodes each code once into bfloat16 (q - 8 is exact there) and
multiplies it with every row by AVX-512 BF16's dot product, exact products summed in float32, each group's scale and
zero applied once per row, the output rounded to bfloat16 once, as torch's is. `int4_dequant` writes the weight in
bfloat16 for the dense GEMM, for a prompt's many rows.

`bf16_mm`: x @ W.T for bfloat16 rows and a dense bfloat16 W (an LM head tied to its embedding, a streamed layer's
matrix: weights not packed for oneDNN), read in place; an LM head's logits kept in float32.
`decode_attention`: one query per row over the paged bfloat16 cache, read in place through the block table
(kernels/cpu_attention.py makes every query of a batch such a row, a prompt's too). `rms_norm` and `rotary`: in the
torch references' roundings, on one thread for a decode step's few rows, split over threads for a prefill's.
`silu_mul`: SwiGLU's silu(gate) * up in one pass over the halves of the fused gate/up product. `argmax`: greedy
decoding's pick over float32 logits, as torch's argmax picks.

Which of them the engine takes, and for how many rows, is kernels/choice.py's: each timed against torch's path on
this machine.
They run where kernels/native_build.py builds them (AVX-512 BF16 and VBMI, a C compiler with OpenMP, OFFLOAD_KERNELS
not "torch"); anywhere else torch's kernels run. Their OpenMP threads are torch's own (the same libgomp, by
soname), torch.get_num_threads() of them; the products and decode attention drop to the calling thread alone for a
while after a region waited on a descheduled thread (kernels/csrc/team.h: a CPU shared with other processes).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from offload.kernels import choice
from offload.kernels.native_build import F32, I64, INT, PTR, bind
from offload.kernels.native_build import cpu_missing as cpu_missing  # asked here by the kernels' callers
from offload.kernels.native_build import library as library

INT4_CHUNK = 32  # a group must be a multiple (the kernel decodes 16 inputs at a time, torch packs 32s)
INT4_BLOCK = 64  # output features in one block of torch's CPU int4 packing
ROWS_SERIAL = 64  # rows (tokens) up to which rms_norm and rotary run on one thread (a decode step's)
# values up to which silu_mul runs on one thread (16 rows of 1536, a one-off timing on 2 threads of a Zen 4 EPYC:
# 17 us serial, 9 split; 2 us a call's own cost)
SILU_SERIAL_VALUES = 4096
ARGMAX_SERIAL = 1 << 16  # values up to which argmax runs on one thread (a step's logits of 2+ rows are split)
BF16_TILE = 16  # output features bf16_mm.c computes at a time
BF16_CHUNK = 32  # inputs its dot products take at a time


def prepare() -> None:
    """Build (once per machine) and load every native kernel now, where it can run, so that no step pays for it:
    the engine calls this, then kernels/timing.py's `ensure`, as it loads a model for the CPU."""
    _int4_mm(), _int4_dequant(), _bf16_mm(), _decode_attention(), _rms_norm(), _rotary(), _silu_mul(), _argmax()


def forget() -> None:
    """Drop what this process built, bound and timed, so that the next call asks again (for tests that change what
    the CPU reports or the compiler)."""
    library.cache_clear()
    for bound in (_int4_mm, _int4_dequant, _bf16_mm, _decode_attention, _rms_norm, _rotary, _silu_mul, _argmax):
        bound.cache_clear()
    choice.forget()


@functools.cache
def _argmax() -> ctypes._CFuncPtr | None:
    return bind("rows", "argmax_f32", [PTR, I64, PTR, I64, I64, I64, INT], I64)


def argmax_fits(x: torch.Tensor) -> bool:
    """Whether `argmax` takes these: float32 rows [rows, n] on the CPU, each row contiguous."""
    plain = x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1
    return plain and x.shape[1] > 0 and _argmax() is not None


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's index of its largest value, the first of equal ones, as torch's argmax(-1) gives it -> int64
    [rows]; None where a row holds a NaN (torch's argmax then answers). `argmax_fits` must hold."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    nan_rows = _argmax()(
        x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1], ARGMAX_SERIAL, torch.get_num_threads()
    )
    return None if nan_rows else out


@functools.cache
def _rms_norm() -> ctypes._CFuncPtr | None:
    return bind("rows", "rms_norm_bf16", [PTR] * 5 + [I64] * 2 + [F32, I64, INT])


@functools.cache
def _rotary() -> ctypes._CFuncPtr | None:
    return bind("rows", "rotary_bf16", [PTR, I64, I64, PTR, PTR, I64, PTR, I64, I64, I64, I64, INT])


def rotary_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary` rotates these: bfloat16 heads [tokens, heads, D] on the CPU, each head's values contiguous,
    cos and sin [tokens, D] bfloat16 with the same row stride, their rows contiguous."""
    return (
        x.dim() == 3
        and x.dtype == cos.dtype == sin.dtype == torch.bfloat16
        and x.device.type == cos.device.type == sin.device.type == "cpu"
        and x.shape[-1] % 2 == 0
        and x.stride(-1) == 1
        and cos.shape == sin.shape == (x.shape[0], x.shape[-1])
        and cos.stride() == sin.stride()
        and cos.stride(-1) == 1
        and _rotary() is not None
    )


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, D] rotated as kernels/rotary.py's torch reference rotates it, bit for bit -> a contiguous
    tensor; `rotary_fits` must hold."""
    tokens, heads, d = x.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    _rotary()(
        x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr(),
        tokens, heads, d, ROWS_SERIAL, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm_fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether `rms_norm` normalizes these: bfloat16 rows on the CPU (and residual), a bfloat16 weight, all
    contiguous."""
    return (
        x.dtype == weight.dtype == torch.bfloat16
        and x.device.type == weight.device.type == "cpu"
        and x.is_contiguous()
        and weight.is_contiguous()
        and weight.shape == x.shape[-1:]
        and 0 < x.shape[-1] <= 1 << 16
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape and residual.is_contiguous()))
        and _rms_norm() is not None
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/rms_norm.py's (rms_norm(x + residual), x + residual) in its numerics; `rms_norm_fits` must hold."""
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    rows = x.numel() // x.shape[-1]
    res = 0 if residual is None else residual.data_ptr()
    _rms_norm()(
        x.data_ptr(), res, weight.data_ptr(), out.data_ptr(), h.data_ptr(), rows, x.shape[-1], eps, ROWS_SERIAL,
        torch.get_num_threads(),
    )  # fmt: skip
    return out, h


@functools.cache
def _silu_mul() -> ctypes._CFuncPtr | None:
    return bind("rows", "silu_mul_bf16", [PTR, I64, PTR, I64, PTR, I64, I64, I64, INT])


def silu_mul_fits(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether `silu_mul` takes these: bfloat16 [rows, N] on the CPU of one shape, each row contiguous (the halves of
    a fused gate/up product qualify)."""
    return (
        gate.dim() == up.dim() == 2
        and gate.dtype == up.dtype == torch.bfloat16
        and gate.device.type == up.device.type == "cpu"
        and gate.shape == up.shape
        and gate.stride(-1) == up.stride(-1) == 1
        and _silu_mul() is not None
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in its roundings (silu's e^x within 2 float32 ulps, where torch's is within 1) -> a contiguous
    tensor; `silu_mul_fits` must hold."""
    rows, n = gate.shape
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    _silu_mul()(
        gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows, n, SILU_SERIAL_VALUES,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


@functools.cache
def _bf16_mm() -> ctypes._CFuncPtr | None:
    return bind("bf16_mm", "bf16_mm", [PTR] * 3 + [I64] * 3 + [INT, INT])


def bf16_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `bf16_mm` multiplies these: bfloat16 rows on the CPU by a dense bfloat16 weight of whole tiles."""
    return (
        x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dim() == 2
        and w.dim() == 2
        and w.shape[0] % BF16_TILE == 0
        and w.shape[1] % BF16_CHUNK == 0
        and w.is_contiguous()
        and not w.is_mkldnn
        and _bf16_mm() is not None
    )


def bf16_mm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] @ w.T -> [M, N], x and w bfloat16, w [N, K] dense; the float32 sums rounded to bfloat16, or kept
    (`out_dtype` float32); `bf16_mm_fits` must hold."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype)
    if not x.shape[0]:  # the kernel divides its rows among threads: none would divide by zero
        return y
    f32 = int(out_dtype == torch.float32)
    _bf16_mm()(
        x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], x.shape[1], f32, torch.get_num_threads()
    )
    return y


ATTENTION_MAX_GROUP = 128  # kernels/csrc/decode_attention.c's MAX_GROUP


@functools.cache
def _decode_attention() -> ctypes._CFuncPtr | None:
    return bind(
        "decode_attention",
        "decode_attention_bf16",
        [PTR] * 4 + [I64] + [PTR] * 3 + [I64] * 5 + [F32, I64, INT, PTR, PTR, I64],
        INT,
    )


def decode_attention_fits(q: torch.Tensor, k_cache: object, v_cache: object) -> bool:
    """Whether `decode_attention` attends these: bfloat16 queries and plain bfloat16 caches on the CPU, heads of a
    multiple of 32 up to 256, at most ATTENTION_MAX_GROUP query heads a KV head."""
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        return False  # a quantized cache (kv_quant.QuantizedKV) dequantizes its blocks elsewhere
    d, hq, hkv = q.shape[-1], q.shape[1], k_cache.shape[2]
    return (
        q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
        and q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.shape == k_cache.shape
        and d % 32 == 0
        and d <= 256
        and hq % hkv == 0
        and hq // hkv <= ATTENTION_MAX_GROUP
        and _decode_attention() is not None
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
    max_len: int,
    picks: torch.Tensor | None = None,
    npicks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row, q [n, Hq, D], over caches [blocks, block_size, Hkv, D] read through `tables` [n, width]
    (int32 block ids, each row its sequence's): keys `starts[i]` to `lens[i]` - 1 (int32) for row i, then the
    `npicks[i]` positions `picks[i]` ([n, w] int32; a draft tree's node: its ancestors and itself), `max_len` the
    most a row attends -> [n, Hq, D] bfloat16; `decode_attention_fits` must hold."""
    q = q.contiguous()
    n, hq, d = q.shape
    block_size, hkv = k_cache.shape[1:3]
    out = torch.empty_like(q)
    tables = tables.to(torch.int32).contiguous()
    if picks is not None:
        picks, npicks = picks.to(torch.int32).contiguous(), npicks.to(torch.int32).contiguous()
    failed = _decode_attention()(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), starts.data_ptr(), out.data_ptr(), n, hq, hkv, d, block_size, scale, max(max_len, 1),
        torch.get_num_threads(), None if picks is None else picks.data_ptr(),
        None if picks is None else npicks.data_ptr(), 0 if picks is None else picks.shape[1],
    )  # fmt: skip
    if failed:
        raise MemoryError(f"decode_attention: no memory for the scores of {hq // hkv} heads over {max_len} positions")
    return out


@functools.cache
def _int4_mm() -> ctypes._CFuncPtr | None:
    return bind("int4_mm", "int4_mm_bf16", [PTR] * 4 + [I64] * 4 + [INT], INT)


@functools.cache
def _int4_dequant() -> ctypes._CFuncPtr | None:
    return bind("int4_mm", "int4_dequant_bf16", [PTR] * 3 + [I64] * 3 + [INT])


def int4_dequant(codes: torch.Tensor, scales: torch.Tensor, group: int, into_scratch: bool = False) -> torch.Tensor:
    """W [N, K] in bfloat16 from int4 `codes` in torch's CPU packing and bfloat16 `scales` [K / group, N, 2]:
    kernels/quant_linear.py's dequantize_cpu_int4 rounded to bfloat16, bit for bit. Codes, scales and group as
    `int4_fits` wants them. `into_scratch`: in this thread's `scratch`, valid until its next use."""
    n, k = codes.shape[0], codes.shape[1] * 2
    w = scratch(n * k, torch.bfloat16).view(n, k) if into_scratch else torch.empty(n, k, dtype=torch.bfloat16)
    _int4_dequant()(codes.data_ptr(), scales.data_ptr(), w.data_ptr(), n, k, group, torch.get_num_threads())
    return w


_scratch = threading.local()


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """[numel] values of `dtype` in a buffer this thread reuses, valid until its next call: where a weight
    dequantized for the dense GEMM lands, a slice at a time. Fresh memory costs its first touch: a 14336 x 4096 Q4_0
    expert dequantized in 32 MB slices took 34.5 ms into new tensors and 4.6 ms into one reused buffer, a 4096 x 4096
    one 8.9 and 1.3 (2-core Xeon VM). It holds the largest slice asked for (at most 32 MB) for the thread's life."""
    nbytes = numel * dtype.itemsize
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _scratch.buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes].view(dtype)


def int4_fits(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int) -> bool:
    """Whether `int4_mm` and `int4_dequant` take these: bfloat16 on the CPU, whole packing blocks, groups of 32s,
    built kernels. How many rows make either worth it is kernels/choice.py's."""
    return (
        x.dtype == torch.bfloat16
        and scales.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and codes.shape[0] % INT4_BLOCK == 0
        and group % INT4_CHUNK == 0
        and x.shape[1] % group == 0
        and scales.is_contiguous()
        and codes.is_contiguous()
        and _int4_mm() is not None
    )


def int4_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] bfloat16 @ W.T -> [M, N] bfloat16, W [N, K] as int4 `codes` in torch's CPU packing ([N, K / 2]
    uint8) with `scales` [K / group, N, 2] (scale, zero) in bfloat16; `int4_fits` must hold."""
    x = x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if not m:
        return y
    threads = torch.get_num_threads()
    if _int4_mm()(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr(), m, n, k, group, threads):
        raise MemoryError(f"int4_mm: no memory for the sums of {m} rows' inputs")
    return y
