"""The disk tier's two background threads (tiers/kv/lower_tiers.py): blocks written through, and blocks read ahead.

WriteThrough: computed blocks handed over at the step boundary are stored by a thread of their own, through a
bounded queue, so a step never waits on an fsync; a block that finds the queue full is not written (the caller
counts it).

ReadAhead: the scheduler's thread asks for blocks (`ask`) that admissions will soon want, and later takes what was
read (`take`); one reader thread reads and verifies them through the disk store meanwhile. A block asked for counts
as asked until it is taken, or until its read finds it gone or bad (the store deletes a bad block; an admission then
computes it), so it is never read twice at once.

Both hold the lock every user of the store holds around each call into it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch


class _Worker:
    """A thread of its own doing `_do(job)` for each job put, in order."""

    def __init__(self, name: str, depth: int = 0) -> None:
        """`depth`: jobs that may wait (0: no bound)."""
        self._jobs: queue.Queue = queue.Queue(depth)
        self._thread: threading.Thread | None = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until every job put so far is done."""
        self._jobs.join()

    def close(self) -> None:
        """Do the jobs put so far, then stop the thread. Closing twice is harmless."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _do(self, job) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._do(job)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()


class WriteThrough(_Worker):
    """`put(key, row)` called for each block offered, in order, on a thread of its own."""

    def __init__(self, put: Callable[[bytes, torch.Tensor], object], depth: int) -> None:
        """`depth`: blocks that may wait for `put`."""
        self._put = put
        super().__init__("kv-disk-writer", depth)

    def offer(self, key: bytes, row: torch.Tensor) -> bool:
        """Queue the block; False (nothing queued) when `depth` blocks are waiting already."""
        try:
            self._jobs.put_nowait((key, row))
        except queue.Full:
            return False
        return True

    def _do(self, job: tuple[bytes, torch.Tensor]) -> None:
        self._put(*job)


class ReadAhead(_Worker):
    """Blocks of a KVDiskStore read by a thread of their own, waiting to be taken."""

    def __init__(self, disk, disk_lock: threading.Lock) -> None:
        """`disk`: the KVDiskStore; `disk_lock`: held around every call into it."""
        self.disk = disk
        self._disk_lock = disk_lock
        self._lock = threading.Lock()  # guards the three below
        self._asked: set[bytes] = set()  # keys asked for and not yet taken
        self._read: dict[bytes, torch.Tensor] = {}  # key -> row, read and verified, in the order read
        self._seconds = 0.0  # spent reading since the last take
        super().__init__("kv-disk-reader")

    @property
    def outstanding(self) -> int:
        """Blocks asked for and not yet taken (read or still reading)."""
        with self._lock:
            return len(self._asked)

    def asked(self, key: bytes) -> bool:
        with self._lock:
            return key in self._asked

    def ask(self, keys: Sequence[bytes]) -> None:
        """Start reading `keys` (none of them asked for already)."""
        with self._lock:
            self._asked.update(keys)
        self._jobs.put(list(keys))

    def take(self) -> tuple[dict[bytes, torch.Tensor], float]:
        """The blocks read since the last take (key -> row) and the seconds their reads took."""
        with self._lock:
            rows, self._read = self._read, {}
            self._asked.difference_update(rows)
            seconds, self._seconds = self._seconds, 0.0
        return rows, seconds

    def clear(self) -> None:
        """Forget the blocks read and not yet taken (reads in flight still land)."""
        self.take()

    def _do(self, keys: list[bytes]) -> None:
        start = time.perf_counter()
        try:
            with self._disk_lock:
                rows = self.disk.get_many(keys)
        except Exception:  # the store failed (e.g. the disk went away): nothing read; admissions will ask again
            rows = [None] * len(keys)
        seconds = time.perf_counter() - start
        with self._lock:
            self._seconds += seconds
            for key, row in zip(keys, rows, strict=True):
                if row is None:  # evicted meanwhile, or found bad (and deleted): an admission computes it
                    self._asked.discard(key)
                else:
                    self._read[key] = row
