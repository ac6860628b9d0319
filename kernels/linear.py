"""y = x @ w.T + b, avoiding the CPU's half-precision GEMM where it is the slow path.

CPUs differ by an order of magnitude here: without bf16 units torch's bf16 GEMM runs several times slower than
float32, with AMX several times faster (docs/benchmarks.md has the measurements). So the choice is measured, not
assumed: the first large product in each half-precision dtype times both paths on a small GEMM (tens of
milliseconds at worst, once per process) and keeps the faster. Where float32 wins, prefill-sized products (at least
`UPCAST_MIN_ROWS` rows) convert the weight a slice of output features at a time, so the scratch stays
small; decode-sized products stay in half precision, where conversion costs more than it saves.
CUDA and float32 go straight to F.linear. bfloat16 rows by a dense weight without a bias (a streamed layer's
matrix) go to kernels/native.py's `bf16_mm`, which reads the weight in place, for the row counts where
kernels/choice.py timed it faster than torch's GEMM. An LM head's logits (`logits`) are float32 on every path.

Weights that stay in memory can also be packed once into oneDNN's blocked layout (`pack_weight`): torch's
half-precision CPU GEMM otherwise reorders the weight on every call, which dominates decode-sized products (the
same product up to the order of accumulation, bit-identical at the model shapes measured, one rounding apart in
rare elements elsewhere). Whether packing pays is measured once per dtype too (`packing_pays`: against the native
kernel at a decode step's one row where that runs, against torch's GEMM at 16 and 256); a packed weight is an opaque
tensor of the same bytes that only `linear` consumes. oneDNN rounds a row alike in a product of a few
rows, not of many, and whether a product of two rows rounds a row as alone depends on the matrix and even on the
rows' values (on an AMD EPYC with AVX-512 BF16 a 1536 -> 576 product gave seeded rows their one-row bits from 2 to 8
rows, and a layer's real activations other bits at 2): a speculating engine's verify rows (kernels/choice.py's
`as_one_row`) go through a packed matrix, or any path but the native kernel's (which gives each row its one-row
bits in one call), one row at a time, so that each row gets what a one-row step gives it.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from offload.common import environment
from offload.kernels import choice, native
from offload.kernels.dispatch import record

UPCAST_MIN_ROWS = 64  # tokens; below this the conversion costs more than the faster GEMM saves
SLICE_FEATURES = 1024  # output features converted at a time: scratch = SLICE_FEATURES * in_features * 4 bytes


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, in], w [out, in] (dense, or packed by `pack_weight`), b [out] -> [tokens, out] in x's dtype."""
    native_fits = not w.is_mkldnn and b is None and native.bf16_mm_fits(x, w)
    if native_fits and choice.native("bf16", x.shape[0], w.shape):  # timed faster here; each row as alone
        record("linear", "native")
        return native.bf16_mm(x, w)
    if _verify_rows(x):  # on another path than the native kernel's: each as alone
        return torch.cat([linear(row, w, b) for row in x.split(1)])
    if w.is_mkldnn:
        return _packed(x, w, b)
    if x.device.type != "cpu" or w.dtype == torch.float32 or x.shape[0] < UPCAST_MIN_ROWS:
        return F.linear(x, w, b)
    if not upcast_is_faster(w.dtype):
        return F.linear(x, w, b)
    return _linear_upcast(x, w, b)


def _verify_rows(x: torch.Tensor) -> bool:
    """Whether `x` holds several rows that must each round as a one-row step's (a speculating engine's verify rows on
    the CPU, kernels/choice.py's `as_one_row`)."""
    return x.shape[0] > 1 and x.device.type == "cpu" and choice.as_one_row(x.shape[0])


def _packed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")


def logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An LM head's x [tokens, hidden] @ w.T (w dense) -> float32 [tokens, vocab] on every path: the products'
    float32 sums are kept, never rounded to a half-precision dtype (bfloat16 logits between 16 and 32 are 1/8 apart,
    so a near-tie rounds into a tie that greedy decoding gives to the lower token id, and a perplexity's
    log-probabilities carry that rounding). kernels/native.py's kernel computes them where kernels/choice.py timed it
    faster; else a float32 GEMM over the weight converted a slice of output features at a time."""
    if native.bf16_mm_fits(x, w) and choice.native("logits", x.shape[0], w.shape):
        record("logits", "native")
        return native.bf16_mm(x, w, torch.float32)
    if _verify_rows(x):  # on another path than the native kernel's: each as alone
        return torch.cat([logits(row, w) for row in x.split(1)])
    record("logits", "torch")
    if w.dtype == torch.float32:
        return F.linear(x.float(), w)
    return _linear_upcast(x, w, None, torch.float32)


def _linear_upcast(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x @ w.T + b in float32, w converted SLICE_FEATURES output features at a time -> `out_dtype` (None: x's)."""
    x32 = x.float()
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    for start in range(0, w.shape[0], SLICE_FEATURES):
        end = min(start + SLICE_FEATURES, w.shape[0])
        bias = None if b is None else b[start:end].float()
        out[:, start:end] = F.linear(x32, w[start:end].float(), bias)
    return out


@functools.cache
def upcast_is_faster(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices faster by converting them to float32 (measured once)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(UPCAST_MIN_ROWS * 2, 1024, generator=gen).to(dtype)  # [128, 1024]
    w = torch.randn(1024, 1024, generator=gen).to(dtype)

    def best_of(fn, repeats: int = 3) -> float:
        fn()  # warm-up: first calls pick kernels and fault in pages
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    return best_of(lambda: _linear_upcast(x, w, None)) < best_of(lambda: F.linear(x, w))


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """`w` [out, in] reordered into oneDNN's blocked layout for `linear`: an opaque CPU tensor of the same bytes."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


@functools.cache
def packing_pays(dtype: torch.dtype) -> bool:
    """Whether packed `dtype` weights multiply faster on this CPU, at decode and at prefill sizes (measured once).
    Never where float32 upcasting wins (that path needs the dense weight) or where torch lacks the ops."""
    if dtype == torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight") or upcast_is_faster(dtype):
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2048, 1024, generator=gen).to(dtype)
    try:
        packed = pack_weight(w)
    except RuntimeError:  # this CPU's oneDNN has no kernel for the dtype
        return False

    one, small, large = (torch.randn(rows, 1024, generator=gen).to(dtype) for rows in (1, 16, 256))
    # a decode step's one row takes the native kernel where it runs: packing would replace it, so it must be faster
    # (on the 2-core AMD EPYC the native kernel took half the packed product's time at one row)
    runs_native = environment.kernel_mode() != choice.TORCH and native.bf16_mm_fits(one, w)
    if runs_native and _time_ratio(packed, w, one, native.bf16_mm) >= 1.0:
        return False
    # decode sizes must gain; prefill sizes, where packing saves little, must not lose more than timing noise
    return _time_ratio(packed, w, small) < 1.0 and _time_ratio(packed, w, large) < 1.1


def _time_ratio(packed: torch.Tensor, w: torch.Tensor, x: torch.Tensor, dense=F.linear, rounds: int = 9) -> float:
    """Packed time over dense time (`dense`: torch's GEMM, or the native kernel) for x @ w.T: the median of
    back-to-back pairs, so that a shared machine's drift, which moves both of a pair together, cancels (minima of seven
    runs of one, then seven of the other, once turned packing off for a whole benchmark run on a noisy VM, its
    decode-sized products then ~1.5x slower)."""

    def seconds(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    run_packed, run_dense = (lambda: linear(x, packed)), (lambda: dense(x, w))
    run_packed(), run_dense()  # warm-up: the first calls pick kernels
    ratios = []
    for i in range(rounds):
        order = (run_packed, run_dense) if i % 2 == 0 else (run_dense, run_packed)  # alternate which goes first
        took = {fn: seconds(fn) for fn in order}
        ratios.append(took[run_packed] / took[run_dense])
    return sorted(ratios)[rounds // 2]
