"""y = x @ W.T for W held as a GGUF file's own blocks (Q4_0, Q4_1, Q8_0), as read from the file: no repacking.

A matrix [N, K] in blocks is a uint8 tensor [N, K / 32, block bytes]; its last dimension names the block type
(BLOCK_TYPES), so a tensor says how to read itself. kernels/csrc/gguf_blocks.c multiplies bfloat16 rows with the
blocks as they lie (each block decoded once into bfloat16 registers, exact products summed in float32), for the
rows of a decode step and of a short prompt (on a CPU with AMX, a decode step of TILES_FROM_ROWS sequences or more
on tiles: kernels/csrc/gguf_tiles.c); from DENSE_FROM_ROWS rows the matrix is dequantized to the compute dtype
a slice of features at a time and multiplied by the dense GEMM (oneDNN, on AMX tiles where the CPU has them).
Without the native kernels (another CPU, OFFLOAD_KERNELS=torch, a CUDA device) `dequantize_ref` does the
dequantizing in torch, then the dense product. An LM head's logits are float32 on every path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from offload.kernels import choice, native
from offload.kernels import linear as dense
from offload.kernels.dispatch import record
from offload.kernels.native_build import I64, INT, PTR, bind

BLOCK = 32  # values a block, along a row's inputs
BLOCK_TYPES = {18: "Q4_0", 20: "Q4_1", 34: "Q8_0"}  # bytes a block -> GGUF's type
TYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # kernels/csrc/gguf_blocks.c's enum
BLOCK_BYTES = {t: b for b, t in BLOCK_TYPES.items()}
# rows from which the matrix is dequantized for the dense GEMM. That product rounds each weight to bfloat16, where the
# block kernel multiplies d (q - 8) unrounded, so a prompt's scores would depend on how many of its rows a step
# computes (how much of it a prefix cache held) wherever the paths switch; the dense product wins from 32-64 rows on
# the 2-core Intel Xeon with AMX (benchmarks/gguf_blocks.py), and switching as the imported int4 does, from 256 (its
# timed choice there), keeps scores of the prompts up to that length on one path. From 64 a 56-layer file's 8-prompt
# prefill took 107 s where 256 took 273 (benchmarks/bigger_than_ram.py --dense), but lm-eval's loglikelihoods through
# the server then parted from the engine's own by 0.007 (tests/server/test_lm_eval.py: choices sharing a cached
# context compute their few continuation rows on the blocks)
DENSE_FROM_ROWS = 256
# the same for a mixture's routed experts, whose rows a step gives each depend on how the step's tokens route anyway:
# dequantized into a reused buffer, a 14336 x 4096 expert's dense product wins from about 8-16 rows (at 64, ~10 ms
# against the blocks' 64), and a batch's prompts put 32-64 rows on each expert
EXPERT_DENSE_FROM_ROWS = 32
# rows of a decode step (kernels/choice.py's decode_rows: one new token a sequence) from which a CPU with AMX takes
# kernels/csrc/gguf_tiles.c; below them, a prompt's rows and a verify step's take the block kernel. On the 2-core
# Intel Xeon with AMX the tiles cost nearly the same from 1 to 16 rows (decoding the blocks dominates) where the block
# kernel grows with each row: tiles win from 4 rows for Q4_0 and Q4_1 (2.0-2.2x at 8 rows, 3.7-4.2x at 16), from 8
# for Q8_0 (benchmarks/gguf_blocks.py). Their sums are added in another order than the block kernel's, and that moved
# the real model's greedy answer to the README's first question (the two first tokens 0.08 nats apart in float32):
# prompts stay on the block kernel, whatever the CPU
TILES_FROM_ROWS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
DEQUANT_BYTES = 32 << 20  # bfloat16 bytes dequantized at a time for the dense GEMM


def is_blocks(w: torch.Tensor) -> bool:
    """Whether `w` is a matrix in GGUF blocks: uint8 [N, K / 32, block bytes] of a type this module reads."""
    return w.dtype == torch.uint8 and w.dim() == 3 and w.shape[2] in BLOCK_TYPES


def block_type(w: torch.Tensor) -> str:
    return BLOCK_TYPES[w.shape[-1]]


def dequantize_ref(w: torch.Tensor) -> torch.Tensor:
    """Blocks [..., K / 32, bytes] -> float32 [..., K]: Q4_0 d (q - 8) and Q8_0 d q exactly, Q4_1 d q + m rounded
    once (computed in float64, where it is exact)."""
    kind = block_type(w)
    d = w[..., 0:2].contiguous().view(torch.float16).float()  # [..., K / 32, 1]
    if kind == "Q8_0":
        q = w[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).flatten(-2)
    codes = w[..., 2:] if kind == "Q4_0" else w[..., 4:]
    q = torch.cat((codes & 15, codes >> 4), dim=-1)  # value j in the low nibble of byte j, j + 16 in the high one
    if kind == "Q4_0":
        return ((q.float() - 8) * d).flatten(-2)
    m = w[..., 2:4].contiguous().view(torch.float16).double()
    return (q.double() * d.double() + m).float().flatten(-2)


def dequantize(w: torch.Tensor, dtype: torch.dtype, into_scratch: bool = False) -> torch.Tensor:
    """W [N, K] in `dtype` from blocks [N, K / 32, bytes]: the native kernel's bfloat16 where it runs, else the torch
    reference's values rounded to `dtype` (the same values). `into_scratch`: the native kernel's in this thread's
    reused buffer (kernels/native.py's `scratch`), valid until its next use."""
    if dtype == torch.bfloat16 and _fits(w) and (fn := _dequant()) is not None:
        n, k = w.shape[0], w.shape[1] * BLOCK
        out = native.scratch(n * k, dtype).view(n, k) if into_scratch else torch.empty(n, k, dtype=dtype)
        fn(w.data_ptr(), TYPE_CODES[block_type(w)], out.data_ptr(), n, k, torch.get_num_threads())
        return out
    return dequantize_ref(w).to(dtype)


def gguf_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, dense_from: int = DENSE_FROM_ROWS
) -> torch.Tensor:
    """x [tokens, K] @ W.T (+ bias) -> [tokens, N] in x's dtype, W in blocks [N, K / 32, bytes]; from `dense_from`
    rows the matrix is dequantized for the dense GEMM."""
    y = _product(x, w, float32=False, dense_from=dense_from)
    return y if bias is None else y + bias


def gguf_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An LM head in blocks: x [tokens, hidden] @ W.T -> float32 [tokens, vocab] (kernels/linear.py's `logits`)."""
    return _product(x, w, float32=True)


def gguf_rows(table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """A token table in blocks [vocab, K / 32, bytes]: the rows of `token_ids`, float32 [tokens, K]."""
    return dequantize_ref(table[token_ids])


def _product(x: torch.Tensor, w: torch.Tensor, float32: bool, dense_from: int = DENSE_FROM_ROWS) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    if not m:  # no rows (a step with no logits wanted): nothing for the kernels to divide among threads
        return torch.empty(0, w.shape[0], dtype=torch.float32 if float32 else x.dtype)
    one_row = choice.as_one_row(m)  # a speculating engine's verify rows stay on the one-row path
    if (m < dense_from or one_row) and _native_rows(x, w):
        kind, n = block_type(w), w.shape[0]
        y = torch.empty(m, n, dtype=torch.float32 if float32 else torch.bfloat16)
        if not one_row and choice.decoding() and m >= TILES_FROM_ROWS[kind] and (tiles := _tiles()) is not None:
            record("gguf_linear", "native")
            record("gguf_tiles", "native")
            xp = torch.empty(m * k, dtype=torch.bfloat16)
            xs = torch.zeros(-(-m // 16) * (k // BLOCK) * 16 if kind == "Q4_1" else 0)  # Q4_1's block sums
            tiles(
                x.data_ptr(), w.data_ptr(), TYPE_CODES[kind], y.data_ptr(), int(float32), m, n, k, xp.data_ptr(),
                xs.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            return y
        if (fn := _mm()) is not None:
            record("gguf_linear", "native")
            threads = torch.get_num_threads()
            if fn(x.data_ptr(), w.data_ptr(), TYPE_CODES[kind], y.data_ptr(), int(float32), m, n, k, threads):
                raise MemoryError(f"gguf_mm: no memory for the scratch of {m} rows of {k} inputs")
            return y
    record("gguf_linear", "torch")
    n, k = w.shape[0], w.shape[1] * BLOCK
    step = max(1, DEQUANT_BYTES // (2 * k))  # output features dequantized at a time
    parts = []
    for start in range(0, n, step):
        part = dequantize(w[start : start + step], x.dtype, into_scratch=True)
        parts.append(dense.logits(x, part) if float32 else dense.linear(x, part))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _fits(w: torch.Tensor) -> bool:
    return w.device.type == "cpu" and w.is_contiguous() and is_blocks(w)


def _native_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[1] == w.shape[1] * BLOCK and _fits(w)


@functools.cache
def _mm() -> ctypes._CFuncPtr | None:
    return bind("gguf_blocks", "gguf_mm", [PTR, PTR, INT, PTR, INT, I64, I64, I64, INT], INT)


@functools.cache
def _tiles() -> ctypes._CFuncPtr | None:
    """kernels/csrc/gguf_tiles.c's product, where this CPU has AMX tiles and this process may use them."""
    ready = bind("gguf_tiles", "gguf_tiles_ready", [], INT)
    if ready is None or not ready():
        return None
    return bind("gguf_tiles", "gguf_tiles_mm", [PTR, PTR, INT, PTR, INT, I64, I64, I64, PTR, PTR, INT])


@functools.cache
def _dequant() -> ctypes._CFuncPtr | None:
    return bind("gguf_blocks", "gguf_dequant_bf16", [PTR, INT, PTR, I64, I64, INT])


def tiles_run() -> bool:
    """Whether a decode step's rows take AMX tiles here (TILES_FROM_ROWS)."""
    return _tiles() is not None


def forget() -> None:
    """Drop the bound kernels, so that the next call asks kernels/native_build.py again (tests)."""
    _mm.cache_clear()
    _tiles.cache_clear()
    _dequant.cache_clear()
