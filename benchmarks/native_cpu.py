"""The native CPU kernels (kernels/native.py) against torch's own paths, on what a decode step computes.

int4: x [rows, K] bfloat16 times W [N, K] as int4 codes in torch's CPU packing, groups of 32 (SmolLM2-135M's four
products, a 4096 x 4096 and a 4096 -> 14336 one), kernels/csrc/int4_mm.c against `_weight_int4pack_mm_for_cpu`.
bf16: a few rows times a dense bfloat16 weight (SmolLM2's tied LM head, 576 -> 49152, and a 576 -> 3072 matrix),
kernels/csrc/bf16_mm.c against F.linear. attention: one query per sequence over a paged bfloat16 cache (SmolLM2's
9 query heads over 3 KV heads of 64, blocks of 16 in shuffled order), kernels/csrc/decode_attention.c against the
path paged_attention_ref takes otherwise (gathered blocks, one SDPA call per group), and prompts (every query a row
of the same kernel, kernels/cpu_attention.py) against one causal SDPA call per sequence. rows: a decode step's and a
prefill's SwiGLU product, RMSNorm with the residual and rotary (kernels/csrc/rows.c) against the torch references
(SmolLM2's widths; these inputs stay cached). Weights are read from memory,
not cache, as in a decode step: each product cycles through enough copies of its weight (at least COLD_BYTES) that
none is still cached when it comes back. The same inputs for both, the same repeats, one process, alternating which
runs first; the outputs are compared too. Prints a table and writes benchmarks/results/native_cpu.json with the
machine.

    python benchmarks/native_cpu.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench_common import machine, timestamp, write_report

COLD_BYTES = 256 << 20  # each product's weights in all: past the last-level cache of the CPUs this runs on
INT4_SHAPES = {  # name -> (N, K)
    "SmolLM2 q/k/v": (960, 576),
    "SmolLM2 o": (576, 576),
    "SmolLM2 gate/up": (3072, 576),
    "SmolLM2 down": (576, 1536),
    "4096 x 4096": (4096, 4096),
    "4096 -> 14336": (14336, 4096),
}
INT4_ROWS = (1, 4, 8, 16, 64, 256)
BF16_SHAPES = {"SmolLM2 LM head": (49152, 576), "576 -> 3072": (3072, 576)}
BF16_ROWS = (1, 2, 4, 8, 16)
ATTENTION = ((1, 160), (16, 160), (1, 1024), (16, 1024))  # (sequences, context)
PROMPTS = ((16, 128), (4, 512), (1, 2048))  # (sequences, prompt tokens)
ROW_OPS_ROWS = (16, 2048)


def cold_copies(make, nbytes: int, cold_bytes: int) -> list:
    return [make() for _ in range(max(2, -(-cold_bytes // nbytes)))]


def per_call(fn, weights: list, repeats: int) -> float:
    """Median over `repeats` passes of the seconds per call, each pass one call per weight copy."""
    for w in weights:
        fn(w)
    passes = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        passes.append((time.perf_counter() - start) / len(weights))
    return statistics.median(passes)


def int4_dispatch(rows: int) -> str:
    """What kernels/quant_linear.py runs for an int4 product of `rows` rows where the native kernels run."""
    from offload.kernels import native

    if rows >= native.INT4_DENSE_MIN_ROWS:
        return "dense GEMM (native dequantization)"
    return "native" if rows >= native.INT4_MIN_ROWS else "torch"


def relative_difference(ours, theirs) -> float:
    """max |ours - theirs| over max |theirs|: one bfloat16 rounding apart is up to 2^-8 of the largest output."""
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max().clamp(min=1e-30)).item()


def measure(kind: str, name: str, rows: int, ours, theirs, weights: list, nbytes: int, repeats: int) -> dict:
    # alternate which goes first, so drift of a shared machine moves both alike
    first, second = per_call(ours, weights, repeats), per_call(theirs, weights, repeats)
    second2, first2 = per_call(theirs, weights, repeats), per_call(ours, weights, repeats)
    native_s, torch_s = min(first, first2), min(second, second2)
    return {
        "kind": kind,
        "shape": name,
        "rows": rows,
        "native_us": native_s * 1e6,
        "torch_us": torch_s * 1e6,
        "speedup": torch_s / native_s,
        "weight_bytes": nbytes,
        "native_gb_per_s": nbytes / native_s / 1e9,
    }


def attention_row(seqs: int, context: int, repeats: int, gen, prompt: bool = False) -> dict:
    """Attention of `seqs` sequences of `context` tokens: one decode query each, or (`prompt`) every position a query
    (a whole prompt, causal); native against the torch path, the same batch."""
    import torch

    from offload.kernels import native
    from offload.kernels.paged_attention import paged_attention_ref
    from offload.kernels.paged_batch import PagedBatch

    block_size, hkv, heads, d = 16, 3, 9, 64
    per_seq = -(-context // block_size)
    blocks = seqs * per_seq
    k, v = (torch.randn(blocks, block_size, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    tables = torch.randperm(blocks, generator=gen).view(seqs, per_seq)
    q_len = context if prompt else 1
    q = torch.randn(seqs * q_len, heads, d, generator=gen).to(torch.bfloat16)
    starts = tuple(range(0, seqs * q_len + 1, q_len))

    def batch() -> PagedBatch:  # a fresh batch per call: a step's memo is rebuilt for each step
        return PagedBatch(starts, (context,) * seqs, tables, torch.zeros(seqs * q_len, dtype=torch.int64))

    fits = native.decode_attention_fits
    ours = lambda _: paged_attention_ref(q, k, v, batch(), d**-0.5)  # noqa: E731

    def theirs(_):
        native.decode_attention_fits = lambda *a: False
        try:
            return paged_attention_ref(q, k, v, batch(), d**-0.5)
        finally:
            native.decode_attention_fits = fits

    diff = relative_difference(ours(None), theirs(None))
    nbytes = 2 * blocks * block_size * hkv * d * 2
    kind, name = ("prompt", f"{seqs} x {context} tokens") if prompt else ("attention", f"{seqs} x {context} tokens")
    calls = 5 if prompt else 50
    row = measure(kind, name, seqs * q_len, ours, theirs, [None] * calls, nbytes, repeats)
    from offload.kernels.cpu_attention import MAX_CHUNK

    dispatch = "torch (SDPA: a chunk over MAX_CHUNK)" if q_len > MAX_CHUNK else "native"
    return row | {"max_relative_difference": diff, "dispatch": dispatch}


def row_ops(rows: int, repeats: int, gen) -> list[dict]:
    """SwiGLU's product, RMSNorm with the residual and rotary over `rows` tokens of SmolLM2's widths: native against
    the torch references."""
    import torch
    import torch.nn.functional as F

    from offload.kernels import native
    from offload.kernels.rms_norm import rms_norm_residual_ref
    from offload.kernels.rotary import _rotate_ref

    fused = torch.randn(rows, 2 * 1536, generator=gen).to(torch.bfloat16)
    gate, up = fused.chunk(2, dim=-1)
    x, r = (torch.randn(rows, 576, generator=gen).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(576, generator=gen).to(torch.bfloat16)
    qk = torch.randn(rows, 15, 64, generator=gen).to(torch.bfloat16)[:, :12]
    angles = torch.randn(rows, 32, generator=gen) * 50
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    cases = {
        "silu(gate) * up": (lambda _: native.silu_mul(gate, up), lambda _: F.silu(gate) * up, 2 * gate.numel() * 2),
        "rms_norm + residual": (
            lambda _: native.rms_norm(x, w, 1e-5, r)[0],
            lambda _: rms_norm_residual_ref(x, w, 1e-5, r)[0],
            2 * x.numel() * 2,
        ),
        "rotary": (lambda _: native.rotary(qk, cos, sin), lambda _: _rotate_ref(qk, cos, sin), qk.numel() * 2),
    }
    out = []
    for name, (ours, theirs, nbytes) in cases.items():
        diff = relative_difference(ours(None), theirs(None))
        row = measure("rows", name, rows, ours, theirs, [None] * 20, nbytes, repeats)
        out.append(row | {"max_relative_difference": diff, "dispatch": "native"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one shape of each kind, small: a check that it runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "native_cpu.json")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    from offload.kernels import native

    if native.cpu_missing() is not None or native._int4_mm() is None or native._bf16_mm() is None:
        raise SystemExit(f"the native kernels cannot run here: {native.cpu_missing() or 'no C compiler with OpenMP'}")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    int4_shapes, bf16_shapes, attention, prompts, row_rows = INT4_SHAPES, BF16_SHAPES, ATTENTION, PROMPTS, ROW_OPS_ROWS
    cold_bytes, int4_rows, bf16_rows = COLD_BYTES, INT4_ROWS, BF16_ROWS
    if args.quick:
        cold_bytes, int4_rows, bf16_rows = 8 << 20, (1, 16), (1, 16)
        int4_shapes, bf16_shapes = {"SmolLM2 o": (576, 576)}, {"576 -> 3072": (3072, 576)}
        attention, prompts, row_rows = ((2, 40),), ((2, 40),), (16,)
    for name, (n, k) in int4_shapes.items():
        nbytes = n * k // 2 + n * (k // 32) * 4  # codes, then a bfloat16 scale and zero per group

        def make(n=n, k=k):
            q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
            codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            return codes, torch.randn(k // 32, n, 2, generator=gen).mul(0.02).to(torch.bfloat16)

        weights = cold_copies(make, nbytes, cold_bytes)
        for rows in int4_rows:
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            ours = lambda w, x=x: native.int4_mm(x, w[0], w[1], 32)  # noqa: E731
            theirs = lambda w, x=x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1])  # noqa: E731
            diff = relative_difference(ours(weights[0]), theirs(weights[0]))
            row = measure("int4", name, rows, ours, theirs, weights, nbytes, args.repeats)
            rows_out.append(row | {"max_relative_difference": diff, "dispatch": int4_dispatch(rows)})
        del weights
    for name, (n, k) in bf16_shapes.items():
        nbytes = n * k * 2
        weights = cold_copies(lambda n=n, k=k: torch.randn(n, k, generator=gen).to(torch.bfloat16), nbytes, cold_bytes)
        for rows in bf16_rows:
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            ours = lambda w, x=x: native.bf16_mm(x, w)  # noqa: E731
            theirs = lambda w, x=x: F.linear(x, w)  # noqa: E731
            diff = relative_difference(ours(weights[0]), theirs(weights[0]))
            row = measure("bf16", name, rows, ours, theirs, weights, nbytes, args.repeats)
            rows_out.append(
                row
                | {"max_relative_difference": diff, "dispatch": "native" if rows <= native.BF16_MAX_ROWS else "torch"}
            )
        del weights
    for seqs, context in attention:
        rows_out.append(attention_row(seqs, context, args.repeats, gen))
    for seqs, context in prompts:
        rows_out.append(attention_row(seqs, context, args.repeats, gen, prompt=True))
    for rows in row_rows:
        rows_out.extend(row_ops(rows, args.repeats, gen))

    print(f"{'kind':<9} {'shape':<19} {'rows':>5} {'native us':>10} {'torch us':>10} {'speedup':>8} {'GB/s':>6}  runs")
    for r in rows_out:
        print(
            f"{r['kind']:<9} {r['shape']:<19} {r['rows']:>5} {r['native_us']:>10.1f} {r['torch_us']:>10.1f} "
            f"{r['speedup']:>7.2f}x {r['native_gb_per_s']:>6.1f}  {r['dispatch']}"
        )
    report = {
        "benchmark": "native_cpu",
        "date": timestamp(),
        "machine": machine(Path.cwd()) | {"threads": torch.get_num_threads(), "torch": torch.__version__},
        "clock": "perf_counter around a pass over every copy of the weight; per call, the median of the passes; "
        "the better of two runs each, alternating which kernel goes first",
        "cold_bytes": cold_bytes,
        "repeats": args.repeats,
        "thresholds": {"int4_min_rows": native.INT4_MIN_ROWS, "bf16_max_rows": native.BF16_MAX_ROWS},
        "rows": rows_out,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
