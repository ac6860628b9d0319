"""The KV pool below the device: host RAM and local disk keep the prefix blocks the device part let go.

    device  KVCache (tiers/kv.py): every block a sequence holds, and cached prefix blocks while there is room
      │ ▲   evicted cached blocks go down (demote); a prefix found below comes back into fresh blocks (promote)
    host    a slab of block rows under --kv-host-memory, least recently used evicted first, to disk
      │ ▲
    disk    KVDiskStore (tiers/kv_store.py) in --offload-dir under --kv-disk-memory: checksummed block files that
            persist, so a restarted engine starts warm; computed blocks are written through by a background thread

A block moves as one row of bytes, whatever the cache's format (KVCache.read_blocks / write_blocks), so a quantized
cache moves its quantized bytes. Host and disk are inclusive: a promoted block keeps its copy below, and a block
demoted again finds it there and moves nothing.

All moves happen at the step boundary, in `settle`, which replays the pool's event log (tiers/blocks.py) in order:
every device row it copies down is read before any row is written, so an evicted block's bytes are still its key's.
`count` and `fetch` answer the pool's admissions (`LowerTiers`); fetched payloads are verified copies.

Reading a block back is not always cheaper than computing it again: host RAM always is (a copy), the disk is when
a block's bytes read faster than its tokens prefill. Both rates are measured as the engine runs (`disk_seconds`
per block read here, `prefill_rate` from the core's prefill steps); until both are known, the disk is read.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiers.blocks import BlockPool
from tiers.kv import KVCache
from tiers.memory import MemoryTier

WRITE_QUEUE = 256  # blocks waiting for the disk writer; a block that finds the queue full is not written through


@dataclass(slots=True)
class KVTierCounters:
    """Blocks and bytes moved between the KV tiers over the pool's life."""

    demoted_host: int = 0  # blocks copied device -> host
    demoted_disk: int = 0  # blocks written to disk (write-through and host evictions)
    dropped: int = 0  # evicted blocks no lower tier kept
    promoted_host: int = 0  # blocks copied host -> device
    promoted_disk: int = 0  # blocks read disk -> device
    bytes_down: int = 0
    bytes_up: int = 0
    writes_skipped: int = 0  # write-through blocks dropped because the disk writer was behind
    disk_seconds: float = 0.0  # spent reading blocks back from disk
    recomputed_not_read: int = 0  # admissions that left disk blocks unread: recomputing them was predicted cheaper


class KVTiers:
    """The host and disk parts of the KV pool; either may be absent (capacity 0 / no store)."""

    def __init__(self, kv: KVCache, host: MemoryTier | None, disk=None) -> None:
        """`host`: the KV host budget (a MemoryTier; None or capacity 0: no host part). `disk`: a KVDiskStore or
        None. The slab for the host part is taken from `host` now, whole."""
        self.kv = kv
        self.disk = disk
        self.row_bytes = kv.bytes_per_block
        self.counters = KVTierCounters()
        slots = 0 if host is None or not host.capacity else host.capacity // self.row_bytes
        while slots and not host.can_allocate(host.footprint(slots * self.row_bytes)):
            slots -= 1  # alignment padding
        self.host = host
        self.prefill_rate: float | None = None  # prefill tokens per second, as the core measures them
        self.host_slots = slots  # blocks host RAM holds
        self._slab = host.allocate(slots * self.row_bytes) if slots else None
        self._rows = self._slab[: slots * self.row_bytes].view(slots, self.row_bytes) if slots else None
        self._host: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._free_slots = list(range(slots))[::-1]
        self._disk_lock = threading.Lock()  # the store is used by the scheduler's thread and the writer
        self._writes: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        if disk is not None:
            self._writes = queue.Queue(WRITE_QUEUE)
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
            self._writer.start()

    @property
    def host_blocks(self) -> int:
        return len(self._host)

    # ---- LowerTiers: what admissions ask ------------------------------------------------------------

    def count(self, keys: Sequence[bytes]) -> int:
        n, disk_pays = 0, self.disk_pays()
        for key in keys:
            if key not in self._host and not (disk_pays and self._on_disk(key)):
                if not disk_pays and self._on_disk(key):
                    self.counters.recomputed_not_read += 1
                break
            n += 1
        return n

    def disk_pays(self) -> bool:
        """Whether reading a block from disk is predicted faster than prefilling its tokens (True until both rates
        are measured)."""
        c = self.counters
        if self.prefill_rate is None or not c.promoted_disk or c.disk_seconds <= 0:
            return True
        read = c.disk_seconds / c.promoted_disk  # seconds per block
        return read < self.kv.block_size / self.prefill_rate

    def fetch(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """Copies of the rows of the longest run of `keys` held below; a disk block that fails its check ends the
        run (the store drops it, and the caller computes from there). Consecutive disk blocks are read together."""
        rows: list[torch.Tensor] = []
        i = 0
        while i < len(keys):
            slot = self._host.get(keys[i])
            if slot is not None:
                self._host.move_to_end(keys[i])
                rows.append(self._rows[slot].clone())
                self.counters.promoted_host += 1
                i += 1
                continue
            run = list(itertools.takewhile(lambda k: k not in self._host and self._on_disk(k), keys[i:]))
            if not run:
                break
            start = time.perf_counter()
            with self._disk_lock:
                got = self.disk.get_many(run)
            self.counters.disk_seconds += time.perf_counter() - start
            good = list(itertools.takewhile(lambda row: row is not None, got))
            rows.extend(good)
            self.counters.promoted_disk += len(good)
            if len(good) < len(run):
                break
            i += len(run)
        self.counters.bytes_up += len(rows) * self.row_bytes
        return rows

    def _on_disk(self, key: bytes) -> bool:
        """A membership test only (a dict lookup, atomic under the GIL): no lock, so admissions never wait on a
        write-through's fsync. A block evicted meanwhile fails its read in `fetch`, which ends the run."""
        return self.disk is not None and key in self.disk

    # ---- the step boundary ----------------------------------------------------------------------------

    def settle(self, pool: BlockPool) -> None:
        """Carry out what the pool logged since the last call, before the next step reads or writes the cache."""
        events, pool.events = pool.events, []
        if not events:
            return
        overlay: dict[int, torch.Tensor] = {}  # block -> the row a promotion puts there (written last)
        down: list[tuple[bytes, int | torch.Tensor, str]] = []  # (key, device block or row, "evict" | "done")
        for event in events:
            kind, key, block = event[:3]
            if kind == "promote":
                overlay[block] = event[3]
            elif kind == "evict":
                down.append((key, overlay.pop(block, block), kind))
            elif self.disk is not None:  # "done": write through to disk
                down.append((key, overlay.get(block, block), kind))
        blocks = sorted({src for _, src, _ in down if isinstance(src, int)})
        read = dict(zip(blocks, self.kv.read_blocks(blocks), strict=True)) if blocks else {}
        for key, src, kind in down:
            row = read[src] if isinstance(src, int) else src
            if kind == "evict":
                self._demote(key, row)
            else:
                self._write_through(key, row)
        if overlay:
            self.kv.write_blocks(list(overlay), torch.stack(list(overlay.values())))

    def clear_host(self) -> None:
        """Forget the blocks kept in host RAM (the disk keeps its own)."""
        self._free_slots.extend(self._host.values())
        self._host.clear()

    def _demote(self, key: bytes, row: torch.Tensor) -> None:
        """An evicted device block: into host RAM (evicting the least recent there, to disk), else to disk, else
        dropped."""
        if key in self._host:
            self._host.move_to_end(key)
            return
        if self._rows is None:
            if not self._to_disk(key, row):
                self.counters.dropped += 1
            return
        if not self._free_slots:
            old_key, slot = self._host.popitem(last=False)
            if not self._to_disk(old_key, self._rows[slot]):
                self.counters.dropped += 1
            self._free_slots.append(slot)
        slot = self._free_slots.pop()
        self._rows[slot].copy_(row)
        self._host[key] = slot
        self.counters.demoted_host += 1
        self.counters.bytes_down += self.row_bytes

    def _to_disk(self, key: bytes, row: torch.Tensor) -> bool:
        """Synchronously, for a block about to leave the host: True if the disk holds it afterwards."""
        if self.disk is None:
            return False
        with self._disk_lock:
            if key in self.disk:
                return True
            kept = self.disk.put(key, row)
        if kept:
            self.counters.demoted_disk += 1
            self.counters.bytes_down += self.row_bytes
        return kept

    def _write_through(self, key: bytes, row: torch.Tensor) -> None:
        try:
            self._writes.put_nowait((key, row))
        except queue.Full:
            self.counters.writes_skipped += 1

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            try:
                self._to_disk(*item)
            finally:
                self._writes.task_done()
        self._writes.task_done()

    def flush(self) -> None:
        """Wait for the write-through queue to drain and make the disk store's index durable."""
        if self._writes is not None:
            self._writes.join()
            with self._disk_lock:
                self.disk.flush()

    def close(self) -> None:
        """Drain the writer, close the disk store and give the host slab back."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None
            with self._disk_lock:
                self.disk.close()
        if self._slab is not None:
            self.host.free(self._slab)
            self._slab = self._rows = None
