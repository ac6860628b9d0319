"""Spill files on disk: their format, the manifest that lists them, their checksums, and the store that keeps
them under a byte budget (SpillStore). What goes into them, and when, is tiers/spill/spilling.py's.

One data file per group, each tensor at an ALIGN-aligned offset, so a group is one aligned read with no slack; a
manifest (manifest.json) lists every file's tensors, size and CRC-32 under a key naming the source (the
checkpoint files' paths, sizes and mtimes, the compute dtype and FORMAT).

Invariants: a file is used only when the manifest lists it under the current key with the same tensors, and
its size and checksum were checked at first use (a bad file is deleted and rewritten, never used); data files
reach their names complete and fsynced (temp name, fsync, rename), the manifest last, the same way; a write
that fails removes everything it wrote and raises one OffloadError line (DiskFull where the disk had no room, which
the caller survives: tiers/files.py); `used` <= `capacity`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from offload.common.errors import OffloadError
from offload.common.sizes import format_size
from offload.tiers.files import DiskFull, free_space, fsync_dir, locked, make_dirs, pwrite_all, write_bytes, write_error
from offload.tiers.io.base import aligned_buffer, aligned_span
from offload.tiers.io.direct import PreadBackend
from offload.tiers.weights.checkpoint import TORCH_DTYPES
from offload.tiers.weights.layout import GroupLayout, Run, TensorAt

FORMAT = 1  # bump when the file layout or the manifest changes: older spill files then count as stale
MANIFEST = "manifest.json"
VERIFY_CHUNK = 16 << 20  # bytes read per step when checking a reused file
DTYPE_CODES = {dtype: code for code, (dtype, _) in TORCH_DTYPES.items()}  # torch dtype -> safetensors code


@dataclass(frozen=True, slots=True)
class SpillTensor:
    short: str  # the family's name for the tensor ("q_proj")
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    offset: int  # bytes from the file's start, a multiple of ALIGN
    nbytes: int


@dataclass(frozen=True, slots=True)
class SpillFile:
    """One group's data file: its tensors one after another, each starting on an ALIGN boundary."""

    name: str  # file name inside the tier's folder
    tensors: tuple[SpillTensor, ...]
    size: int  # bytes, a multiple of ALIGN
    crc32: int | None = None  # of all `size` bytes, padding included; None until written

    def layout(self, folder: Path) -> GroupLayout:
        """The read plan of this file: one run, tensors at their file offsets (the slot mirrors the file)."""
        tensors = tuple(TensorAt(t.short, t.offset, t.dtype, t.shape, t.nbytes) for t in self.tensors)
        return GroupLayout((Run(folder / self.name, 0, self.size, 0),), tensors, self.size)


def plan_file(name: str, tensors: Sequence[tuple[str, str, tuple[int, ...]]]) -> SpillFile:
    """Where tensors (short name, safetensors code, shape) go in a data file called `name`."""
    at, placed = 0, []
    for short, dtype, shape in tensors:
        nbytes = math.prod(shape) * TORCH_DTYPES[dtype][1]
        placed.append(SpillTensor(short, dtype, tuple(shape), at, nbytes))
        at += aligned_span(0, nbytes).length
    return SpillFile(name, tuple(placed), at)


class SpillStore:
    """Spill files in `directory`/`namespace` under a byte budget (`capacity`; None: only the filesystem's).

    `open(key)` reads the manifest, `lookup` hands out a listed file once checked, `write` adds files.
    Counters: `used` (bytes of files listed under the key), `peak`, `bytes_written`, `bytes_verified`.
    """

    def __init__(self, directory: str | Path, capacity: int | None = None, namespace: str = "") -> None:
        self.directory = Path(directory)  # what the user named; errors say this
        self.folder = self.directory / namespace if namespace else self.directory
        self.capacity = capacity
        self.used = 0  # bytes
        self.peak = 0  # bytes
        self.bytes_written = 0  # bytes, by this object
        self.bytes_verified = 0  # bytes read to check reused files
        self._key: dict | None = None
        self._files: dict[str, SpillFile] = {}  # the manifest's entries under _key
        self._stale: list[str] = []  # files of a manifest under another key: deleted by the next write
        self._checked: set[str] = set()

    @property
    def num_free(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.used

    def can_allocate(self, nbytes: int) -> bool:
        return self.capacity is None or self.used + nbytes <= self.capacity

    def open(self, key: dict) -> None:
        """Take the manifest's files when it was written under `key` and each is there with its listed size;
        another key's are stale (deleted at the next write); a manifest that does not parse is ignored. Reads only."""
        self._key = json.loads(json.dumps(key))  # as it reads back from the file: lists, not tuples
        before = self._files
        try:
            manifest = json.loads((self.folder / MANIFEST).read_text())
            files = [_entry(f) for f in manifest["files"]]
        except (OSError, ValueError, KeyError, TypeError):
            files, manifest = [], {}
        fresh = manifest.get("key") == self._key
        self._files = {f.name: f for f in files if _size(self.folder / f.name) == f.size} if fresh else {}
        self._stale = [] if fresh else [f.name for f in files]
        self._checked = {n for n in self._checked if before.get(n) == self._files.get(n)}
        self.used = sum(f.size for f in self._files.values())
        self.peak = max(self.peak, self.used)

    def lookup(self, file: SpillFile) -> GroupLayout | None:
        """The layout of `file` when the manifest lists it with the same tensors and its size and checksum match
        (checked at the first lookup); else None, and a listed file that fails the check is deleted."""
        entry = self._files.get(file.name)
        if entry is None or (entry.tensors, entry.size) != (file.tensors, file.size):
            return None
        if file.name not in self._checked:
            if _crc32(self.folder / file.name, entry.size) != entry.crc32:
                self._drop(file.name)
                return None
            self.bytes_verified += entry.size
            self._checked.add(file.name)
        return entry.layout(self.folder)

    def write(
        self,
        files: Sequence[SpillFile],
        fill: Callable[[SpillFile], dict[str, torch.Tensor]],
        keep: Collection[str] = (),
    ) -> list[GroupLayout]:
        """Write `files`, each with the tensors fill(file) returns (named, typed and shaped as planned), then the
        manifest; their layouts, in order. Files other than `files` and `keep` may be deleted to stay under the
        budget. On any failure everything this call wrote is removed and an OffloadError says why: DiskFull where
        the filesystem has no room for them."""
        if self._key is None:
            raise ValueError("SpillStore.write before open(key)")
        needed = sum(f.size for f in files)  # bytes; at most: another process may have written some meanwhile
        self._check_room(needed, keep={*keep, *(f.name for f in files)})
        created: list[Path] = []
        written: list[Path] = []  # temp names, then final names: removed on failure
        try:
            created = make_dirs(self.folder)
            with locked(self.folder):
                self.open(self._key)  # what another process wrote since our open is reused, not rewritten
                todo = [f for f in files if self.lookup(f) is None]
                # writers hold the lock while their temp files exist: any found now is a killed run's leftover
                for path in [*self.folder.glob(".*.tmp"), *(self.folder / name for name in self._stale)]:
                    path.unlink(missing_ok=True)
                done = []
                for f in todo:
                    tmp = self.folder / f".{f.name}.{os.getpid()}.tmp"
                    written.append(tmp)
                    done.append(replace(f, crc32=_write_file(tmp, f, fill(f))))
                for i, f in enumerate(done):
                    os.replace(written[i], self.folder / f.name)
                    written[i] = self.folder / f.name
                fsync_dir(self.folder)
                after = {**self._files, **{f.name: f for f in done}}
                manifest = {"format": FORMAT, "key": self._key, "files": [asdict(f) for f in after.values()]}
                tmp = self.folder / f".{MANIFEST}.{os.getpid()}.tmp"
                written.append(tmp)
                write_bytes(tmp, json.dumps(manifest, indent=1).encode())
                os.replace(tmp, self.folder / MANIFEST)
                fsync_dir(self.folder)
        except BaseException as exc:
            for path in written:
                with contextlib.suppress(OSError):
                    path.unlink()
            for path in reversed(created):
                with contextlib.suppress(OSError):
                    path.rmdir()
            if isinstance(exc, OSError):
                where, doing = f"--offload-dir {self.directory}", f"writing {format_size(needed)} of converted weights"
                raise write_error(exc, where, doing) from None
            raise
        self._files, self._stale = after, []
        self._checked.update(f.name for f in done)
        self.bytes_written += sum(f.size for f in done)
        self.used = sum(f.size for f in after.values())
        self.peak = max(self.peak, self.used)
        return [after[f.name].layout(self.folder) for f in files]

    def _check_room(self, needed: int, keep: set[str]) -> None:
        """Refuse before writing: over the budget (after dropping files not in `keep`) or the free space."""
        if not self.can_allocate(needed):
            for name in [n for n in self._files if n not in keep]:
                self._drop(name)
            if not self.can_allocate(needed):
                raise OffloadError(
                    f"--offload-dir {self.directory}: needs {format_size(needed)} for converted weights, the "
                    f"--disk-memory budget of {format_size(self.capacity)} has {format_size(self.num_free)} left"
                )
        free = free_space(self.folder)
        if needed > free:
            where = f"--offload-dir {self.directory}"
            raise DiskFull(where, f"{format_size(free)} free", f"needs {format_size(needed)} for converted weights")

    def _drop(self, name: str) -> None:
        """Forget a listed file and delete it (where the filesystem lets us; the manifest may still list it,
        which is harmless: a missing or changed file fails its check)."""
        self.used -= self._files.pop(name).size
        self._checked.discard(name)
        with contextlib.suppress(OSError):
            (self.folder / name).unlink()


def _entry(d: dict) -> SpillFile:
    """A manifest entry; raises ValueError or KeyError or TypeError when malformed."""
    name = d["name"]
    if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
        raise ValueError(f"bad file name {name!r}")
    tensors = tuple(
        SpillTensor(t["short"], t["dtype"], tuple(t["shape"]), int(t["offset"]), int(t["nbytes"])) for t in d["tensors"]
    )
    return SpillFile(name, tensors, int(d["size"]), int(d["crc32"]))


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _write_file(path: Path, file: SpillFile, tensors: dict[str, torch.Tensor]) -> int:
    """Write `file`'s bytes to a new file at `path`, fsynced; returns their CRC-32."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        crc, at = 0, 0
        for t in file.tensors:
            data = tensors[t.short]
            if DTYPE_CODES.get(data.dtype) != t.dtype or tuple(data.shape) != t.shape:
                got = f"{data.dtype} {tuple(data.shape)}"
                raise ValueError(f"{file.name}: {t.short} is {got}, planned {t.dtype} {t.shape}")
            raw = memoryview(data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            crc = pwrite_all(fd, memoryview(bytes(t.offset - at)), at, crc)  # padding up to the aligned offset
            crc = pwrite_all(fd, raw, t.offset, crc)
            at = t.offset + t.nbytes
        crc = pwrite_all(fd, memoryview(bytes(file.size - at)), at, crc)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # streamed with O_DIRECT: keep it out of the page cache
    finally:
        os.close(fd)
    return crc


def _crc32(path: Path, size: int) -> int | None:
    """CRC-32 of `path`, or None when it is missing or not `size` bytes. Read with O_DIRECT through the pread
    backend: a check reads every byte once, and through the page cache it would fill host RAM with the file."""
    buf = aligned_buffer(min(VERIFY_CHUNK, size))
    crc = 0
    try:
        with PreadBackend(threads=1) as backend:
            if backend.file_size(path) != size:
                return None
            for lo in range(0, size, VERIFY_CHUNK):
                crc = zlib.crc32(backend.submit(path, lo, min(VERIFY_CHUNK, size - lo), buf).wait().numpy(), crc)
    except OffloadError:  # missing, unreadable or shrunk while read
        return None
    return crc
