"""Sequential read bandwidth of one large file, cold: buffered reads vs the O_DIRECT pread pool vs libaio.

    python benchmarks/io_bandwidth.py --dir /path/on/the/nvme [--size-gib 1] [--request-mib 64] [--depth 4]

Writes (or reuses) <dir>/io_bandwidth.bin, drops it from the page cache before every run (fsync, then
POSIX_FADV_DONTNEED), reads it end to end with each method, prints a table and writes the JSON, with the
machine it ran on, to benchmarks/results/io_bandwidth.json. GB/s is 1e9 bytes per second of wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_common import host, storage, timestamp, write_report

from offload.tiers.io.aio import AioBackend, aio_unavailable
from offload.tiers.io.base import ReadBackend, aligned_buffer, evict_page_cache
from offload.tiers.io.direct import PreadBackend

RESULTS = Path(__file__).parent / "results" / "io_bandwidth.json"
MiB = 1 << 20


def ensure_file(path: Path, nbytes: int) -> None:
    """Random bytes (incompressible, so no storage layer can shortcut them), written once and reused."""
    if path.exists() and path.stat().st_size == nbytes:
        return
    with open(path, "wb") as f:
        for _ in range(0, nbytes, 64 * MiB):
            f.write(os.urandom(min(64 * MiB, nbytes - f.tell())))
        f.flush()
        os.fsync(f.fileno())


def read_buffered(path: Path, request: int, depth: int) -> int:
    """One thread, plain read() through the page cache (kernel readahead is its only parallelism)."""
    buf = bytearray(request)
    done = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            done += n
    return done


def read_backend(backend: ReadBackend, path: Path, request: int, depth: int, pin: bool) -> int:
    """`depth` requests of `request` bytes in flight, each into its own aligned buffer, reaped in order."""
    size = backend.file_size(path)
    bufs = [aligned_buffer(request, pin=pin) for _ in range(depth)]
    in_flight = []
    done = 0
    for i, offset in enumerate(range(0, size, request)):
        if len(in_flight) == depth:
            done += in_flight.pop(0).wait().numel()
        in_flight.append(backend.submit(path, offset, min(request, size - offset), bufs[i % depth]))
    for req in in_flight:
        done += req.wait().numel()
    return done


def read_aio_op(path: Path, request: int, depth: int) -> int:
    """DeepSpeed's op on its own, the ceiling for the aio backend: async_pread of whole requests into page-locked
    buffers from the op's allocator (no bounce copy), `depth` in flight, all reaped by one wait()."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    handle = AsyncIOBuilder().load(verbose=False).aio_handle(4 << 20, 32, False, True, 1)
    bufs = [handle.new_cpu_locked_tensor(request, torch.empty(0, dtype=torch.uint8)) for _ in range(depth)]
    size = path.stat().st_size - path.stat().st_size % request  # whole requests: the op asserts reads end in the file
    for lo in range(0, size, request * depth):
        batch = range(lo, min(lo + request * depth, size), request)
        for buf, offset in zip(bufs, batch, strict=False):  # the last batch may be short
            handle.async_pread(buf, str(path), offset)
        handle.wait()
    for buf in bufs:
        handle.free_cpu_locked_tensor(buf)
    return size


def measure(path: Path, read: Callable[[], int], repeats: int) -> list[float]:
    rates = []  # GB/s
    for _ in range(repeats):
        evict_page_cache(path)
        start = time.perf_counter()
        nbytes = read()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the drive to measure")
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--request-mib", type=int, default=64, help="bytes per request (a layer's weights, say)")
    parser.add_argument("--depth", type=int, default=4, help="requests in flight")
    parser.add_argument("--threads", type=int, default=8, help="preadv pool threads")
    parser.add_argument("--chunk-mib", type=int, default=8, help="bytes per preadv call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    path = args.dir / "io_bandwidth.bin"
    nbytes = int(args.size_gib * (1 << 30))
    ensure_file(path, nbytes)
    request = args.request_mib * MiB
    pin = torch.cuda.is_available()

    runs: dict[str, Callable[[], int]] = {"buffered read (page cache, cold)": lambda: read_buffered(path, request, 1)}
    pread = PreadBackend(threads=args.threads, chunk_bytes=args.chunk_mib * MiB)
    runs[f"pread O_DIRECT ({args.threads} threads x {args.chunk_mib} MiB)"] = lambda: read_backend(
        pread, path, request, args.depth, pin
    )
    aio = None
    if (reason := aio_unavailable()) is None:
        aio = AioBackend()
        runs["aio backend (DeepSpeed libaio)"] = lambda: read_backend(aio, path, request, args.depth, pin)
        runs["DeepSpeed aio op alone, page-locked"] = lambda: read_aio_op(path, request, args.depth)
    else:
        print(f"aio skipped: {reason}")

    results = []
    for method, read in runs.items():
        rates = measure(path, read, args.repeats)
        results.append(
            {
                "method": method,
                "gb_per_s": [round(r, 3) for r in rates],
                "median": round(statistics.median(rates), 3),
                "best": round(max(rates), 3),
            }
        )
    direct = {"pread": pread.is_direct(path)} | ({"aio": aio.is_direct(path)} if aio else {})
    pread.close()
    if aio:
        aio.close()

    width = max(len(r["method"]) for r in results)
    print(f"{'method':<{width}}  median GB/s  best GB/s  runs")
    for r in results:
        runs_text = ", ".join(f"{x:.3f}" for x in r["gb_per_s"])
        print(f"{r['method']:<{width}}  {r['median']:11.3f}  {r['best']:9.3f}  {runs_text}")
    report = {
        "benchmark": "io_bandwidth",
        "date": timestamp(),
        "machine": host() | {"dir": str(args.dir.resolve())} | storage(args.dir),
        "file_bytes": nbytes,
        "request_bytes": request,
        "depth": args.depth,
        "pinned_buffers": pin,  # False on a CPU-only machine: the aio backend then reads through a bounce buffer
        "o_direct": direct,
        "results": results,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
