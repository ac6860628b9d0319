"""Timing each CPU kernel on its paths, once per machine, for kernels/choice.py's choice.

`ensure` gives this process the machine's timings: read from the cache where this machine (its libraries, torch,
CPU and threads) was timed before, else measured now (about ten seconds on 2 cores) and kept; the engine calls it
as it loads a model for the CPU. `retime` measures again and replaces them (`offload probe` does: a machine timed
while busy can be timed again idle).

What is timed: for each kernel and row count of choice.PLAN, one call of the engine's own entry point with the path
forced (choice.forcing), on inputs of a mid-sized Llama layer (hidden 2048, 16 query heads over 4 KV heads of 128,
SwiGLU of 5632, a vocabulary of 32768). A product's call is a pass over copies of its weight that together exceed
COLD_BYTES, so that each weight comes from beyond the core's own caches, as a decode step's do. Inputs are built
once per kernel and shape, from a fixed seed. Changing them means bumping choice.VERSION.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable

import torch

from offload.common import environment
from offload.kernels import choice, native_build
from offload.kernels.choice import NATIVE, Choices, Timing

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2048, 16, 4, 128, 5632, 16384
GROUP = 32  # int4 group size
BLOCK = 16  # KV cache block size
CONTEXT = 512  # a decode step's context
# weights a product's pass reads: past what a core's caches keep close (a 3072 x 576 int4 product at one row, on a
# 2-core AMX Xeon VM: torch's kernel 0.85x the native one's time from 64 MiB of copies, as from 256; from 16 MiB
# the two were even), at most MAX_COPIES of them (a tiny matrix stays cached in use anyway)
COLD_BYTES = 64 << 20
MAX_COPIES = 256
# a matrix with fewer weights than this takes its kernel's own timings, not timed at its shape: its products take
# microseconds, about the calls' own cost (SmolLM2's smallest, 576 x 576, has 331,776)
MIN_SHAPE_ELEMENTS = 1 << 18
# a native kernel twice this much slower than the best path at two row counts in a row is not timed at more rows:
# what it does per row (a register tile of rows against the weight read once) only loses more ground with rows
GIVE_UP = 2.0


def ensure(products: Iterable[tuple[str, int, int]] = ()) -> Choices | None:
    """This machine's timings, adopted for this process's choices: read where kept, else measured now and kept;
    with `products` ((kernel, out, in) of the model's own matrices: "int4", "bf16", "logits"), each of those
    shapes not timed yet is timed now too and kept beside them. None where no native kernel runs
    (native_build.why_off says why) or OFFLOAD_KERNELS chose."""
    if environment.kernel_mode() != "measured" or native_build.why_off() is not None:
        return None
    timed = choice.kept() or choice.read(choice.timings_file()) or _keep(Choices(measure(), choice.timings_file()))
    timed_at = [(k, n, i) for k, n, i in products if _native_fits(k, n, i) and n * i >= MIN_SHAPE_ELEMENTS]
    wanted = {choice.key(k, (n, i)): (k, n, i) for k, n, i in timed_at}
    missing = {name: shape for name, shape in wanted.items() if name not in timed.timings}
    if missing:
        extra = {name: _timings(k, choice.SHAPE_ROWS[k], _shape_case(k, n, i)) for name, (k, n, i) in missing.items()}
        timed = _keep(Choices(timed.timings | extra, timed.file))
    _drop_inputs()
    choice.adopt(timed)
    choice.shaped(set(wanted))
    return timed


def retime() -> Choices | None:
    """Time every kernel again now (the shapes of models timed before are timed again as their models load), keep
    the timings in place of the old ones and adopt them; None where no native kernel runs."""
    if environment.kernel_mode() != "measured" or native_build.why_off() is not None:
        return None
    choice.forget()
    timed = _keep(Choices(measure(), choice.timings_file()))
    _drop_inputs()
    choice.adopt(timed)
    return timed


def _drop_inputs() -> None:
    """Free the timed weights' copies (up to COLD_BYTES each kind and shape): the model needs the memory."""
    for cached in (_int4_weights, _bf16_weights, _shape_weights):
        cached.cache_clear()


def _keep(timed: Choices) -> Choices:
    """`timed`, written to its file (a failure to write is said, and the timings are used all the same)."""
    file = timed.file
    data = {"cpu": native_build.cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    data["load_average"] = os.getloadavg()[0]  # a busy machine's timings are worth timing again (`retime`)
    data["timings"] = choice.encode(timed)
    try:
        native_build.write_atomically(file, json.dumps(data, indent=1).encode())
    except OSError as exc:
        print(f"offload: keeping the kernels' timings in {file} failed ({exc}); they are timed again next run",
              file=sys.stderr)  # fmt: skip
    return timed


def measure() -> dict[str, tuple[Timing, ...]]:
    """Time every kernel of choice.PLAN on each of its paths at its row counts, on this module's mid-sized layer."""
    return {k: _timings(k, rows, functools.partial(case, k)) for k, (_, rows) in choice.PLAN.items()}


def _timings(
    kernel: str, row_counts: tuple[int, ...], make: Callable[[int], Callable[[], object]], rounds: int = 5
) -> tuple[Timing, ...]:
    """`kernel` timed on each of its paths at each row count (`make(rows)` gives the call): the best of `rounds`
    rounds, the paths alternating within a round so that a shared machine's drift falls on each alike. A row count
    whose winner differs from both its neighbours' (one path faster at 4 and at 16 rows, the other at 8) is more
    likely a slow spell than a crossing: it is timed for twice as many rounds more, its best times the best of all."""
    paths = choice.PLAN[kernel][0]
    timings: list[Timing] = []
    for rows in row_counts:
        candidates = [p for p in paths if rows >= choice.FROM_ROWS.get((kernel, p), 0)]
        if len(timings) >= 2 and all(_lost(t, NATIVE) for t in timings[-2:]):
            candidates.remove(NATIVE)
        # a few rows take microseconds a product, where a shared machine's jitter is as large as the paths' gap:
        # more rounds there, which cost little
        timings.append(_time(make(rows), rows, candidates, rounds if rows > 16 else 2 * rounds))
    for i in range(1, len(timings) - 1):
        before, this, after = timings[i - 1 : i + 2]
        if before.path == after.path != this.path:
            again = _time(make(this.rows), this.rows, list(this.us), 2 * rounds)
            timings[i] = Timing(this.rows, {p: min(t, again.us[p]) for p, t in this.us.items()})
    return tuple(timings)


def _time(call: Callable[[], object], rows: int, paths: list[str], rounds: int) -> Timing:
    best = dict.fromkeys(paths, float("inf"))
    for r in range(rounds + 1):  # the first round warms each path up, untimed
        for p in paths[r % len(paths) :] + paths[: r % len(paths)]:
            with choice.forcing(p):
                start = time.perf_counter()
                call()
                took = time.perf_counter() - start
            if r:
                best[p] = min(best[p], took)
    return Timing(rows, {p: round(t * 1e6, 2) for p, t in best.items()})


def _lost(t: Timing, p: str) -> bool:
    """Whether path `p` was GIVE_UP times slower than the best at timing `t` (or not timed there)."""
    return p not in t.us or t.us[p] >= GIVE_UP * min(t.us.values())


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _copies(t: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    nbytes = sum(x.numel() * x.element_size() for x in t)
    return [t] + [tuple(x.clone() for x in t) for _ in range(min(COLD_BYTES // nbytes, MAX_COPIES))]


@functools.cache
def _int4_weights() -> list[tuple[torch.Tensor, ...]]:
    gen = _gen()
    q = torch.randint(0, 16, (HIDDEN, HIDDEN), dtype=torch.int32, generator=gen)
    codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = torch.randn(HIDDEN // GROUP, HIDDEN, 2, generator=gen).mul(0.02).to(torch.bfloat16)
    return _copies((codes, scales))


@functools.cache
def _bf16_weights(n: int) -> list[tuple[torch.Tensor, ...]]:
    return _copies((torch.randn(n, HIDDEN, generator=_gen()).mul(0.02).to(torch.bfloat16),))


def _rows(rows: int, width: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=_gen()).to(torch.bfloat16)


def _products(fn: Callable, weights: list, x: torch.Tensor) -> Callable[[], object]:
    """A pass of `fn(x, *w)` over the copies of w: all of them up to 16 rows of x, a share of them falling as the
    rows grow past that (the product is then bound by its arithmetic, not by where its weight comes from)."""
    share = weights[: max(2, len(weights) * 16 // max(x.shape[0], 16))]

    def call() -> None:
        for w in share:
            fn(x, *w)

    return call


def _attention(seqs: int, q_len: int) -> Callable[[], object]:
    from offload.kernels.paged_attention import paged_attention_ref
    from offload.kernels.paged_batch import PagedBatch

    gen = _gen()
    context = CONTEXT if q_len == 1 else q_len
    per_seq = -(-context // BLOCK)
    blocks = seqs * per_seq
    k, v = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(2))
    tables = torch.randperm(blocks, generator=gen).view(seqs, per_seq)
    q = torch.randn(seqs * q_len, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    starts = tuple(range(0, seqs * q_len + 1, q_len))
    slots = torch.zeros(seqs * q_len, dtype=torch.int64)

    def call() -> None:  # a fresh batch a call, as a step builds one
        paged_attention_ref(q, k, v, PagedBatch(starts, (context,) * seqs, tables, slots), HEAD_DIM**-0.5)

    return call


def _native_fits(kernel: str, n: int, k: int) -> bool:
    """Whether the native kernel takes a matrix of [n, k] (kernels/native.py's conditions on the weight)."""
    from offload.kernels import native

    if kernel == "int4":
        return n % native.INT4_BLOCK == 0 and k % GROUP == 0
    return n % native.BF16_TILE == 0 and k % native.BF16_CHUNK == 0


@functools.cache
def _shape_weights(kernel: str, n: int, k: int) -> list[tuple[torch.Tensor, ...]]:
    """Copies of a weight of [n, k] in `kernel`'s storage (int4 codes and scales, or bfloat16), values drawn in
    their own dtype; of at most COLD_BYTES, its first output features where the whole is larger (a large LM head:
    the time per feature is the same past a few thousand, and loading a model must not hold a second head)."""
    gen = _gen()
    row_bytes = k // 2 + k // GROUP * 4 if kernel == "int4" else 2 * k
    n = min(n, max(64, COLD_BYTES // row_bytes // 64 * 64))
    if kernel == "int4":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)  # any bytes are codes
        scales = torch.empty(k // GROUP, n, 2, dtype=torch.bfloat16).uniform_(-0.02, 0.02, generator=gen)
        return _copies((codes, scales))
    return _copies((torch.empty(n, k, dtype=torch.bfloat16).uniform_(-0.05, 0.05, generator=gen),))


def _shape_case(kernel: str, n: int, k: int) -> Callable[[int], Callable[[], object]]:
    """`make(rows)` for product `kernel` at the model's own [n, k]."""
    from offload.common.quant import WeightQuant
    from offload.kernels import linear, quant_linear

    weights = _shape_weights(kernel, n, k)
    if kernel == "int4":
        fmt = WeightQuant(bits=4, group_size=GROUP, layout="cpu")
        fn = lambda x, c, s: quant_linear.quant_linear(x, c, s, fmt)  # noqa: E731
    else:
        fn = linear.logits if kernel == "logits" else linear.linear
    return lambda rows: _products(fn, weights, _rows(rows, k))


def case(kernel: str, rows: int) -> Callable[[], object]:
    """One timed call of `kernel` at `rows` rows (tokens; sequences for decode attention)."""
    from offload.common.quant import WeightQuant
    from offload.kernels import activation, linear, quant_linear, rms_norm, rotary

    if kernel == "int4":
        fmt = WeightQuant(bits=4, group_size=GROUP, layout="cpu")
        return _products(lambda x, c, s: quant_linear.quant_linear(x, c, s, fmt), _int4_weights(), _rows(rows, HIDDEN))
    if kernel == "bf16":
        return _products(linear.linear, _bf16_weights(HIDDEN), _rows(rows, HIDDEN))
    if kernel == "logits":
        return _products(linear.logits, _bf16_weights(VOCAB), _rows(rows, HIDDEN))  # 128 MiB: one copy
    if kernel == "decode_attention":
        return _attention(rows, 1)
    if kernel == "prompt_attention":
        return _attention(1, rows)
    x, r = _rows(rows, HIDDEN), _rows(rows, HIDDEN)
    if kernel == "rms_norm":
        w = torch.ones(HIDDEN, dtype=torch.bfloat16)
        return lambda: rms_norm.fused_rms_norm(x, w, 1e-5, r)
    if kernel == "rotary":
        qk = torch.randn(rows, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=_gen()).to(torch.bfloat16)[
            :, : HEADS + KV_HEADS
        ]
        angles = torch.randn(rows, HEAD_DIM // 2, generator=_gen()) * 50
        cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        return lambda: rotary.apply_rotary_heads(qk, cos, sin)
    if kernel == "silu_mul":
        gate, up = _rows(rows, 2 * FFN).chunk(2, dim=-1)
        return lambda: activation.silu_mul(gate, up)
    if kernel == "argmax":
        from offload.kernels.argmax import argmax

        logits = torch.randn(rows, VOCAB, generator=_gen())
        return lambda: argmax(logits)
    raise ValueError(f"no timed case for kernel {kernel!r}")
