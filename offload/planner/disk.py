"""The probe's disk test: a file written with O_DIRECT and fsync, dropped from the page cache, then read back cold
through each read backend (the pread pool, and aio where its op is already built), several large requests in
flight, into the buffers the engine's ring would read into (page-locked by the aio op where RLIMIT_MEMLOCK allows,
tiers/weights/landing.py); the file is always removed. The fastest backend's rate is what io_backend="auto" takes.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

import torch

from offload.common.errors import OffloadError
from offload.common.hardware import SMALL_READ_BYTES
from offload.common.sizes import format_size
from offload.tiers.io.aio import aio_built
from offload.tiers.io.backends import make_backend
from offload.tiers.io.base import ALIGN, O_DIRECT, aligned_buffer, aligned_span, evict_page_cache
from offload.tiers.memory import MemoryTier
from offload.tiers.weights.landing import LandingBuffers

MiB = 1 << 20
DISK_HEADROOM = 64 * MiB  # bytes the disk test leaves free beyond its own file
# the small-read test: requests of an expert's size at scattered offsets, as expert streaming reads its misses
# (a fine-grained mixture's experts are a few hundred KB to a few MB), many in flight, over at most SMALL_SPAN bytes
SMALL_READ = SMALL_READ_BYTES
SMALL_DEPTH = 8  # the engine's pread pool (tiers/io/backends.make_backend)
SMALL_SPAN = 256 * MiB


class DiskSpeed(NamedTuple):
    read: float  # bytes/s, cold sequential reads of `extent_bytes` through the fastest backend
    write: float  # bytes/s, sequential O_DIRECT writes including the final fsync
    direct: bool  # whether the reads bypassed the page cache (O_DIRECT was accepted)
    by_backend: dict[str, float]  # backend -> bytes/s, the same reads through each backend measured
    missing: str  # why a backend was not measured; "" when each was
    small_read: float  # bytes/s, cold SMALL_READ-byte requests at scattered offsets through the pread backend


def measure_disk(directory: str | Path, nbytes: int, extent: int = 64 * MiB, depth: int = 4) -> DiskSpeed:
    """Write a test file of `nbytes` in `directory`, then cold-read it through the pread backend and the aio one
    (left out where it cannot read); the file is removed whatever happens."""
    directory = Path(directory)
    if not directory.is_dir():
        raise OffloadError(f"{directory}: no such directory")
    nbytes = aligned_span(0, nbytes).length
    free = shutil.disk_usage(directory).free
    if free < nbytes + DISK_HEADROOM:
        raise OffloadError(
            f"{directory}: {format_size(free)} free, the disk test needs {format_size(nbytes + DISK_HEADROOM)} "
            "(a smaller --disk-bytes, or another --dir)"
        )
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".offload-probe-", suffix=".bin")
    except OSError as exc:
        raise OffloadError(f"{directory}: cannot write the disk test file ({exc.strerror})") from None
    path = Path(name)
    try:
        os.close(fd)
        write_seconds = _write_test_file(path, nbytes, extent)
        evict_page_cache(path)
        read_seconds, direct = _read_test_file(path, nbytes, extent, depth, "pread")
        by_backend, missing = {"pread": nbytes / read_seconds}, ""
        evict_page_cache(path)
        small_read = _read_scattered(path, min(nbytes, SMALL_SPAN))
        evict_page_cache(path)  # same file, same requests: only the backend differs
        if not aio_built():  # a probe never waits minutes for DeepSpeed's JIT build (`make aio-op` does it)
            missing = "aio not measured: its op is not built here (make aio-op)"
        else:  # refused where the op is unavailable, or its bounce buffers exceed RLIMIT_MEMLOCK (as in the engine)
            try:
                by_backend["aio"] = nbytes / _read_test_file(path, nbytes, extent, depth, "aio")[0]
            except OffloadError as exc:
                missing = f"aio not measured: {exc}"
    except OSError as exc:
        raise OffloadError(f"{directory}: disk test failed ({exc.strerror})") from None
    finally:
        path.unlink(missing_ok=True)
    return DiskSpeed(max(by_backend.values()), nbytes / write_seconds, direct, by_backend, missing, small_read)


def _read_scattered(path: Path, span: int) -> float:
    """Bytes/s of cold SMALL_READ-byte reads of the first `span` bytes of `path` in a shuffled order (a fixed seed),
    SMALL_DEPTH in flight through the pread backend, into page-aligned buffers."""
    backend = make_backend("pread", threads=SMALL_DEPTH)
    bufs = [aligned_buffer(SMALL_READ) for _ in range(SMALL_DEPTH)]
    offsets = list(range(0, span - SMALL_READ + 1, SMALL_READ))
    order = torch.randperm(len(offsets), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        in_flight: deque = deque()
        start = time.perf_counter()
        for i, j in enumerate(order):
            if len(in_flight) == SMALL_DEPTH:
                in_flight.popleft().wait()
            in_flight.append(backend.submit(path, offsets[j], SMALL_READ, bufs[i % SMALL_DEPTH]))
        while in_flight:
            in_flight.popleft().wait()
        return len(offsets) * SMALL_READ / (time.perf_counter() - start)
    finally:
        backend.close()


def _write_test_file(path: Path, nbytes: int, extent: int) -> float:
    """Fill `path` with `nbytes` of incompressible, page-unique bytes in `extent` writes; seconds incl. fsync."""
    buf = aligned_buffer(extent)  # [extent] uint8, ALIGN-aligned for O_DIRECT
    buf.copy_(torch.randint(0, 256, (extent,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    # a distinct page number at the head of every page, so no layer below can deduplicate the extents
    stamps = buf.view(-1, ALIGN)[:, :8].view(torch.int64)  # [extent / ALIGN, 1]
    pages = torch.arange(stamps.shape[0], dtype=torch.int64).unsqueeze(1)
    data = memoryview(buf.numpy())
    fd = _open_for_write(path)
    try:
        start = time.perf_counter()
        for i, offset in enumerate(range(0, nbytes, extent)):
            length = min(extent, nbytes - offset)
            stamps.copy_(pages + i * stamps.shape[0])
            done = 0
            while done < length:
                done += os.pwrite(fd, data[done:length], offset + done)
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def _open_for_write(path: Path) -> int:
    try:
        return os.open(path, os.O_WRONLY | O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_WRONLY)  # this filesystem refuses O_DIRECT: buffered writes, then fsync


def _read_test_file(path: Path, nbytes: int, extent: int, depth: int, backend_name: str) -> tuple[float, bool]:
    """Seconds to read `path` through `backend_name`, `depth` requests of `extent` in flight; and whether direct."""
    backend = make_backend(backend_name)
    # a ring's buffers: pinned by torch where CUDA is present, else page-locked by the backend where it reads those
    # faster (the aio op, within RLIMIT_MEMLOCK), else plain
    host = MemoryTier("probe", None, torch.device("cpu"), pin=True)
    landing = LandingBuffers(host, backend, extent, depth, "the probe's read buffers")
    try:
        bufs = landing.buffers
        in_flight: deque = deque()
        start = time.perf_counter()
        for i, offset in enumerate(range(0, nbytes, extent)):
            if len(in_flight) == depth:
                in_flight.popleft().wait()  # frees bufs[i % depth], the buffer of the oldest request
            in_flight.append(backend.submit(path, offset, min(extent, nbytes - offset), bufs[i % depth]))
        while in_flight:
            in_flight.popleft().wait()
        seconds = time.perf_counter() - start
        return seconds, backend.is_direct(path)
    finally:
        try:
            backend.close()  # every read has ended: nothing lands in the buffers any more
        finally:
            landing.close()
