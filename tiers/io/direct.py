"""O_DIRECT preadv on a thread pool: the backend that needs nothing but the kernel.

A large read is cut into chunk_bytes pieces that are all handed to the pool at once, so one layer's
weights keep several requests queued at the device; preadv releases the GIL while it waits.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from offload.common.errors import OffloadError
from offload.tiers.io.base import ALIGN, OpenFile, ReadBackend


class PreadBackend(ReadBackend):
    """Reads with os.preadv on files opened O_DIRECT (buffered where the filesystem refuses O_DIRECT)."""

    name = "pread"

    def __init__(self, threads: int = 8, chunk_bytes: int = 8 << 20) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}")
        super().__init__()
        self.threads = threads
        self.chunk_bytes = chunk_bytes  # bytes; one pool task reads at most this much
        self._pool: ThreadPoolExecutor | None = None  # started at the first read

    def _start(self, file: OpenFile, start: int, region: torch.Tensor) -> Callable[[], int]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"offload-io-{self.name}")
            pool = self._pool
        chunks: list[tuple[int, Future[int]]] = []
        for lo in range(0, region.numel(), self.chunk_bytes):
            piece = region[lo : lo + self.chunk_bytes]
            self._io_begin()
            chunks.append((piece.numel(), pool.submit(self._read_chunk, file, start + lo, piece)))

        def reap() -> int:
            wait([chunk for _, chunk in chunks])
            landed = 0
            for want, chunk in chunks:  # past a short chunk lies the end of the file: nothing after it counts
                got = chunk.result()
                landed += got
                if got < want:
                    break
            return landed

        return reap

    def _read_chunk(self, file: OpenFile, offset: int, piece: torch.Tensor) -> int:
        """preadv until `piece` is full or the file ends; runs on the pool."""
        out = memoryview(piece.numpy())
        done = 0
        try:
            while done < len(out):
                n = os.preadv(file.fd, [out[done:]], offset + done)
                if n == 0:
                    break
                done += n
        except OSError as exc:
            raise OffloadError(f"{file.path}: read failed at byte {offset + done} ({exc.strerror})") from None
        finally:
            self._io_end(done)
        return done

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        super().close()
