"""The disk part of the KV cache: full KV blocks in files, keyed by prefix hash, under a byte budget (KVDiskStore).

One file per block rather than one slab file with slots: a block reaches its name whole (temp name, fsync,
rename), so no torn block is ever read back and nothing in the store's state can be half-updated by a crash; an
evicted block gives its space back with one unlink; and there is no slot map to keep consistent with a slab. The
price is an inode per block and an open per block read: at 360 KB blocks a 100 GiB budget is about 290,000 files in one
folder, which ext4 and xfs index without trouble.

A block file, `<hash hex>.<key tag>.kv`, all of it ALIGN-aligned so it is read whole with O_DIRECT:

    [0, ALIGN)                  header (HEADER), zero-padded: magic, key digest, hash length, hash, payload bytes,
                                CRC-32 of the payload
    [ALIGN, ALIGN + payload)    the block's bytes (KVCache.read_blocks' row), zero-padded to ALIGN

The key digest is a SHA-256 of the key, the payload size and FORMAT; the tag in the name is its first 8 bytes in hex,
so files of another key are told apart at open without reading them. manifest.json holds only the recency order
({"format", "key", "block_nbytes", "lru": [hash hex, least recently used first]}): the files themselves are what the
store holds. At open, files of this key the manifest does not list (put after the last flush) count as the most
recent, in mtime order; a manifest under another key or that does not parse gives no order at all. Files the
store did not name are left alone (and not counted).

Invariants: the store holds an exclusive flock on its folder from open to close, so no other process writes there
and a temp file found at open is a killed writer's; a block is returned only when its header names this key and
this hash and its CRC-32 matches, else its file is deleted and it counts in `dropped_corrupt`; `used` (bytes of block
files, headers and padding included) == blocks * file_nbytes <= capacity at every moment, a put's temp file included;
a put that fails leaves neither its temp file nor its block file, and indexes nothing.

A full disk (tiers/files.py's DiskFull) fails a put or a flush and changes nothing else: the blocks held still read
back. At open it fails nothing: the manifest keeps its last order, and `full` says why it was not rewritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

from offload.common.errors import OffloadError
from offload.tiers.files import (
    DiskFull,
    fsync_dir,
    make_dirs,
    os_error_reason,
    pwrite_all,
    try_lock,
    write_bytes,
    write_error,
)
from offload.tiers.io.base import ALIGN, ReadBackend, ReadRequest, aligned_buffer, aligned_span
from offload.tiers.io.direct import PreadBackend

FORMAT = 1  # bump when the block file or the manifest changes: older blocks then count as another key's
MANIFEST = "manifest.json"
MAGIC = b"OFFKVBLK"
MAX_HASH = 64  # bytes
HEADER = struct.Struct(f"<8s32sB{MAX_HASH}sQI")  # magic, key digest, hash length, hash (zero-padded), nbytes, crc32
BLOCK_NAME = re.compile(r"((?:[0-9a-f]{2}){1,64})\.([0-9a-f]{16})\.kv")  # hash hex, key tag
OPEN_FILES = 256  # block files the read backend may keep open between calls; past this it closes them all


class KVDiskStore:
    """Full KV blocks under `folder` by prefix hash: at most `capacity` bytes of block files, least recently used
    evicted first, each verified on every read. One thread at a time.

    `key` (JSON-able) names what makes a block's bytes mean the same thing (model fingerprint, KV format, block
    geometry); blocks stored under another key are deleted at open. Reads go through `backend` (default: a
    PreadBackend), which keeps a block's file open from its first read until the block is removed or OPEN_FILES
    are open; the store then closes all the backend's files, so give it a backend of its own.

    Counters: `blocks`, `used` and `peak` (bytes of block files), `bytes_written` and `bytes_read` (by this object),
    `hits` and `misses` (of get and get_many), `dropped_corrupt` (blocks found bad or missing, unfinished writes
    cleaned at open), `dropped_foreign` (another key's files deleted at open), `evicted` (to stay in the budget).
    """

    def __init__(
        self, folder: str | Path, key: dict, block_nbytes: int, capacity: int, backend: ReadBackend | None = None
    ) -> None:
        if block_nbytes < 1:
            raise ValueError(f"block_nbytes must be >= 1, got {block_nbytes}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        self.folder = Path(folder)
        self.key = json.loads(json.dumps(key))  # as it reads back from the manifest: lists, not tuples
        self.block_nbytes = block_nbytes
        self.capacity = capacity  # bytes
        self.file_nbytes = ALIGN + aligned_span(0, block_nbytes).length  # bytes on disk per block: header + payload
        text = json.dumps({"format": FORMAT, "block_nbytes": block_nbytes, "key": self.key}, sort_keys=True)
        self._digest = hashlib.sha256(text.encode()).digest()
        self._tag = self._digest[:8].hex()
        self.used = 0  # bytes
        self.peak = 0  # bytes
        self.bytes_written = 0
        self.bytes_read = 0
        self.hits = 0
        self.misses = 0
        self.dropped_corrupt = 0
        self.dropped_foreign = 0
        self.evicted = 0
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # held hashes, least recently used first
        self._backend = backend if backend is not None else PreadBackend()
        # blocks whose files the backend holds open. One is closed before its block is removed: an open descriptor
        # would keep a deleted file's space, and the backend would refuse a new file under the name as "replaced"
        self._open: set[bytes] = set()
        self._lock_fd: int | None = None
        self.full: DiskFull | None = None  # the disk had no room to record the key at open
        try:
            self._lock_fd = self._lock()
            self._load()
            while self.used > self.capacity:  # the budget shrank since the last run
                self._evict_one()
            self.peak = self.used
            try:
                self.flush()  # records the key now, and fails here if the folder is not writable
            except DiskFull as exc:  # writable, but full: what it holds still reads back
                self.full = exc
        except BaseException:
            self._release()
            raise

    @property
    def blocks(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        """Whether the store holds the block (get may still find its file bad); not a use."""
        return block_hash in self._lru

    def hashes(self) -> list[bytes]:
        """The blocks held, least recently used first."""
        return list(self._lru)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's bytes ([block_nbytes] uint8 on the CPU), or None when it is absent or found bad."""
        return self.get_many([block_hash])[0]

    def get_many(self, hashes: list[bytes]) -> list[torch.Tensor | None]:
        """Each block's bytes ([block_nbytes] uint8, a view into an aligned CPU buffer of its own), None for each one
        absent or found bad (its file is then deleted). Every read is submitted before the first is waited for."""
        self._check_open()
        pending: list[tuple[int, bytes, ReadRequest | None]] = []
        for i, block_hash in enumerate(hashes):
            if block_hash in self._lru:
                pending.append((i, block_hash, self._submit(block_hash)))
        found: list[torch.Tensor | None] = [None] * len(hashes)
        bad = set()
        for i, block_hash, request in pending:
            raw = self._wait(request)  # [file_nbytes] uint8
            if raw is not None and self._intact(block_hash, raw):
                found[i] = raw[ALIGN : ALIGN + self.block_nbytes]
                self._lru.move_to_end(block_hash)
            else:
                bad.add(block_hash)
        for block_hash in bad:  # after every wait: removing one closes the backend's files
            self._remove(block_hash)
        self.dropped_corrupt += len(bad)
        if len(self._open) > OPEN_FILES:
            self._close_files()
        hits = sum(block is not None for block in found)
        self.hits += hits
        self.misses += len(found) - hits
        return found

    def put(self, block_hash: bytes, data: torch.Tensor) -> bool:
        """Store `data` ([block_nbytes] uint8 on the CPU) as block `block_hash`, durable once this returns True,
        evicting least recently used blocks to make room; False when one block file is larger than the whole
        budget. A block already held is only marked used: under one key, one hash names one content. DiskFull when
        the disk has no room for it (nothing of it is left, the blocks evicted for it stay evicted)."""
        self._check_open()
        if not 1 <= len(block_hash) <= MAX_HASH:
            raise ValueError(f"a block hash is 1 to {MAX_HASH} bytes, got {len(block_hash)}")
        if data.dtype != torch.uint8 or data.device.type != "cpu" or data.numel() != self.block_nbytes:
            raise ValueError(
                f"a KV block is {self.block_nbytes} uint8 bytes on the CPU, got {data.dtype} "
                f"{tuple(data.shape)} on {data.device}"
            )
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        if self.file_nbytes > self.capacity:
            return False
        while self.used + self.file_nbytes > self.capacity:
            self._evict_one()
        path = self._path(block_hash)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            self._write_block(tmp, block_hash, data)
            os.replace(tmp, path)
            fsync_dir(self.folder)
        except OSError as exc:
            for written in (tmp, path):
                with contextlib.suppress(OSError):
                    written.unlink()
            raise write_error(exc, str(self.folder), "writing a KV cache block") from None
        self._lru[block_hash] = None
        self.used += self.file_nbytes
        self.peak = max(self.peak, self.used)
        self.bytes_written += self.file_nbytes
        return True

    def discard(self, block_hash: bytes) -> None:
        """Delete the block if held."""
        self._check_open()
        if block_hash in self._lru:
            self._remove(block_hash)

    def flush(self) -> None:
        """Write the manifest (the recency order) under its name atomically and durably."""
        self._check_open()
        manifest = {"format": FORMAT, "key": self.key, "block_nbytes": self.block_nbytes}
        manifest["lru"] = [block_hash.hex() for block_hash in self._lru]
        tmp = self.folder / f".{MANIFEST}.tmp"
        try:
            tmp.unlink(missing_ok=True)
            write_bytes(tmp, json.dumps(manifest).encode())
            os.replace(tmp, self.folder / MANIFEST)
            fsync_dir(self.folder)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise write_error(exc, str(self.folder), "writing the KV cache manifest") from None

    def close(self) -> None:
        """Flush, then close the backend's files and let go of the folder. Closing twice is harmless."""
        if self._lock_fd is None:
            return
        try:
            self.flush()
        finally:
            self._release()

    def __enter__(self) -> KVDiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_integrity(self) -> None:
        """The index matches the folder's block files of this key, and the budget holds (lists the folder)."""
        assert self.used == len(self._lru) * self.file_nbytes, "used does not match the blocks held"
        assert self.used <= self.capacity and self.used <= self.peak, "over budget, or above the recorded peak"
        on_disk = {m[1] for m in map(BLOCK_NAME.fullmatch, os.listdir(self.folder)) if m and m[2] == self._tag}
        assert on_disk == {block_hash.hex() for block_hash in self._lru}, "the index and the block files differ"

    # ---- open ------------------------------------------------------------------------------------------------

    def _lock(self) -> int:
        try:
            make_dirs(self.folder)
            fd = try_lock(self.folder)
        except OSError as exc:
            raise OffloadError(f"{self.folder}: {os_error_reason(exc)} (opening the KV cache folder)") from None
        if fd is None:
            raise OffloadError(f"{self.folder}: another engine is using this KV cache folder")
        return fd

    def _load(self) -> None:
        """Index this key's block files, in the manifest's recency order; delete unfinished writes, other keys'
        files and files of the wrong size. Reads no block."""
        found: dict[bytes, int] = {}  # hash -> mtime, ns
        bad: set[bytes] = set()
        try:
            for entry in list(os.scandir(self.folder)):
                name = entry.name
                if not entry.is_file(follow_symlinks=False):
                    continue
                if name.startswith(".") and name.endswith(".tmp"):  # we hold the lock: a killed writer's
                    os.unlink(entry.path)
                    if BLOCK_NAME.fullmatch(name[1:-4]):
                        self.dropped_corrupt += 1
                    continue
                match = BLOCK_NAME.fullmatch(name)
                if match is None:
                    continue  # the manifest, or not the store's
                if match[2] != self._tag:
                    os.unlink(entry.path)
                    self.dropped_foreign += 1
                    continue
                st = entry.stat(follow_symlinks=False)
                if st.st_size != self.file_nbytes:
                    os.unlink(entry.path)
                    bad.add(bytes.fromhex(match[1]))
                    continue
                found[bytes.fromhex(match[1])] = st.st_mtime_ns
        except OSError as exc:
            raise OffloadError(f"{self.folder}: {os_error_reason(exc)} (opening the KV cache folder)") from None
        listed = dict.fromkeys(self._read_manifest())
        bad.update(h for h in listed if h not in found)  # deleted since the last flush
        self.dropped_corrupt += len(bad)
        unlisted = sorted((h for h in found if h not in listed), key=found.__getitem__)
        self._lru = OrderedDict.fromkeys([*(h for h in listed if h in found), *unlisted])
        self.used = len(self._lru) * self.file_nbytes

    def _read_manifest(self) -> list[bytes]:
        """The recency order saved under this key, least recent first; [] when the manifest is missing, does not
        parse, or was written under another key, payload size or FORMAT."""
        try:
            manifest = json.loads((self.folder / MANIFEST).read_bytes())
            if (manifest["format"], manifest["key"], manifest["block_nbytes"]) != (FORMAT, self.key, self.block_nbytes):
                return []
            return [bytes.fromhex(h) for h in manifest["lru"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    # ---- blocks ----------------------------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}.{self._tag}.kv"

    def _header(self, block_hash: bytes, crc: int) -> bytes:
        return HEADER.pack(MAGIC, self._digest, len(block_hash), block_hash, self.block_nbytes, crc)

    def _write_block(self, path: Path, block_hash: bytes, data: torch.Tensor) -> None:
        """Write the block file to `path`, fsynced."""
        payload = memoryview(data.detach().reshape(-1).contiguous().numpy())
        padding = self.file_nbytes - ALIGN - self.block_nbytes
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            crc = pwrite_all(fd, payload, ALIGN, 0)
            pwrite_all(fd, memoryview(self._header(block_hash, crc).ljust(ALIGN, b"\0")), 0, 0)
            pwrite_all(fd, memoryview(bytes(padding)), ALIGN + self.block_nbytes, 0)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read back with O_DIRECT: keep it out of the page cache
        finally:
            os.close(fd)

    def _submit(self, block_hash: bytes) -> ReadRequest | None:
        """Start reading the whole block file; None when it is missing or not whole."""
        buf = aligned_buffer(self.file_nbytes)
        self._open.add(block_hash)
        try:
            return self._backend.submit(self._path(block_hash), 0, self.file_nbytes, buf)
        except OffloadError:
            return None

    def _wait(self, request: ReadRequest | None) -> torch.Tensor | None:
        if request is None:
            return None
        try:
            raw = request.wait()
        except OffloadError:  # unreadable, or changed under us
            return None
        self.bytes_read += self.file_nbytes
        return raw

    def _intact(self, block_hash: bytes, raw: torch.Tensor) -> bool:
        """Whether `raw` (a whole block file) is block `block_hash` under this key, with its payload's CRC-32."""
        crc = zlib.crc32(raw[ALIGN : ALIGN + self.block_nbytes].numpy())
        return raw[: HEADER.size].numpy().tobytes() == self._header(block_hash, crc)

    def _evict_one(self) -> None:
        self._remove(next(iter(self._lru)))
        self.evicted += 1

    def _remove(self, block_hash: bytes) -> None:
        """Delete the block's file, then forget it (a file that could not be deleted would still take space)."""
        if block_hash in self._open:
            self._close_files()
        try:
            self._path(block_hash).unlink(missing_ok=True)
        except OSError as exc:
            raise OffloadError(f"{self.folder}: {os_error_reason(exc)} (deleting a KV cache block)") from None
        del self._lru[block_hash]
        self.used -= self.file_nbytes

    def _close_files(self) -> None:
        self._backend.close()
        self._open.clear()

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise ValueError(f"KVDiskStore({self.folder}) used after close()")

    def _release(self) -> None:
        self._close_files()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
