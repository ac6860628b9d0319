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
runs first; the outputs are compared too. int4 products of 64 rows and more are also timed dequantized for the
dense GEMM (kernels/quant_linear.py's prefill path), and the LM head as the engine computes it, float32 logits
(kernels/linear.py's `logits`: the native kernel against a float32 GEMM over the converted weight).

Each row also says which path the engine takes on this machine ("taken": kernels/choice.py's timings, made once
per machine, the products' at these shapes as a model of them has them timed as it loads) and how the taken path's
time compares with the best other one measured here ("vs other", 1.00x or more where the engine chose right).
Prints a table and writes benchmarks/results/native_cpu.json with the machine. `--rechoose FILE` measures nothing:
it takes the paths that FILE's recorded timings (another machine's run) give under this checkout's rule for
choosing, and prints that run's table with them.

    python benchmarks/native_cpu.py [--repeats 5] [--quick] [--rechoose RESULTS.json]
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
TAKEN_AT_LEAST = 0.97  # the bound every taken path must meet against the best other (benchmarks/cpu_check.py)


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


KERNEL_OF = {"int4": "int4", "attention": "decode_attention", "prompt": "prompt_attention"}  # kind -> choice's
ROW_KERNEL = {"silu(gate) * up": "silu_mul", "rms_norm + residual": "rms_norm", "rotary": "rotary"}


def taken(row: dict, choices) -> dict:
    """What the engine takes for this row's kernel and rows on this machine, and its time against the best other
    path timed here."""
    kernel = KERNEL_OF.get(row["kind"]) or ROW_KERNEL.get(row["shape"])
    if kernel is None:
        kernel = "logits" if row["shape"] == "SmolLM2 LM head" else "bf16"
    rows = row["rows"] if row["kind"] != "prompt" else row["rows"] // row["sequences"]
    if row["kind"] == "attention":
        rows = row["sequences"]
    path = choices.path(kernel, rows, row.get("matrix"))
    times = {p: row[f"{p}_us"] for p in ("native", "torch", "dense") if f"{p}_us" in row}
    others = [t for p, t in times.items() if p != path]
    return {"kernel": kernel, "taken": path, "taken_vs_other": min(others) / times[path]}


def relative_difference(ours, theirs) -> float:
    """max |ours - theirs| over max |theirs|: one bfloat16 rounding apart is up to 2^-8 of the largest output."""
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max().clamp(min=1e-30)).item()


def measure(
    kind: str, name: str, rows: int, ours, theirs, weights: list, nbytes: int, repeats: int, dense=None
) -> dict:
    # alternate which goes first, so drift of a shared machine moves both alike
    fns = {"native": ours, "torch": theirs} | ({"dense": dense} if dense is not None else {})
    took = {p: [] for p in fns}
    for order in (list(fns), list(fns)[::-1]):
        for p in order:
            took[p].append(per_call(fns[p], weights, repeats))
    best = {p: min(t) for p, t in took.items()}
    return {
        "kind": kind,
        "shape": name,
        "rows": rows,
        **{f"{p}_us": s * 1e6 for p, s in best.items()},
        "speedup": best["torch"] / best["native"],
        "weight_bytes": nbytes,
        "native_gb_per_s": nbytes / best["native"] / 1e9,
    }


def attention_row(seqs: int, context: int, repeats: int, gen, prompt: bool = False) -> dict:
    """Attention of `seqs` sequences of `context` tokens: one decode query each, or (`prompt`) every position a query
    (a whole prompt, causal); native against the torch path, the same batch."""
    import torch

    from offload.kernels import choice
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

    def attend(path: str):
        with choice.forcing(path):
            return paged_attention_ref(q, k, v, batch(), d**-0.5)

    ours, theirs = (lambda _: attend("native")), (lambda _: attend("torch"))

    diff = relative_difference(ours(None), theirs(None))
    nbytes = 2 * blocks * block_size * hkv * d * 2
    kind, name = ("prompt", f"{seqs} x {context} tokens") if prompt else ("attention", f"{seqs} x {context} tokens")
    calls = 5 if prompt else 50
    row = measure(kind, name, seqs * q_len, ours, theirs, [None] * calls, nbytes, repeats)
    return row | {"max_relative_difference": diff, "sequences": seqs}


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
        out.append(row | {"max_relative_difference": diff})
    return out


def print_table(rows: list[dict]) -> None:
    print(
        f"{'kind':<9} {'shape':<19} {'rows':>5} {'native us':>10} {'torch us':>10} {'dense us':>9} {'speedup':>8} "
        f"{'GB/s':>6}  {'taken':<6} {'vs other':>8}"
    )
    for r in rows:
        dense = f"{r['dense_us']:>9.1f}" if "dense_us" in r else f"{'':>9}"
        print(
            f"{r['kind']:<9} {r['shape']:<19} {r['rows']:>5} {r['native_us']:>10.1f} {r['torch_us']:>10.1f} {dense} "
            f"{r['speedup']:>7.2f}x {r['native_gb_per_s']:>6.1f}  {r['taken']:<6} {r['taken_vs_other']:>7.2f}x"
        )
    worst = min(rows, key=lambda r: r["taken_vs_other"])
    below = sum(r["taken_vs_other"] < TAKEN_AT_LEAST for r in rows)
    print(f"worst taken path: {worst['kernel']} at {worst['rows']} rows, {worst['taken_vs_other']:.2f}x the best other")
    print(f"rows whose taken path is below {TAKEN_AT_LEAST}x the best other: {below} of {len(rows)}")


def rechoose(file: Path) -> None:
    """FILE's rows with the paths its recorded timings give under this checkout's kernels/choice.py."""
    import json

    from offload.kernels import choice

    try:
        report = json.loads(file.read_text())
        timings: dict[str, list] = {}
        for t in report["choices"]["timings"]:
            timings.setdefault(t["kernel"], []).append(choice.Timing(t["rows"], t["us"]))
        rows = report["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{file}: not a native_cpu.py results file with its choices' timings ({e})") from None
    chosen = choice.Choices({k: tuple(v) for k, v in timings.items()}, file)
    print(f"{file}: {report['machine'].get('cpu', '?')}, {report['date']}; paths under this checkout's rule:")
    for name in timings:
        print(f"  {name}: {chosen.describe(name)}")
    print_table([r | taken(r, chosen) for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one shape of each kind, small: a check that it runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "native_cpu.json")
    parser.add_argument(
        "--rechoose",
        type=Path,
        metavar="RESULTS",
        help="measure nothing: RESULTS' table again, "
        "its paths taken by its recorded timings under this checkout's rule",
    )
    args = parser.parse_args()
    if args.rechoose is not None:
        return rechoose(args.rechoose)

    import torch
    import torch.nn.functional as F

    from offload.common import environment
    from offload.kernels import choice, native, native_build, timing
    from offload.kernels.linear import _linear_upcast
    from offload.kernels.quant_linear import _dense_int4

    if (off := native_build.why_off()) is not None:
        raise SystemExit(f"the native kernels cannot run here: {off}")
    if environment.kernel_mode() != "measured":
        raise SystemExit("unset OFFLOAD_KERNELS: the table says what the engine takes by its own timings")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    int4_shapes, bf16_shapes, attention, prompts, row_rows = INT4_SHAPES, BF16_SHAPES, ATTENTION, PROMPTS, ROW_OPS_ROWS
    cold_bytes, int4_rows, bf16_rows = COLD_BYTES, INT4_ROWS, BF16_ROWS
    if args.quick:
        cold_bytes, int4_rows, bf16_rows = 8 << 20, (1, 16), (1, 16)
        int4_shapes, bf16_shapes = {"SmolLM2 o": (576, 576)}, {"576 -> 3072": (3072, 576)}
        attention, prompts, row_rows = ((2, 40),), ((2, 40),), (16,)
    # the engine times a model's own matrices as it loads: these shapes, as a model of them would have them timed
    shapes = [("int4", n, k) for n, k in int4_shapes.values()]
    shapes += [("logits" if name == "SmolLM2 LM head" else "bf16", n, k) for name, (n, k) in bf16_shapes.items()]
    choices = timing.ensure(shapes)
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
            dense = (lambda w, x=x: _dense_int4(x, w[0], w[1], 32, True)) if rows >= 64 else None  # noqa: E731
            diff = relative_difference(ours(weights[0]), theirs(weights[0]))
            row = measure("int4", name, rows, ours, theirs, weights, nbytes, args.repeats, dense)
            rows_out.append(row | {"max_relative_difference": diff, "matrix": (n, k)})
        del weights
    for name, (n, k) in bf16_shapes.items():
        nbytes = n * k * 2
        weights = cold_copies(lambda n=n, k=k: torch.randn(n, k, generator=gen).to(torch.bfloat16), nbytes, cold_bytes)
        head = name == "SmolLM2 LM head"  # float32 logits, as the engine computes an LM head's
        for rows in bf16_rows:
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            if head:
                ours = lambda w, x=x: native.bf16_mm(x, w, torch.float32)  # noqa: E731
                theirs = lambda w, x=x: _linear_upcast(x, w, None, torch.float32)  # noqa: E731
            else:
                ours = lambda w, x=x: native.bf16_mm(x, w)  # noqa: E731
                theirs = lambda w, x=x: F.linear(x, w)  # noqa: E731
            diff = relative_difference(ours(weights[0]), theirs(weights[0]))
            row = measure("bf16", name, rows, ours, theirs, weights, nbytes, args.repeats)
            rows_out.append(row | {"max_relative_difference": diff, "matrix": (n, k)})
        del weights
    for seqs, context in attention:
        rows_out.append(attention_row(seqs, context, args.repeats, gen))
    for seqs, context in prompts:
        rows_out.append(attention_row(seqs, context, args.repeats, gen, prompt=True))
    for rows in row_rows:
        rows_out.extend(row_ops(rows, args.repeats, gen))

    rows_out = [r | taken(r, choices) for r in rows_out]
    print_table(rows_out)
    report = {
        "benchmark": "native_cpu",
        "date": timestamp(),
        "machine": machine(Path.cwd()) | {"threads": torch.get_num_threads(), "torch": torch.__version__},
        "clock": "perf_counter around a pass over every copy of the weight; per call, the median of the passes; "
        "the better of two runs each, alternating which kernel goes first",
        "cold_bytes": cold_bytes,
        "repeats": args.repeats,
        "choices": {"file": str(choices.file), "timings": choice.timing_table(choices)},
        "rows": rows_out,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
