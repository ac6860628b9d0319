"""The KV pool below the device (tiers/kv/lower_tiers.py, tiers/kv/disk_threads.py). Read-ahead: what is read lands
byte-identical above the disk, within its room, stops at the first block the disk lacks, skips bad blocks, and never
lets a pending write-through read a block the landing reused. Moves: a running sequence's blocks copied down or up
land byte-identical, and the copies down are timed (the scheduler prices them, scheduler/kv_prices.py). Disk blocks
count for an admission only where the caller lets them."""

from __future__ import annotations

import hashlib

import torch

from offload.tiers.kv.blocks import BlockPool, BlockTables
from offload.tiers.kv.disk_store import KVDiskStore
from offload.tiers.kv.kv_cache import KVCache
from offload.tiers.kv.lower_tiers import KVTiers
from offload.tiers.memory import MemoryTier

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8


def cache(blocks: int) -> KVCache:
    return KVCache(LAYERS, blocks, BLOCK, HEADS, DIM, torch.float32, torch.device("cpu"))


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def row(kv: KVCache, i: int) -> torch.Tensor:
    """Block i's bytes: distinct for every i."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (kv.bytes_per_block,), dtype=torch.uint8, generator=g)


def tiers_over(tmp_path, device_blocks: int, host_blocks: int = 0, on_disk: range = range(8)):
    kv = cache(device_blocks)
    disk = KVDiskStore(tmp_path / "kv", {"test": 1}, kv.bytes_per_block, 1 << 30)
    for i in on_disk:
        assert disk.put(key(i), row(kv, i))
    host = host_kv = None
    if host_blocks:
        host_kv = cache(host_blocks)
        host = MemoryTier("kv host", host_kv.nbytes, torch.device("cpu"))
    tiers = KVTiers(kv, host_kv, host, disk)
    return kv, tiers, BlockPool(device_blocks, record=True)


def test_blocks_read_ahead_land_in_the_devices_empty_blocks_byte_identical(tmp_path) -> None:
    kv, tiers, pool = tiers_over(tmp_path, device_blocks=16)
    keys = [key(i) for i in range(6)]
    tiers.prefetch(keys, pool)
    tiers._ahead.wait()
    tiers.land(pool)
    landed = pool.lookup(keys)
    assert len(landed) == 6 and pool.num_cached == 6  # cached: findable, held by no one
    tiers.settle(pool)  # the Promoted events write the rows before the next step
    for i, block in enumerate(landed):
        assert torch.equal(kv.read_blocks([block])[0], row(kv, i))
    c = tiers.counters
    assert c.prefetched == c.promoted_disk == 6 and c.bytes_up == 6 * kv.bytes_per_block and c.disk_seconds > 0
    tiers.close()


def test_what_is_read_ahead_is_bounded_by_its_room_and_stops_at_the_first_block_the_disk_lacks(tmp_path) -> None:
    kv, tiers, pool = tiers_over(tmp_path, device_blocks=8, on_disk=range(20))
    tiers.prefetch([key(i) for i in range(20)], pool)  # 8 empty blocks: half of them may be asked for
    tiers._ahead.wait()
    tiers.prefetch([key(i) for i in range(20)], pool)  # still unlanded: asks for nothing more
    tiers._ahead.wait()
    tiers.land(pool)
    assert pool.lookup([key(i) for i in range(20)]) == pool.lookup([key(i) for i in range(4)])
    assert pool.num_cached == 4
    kv2, tiers2, pool2 = tiers_over(tmp_path / "gap", device_blocks=64, on_disk=[0, 1, 3, 4])
    tiers2.prefetch([key(i) for i in range(5)], pool2)
    tiers2._ahead.wait()
    tiers2.land(pool2)
    assert pool2.num_cached == 2  # blocks 0 and 1: an admission could not use 3 and 4 past the missing 2
    tiers.close()
    tiers2.close()


def test_a_bad_block_read_ahead_is_dropped_and_asked_for_no_more(tmp_path) -> None:
    kv, tiers, pool = tiers_over(tmp_path, device_blocks=16)
    path = next((tmp_path / "kv").glob(f"{key(2).hex()}.*.kv"))
    data = bytearray(path.read_bytes())
    data[4096 + 3] ^= 0x10  # a bit of the payload
    path.write_bytes(bytes(data))
    tiers.prefetch([key(i) for i in range(4)], pool)
    tiers._ahead.wait()
    tiers.land(pool)
    assert [bool(pool.lookup([key(i)])) for i in range(4)] == [True, True, False, True]
    assert key(2) not in tiers.disk and tiers.disk.dropped_corrupt == 1
    assert tiers._ahead.outstanding == 0 and tiers.counters.prefetched == 3
    tiers.close()


def test_landing_in_host_ram_carries_out_pending_write_throughs_before_reusing_their_blocks(tmp_path) -> None:
    """Host blocks cached with a write-through still pending (Computed, logged after the last step): landing evicts
    them for the blocks read ahead, and the disk must still receive their own bytes, not the landed ones."""
    kv, tiers, pool = tiers_over(tmp_path, device_blocks=16, host_blocks=4, on_disk=range(4))
    host_kv, host_pool = tiers.host_kv, tiers.host_pool
    for i in range(10, 14):  # four computed blocks of a host-resident sequence, then released
        block = host_pool.allocate(1)
        host_kv.write_blocks(block, row(host_kv, i)[None])
        assert host_pool.register_computed(block[0], key(i))
        host_pool.free(block)
    tiers.prefetch([key(i) for i in range(4)], pool)  # 4 host blocks not held: 2 may be asked for
    tiers._ahead.wait()
    tiers.land(pool)
    tiers.flush()
    for i in (0, 1):  # landed in host RAM, found there by an admission (a copy, not a disk read)
        (block,) = host_pool.lookup([key(i)])
        assert torch.equal(host_kv.read_blocks([block])[0], row(kv, i))
    for i in range(10, 14):  # every evicted or still cached block's own bytes reached the disk
        assert torch.equal(tiers.disk.get(key(i)), row(kv, i))
    assert tiers.counters.prefetched == 2 and tiers.counters.demoted_host == 0
    got = tiers.fetch([key(0), key(1)])
    assert [torch.equal(g, row(kv, i)) for i, g in enumerate(got)] == [True, True]
    assert tiers.counters.promoted_host == 2
    tiers.close()


def test_moving_a_sequence_down_and_back_up_copies_its_blocks_and_times_the_copy_down(tmp_path) -> None:
    kv, tiers, pool = tiers_over(tmp_path, device_blocks=16, host_blocks=8, on_disk=range(0))
    device, host = BlockTables(pool, BLOCK), BlockTables(tiers.host_pool, BLOCK)
    assert tiers.counters.seconds_per_block_moved is None  # nothing timed yet
    src = list(device.grow(0, 3 * BLOCK))
    kv.write_blocks(src, torch.stack([row(kv, i) for i in range(3)]))
    dst = list(device.move_down(0, host))
    tiers.settle(pool)
    assert [torch.equal(tiers.host_kv.read_blocks([d])[0], row(kv, i)) for i, d in enumerate(dst)] == [True] * 3
    c = tiers.counters
    assert c.moved_blocks == 3 and c.move_seconds > 0 and c.bytes_down == 3 * kv.bytes_per_block
    assert c.seconds_per_block_moved == c.move_seconds / 3
    kv.write_blocks(src, torch.zeros(3, kv.bytes_per_block, dtype=torch.uint8))  # the device blocks are reused
    back = list(device.move_up(0, host))
    tiers.settle(pool)
    assert [torch.equal(kv.read_blocks([b])[0], row(kv, i)) for i, b in enumerate(back)] == [True] * 3
    assert c.moved_blocks == 3 and c.bytes_up == 3 * kv.bytes_per_block  # only copies down are timed
    tiers.close()


def test_blocks_only_the_disk_holds_count_only_where_the_caller_lets_them(tmp_path) -> None:
    kv, tiers, pool = tiers_over(tmp_path, device_blocks=16, host_blocks=8, on_disk=range(1, 4))
    host_pool = tiers.host_pool
    block = host_pool.allocate(1)  # block 0 cached in host RAM
    host_kv = tiers.host_kv
    host_kv.write_blocks(block, row(host_kv, 0)[None])
    host_pool.register(block[0], key(0))
    host_pool.free(block)
    keys = [key(i) for i in range(4)]
    assert tiers.count(keys) == 4 and tiers.count(keys, disk=False) == 1
    assert tiers.below_host.count(keys[1:]) == 3 and tiers.below_host.count(keys[1:], disk=False) == 0
    assert tiers.counters.seconds_per_block_read is None
    assert len(tiers.fetch(keys)) == 4
    c = tiers.counters
    assert c.promoted_host == 1 and c.promoted_disk == 3 and c.seconds_per_block_read == c.disk_seconds / 3
    tiers.close()
