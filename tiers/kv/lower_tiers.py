"""The KV pool below the device: host RAM and local disk.

    device  KVCache (tiers/kv/kv_cache.py): blocks of sequences admitted there, cached prefix blocks while room lasts
      │ ▲   evicted cached blocks go down (demote); a prefix found below comes back into fresh blocks (promote);
      │     a running sequence that cannot grow on the device moves down whole (its blocks copied, then freed),
      │     and back up once the device part has room for it again
    host    a second KVCache in host RAM under --kv-host-memory, with its own BlockPool: the blocks of sequences whose
      │ ▲   KV lives there (admitted when the device part was full, or moved down), attended where they are, and
      │     cached prefix blocks, least recently used evicted first, to disk
    disk    KVDiskStore (tiers/kv/disk_store.py) in --offload-dir under --kv-disk-memory: checksummed block files that
            persist, so a restarted engine starts warm; computed blocks are written through by a background thread

A block moves as one row of bytes, whatever the cache's format (KVCache.read_blocks / write_blocks), so a quantized
cache moves its quantized bytes. Host and disk copies of cached blocks are inclusive: a promoted block keeps its
copy below, and a block demoted again finds it there and moves nothing.

All moves happen at the step boundary, in `settle`, which replays the event logs of both pools (tiers/kv/blocks.py,
events in tiers/kv/events.py) in order, the host part's first: every row it copies is read before any row is
written, so an evicted or moved block's bytes are still its own. `count` and `fetch` answer the device part's
admissions (`LowerTiers`), `below_host` the host part's (the disk only); fetched payloads are verified copies.

Reading a block back is not always cheaper than computing it again: host RAM always is (a copy), the disk is when
a block's bytes read faster than its tokens prefill; a running sequence moves down rather than being preempted when
copying its blocks is faster than prefilling its tokens again. The tiers only measure: their counters give the
seconds per block read from disk or moved down (`KVTierCounters.seconds_per_block_read`, `seconds_per_block_moved`);
the scheduler prices them against the core's measured prefill rate (scheduler/kv_prices.py) and says whether an
admission may count blocks only the disk holds (`count(keys, disk=...)`) and whether to read ahead.

Disk reads need not wait for admission. After planning a step, the scheduler names the cached blocks the next
waiting sequences will ask for (`prefetch`); a reader thread reads and verifies those only the disk holds while the
step computes, and at the next step boundary, before admissions (`land`), they become cached blocks in host RAM
or, without a host part, in the device part (evicting the least recent cached blocks there, as a promotion does).
An admission then finds them above the disk and copies instead of reading. What is read ahead is bounded by the
room it lands in (PREFETCH_SHARE of the blocks no sequence holds there); a block that finds no room when it lands,
or is already there, is dropped (`prefetch_dropped`).

A full disk is a fault the cache survives: the disk part's writes turn off for the rest of the run (`disk_off` says
why), the blocks it holds still read back (tiers/kv/disk_threads.py's WriteThrough). Any other failure of a write is
raised once, at the next step boundary or flush.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from offload.tiers.kv.blocks import BlockPool
from offload.tiers.kv.disk_threads import ReadAhead, WriteThrough
from offload.tiers.kv.events import Computed, Evicted, MovedDown, MovedUp, Promoted
from offload.tiers.kv.kv_cache import KVCache
from offload.tiers.memory import MemoryTier

WRITE_QUEUE = 256  # blocks waiting for the disk writer; a block that finds the queue full is not written through
PREFETCH_SHARE = 0.5  # of the blocks a read-ahead may land in: those no sequence holds


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
    moved_blocks: int = 0  # blocks of running sequences copied device -> host (moved down instead of preempted)
    move_seconds: float = 0.0  # spent copying them
    prefetched: int = 0  # blocks read from disk ahead of admission and placed above it (in promoted_disk too)
    prefetch_dropped: int = 0  # blocks read ahead that found no room when they landed, or were already above

    @property
    def seconds_per_block_moved(self) -> float | None:
        """What copying a running sequence's block down has cost so far, on average; None until one was timed."""
        return self.move_seconds / self.moved_blocks if self.moved_blocks and self.move_seconds > 0 else None

    @property
    def seconds_per_block_read(self) -> float | None:
        """What reading a block back from disk has cost so far, on average; None until one was timed."""
        return self.disk_seconds / self.promoted_disk if self.promoted_disk and self.disk_seconds > 0 else None


class _DiskOnly:
    """The lower tier of the host part's own tables: the disk."""

    def __init__(self, tiers: KVTiers) -> None:
        self.tiers = tiers

    def count(self, keys: Sequence[bytes], disk: bool = True) -> int:
        if not disk:
            return 0
        return sum(1 for _ in itertools.takewhile(self.tiers._on_disk, keys))

    def fetch(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        return self.tiers.fetch(keys, disk_only=True)

    @property
    def reads_ahead(self) -> bool:
        return self.tiers.reads_ahead

    def prefetch(self, keys: Sequence[bytes], pool: BlockPool) -> None:
        self.tiers.prefetch(keys, pool)

    def land(self, pool: BlockPool) -> None:
        self.tiers.land(pool)


class KVTiers:
    """The host and disk parts of the KV pool; either may be absent (no host cache / no store)."""

    def __init__(
        self, kv: KVCache, host_kv: KVCache | None, host: MemoryTier | None, disk=None, prefetch: bool = True
    ) -> None:
        """`host_kv`: the host part, a KVCache in host RAM of `kv`'s format (None: no host part), charged to `host`
        (the --kv-host-memory budget). `disk`: a KVDiskStore or None. `prefetch`: read the disk blocks the
        scheduler names ahead of admission (else only when an admission asks)."""
        self.kv = kv
        self.disk = disk
        self.row_bytes = kv.bytes_per_block
        self.counters = KVTierCounters()
        self.host = host
        self.host_kv = host_kv
        if host_kv is not None and (host is None or not host.adopt(host_kv.storage)):
            raise ValueError(f"the host KV cache ({host_kv.nbytes} bytes) does not fit its budget")
        self.host_slots = 0 if host_kv is None else host_kv.num_blocks  # blocks host RAM holds
        # the host part's blocks: cached prefix blocks (keyed, unheld, least recent evicted first, to disk) and the
        # blocks of sequences whose KV lives in host RAM
        self.host_pool = BlockPool(self.host_slots, record=True)
        self.below_host = _DiskOnly(self)  # what the host part's own tables fetch from
        self._disk_lock = threading.Lock()  # the store is used by the scheduler's thread and the writer
        self._writer: WriteThrough | None = None
        self._ahead: ReadAhead | None = None
        if disk is not None:
            self._writer = WriteThrough(disk, self._disk_lock, WRITE_QUEUE, self._written)
            if prefetch:
                self._ahead = ReadAhead(disk, self._disk_lock)

    @property
    def disk_off(self) -> str | None:
        """Why the disk part takes no more blocks (None: it does, or there is none)."""
        return None if self._writer is None else self._writer.off

    @property
    def host_blocks(self) -> int:
        """Blocks of the host part in use: cached prefix blocks and those of host-resident sequences."""
        return self.host_slots - self.host_pool.num_empty

    # ---- LowerTiers: what the device part's admissions ask ----------------------------------------------

    def count(self, keys: Sequence[bytes], disk: bool = True) -> int:
        n = 0
        for key in keys:
            if not self.host_pool.lookup([key]) and not (disk and self._on_disk(key)):
                break
            n += 1
        return n

    def fetch(self, keys: Sequence[bytes], disk_only: bool = False) -> list[torch.Tensor]:
        """Copies of the rows of the longest run of `keys` held below; a disk block that fails its check ends the
        run (the store drops it, and the caller computes from there). Consecutive disk blocks are read together."""
        rows: list[torch.Tensor] = []
        i = 0
        while i < len(keys):
            held = [] if disk_only else self.host_pool.lookup(keys[i : i + 1])
            if held:
                self._touch(held)
                rows.append(self.host_kv.read_blocks(held)[0])
                self.counters.promoted_host += 1
                i += 1
                continue
            run = list(
                itertools.takewhile(
                    lambda k: (disk_only or not self.host_pool.lookup([k])) and self._on_disk(k), keys[i:]
                )
            )
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

    def _touch(self, blocks: list[int]) -> None:
        """Mark cached host blocks as just used (held ones are in use anyway)."""
        self.host_pool.share(blocks)
        self.host_pool.free(blocks)

    def _on_disk(self, key: bytes) -> bool:
        """A membership test only (a dict lookup, atomic under the GIL): no lock, so admissions never wait on a
        write-through's fsync. A block evicted meanwhile fails its read in `fetch`, which ends the run."""
        return self.disk is not None and key in self.disk

    # ---- read-ahead ---------------------------------------------------------------------------------------

    @property
    def reads_ahead(self) -> bool:
        """Whether `prefetch` reads anything (a disk part, read-ahead on)."""
        return self._ahead is not None

    def prefetch(self, keys: Sequence[bytes], pool: BlockPool) -> None:
        """Start reading, in the background, the blocks of `keys` (in the order an admission asks for them) that
        only the disk holds, up to the first it lacks and as many as their landing room allows: the blocks no
        sequence holds in the host part, else in `pool` (the device part). Whether reading them pays is the
        caller's to say (it asks only where it does)."""
        if self._ahead is None:
            return
        room = (self.host_pool if self.host_kv is not None else pool).num_free
        budget = int(room * PREFETCH_SHARE) - self._ahead.outstanding
        wanted = []
        for key in keys:
            if len(wanted) >= budget:
                break
            if self._ahead.asked(key) or self.host_pool.lookup([key]) or pool.lookup([key]):
                continue
            if not self._on_disk(key):
                break  # an admission takes a run of blocks from the first: none past a missing one
            wanted.append(key)
        if wanted:
            self._ahead.ask(wanted)

    def land(self, pool: BlockPool) -> None:
        """Place the blocks read ahead so far as cached blocks above the disk, before this step's admissions, each
        evicting the least recent cached block there if need be: in the host part (written now, after the host
        part's pending events are carried out, so none of them reads a block this reuses), else in `pool` (the
        device part; written before the next step, event Promoted, after what it evicted is handed down)."""
        if self._ahead is None:
            return
        rows, seconds = self._ahead.take()
        if not rows:
            return
        c = self.counters
        c.disk_seconds += seconds
        if self.host_kv is not None:
            self._replay(self.host_pool, self.host_kv, self._evict_host)
        for key, row in rows.items():
            if self.host_pool.lookup([key]) or pool.lookup([key]):
                c.prefetch_dropped += 1
                continue
            if self.host_kv is not None:
                placed = self._place_host(key, row)
            elif placed := pool.num_free > 0:
                block = pool.allocate(1)  # evicting the least recent cached block, handed down at the step boundary
                pool.register_promoted(block[0], key, row)
                pool.free(block)
                c.bytes_up += self.row_bytes
            if not placed:
                c.prefetch_dropped += 1
                continue
            c.prefetched += 1
            c.promoted_disk += 1

    # ---- the step boundary ----------------------------------------------------------------------------

    def settle(self, pool: BlockPool) -> None:
        """Carry out what the device part's pool and the host part's logged since the last call, before the next
        step reads or writes either cache."""
        if self._writer is not None:
            self._writer.raise_failure()
        # a running sequence's blocks moved back up (MovedUp, in the device part's log): read before the host part's
        # replay writes into its freed blocks
        up = [e for e in pool.events if isinstance(e, MovedUp)]
        rows = {}
        if up:
            rows = dict(zip((e.block for e in up), self.host_kv.read_blocks([e.source for e in up]), strict=True))
        if self.host_kv is not None:
            self._replay(self.host_pool, self.host_kv, self._evict_host)
        self._replay(pool, self.kv, self._demote, rows)

    def _replay(self, pool: BlockPool, kv: KVCache, evicted, up: dict[int, torch.Tensor] | None = None) -> None:
        events = pool.take_events()
        if not events:
            return
        overlay: dict[int, torch.Tensor] = {}  # block -> the row a promotion or move puts there (written last)
        down: list[tuple[Evicted | Computed, int | torch.Tensor]] = []  # (event, its block, or the row put there)
        # a running sequence's blocks moved down (MovedDown, in the host part's log): read before any write
        moved = [e for e in events if isinstance(e, MovedDown)]
        rows = {}
        start = time.perf_counter()
        if moved:
            rows = dict(zip((e.block for e in moved), self.kv.read_blocks([e.source for e in moved]), strict=True))
        read_seconds = time.perf_counter() - start
        for event in events:
            match event:
                case Promoted(block=block, payload=row):
                    overlay[block] = row
                case MovedDown(block=block):
                    overlay[block] = rows[block]
                    self.counters.bytes_down += self.row_bytes
                case MovedUp(block=block):
                    overlay[block] = up[block]
                    self.counters.bytes_up += self.row_bytes
                case Evicted(block=block):
                    down.append((event, overlay.pop(block, block)))
                case Computed(block=block) if self.disk is not None:  # written through to disk
                    down.append((event, overlay.get(block, block)))
        blocks = sorted({src for _, src in down if isinstance(src, int)})
        read = dict(zip(blocks, kv.read_blocks(blocks), strict=True)) if blocks else {}
        for event, src in down:
            row = read[src] if isinstance(src, int) else src
            if isinstance(event, Evicted):
                evicted(event.key, row)
            else:
                self._write_through(event.key, row)
        if overlay:
            start = time.perf_counter()
            kv.write_blocks(list(overlay), torch.stack(list(overlay.values())))
            if moved:  # the copy's price: its reads, and its share of the writes
                write_seconds = (time.perf_counter() - start) * len(moved) / len(overlay)
                self.counters.move_seconds += read_seconds + write_seconds
                self.counters.moved_blocks += len(moved)

    def _evict_host(self, key: bytes, row: torch.Tensor) -> None:
        if not self._to_disk(key, row):
            self.counters.dropped += 1

    def clear_host(self) -> None:
        """Forget the prefix blocks cached in host RAM and those read ahead (the disk keeps its own)."""
        self.host_pool.drop_cached()
        if self._ahead is not None:
            self._ahead.clear()

    def _demote(self, key: bytes, row: torch.Tensor) -> None:
        """An evicted device block: into host RAM (evicting the least recent cached block there, to disk), else
        to disk, else dropped."""
        held = self.host_pool.lookup([key])
        if held:
            self._touch(held)
        elif self._place_host(key, row):
            self.counters.demoted_host += 1
            self.counters.bytes_down += self.row_bytes
        else:  # no host part, or every host block is held by a host-resident sequence
            self._evict_host(key, row)

    def _place_host(self, key: bytes, row: torch.Tensor) -> bool:
        """Write `row` into a host block cached under `key`, evicting the least recent cached block there (its
        bytes to disk first); False when there is no host part or every host block is held. The host part's
        event log must be empty (carried out)."""
        block = self.host_pool.allocate(1) if self.host_kv is not None else None
        if block is None:
            return False
        for event in self.host_pool.take_events():  # the cached block this allocation evicted: its bytes go first
            match event:
                case Evicted(key=evicted_key, block=evicted):
                    self._evict_host(evicted_key, self.host_kv.read_blocks([evicted])[0])
        self.host_kv.write_blocks(block, row[None])
        self.host_pool.register(block[0], key)
        self.host_pool.free(block)
        return True

    def _to_disk(self, key: bytes, row: torch.Tensor) -> bool:
        """Synchronously, for a block about to leave the host: True if the disk holds it afterwards."""
        return self._writer is not None and self._writer.put(key, row)

    def _written(self) -> None:
        """A block stored on disk (on the writer's thread, or the scheduler's)."""
        self.counters.demoted_disk += 1
        self.counters.bytes_down += self.row_bytes

    def _write_through(self, key: bytes, row: torch.Tensor) -> None:
        if self._writer.off is None and not self._writer.offer(key, row):
            self.counters.writes_skipped += 1

    def flush(self) -> None:
        """Wait for the write-through queue to drain and make the disk store's index durable."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Stop the reader, drain the writer, close the disk store and give the host slab back."""
        if self._ahead is not None:
            self._ahead.close()
        if self._writer is not None:
            self._writer.close()  # and the disk store; closing twice is harmless
        if self.host_kv is not None and self.host is not None and self.host.used:
            self.host.free(self.host_kv.storage)
