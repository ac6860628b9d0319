"""GGUF blocks multiplied as they lie (kernels/gguf_linear.py) against the engine's own int4 on the same values.

x [rows, K] bfloat16 times W [N, K]: W as Q4_0, Q4_1 or Q8_0 blocks read from a GGUF file in place (kernels/csrc/
gguf_blocks.c; from DENSE_FROM_ROWS rows dequantized for the dense GEMM), against the same codes imported into the
engine's int4 (torch's CPU packing, bfloat16 scale and zero a group: kernels/native.py's int4_mm, or
kernels/quant_linear.py's path at that row count), the path an imported GGUF took (Q8_0 has none). Shapes: a Mixtral
expert's 14336 x 4096 and 4096 x 14336, a 4096 x 4096 attention matrix, SmolLM2's 3072 x 576. Weights come from
memory, not cache: each product cycles through copies of its weight, at least COLD_BYTES in all. Also each matrix's
bytes and the rate its block product reads them at (GB/s), beside the rate these threads read plain memory at
(`memory_read_rate`: torch's sum over 1 GiB of random floats; a product that reads near it is bound by memory, not by
its arithmetic). The "blocks", "tiles" (AMX, where the CPU has it) and
"dense" columns time kernels/csrc/gguf_blocks.c, kernels/csrc/gguf_tiles.c and the dequantize-then-GEMM path at
every row count, which is how TILES_FROM_ROWS and DENSE_FROM_ROWS are chosen; "gguf" is the path gguf_linear takes
there for a decode step's rows (a prompt's stay on the block kernel below DENSE_FROM_ROWS). Prints a table and
writes benchmarks/results/gguf_blocks.json.

    python benchmarks/gguf_blocks.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_common import machine, timestamp, write_report
from native_cpu import per_call

COLD_BYTES = 256 << 20
SHAPES = {"expert gate/up": (14336, 4096), "expert down": (4096, 14336), "4096 x 4096": (4096, 4096),
          "SmolLM2 gate/up": (3072, 576)}  # fmt: skip
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two shapes, rows 1, 8 and 64")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gguf_blocks.json")
    args = parser.parse_args()

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from offload.common.quant import WeightQuant
    from offload.gguf.codes import engine_int4, int4_groups
    from offload.kernels import choice, gguf_linear, quant_linear

    shapes = dict(list(SHAPES.items())[1:3]) if args.quick else SHAPES
    rows = (1, 8, 64) if args.quick else ROWS
    fmt = WeightQuant(4, 32, "cpu")
    memory = memory_read_rate(torch)
    print(f"memory read by {torch.get_num_threads()} threads: {memory / 1e9:.1f} GB/s (a sum over 1 GiB)", flush=True)
    out = []
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        for name, (n, k) in shapes.items():
            gen = np.random.default_rng(0)
            raw = quants.quantize(gen.standard_normal((n, k), dtype=np.float32) * 0.02, T[kind])  # [n, row bytes]
            blocks = torch.from_numpy(raw.reshape(n, k // 32, -1).copy())
            nbytes = blocks.numel()
            copies = max(2, -(-COLD_BYTES // nbytes))
            block_copies = [blocks.clone() for _ in range(copies)]
            int4_copies = []  # Q8_0 has no int4 import to compare with
            if kind != "Q8_0":
                codes, scales = engine_int4(int4_groups(raw, T[kind]))
                packed = quant_linear.to_cpu_layout(codes, 4)
                int4_copies = [(packed.clone(), scales.to(torch.bfloat16)) for _ in range(copies)]
            for m in rows:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
                with choice.decode_rows(True):  # a decode step's rows: the tiles may take them
                    ours = per_call(lambda w, x=x: gguf_linear.gguf_linear(x, w), block_copies, args.repeats)
                forced = {}  # the block kernel and the tiles, each at every row count below the dense switch
                for path, from_rows in (("blocks", 1 << 30), ("tiles", 1)):
                    if path == "tiles" and gguf_linear._tiles() is None:
                        continue
                    saved = gguf_linear.TILES_FROM_ROWS[kind]
                    gguf_linear.TILES_FROM_ROWS[kind] = from_rows
                    try:
                        with choice.decode_rows(True):
                            forced[path] = per_call(
                                lambda w, x=x: gguf_linear.gguf_linear(x, w, dense_from=1 << 30), block_copies,
                                args.repeats,
                            )  # fmt: skip
                    finally:
                        gguf_linear.TILES_FROM_ROWS[kind] = saved
                dense = per_call(
                    lambda w, x=x: gguf_linear.dense.linear(x, gguf_linear.dequantize(w, torch.bfloat16)),
                    block_copies, args.repeats,
                )  # fmt: skip
                theirs = int4_copies and per_call(
                    lambda w, x=x: quant_linear.quant_linear(x, w[0], w[1], fmt), int4_copies, args.repeats
                )
                taken = (
                    "dense" if m >= gguf_linear.DENSE_FROM_ROWS
                    else "tiles" if "tiles" in forced and m >= gguf_linear.TILES_FROM_ROWS[kind] else "blocks"
                )  # fmt: skip
                row = {
                    "type": kind, "shape": name, "n": n, "k": k, "rows": m, "bytes": nbytes,
                    "gguf_us": ours * 1e6, "blocks_us": forced["blocks"] * 1e6,
                    "tiles_us": forced["tiles"] * 1e6 if "tiles" in forced else None, "dense_us": dense * 1e6,
                    "imported_int4_us": theirs * 1e6 if theirs else None, "taken": taken,
                    "vs_imported": theirs / ours if theirs else None,
                    "read_gb_s": nbytes / ours / 1e9, "of_memory_rate": nbytes / ours / memory,
                }  # fmt: skip
                out.append(row)
                tiles = f"{forced['tiles'] * 1e6:9.1f}" if "tiles" in forced else "        -"
                imported = f"{theirs * 1e6:9.1f} us  -> {theirs / ours:5.2f}x" if theirs else "        -            "
                print(
                    f"{kind} {name:16s} rows {m:4d}  gguf {ours * 1e6:9.1f} us ({taken:6s})  blocks"
                    f" {forced['blocks'] * 1e6:9.1f}  tiles {tiles}  dense {dense * 1e6:9.1f}"
                    f"  imported int4 {imported}  {nbytes / ours / 1e9:6.2f} GB/s"
                    f" ({nbytes / ours / memory:4.0%} of memory's)",
                    flush=True,
                )
    write_report(
        args.out,
        {
            "machine": machine(Path("/tmp")),
            "time": timestamp(),
            "threads": torch.get_num_threads(),
            "memory_read_gb_s": memory / 1e9,
            "rows": out,
        },  # fmt: skip
    )


def memory_read_rate(torch, seconds: float = 2.0) -> float:
    """Bytes/s at which torch's threads read memory: sums over 1 GiB of random float32 (random, so that no page is
    shared with another: a hypervisor may merge pages of equal bytes, and a read of merged pages comes from cache)."""
    import time

    data = torch.randn(1 << 28)
    data.sum()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        data.sum()
        calls += 1
    return data.numel() * 4 * calls / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
