"""Reads through DeepSpeed's AsyncIO op (libaio, O_DIRECT), the NVMe path of ZeRO-Inference.

What the op (DeepSpeed 0.19) does and does not do, and how this backend fits around it:
- `async_pread(buffer, filename, file_offset)` reads buffer.nbytes() bytes at file_offset, split evenly across
  the handle's threads, each in block_size iocbs. It opens the file by name with O_DIRECT on every call, asserts
  (aborting the process) that the read ends inside the file, and ignores per-iocb errors and short reads.
  So the op only ever gets the part of a span that lies inside the file and divides into aio_threads aligned
  shares; the remainder (under aio_threads * ALIGN bytes, with the file's partial last page) goes to the pool.
- `wait()` reaps every op in flight on the handle, not one: requests carry a ticket, and the first wait()
  covering a ticket reaps all outstanding ops. Destroying a handle with ops in flight aborts, hence `close()`.
- A buffer that is not page-locked (torch-pinned, or inside one the op locked itself, `new_cpu_locked_tensor`)
  is read through a bounce buffer the op allocates and mlocks per read, then copied: correct, slower, and bounded
  by RLIMIT_MEMLOCK (checked here, since a failed mlock aborts inside the op). `locked_buffer` hands out buffers
  the op locks for good (a ring's, on a CPU device, where torch cannot pin), within half of that limit; the op
  frees them only when told (`free_locked`), never on its own, so their owner gives them back.
Files on filesystems without O_DIRECT are read by the preadv pool, buffered; `is_direct(path)` says which.
"""

from __future__ import annotations

import fcntl
import functools
import os
import resource
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from offload.common.errors import OffloadError
from offload.common.quiet import quiet_deepspeed_import
from offload.tiers.io.base import ALIGN, OpenFile, aligned_span
from offload.tiers.io.direct import PreadBackend


def use_environment_build_dir() -> Path:
    """Where torch's JIT keeps the op's build, made this Python environment's own: inside a virtualenv (unless
    $TORCH_EXTENSIONS_DIR says otherwise), `<venv>/torch_extensions`. torch's default folder is shared by every
    environment of the user, and two environments at different paths rebuild the op over each other there (their
    include paths differ), each waiting on the other's lock. Sets $TORCH_EXTENSIONS_DIR for this process, so
    DeepSpeed's own loads (ZeRO-Inference) find the same build."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ and sys.prefix != sys.base_prefix:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    from torch.utils.cpp_extension import _get_build_directory  # honours $TORCH_EXTENSIONS_DIR; creates the folder

    return Path(_get_build_directory("async_io", verbose=False))


@contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Hold the op's build for this process. torch's own lock is a file that a killed build leaves behind, after
    which every later load waits on it forever; this flock dies with its holder. Every load here takes the flock
    first, so a torch lock found while holding it belongs to no live build and goes."""
    with open(build.parent / "async_io.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


@contextmanager
def _known_cpu(build: Path) -> Iterator[None]:
    """py-cpuinfo's description of this CPU, kept beside the build. DeepSpeed's loader asks for it twice for the
    op's compiler flags, and each answer spawns a Python process: 2.2 s of every load on the 2-core Xeon. The
    answer is kept per digest of the CPU's name and flags (another CPU, another answer); it is the one asked again."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then asks lscpu itself
        yield
        return
    import hashlib
    import json

    try:  # what names the CPU, not its clock of the moment
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        named = sorted({line for line in lines if line.split(":")[0].strip() in ("vendor_id", "model name", "flags")})
        digest = hashlib.sha256("\n".join(named).encode()).hexdigest()[:16] if named else None
    except OSError:
        digest = None
    kept = build / f"cpuinfo-{digest}.json"
    asked = cpuinfo.get_cpu_info

    def known() -> dict:
        try:
            return json.loads(kept.read_text())
        except (OSError, ValueError):
            info = asked()
            if digest is not None:
                staged = kept.with_suffix(f".{os.getpid()}.tmp")
                staged.write_text(json.dumps(info))
                staged.replace(kept)
            return info

    cpuinfo.get_cpu_info = known if digest is not None else functools.cache(asked)
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = asked


@functools.cache
def _load_op() -> ModuleType | str:
    """DeepSpeed's async_io op, or one line saying why not. The first call in a fresh environment JIT-builds it
    (minutes; cached in use_environment_build_dir()), later calls and processes load the cached build."""
    try:
        with quiet_deepspeed_import():
            from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as exc:  # ImportError, or deepspeed failing its own import
        return f"deepspeed is not importable ({exc}); install it with `pip install --no-deps deepspeed`"
    builder = AsyncIOBuilder()
    build = use_environment_build_dir()
    # the compatibility check compiles a probe against libaio, writing to sys.stderr's file descriptor, and fails
    # where sys.stderr has none (pytest's capture, notebooks): it decides whether a build can work, so a build
    # that exists needs no check
    if not (build / "async_io.so").exists() and not builder.is_compatible():
        return "libaio is missing (apt-get install libaio-dev)"
    try:
        with _build_lock(build), _known_cpu(build):
            return builder.load(verbose=False)
    except Exception as exc:
        return f"building DeepSpeed's async_io op failed ({str(exc).splitlines()[0] if str(exc) else exc!r})"


def aio_built() -> bool:
    """Whether the op is loaded, or was built before in this environment, so that using it costs no build."""
    if _load_op.cache_info().currsize:
        return not isinstance(_load_op(), str)
    try:
        return (use_environment_build_dir() / "async_io.so").exists()
    except ImportError:
        return False


def aio_unavailable() -> str | None:
    """None when the aio backend can run here, else why not (loading, and if needed building, the op)."""
    op = _load_op()
    return op if isinstance(op, str) else None


def aio_ready() -> bool:
    """Whether the aio backend runs here without first building the op (minutes): what an automatic choice asks."""
    return aio_built() and aio_unavailable() is None


LANES = 4  # aio handles per backend: reads into different buffers are reaped independently


class _Lane:
    """One aio_handle and the reads in flight on it. The op's wait() reaps every read on its handle, so reads that
    must land at different times (a ring's slots) go to different lanes: waiting for one slot's layer then does not
    wait for the next slot's read, which keeps reading while the layer computes."""

    def __init__(self, handle: object) -> None:
        self.handle = handle
        self.lock = threading.Lock()  # serializes every call on the handle: submit, reap, lock and free a buffer
        self.pending: list[_Op] = []  # each op submitted and not yet reaped
        self.submitted = 0  # tickets handed out; op k is reaped once reaped >= k
        self.reaped = 0


class AioBackend(PreadBackend):
    """libaio reads through DeepSpeed aio_handles (one lane per buffer, up to LANES); the preadv pool takes partial
    tails and non-O_DIRECT files."""

    name = "aio"

    def __init__(
        self,
        block_size: int = 4 << 20,
        queue_depth: int = 32,
        aio_threads: int = 1,
        threads: int = 4,
        chunk_bytes: int = 8 << 20,
    ) -> None:
        op = _load_op()
        if isinstance(op, str):
            raise OffloadError(f"I/O backend 'aio': {op}")
        if block_size < ALIGN or block_size % ALIGN:
            raise ValueError(f"block_size must be a positive multiple of {ALIGN}, got {block_size}")
        if aio_threads < 1:
            raise ValueError(f"aio_threads must be >= 1, got {aio_threads}")
        super().__init__(threads, chunk_bytes)
        # block_size: bytes per iocb; queue_depth: iocbs in flight per handle thread
        self._lanes = [_Lane(op.aio_handle(block_size, queue_depth, False, True, aio_threads)) for _ in range(LANES)]
        self._share = aio_threads * ALIGN  # bytes; the op's reads divide into aio_threads aligned shares
        self._lock_limit = _memlock_limit()  # bytes the op may mlock for bounce and locked buffers; None: no limit
        self._assign_lock = threading.Lock()  # guards the lane assignments and the locked-buffer registry
        self._lane_of: dict[int, int] = {}  # storage data_ptr -> lane, for buffers the op did not lock
        self._next_lane = 0
        self.locked_bytes = 0  # bytes of locked_buffer's buffers not yet given back
        self._locked: dict[int, tuple[int, int]] = {}  # data_ptr -> (bytes, lane) of each of them
        self.bounced_bytes = 0  # bytes the op has read through a bounce buffer (into memory it had not locked)
        # the op aborts the process when a handle is destroyed with reads in flight, and a ring always has reads
        # ahead: whoever drops the backend without close() (or exits), every handle is drained first
        self._drain = weakref.finalize(self, _drain, self._lanes)

    def _lane_for(self, region: torch.Tensor) -> _Lane:
        """The lane of the buffer `region` lies in: the one that locked it, else one per buffer, round-robin (a
        buffer the op locked is only known as locked to the handle that locked it)."""
        key = region.untyped_storage().data_ptr()
        with self._assign_lock:
            if key in self._locked:
                return self._lanes[self._locked[key][1]]
            lane = self._lane_of.get(key)
            if lane is None:
                if len(self._lane_of) >= 1024:  # forget buffers long gone; reads in flight keep their lane
                    self._lane_of.clear()
                lane = self._lane_of[key] = self._next_lane
                self._next_lane = (self._next_lane + 1) % LANES
        return self._lanes[lane]

    def _start(self, file: OpenFile, start: int, region: torch.Tensor) -> Callable[[], int]:
        if not file.direct:
            return super()._start(file, start, region)
        inside = min(region.numel(), file.size - start)  # bytes of the span inside the file
        bulk = inside - inside % self._share
        tail = super()._start(file, start + bulk, region[bulk:]) if bulk < region.numel() else (lambda: 0)
        if bulk == 0:
            return tail
        target = region[:bulk]  # the op's buffer; a view of its own, so its references are the op's and ours
        lane = self._lane_for(region)
        bounced = not lane.handle.is_pinned(target)  # the op's own test: torch-pinned, or locked by this handle
        with lane.lock:
            if bounced:
                locked = self._locked_now()
                if self._lock_limit is not None and locked + bulk > self._lock_limit:
                    tail()
                    raise OffloadError(
                        f"{file.path}: aio read of {bulk} bytes into an unpinned buffer needs a page-locked bounce "
                        f"buffer beyond RLIMIT_MEMLOCK ({self._lock_limit} bytes, {locked} in use); pass a pinned "
                        "buffer, raise `ulimit -l`, or use the pread backend"
                    )
            self._io_begin()
            if lane.handle.async_pread(target, str(file.path), start) != 0:
                self._io_end(0)
                tail()
                raise OffloadError(f"{file.path}: aio read of bytes {start}..{start + bulk} did not start")
            lane.pending.append(_Op(bulk, bounced, target))
            self.bounced_bytes += bulk if bounced else 0
            lane.submitted += 1
            ticket = lane.submitted

        def reap() -> int:
            self._reap(lane, ticket)
            self._check_unchanged(file)  # the op reports no short reads: a file that shrank under it must not pass
            return bulk + tail()

        return reap

    def _reap(self, lane: _Lane, ticket: int) -> None:
        """Block until op `ticket` of `lane` is complete, reaping every op in flight on its handle with it."""
        with lane.lock:
            if lane.reaped >= ticket:
                return
            lane.handle.wait()
            _await_release(lane.pending)
            for op in lane.pending:
                self._io_end(op.nbytes)
            lane.pending.clear()
            lane.reaped = lane.submitted

    def _reap_all(self) -> None:
        for lane in self._lanes:
            self._reap(lane, lane.submitted)

    def locked_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A buffer page-locked by the op, which reads into it with no bounce copy; None where it would take this
        backend's locked memory past half of RLIMIT_MEMLOCK (the other half stays for the bounce buffers of reads
        into other memory), said once in `lock_note`. Give it back with `free_locked` before the backend goes."""
        size = aligned_span(0, nbytes).length  # bytes; the op's buffers start on a page
        with self._assign_lock:
            locked = self._locked_now()
            if size == 0 or (self._lock_limit is not None and locked + size > self._lock_limit // 2):
                if size and not self.lock_note:
                    self.lock_note = (
                        f"aio read buffers not page-locked: {size} bytes more would take locked memory past half of "
                        f"RLIMIT_MEMLOCK ({self._lock_limit} bytes, {locked} locked); reads into them bounce through "
                        "a copy (raise `ulimit -l`)"
                    )
                return None
            index, self._next_lane = self._next_lane, (self._next_lane + 1) % LANES
            with self._lanes[index].lock:
                buf = self._lanes[index].handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
            if buf.data_ptr() == 0:  # the op's allocation or mlock failed (it printed why)
                return None
            self._locked[buf.data_ptr()] = (size, index)
            self.locked_bytes += size
        return buf

    def free_locked(self, buf: torch.Tensor) -> None:
        """Give back a buffer from `locked_buffer`, after the reads in flight have landed."""
        self._reap_all()
        with self._assign_lock:
            size, index = self._locked.pop(buf.data_ptr(), (None, None))
            if size is None:
                raise ValueError(f"aio: buffer {buf.data_ptr():#x} was not locked here")
            with self._lanes[index].lock:
                self._lanes[index].handle.free_cpu_locked_tensor(buf)
            self.locked_bytes -= size

    def _locked_now(self) -> int:
        """Bytes this backend has the op hold mlocked: its locked buffers and the bounce buffers of reads in flight.
        Memory other code in the process locks is not seen."""
        return self.locked_bytes + sum(op.nbytes for lane in self._lanes for op in list(lane.pending) if op.bounced)

    def close(self) -> None:
        self._reap_all()
        self._drain.detach()
        super().close()


class _Op(NamedTuple):
    """A read submitted to the op."""

    nbytes: int
    bounced: bool  # read through a bounce buffer the op locked for it
    target: torch.Tensor  # [nbytes] uint8, the buffer handed to the op


def _await_release(ops: list[_Op]) -> None:
    """After wait(): let the op's worker threads drop their references to the reaped reads' buffers (up to a second).
    A worker drops its last one just after wait() returns and needs the GIL to do so (the tensor came from Python);
    a worker still waiting for it when the interpreter finalizes aborts the process ("terminate called without an
    active exception"), so no reap returns before they are dropped, the GIL let go meanwhile."""
    deadline = time.monotonic() + 1.0
    for op in ops:
        while op.target._use_count() > 1 and time.monotonic() < deadline:  # 1: our own reference alone
            time.sleep(1e-5)


def _drain(lanes: list[_Lane]) -> None:
    """Wait for each handle's reads in flight, if any (the op also aborts on a wait with none pending)."""
    for lane in lanes:
        with lane.lock:
            if lane.pending:
                lane.handle.wait()
                _await_release(lane.pending)
                lane.pending.clear()


CAP_IPC_LOCK = 14  # capability bit: mlock without limit


def _memlock_limit() -> int | None:
    """Bytes this process may mlock; None with CAP_IPC_LOCK or an infinite RLIMIT_MEMLOCK."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    status = Path("/proc/self/status")
    caps = next((line.split()[1] for line in status.read_text().splitlines() if line.startswith("CapEff:")), "0")
    if soft == resource.RLIM_INFINITY or int(caps, 16) >> CAP_IPC_LOCK & 1:
        return None
    return soft
