"""Which path each CPU kernel takes, kernels/native.py's or torch's, chosen by timing both on this machine.

The native kernels were tuned on one CPU; on another torch's path can be the faster one (oneDNN's bfloat16 GEMM and
SDPA run on AMX tiles where the CPU has them). So nothing is assumed: every kernel that has both paths is timed once
per machine (kernels/timing.py, through the engine's own entry points with the path forced), and each takes the
faster. Products (int4, bf16, logits) and attention are timed at several row counts, and each path takes one range
of rows, the ranges (at most MAX_SWITCHES switches) where the paths together cost the least (`split`): a `Timing`
says which rows it decides for and what it measured.

The timings are kept as JSON in cache_dir()/native beside the built libraries, named by a digest of those
libraries, torch's version, the CPU, the threads and the plan below, so that a new build, a new torch or another
CPU times again. Until this process has timings (the engine times, or reads them, as it loads a model for the
CPU), every kernel takes torch's path. OFFLOAD_KERNELS=native takes every native kernel wherever it runs, at the
thresholds measured on a Zen 4 EPYC (`UNMEASURED`), without timing; OFFLOAD_KERNELS=torch takes none.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from offload.common import environment
from offload.kernels import native_build

NATIVE, TORCH, DENSE = "native", "torch", "dense"  # dense: int4 codes dequantized for the bfloat16 GEMM
VERSION = 3  # of this plan and of kernels/timing.py's cases: a change there must bump it, which times again
# kernel -> (its paths, the row counts it is timed at): each count decides for the rows up to the next one
PLAN: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {
    "int4": ((NATIVE, TORCH, DENSE), (1, 2, 4, 8, 16, 32, 64, 128, 256)),
    "bf16": ((NATIVE, TORCH), (1, 2, 4, 8, 16, 32, 64, 256)),
    "logits": ((NATIVE, TORCH), (1, 4, 16, 64, 256)),
    "decode_attention": ((NATIVE, TORCH), (1, 16)),
    "prompt_attention": ((NATIVE, TORCH), (64, 256, 1024, 2048)),
    "rms_norm": ((NATIVE, TORCH), (1, 16, 256, 2048)),
    "rotary": ((NATIVE, TORCH), (1, 16, 256, 2048)),
    "silu_mul": ((NATIVE, TORCH), (1, 16, 256, 2048)),
    "argmax": ((NATIVE, TORCH), (1, 16)),
}
# (kernel, path) -> the fewest rows it is timed at, and a candidate for: dequantizing a whole int4 weight for a few
# rows reads four times its codes' bytes and writes them again, which no CPU makes up for
FROM_ROWS = {("int4", DENSE): 64}
PRODUCTS = ("int4", "bf16", "logits")  # timed again at each model's own matrix shapes: see `key`
# kernels whose rows are tokens, each computed alone, whose paths may round a row apart (the native silu within 2
# float32 ulps of e^x where torch's is within 1): a verify step's rows take their one-row path (`one_row_path_up_to`)
ROW_WISE = (*PRODUCTS, "rms_norm", "rotary", "silu_mul", "argmax")
# row-wise kernels that are not products take one path at every row count (the one of least cost over the counts
# timed): a prompt's rows then round alike however it is cut into steps (a prefix-cache hit leaves a chunk of a few
# rows where a fresh prefill computes them all; the native silu and torch's round a row apart)
ONE_PATH = tuple(k for k in ROW_WISE if k not in PRODUCTS)
# the relative cost (each count timed weighs 1 at its best path) within which a split counts as tied with the best
NEAR_TIE = 0.05
# switches between paths a kernel's rows may make: on an Intel Xeon with AMX torch's int4 kernel wins at 1-4 rows,
# the native one from 8 and the dense GEMM from 256 (benchmarks/results/native_cpu-xeon-amx-quiet.json)
MAX_SWITCHES = 2
# row counts a product is timed at for one matrix shape
SHAPE_ROWS = {"int4": (1, 4, 8, 16, 32, 64, 128, 256), "bf16": (1, 4, 8, 16, 32, 64, 256), "logits": (1, 16, 64, 256)}
# what OFFLOAD_KERNELS=native takes: kernel -> ((from rows, path), ...), the fixed thresholds native.py measured on
# 2 threads of a Zen 4 EPYC (benchmarks/results/native_cpu.json there; prompts' attention native at every length since
# a group's query heads share each key row: native_cpu-epyc.json)
UNMEASURED: dict[str, tuple[tuple[int, str], ...]] = {
    "int4": ((1, NATIVE), (256, DENSE)),
    "bf16": ((1, NATIVE), (17, TORCH)),
}


@dataclass(frozen=True, slots=True)
class Timing:
    """One row count of a kernel timed on each path: it decides for `rows` up to the next timing's."""

    rows: int
    us: dict[str, float]  # path -> microseconds per call, the best of the rounds

    @property
    def path(self) -> str:
        return min(self.us, key=self.us.__getitem__)

    @property
    def speedup(self) -> float:
        """The path taken against the best of the others: their time over its time."""
        others = [t for p, t in self.us.items() if p != self.path]
        return min(others) / self.us[self.path] if others else 1.0


@dataclass(frozen=True)
class Choices:
    """Every kernel's timings on this machine, and where they are kept."""

    timings: dict[str, tuple[Timing, ...]]
    file: Path | None = None

    def path(self, kernel: str, rows: int, shape: tuple[int, int] | None = None) -> str:
        """The path taken at `rows` rows: by the timings at this matrix shape ([out, in] features) where there
        are some, else by the kernel's own."""
        name = key(kernel, shape) if shape is not None else kernel
        name = name if name in self.timings else kernel
        return taken(split(self.timings[name], name in ONE_PATH), rows)

    def describe(self, name: str) -> str:
        """e.g. "torch 1-7, native 8-127, dense from 128": the row ranges each path takes."""
        ranges = split(self.timings[name], name in ONE_PATH)
        if len(ranges) == 1:
            return ranges[0][1]
        parts = [f"{p} {start}-{end - 1}" for (start, p), (end, _) in itertools.pairwise(ranges)]
        return ", ".join([*parts, f"{ranges[-1][1]} from {ranges[-1][0]}"])

    def shown(self, name: str) -> bool:
        """Whether the summary names `name`'s timings: every kernel's own, but the products' only where this
        process's model had no shapes timed (`shaped`: those shapes' instead)."""
        if " " in name:
            return name in _shaped
        return name not in PRODUCTS or not _shaped


def split(timings: tuple[Timing, ...], one: bool = False) -> tuple[tuple[int, str], ...]:
    """The row ranges each path takes: ((first row, path), ...) from row 1, each path one range of rows, at most
    MAX_SWITCHES switches (none with `one`), where the paths together cost the least, each row count timed weighing
    alike (its time over the best there). A few switches, not one a timing: a near-tie that flips from count to count
    would make a sequence's tokens depend on how many others share its step (greedy answers are batch-invariant only
    where every batch size takes the same path), so a switch is made only where it pays (NEAR_TIE)."""

    def cost(t: Timing, p: str) -> float:
        return t.us[p] / min(t.us.values()) if p in t.us else float("inf")

    paths = list(dict.fromkeys(p for t in timings for p in t.us))
    options = []  # (total, the switches' timing indices, the paths of the ranges)
    for switches in range(1 if one else min(MAX_SWITCHES, len(timings) - 1) + 1):
        for at in itertools.combinations(range(1, len(timings)), switches):
            for ways in itertools.permutations(paths, switches + 1):  # each path one range: no path twice
                spans = itertools.pairwise((0, *at, len(timings)))
                total = sum(cost(t, w) for w, (a, b) in zip(ways, spans, strict=True) for t in timings[a:b])
                options.append((total, at, ways))
    best = min(total for total, _, _ in options)
    # of those within a near-tie of the least cost: the fewest switches, then the latest (a path change costs
    # exactness, across batch sizes and however a prompt is cut, so a tie must not move it to fewer rows)
    near = [o for o in options if o[0] <= best + NEAR_TIE]
    _, at, ways = min(near, key=lambda o: (len(o[1]), [-i for i in o[1]], o[0]))
    return tuple(zip((1, *(timings[i].rows for i in at)), ways, strict=True))


def taken(ranges: tuple[tuple[int, str], ...], rows: int) -> str:
    """The path `split`'s ranges give `rows` rows."""
    return next(p for start, p in reversed(ranges) if rows >= start)


_forced: list[str] = []  # a path every kernel takes while timing (innermost last)
_shaped: set[str] = set()  # the timings of this process's model's own product shapes (for the summary)
_memo: dict[tuple, str] = {}  # (OFFLOAD_KERNELS' mode, kernel, rows, shape) -> path, for the timings adopted
_adopted: list[Choices] = []  # this process's timings (kernels/timing.py's `ensure`)
_one_row_up_to = [1]  # products of up to this many rows take the path of one row (`one_row_path_up_to`)
_decode_rows = [False]  # the products running now have a decode step's rows, one new token a sequence (`decode_rows`)


@contextlib.contextmanager
def forcing(path: str) -> Iterator[None]:
    """Every kernel takes `path` inside this block (where it can run: a kernel without it takes torch's)."""
    _forced.append(path)
    try:
        yield
    finally:
        _forced.pop()


def key(kernel: str, shape: tuple[int, int]) -> str:
    """The timings' name for product `kernel` at a matrix of `shape` [out, in] features: "int4 3072x576"."""
    return f"{kernel} {shape[0]}x{shape[1]}"


def path(kernel: str, rows: int, shape: tuple[int, int] | None = None) -> str:
    """The path `kernel` takes for `rows` rows on this machine: "native", "torch" (int4 also "dense"); a product's
    by its timings at its weight's `shape` [out, in] where the model's shapes were timed. The caller has checked
    that the native kernel can take these tensors. Asked for every kernel of every layer: answers are memoized."""
    if _forced:
        return _forced[-1] if _forced[-1] in PLAN[kernel][0] else TORCH
    if kernel in ROW_WISE and rows <= _one_row_up_to[0]:
        rows = 1
    asked = (environment.kernel_mode(), kernel, rows, shape)
    if (known := _memo.get(asked)) is None:
        known = _memo[asked] = _decide(kernel, rows, shape)
    return known


def _decide(kernel: str, rows: int, shape: tuple[int, int] | None) -> str:
    if (how := environment.kernel_mode()) == TORCH:
        return TORCH
    if how == NATIVE:
        return next((p for start, p in reversed(UNMEASURED.get(kernel, ())) if rows >= start), NATIVE)
    timed = kept()
    return timed.path(kernel, rows, shape) if timed is not None else TORCH


def one_row_path_up_to(rows: int) -> None:
    """Products and the other row-wise kernels (ROW_WISE) of up to `rows` rows take the path they take for one row,
    from now on in this process (a larger `rows` than before only). Speculative decoding's verify step gives a
    sequence k + 1 rows where a plain step gives it one: on the same path each row rounds as alone, so greedy output
    stays the plain output (a path that switches between 1 and k + 1 rows would part them: bfloat16 products where
    oneDNN wins from 8 rows; SwiGLU's silu(gate) * up on the AMD EPYC, torch's at one row and the native from 2)."""
    _one_row_up_to[0] = max(_one_row_up_to[0], rows)


@contextlib.contextmanager
def decode_rows(each: bool) -> Iterator[None]:
    """Inside this block the products' rows are (`each`), or are not, a decode step's: one row a sequence, its one new
    token. A kernel that rounds apart from the one-row path may take such rows (a row's bits then depend on how many
    sequences decode beside it, never on how a prompt was cut into steps); a prompt's rows stay where they were, so
    that a prompt's greedy answer does not move with the CPU's features (kernels/gguf_linear.py's tiles)."""
    saved, _decode_rows[0] = _decode_rows[0], each
    try:
        yield
    finally:
        _decode_rows[0] = saved


def decoding() -> bool:
    """Whether the products running now have a decode step's rows (`decode_rows`)."""
    return _decode_rows[0]


def as_one_row(rows: int) -> bool:
    """Whether `rows` rows of one sequence compute as if each were alone (`one_row_path_up_to`): a verify step's."""
    return rows <= _one_row_up_to[0]


def native(kernel: str, rows: int, shape: tuple[int, int] | None = None) -> bool:
    return path(kernel, rows, shape) == NATIVE


def kept() -> Choices | None:
    """This machine's timings as this process has them (kernels/timing.py's `ensure` reads or makes them); None
    before that: every kernel then takes torch's path."""
    return _adopted[-1] if _adopted else None


def adopt(timed: Choices) -> None:
    """Take `timed` for this process's choices."""
    _adopted[:] = [timed]
    _memo.clear()


def shaped(names: set[str]) -> None:
    """Say that this process's model computes products of these timings' shapes (kernels/timing.py)."""
    _shaped.update(names)


def forget() -> None:
    """Drop this process's timings, and the rows that take one row's path."""
    _adopted.clear()
    _shaped.clear()
    _memo.clear()
    _one_row_up_to[0] = 1


def read(file: Path) -> Choices | None:
    """The timings kept in `file`, or None where there are none or they cannot be read (never used then)."""
    try:
        data = json.loads(file.read_text())
        return Choices({k: tuple(Timing(**t) for t in v) for k, v in data["timings"].items()}, file)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def timings_file() -> Path:
    """Where this machine's timings are kept: named by the libraries timed, torch's version, the CPU, the threads
    and the plan."""
    parts = [*native_build.built(), torch.__version__, native_build.cpu_name(), str(torch.get_num_threads())]
    plan = repr((VERSION, PLAN, FROM_ROWS, SHAPE_ROWS))
    digest = hashlib.sha256("\n".join([*parts, plan]).encode()).hexdigest()[:16]
    return native_build.cache_folder() / f"choices-{digest}.json"


def encode(timed: Choices) -> dict:
    """The JSON kept for `timed`."""
    return {k: [asdict(t) for t in v] for k, v in timed.timings.items()}


def summary() -> str:
    """The run summary's word on the CPU kernels, as far as this process used them (nothing is built or timed
    here): how each was chosen, or why none is native; "" where none was asked for."""
    if (off := native_build.known_off()) is not None:
        return f"native off ({off}): torch's paths"
    if environment.kernel_mode() == NATIVE:
        return "native wherever it runs (OFFLOAD_KERNELS=native: thresholds not timed here)"
    if environment.kernel_mode() == TORCH or (timed := kept()) is None:
        return ""
    chosen = "; ".join(f"{k} {timed.describe(k)}" for k in timed.timings if timed.shown(k))
    return f"timed on this machine ({timed.file}): {chosen}"


def timing_table(timed: Choices) -> list[dict]:
    """One row per kernel and row count: what each path took and which one the engine takes there (`split`'s, for
    benchmarks)."""
    rows = []
    for name, ts in timed.timings.items():
        ranges = split(ts, name in ONE_PATH)
        for t in ts:
            rows.append({"kernel": name, "rows": t.rows, "us": dict(t.us), "taken": taken(ranges, t.rows)})
    return rows
