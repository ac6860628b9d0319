"""The disk tier's two background threads (tiers/kv/lower_tiers.py): blocks written through, and blocks read ahead.

WriteThrough: every write into the disk store. Computed blocks handed over at the step boundary are stored by a
thread of their own, through a bounded queue, so a step never waits on an fsync; a block that finds the queue full is
not written (the caller counts it); a block leaving host RAM is stored at once (`put`). The first write that finds no
room (ENOSPC, EDQUOT, EFBIG: tiers/files.py's DiskFull), on either thread, turns the writes off for the rest of the
run (`off` says why, one line on stderr says so once): the block it failed to write is simply not kept, and the
blocks the store holds still read back. Any other failure of a write turns the writes off as well, and
`raise_failure` raises it once, on the scheduler's thread; the writer thread lives on either way, so draining and
closing never hang.

ReadAhead: the scheduler's thread asks for blocks (`ask`) that admissions will soon want, and later takes what was
read (`take`); one reader thread reads and verifies them through the disk store meanwhile. A block asked for counts
as asked until it is taken, or until its read finds it gone or bad (the store deletes a bad block; an admission then
computes it), so it is never read twice at once.

Both hold the lock every user of the store holds around each call into it.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

from offload.tiers.files import DiskFull


class _Worker:
    """A thread of its own doing `_do(job)` for each job put, in order; a job that raises is done all the same, and
    the first error one raised is kept (`_failure`)."""

    def __init__(self, name: str, depth: int = 0) -> None:
        """`depth`: jobs that may wait (0: no bound)."""
        self._jobs: queue.Queue = queue.Queue(depth)
        self._failure: Exception | None = None
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
            except Exception as exc:  # the thread lives on: close() and wait() must not hang on a queue nobody reads
                self._failure = self._failure or exc
            finally:
                self._jobs.task_done()
        self._jobs.task_done()


class WriteThrough(_Worker):
    """Blocks stored in a KVDiskStore: now (`put`), or in order on a thread of its own (`offer`), while the writes
    are on (`off` is None)."""

    def __init__(self, disk, disk_lock: threading.Lock, depth: int, written: Callable[[], object]) -> None:
        """`disk`: the KVDiskStore; `disk_lock`: held around every call into it; `depth`: blocks that may wait for
        the thread; `written`: called for each block stored."""
        self.disk = disk
        self._disk_lock = disk_lock
        self._written = written
        self.off: str | None = None  # why no more blocks are written (None: they are)
        super().__init__("kv-disk-writer", depth)
        if disk.full is not None:  # no room even for its manifest at open
            self._turn_off(disk.full)

    def offer(self, key: bytes, row: torch.Tensor) -> bool:
        """Queue the block; False (nothing queued) when `depth` blocks are waiting already."""
        try:
            self._jobs.put_nowait((key, row))
        except queue.Full:
            return False
        return True

    def put(self, key: bytes, row: torch.Tensor) -> bool:
        """Store the block now: True if the disk holds it afterwards."""
        with self._disk_lock:
            if key in self.disk:
                return True
            if self.off is not None or self._failure is not None:
                return False
            try:
                kept = self.disk.put(key, row)
            except DiskFull as exc:
                self._turn_off(exc)
                return False
            except Exception as exc:  # raised on the scheduler's thread (raise_failure)
                self._failure = exc
                return False
        if kept:
            self._written()
        return kept

    def raise_failure(self) -> None:
        """Raise, once, a write's failure other than a full disk; no block is written after it."""
        with self._disk_lock:
            failure = self._failure if self.off is None else None
            if failure is not None:
                self.off = f"kv disk tier: {failure}"
        if failure is not None:
            raise failure

    def flush(self) -> None:
        """Wait for the blocks queued, raise a failure (`raise_failure`), and make the store's index durable where
        the disk has room for it (else the index keeps its last order, which the blocks written since only follow)."""
        self.wait()
        self.raise_failure()
        with self._disk_lock:
            try:
                self.disk.flush()
            except DiskFull as exc:
                self._turn_off(exc)

    def close(self) -> None:
        """Write the blocks queued, stop the thread and close the store (closed all the same on a full disk)."""
        super().close()
        with self._disk_lock:
            try:
                self.disk.close()
            except DiskFull as exc:
                self._turn_off(exc)

    def _turn_off(self, exc: DiskFull) -> None:
        """No more blocks are written; said once. Called with the disk lock held, or before any block is offered."""
        if self.off is None:
            self.off = f"kv disk tier: {exc.where}: {exc.reason}; the disk tier takes no more blocks"
            print(self.off, file=sys.stderr, flush=True)

    def _do(self, job: tuple[bytes, torch.Tensor]) -> None:
        self.put(*job)


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
