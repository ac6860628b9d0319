"""On a CUDA machine: each Triton kernel against its torch baseline, timed with CUDA events.

    PYTHONPATH=. python3 benchmarks/gpu/bench_kernels.py [--iters 50] [--kernels rms_norm,rotary]
        [--out benchmarks/results/gpu_kernels.json]
    PYTHONPATH=. TRITON_INTERPRET=1 python3 benchmarks/gpu/bench_kernels.py --dry-run

Kernels and baselines, bfloat16 unless said otherwise:
    paged_decode   kernels.paged_decode.paged_decode vs SDPA over the blocks gathered into one tensor per sequence
    quant_matmul   int4 / int8 fused dequant-matmul vs quant_matmul_ref (dequantize W, then matmul) and the dense
                   bfloat16 matmul the quantized weight replaces
    rms_norm       kernels.rms_norm.rms_norm_residual (residual add fused) vs rms_norm_residual_ref
    rotary         kernels.rotary.rotary vs rotary_ref
A kernel whose module or function is missing is skipped with the reason printed.

Each time is the median of `--iters` calls after `--warmup` calls, each call between its own pair of CUDA events,
with the L2 cache flushed before it (so a kernel re-reading its inputs from L2 does not pass for HBM bandwidth).
Rates count the bytes a kernel must move (inputs read once, outputs written once) and the FLOPs of the math;
"% peak" is the larger of bandwidth / peak bandwidth and FLOP/s / peak bfloat16 tensor FLOP/s, with the peaks
from the card's datasheet (`PEAKS`) or, for a card not in it, measured (a 1 GiB device copy, an 8192^3 matmul).
`--dry-run` runs tiny float32 shapes on the CPU in Triton's interpreter, timed by the wall clock, to check the
script itself. Prints a table, writes JSON (card, versions, peaks, one row per timing). A minute or two on an H100.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
KERNELS = ("paged_decode", "quant_matmul", "rms_norm", "rotary")
Output = torch.Tensor | tuple[torch.Tensor, ...]
L2_FLUSH_BYTES = 256 << 20  # larger than any card's L2 (H100: 50 MiB)
COPY_BYTES = 1 << 30  # the device copy that measures an unknown card's bandwidth


@dataclass(frozen=True, slots=True)
class Peak:
    """What the card can do at most: HBM bandwidth and dense bfloat16 tensor throughput."""

    bytes_per_s: float
    flops: float
    source: str  # "datasheet" or "measured: ..."


# (words the device name must contain, upper-cased; bandwidth bytes/s; dense bf16 tensor FLOP/s), first match wins:
# the more specific names come first ("L40S" before "L4", "H100 PCIE" before "H100")
PEAKS: tuple[tuple[tuple[str, ...], float, float], ...] = (
    (("GH200",), 4.0e12, 989e12),
    (("H200", "NVL"), 4.8e12, 835e12),
    (("H200",), 4.8e12, 989e12),
    (("H100", "NVL"), 3.9e12, 835e12),
    (("H100", "PCIE"), 2.0e12, 756e12),
    (("H100",), 3.35e12, 989e12),  # SXM ("H100 80GB HBM3")
    (("A100", "80GB", "PCIE"), 1.935e12, 312e12),
    (("A100", "80GB"), 2.039e12, 312e12),
    (("A100",), 1.555e12, 312e12),  # 40 GB
    (("L40S",), 864e9, 362e12),
    (("L40",), 864e9, 181e12),
    (("L4",), 300e9, 121e12),
    (("A10G",), 600e9, 125e12),  # the A10's datasheet figures (same GA102 part)
    (("RTX 4090",), 1008e9, 165e12),  # bf16 with float32 accumulation
    (("T4",), 320e9, 65e12),  # no bf16 units: the float16 tensor peak
)


def table_peak(card: str) -> Peak | None:
    """The datasheet peaks of the card named `card` (torch.cuda.get_device_name), or None for a card not listed."""
    name = card.upper()
    for words, bandwidth, flops in PEAKS:
        if all(w in name for w in words):
            return Peak(bandwidth, flops, "datasheet")
    return None


@dataclass(frozen=True, slots=True)
class Row:
    """One implementation of one kernel at one shape."""

    kernel: str
    impl: str  # "triton", or the torch baseline's name
    shape: str
    seconds: float  # per call, median
    bytes: int  # the kernel must move
    flops: int
    peak_fraction: float | None  # of the nearer roof; None without a peak (dry run)
    bound: str  # "memory" or "compute": which roof peak_fraction is of
    speedup: float | None = None  # the first baseline's time / this time, for the triton row
    max_abs_err: float | None = None  # triton's output against the first baseline's, for the triton row

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12


class Clock:
    """Median seconds per call of a function: CUDA events around each call with the L2 flushed before it, or the
    wall clock on a CPU (the dry run)."""

    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def time(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.flush is None:
            times = []
            for _ in range(self.iters):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        pairs = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.iters)
        ]
        for start, end in pairs:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3


def measure_peak(clock: Clock) -> Peak:
    """Peaks of a card the table lacks: a device-to-device copy (bytes read + written) and a bf16 matmul."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=clock.device)
    bandwidth = 2 * COPY_BYTES / clock.time(functools.partial(torch.empty_like(src).copy_, src))
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=clock.device)
    flops = 2 * n**3 / clock.time(lambda: a @ a)
    return Peak(bandwidth, flops, f"measured: {COPY_BYTES >> 30} GiB copy, {n}^3 bf16 matmul")


class Bench:
    """Times implementations of one kernel at one shape and turns the times into rows."""

    def __init__(self, clock: Clock, peak: Peak | None):
        self.clock, self.peak = clock, peak
        self.rows: list[Row] = []

    def compare(
        self,
        kernel: str,
        shape: str,
        moved: int,
        flops: int,
        triton_fn: Callable[[], Output],
        baselines: dict[str, Callable[[], Output]],
    ) -> None:
        """Time `triton_fn` and each baseline (the first is the one speedup and error are against)."""
        first = next(iter(baselines))
        err = (flat(triton_fn()) - flat(baselines[first]())).abs().max().item()
        times = {name: self.clock.time(fn) for name, fn in baselines.items()}
        seconds = self.clock.time(triton_fn)
        self.rows.append(self.row(kernel, "triton", shape, seconds, moved, flops, times[first], err))
        for name, t in times.items():
            self.rows.append(self.row(kernel, name, shape, t, moved, flops))

    def row(self, kernel, impl, shape, seconds, moved, flops, baseline_s=None, err=None) -> Row:
        fraction, bound = None, "memory"
        if self.peak is not None:
            memory = moved / seconds / self.peak.bytes_per_s
            compute = flops / seconds / self.peak.flops
            fraction, bound = (memory, "memory") if memory >= compute else (compute, "compute")
        speedup = baseline_s / seconds if baseline_s is not None else None
        return Row(kernel, impl, shape, seconds, moved, flops, fraction, bound, speedup, err)


def flat(out: Output) -> torch.Tensor:
    """A kernel's output, or its outputs concatenated, as one float32 vector."""
    parts = out if isinstance(out, tuple) else (out,)
    return torch.cat([t.flatten().float() for t in parts])


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def find(kernel: str, module_name: str, *names: str) -> tuple[ModuleType | None, str | None]:
    """(the module, None) when it imports and has every function in `names`, else (None, why not)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return None, f"{kernel}: cannot import {module_name} ({e})"
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        return None, f"{kernel}: {module_name} has no {', '.join(missing)}"
    return module, None


@dataclass(frozen=True, slots=True)
class Shapes:
    """The shapes each kernel runs at: model-sized on a GPU, tiny for the dry run."""

    paged_decode: tuple[tuple[int, int, int, int, int, int], ...]  # (seqs, context, Hq, Hkv, head_dim, block_size)
    quant_matmul: tuple[tuple[int, int, int, int], ...]  # (M, N, K, group_size)
    rms_norm: tuple[tuple[int, int], ...]  # (tokens, hidden)
    rotary: tuple[tuple[int, int, int, int], ...]  # (tokens, Hq, Hkv, head_dim)
    dtype: torch.dtype


GPU_SHAPES = Shapes(
    paged_decode=((1, 4096, 32, 8, 128, 16), (32, 2048, 32, 8, 128, 16), (128, 512, 32, 8, 128, 16)),
    quant_matmul=((1, 4096, 4096, 128), (16, 11008, 4096, 128), (1, 4096, 11008, 128), (512, 4096, 4096, 128)),
    rms_norm=((1, 4096), (256, 4096), (4096, 8192)),
    rotary=((1, 32, 8, 128), (256, 32, 8, 128), (4096, 32, 8, 128)),
    dtype=torch.bfloat16,
)
# float32: the interpreter's dot products of bfloat16 operands are not trustworthy
DRY_SHAPES = Shapes(
    paged_decode=((2, 40, 4, 2, 16, 16),),
    quant_matmul=((2, 64, 128, 32),),
    rms_norm=((3, 96),),
    rotary=((3, 4, 2, 16),),
    dtype=torch.float32,
)


def bench_paged_decode(bench: Bench, shapes: Shapes, device: torch.device) -> str | None:
    module, why = find("paged_decode", "offload.kernels.paged_decode", "paged_decode")
    if module is None:
        return why
    accepts_max_context = "max_context" in inspect.signature(module.paged_decode).parameters
    for seqs, context, heads, kv_heads, head_dim, block_size in shapes.paged_decode:
        per_seq = math.ceil(context / block_size)
        k_cache, v_cache = (
            torch.randn(seqs * per_seq, block_size, kv_heads, head_dim, dtype=shapes.dtype, device=device)
            for _ in range(2)
        )
        block_tables = torch.randperm(seqs * per_seq, device=device).view(seqs, per_seq).to(torch.int32)
        context_lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
        q = torch.randn(seqs, heads, head_dim, dtype=shapes.dtype, device=device)
        scale = head_dim**-0.5
        extra = {"max_context": context} if accepts_max_context else {}
        operands = (q, k_cache, v_cache, block_tables, context_lens, scale)
        moved = nbytes(q, q) + 2 * seqs * context * kv_heads * head_dim * q.element_size() + nbytes(block_tables)
        flops = 4 * seqs * heads * context * head_dim  # q.k and p.v
        shape = f"S={seqs} ctx={context} Hq={heads} Hkv={kv_heads} D={head_dim} bs={block_size}"
        bench.compare(
            "paged_decode",
            shape,
            moved,
            flops,
            lambda ops=operands, kw=extra: module.paged_decode(*ops, **kw),
            {"sdpa_gathered": lambda ops=operands, n=context: sdpa_gathered(*ops, n)},
        )
    return None


def sdpa_gathered(q, k_cache, v_cache, block_tables, context_lens, scale: float, context: int) -> torch.Tensor:
    """Decode attention the torch way: every sequence's blocks gathered into [S, Hkv, context, D], then SDPA (all
    sequences hold `context` tokens, so no mask)."""
    k = k_cache[block_tables].flatten(1, 2)[:, :context].transpose(1, 2)
    v = v_cache[block_tables].flatten(1, 2)[:, :context].transpose(1, 2)
    return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]


def bench_quant_matmul(bench: Bench, shapes: Shapes, device: torch.device) -> str | None:
    module, why = find("quant_matmul", "offload.kernels.quant_matmul", "quant_matmul", "quantize", "quant_matmul_ref")
    if module is None:
        return why
    fused = getattr(module, "quant_matmul_triton", module.quant_matmul)  # quant_matmul falls back to torch on a CPU
    for bits in (4, 8):
        for m, n, k, group_size in shapes.quant_matmul:
            w = torch.randn(n, k, dtype=shapes.dtype, device=device) * 0.02
            qweight, scales = module.quantize(w, bits, group_size)
            x = torch.randn(m, k, dtype=shapes.dtype, device=device)
            moved = nbytes(qweight, scales, x) + m * n * x.element_size()
            bench.compare(
                "quant_matmul",
                f"int{bits} M={m} N={n} K={k} g={group_size}",
                moved,
                2 * m * n * k,
                lambda x=x, q=qweight, s=scales, b=bits: fused(x, q, s, b),
                {
                    "dequant_then_matmul": lambda x=x, q=qweight, s=scales, b=bits: module.quant_matmul_ref(x, q, s, b),
                    "dense_matmul": lambda x=x, w=w: F.linear(x, w),
                },
            )
    return None


def bench_rms_norm(bench: Bench, shapes: Shapes, device: torch.device) -> str | None:
    module, why = find("rms_norm", "offload.kernels.rms_norm", "rms_norm_residual", "rms_norm_residual_ref")
    if module is None:
        return why
    for tokens, hidden in shapes.rms_norm:
        x, residual = (torch.randn(tokens, hidden, dtype=shapes.dtype, device=device) for _ in range(2))
        weight = torch.rand(hidden, dtype=shapes.dtype, device=device) + 0.5
        moved = 4 * nbytes(x) + nbytes(weight)  # x, residual in; normed, h out
        bench.compare(
            "rms_norm",
            f"T={tokens} H={hidden} +residual",
            moved,
            0,
            lambda x=x, w=weight, r=residual: module.rms_norm_residual(x, w, 1e-5, r),
            {"torch": lambda x=x, w=weight, r=residual: module.rms_norm_residual_ref(x, w, 1e-5, r)},
        )
    return None


def bench_rotary(bench: Bench, shapes: Shapes, device: torch.device) -> str | None:
    module, why = find("rotary", "offload.kernels.rotary", "rotary", "rotary_ref")
    if module is None:
        return why
    for tokens, heads, kv_heads, head_dim in shapes.rotary:
        q = torch.randn(tokens, heads, head_dim, dtype=shapes.dtype, device=device)
        k = torch.randn(tokens, kv_heads, head_dim, dtype=shapes.dtype, device=device)
        angles = torch.rand(tokens, head_dim, device=device) * 100
        cos, sin = angles.cos().to(shapes.dtype), angles.sin().to(shapes.dtype)
        moved = 2 * nbytes(q, k) + nbytes(cos, sin)
        bench.compare(
            "rotary",
            f"T={tokens} Hq={heads} Hkv={kv_heads} D={head_dim}",
            moved,
            0,
            lambda ops=(q, k, cos, sin): module.rotary(*ops),
            {"torch": lambda ops=(q, k, cos, sin): module.rotary_ref(*ops)},
        )
    return None


BENCHES = {
    "paged_decode": bench_paged_decode,
    "quant_matmul": bench_quant_matmul,
    "rms_norm": bench_rms_norm,
    "rotary": bench_rotary,
}


def format_row(r: Row) -> str:
    percent = f"{100 * r.peak_fraction:5.1f}% {r.bound[:3]}" if r.peak_fraction is not None else "-"
    speedup = f"{r.speedup:.2f}x" if r.speedup is not None else ""
    err = f"{r.max_abs_err:.2g}" if r.max_abs_err is not None else ""
    return (
        f"{r.kernel:<13} {r.impl:<20} {r.shape:<40} {r.seconds * 1e6:10.1f} {r.gb_per_s:8.1f} {r.tflops:8.2f} "
        f"{percent:>11} {speedup:>7} {err:>8}"
    )


HEADER = (
    f"{'kernel':<13} {'impl':<20} {'shape':<40} {'us/call':>10} {'GB/s':>8} {'TFLOP/s':>8} {'% peak':>11} "
    f"{'speedup':>7} {'max err':>8}"
)


def run(args: argparse.Namespace) -> dict:
    """Time the kernels `args` names; the report (rows and skips) as a dict."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    clock = Clock(device, warmup=1 if args.dry_run else args.warmup, iters=2 if args.dry_run else args.iters)
    card = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    peak = None if args.dry_run else table_peak(card) or measure_peak(clock)
    if peak is not None:
        print(f"{card}: {peak.bytes_per_s / 1e9:.0f} GB/s, {peak.flops / 1e12:.0f} bf16 TFLOP/s ({peak.source})")
    bench = Bench(clock, peak)
    skipped = []
    for name in args.kernels:
        start = time.perf_counter()
        try:
            why = BENCHES[name](bench, DRY_SHAPES if args.dry_run else GPU_SHAPES, device)
        except Exception as e:  # a kernel still being written must not cost the others their numbers
            why = f"{name}: failed: {type(e).__name__}: {e}"
        print(f"skipped {why}" if why else f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
        if why:
            skipped.append(why)
    print()
    print(HEADER)
    for r in bench.rows:
        print(format_row(r))
    return {
        "benchmark": "gpu_kernels",
        "card": card,
        "torch": torch.__version__,
        "triton": importlib.import_module("triton").__version__,
        "cuda": torch.version.cuda,
        "peak": asdict(peak) if peak is not None else None,
        "dry_run": args.dry_run,
        "iters": clock.iters,
        "rows": [asdict(r) | {"gb_per_s": r.gb_per_s, "tflops": r.tflops} for r in bench.rows],
        "skipped": skipped,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50, help="timed calls per implementation and shape")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU in Triton's interpreter")
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "gpu_kernels.json")
    args = parser.parse_args(argv)
    args.kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(args.kernels) - set(KERNELS))
    if unknown:
        parser.error(f"--kernels: unknown {', '.join(unknown)}; known: {', '.join(KERNELS)}")
    return args


def refusal(args: argparse.Namespace) -> str | None:
    """Why this run cannot go ahead here, or None."""
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "--dry-run runs Triton's CPU interpreter: set TRITON_INTERPRET=1 before starting"
        return None
    if not torch.cuda.is_available():
        return "this benchmark needs a CUDA device; --dry-run (with TRITON_INTERPRET=1) checks it on a CPU"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    why = refusal(args)
    if why:
        raise SystemExit(why)
    from offload_vs_accelerate import sibling  # benchmarks/gpu/ is sys.path[0] when this script runs

    common = sibling("bench_common")
    report = {"date": common.timestamp(), "host": common.host()} | run(args)
    common.write_report(args.out, report)


if __name__ == "__main__":
    main()
