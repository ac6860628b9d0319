"""Prefix reuse in the block pool and tables: hash chains, copy-free sharing, reference counts, LRU eviction of
cached blocks, the event log the lower tiers replay, and lookups through a lower tier."""

from __future__ import annotations

import random

import pytest

from offload.tiers.kv.blocks import BlockPool, BlockTables
from offload.tiers.kv.events import Computed, Evicted, MovedDown, MovedUp, Promoted
from offload.tiers.kv.prefix import chain_root, extend_chain

ROOT = chain_root({"model": "test"})


def tables_with(num_blocks: int, block_size: int = 4, lower=None) -> BlockTables:
    return BlockTables(BlockPool(num_blocks, record=lower is not None), block_size, ROOT, lower)


def compute(tables: BlockTables, seq_id: int, tokens: list[int], budget: int = 1000) -> tuple[list[int], int]:
    """Admit `tokens` and pretend the step computed the first chunk; returns (table, cached tokens at admission)."""
    table, hit, end = tables.admit(seq_id, tokens, budget)
    tables.commit(seq_id, tokens, end)
    return table, hit


# --- the chain ---------------------------------------------------------------------------------------


def test_chain_keys_name_the_whole_prefix() -> None:
    a = extend_chain([], ROOT, list(range(12)), 4)
    b = extend_chain([], ROOT, [*range(4), 99, *range(5, 12)], 4)
    assert len(a) == 3
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # block 2's tokens are equal, its prefix is not
    assert extend_chain(a[:1], ROOT, list(range(12)), 4) == a  # extends incrementally to the same keys
    assert extend_chain([], chain_root({"model": "other"}), list(range(12)), 4)[0] != a[0]
    assert extend_chain([], ROOT, list(range(11)), 4) == a[:2]  # a partial block has no key


# --- sharing -----------------------------------------------------------------------------------------


def test_a_second_sequence_shares_the_full_blocks_of_the_prefix() -> None:
    tables = tables_with(10)
    first, hit = compute(tables, 0, list(range(10)))  # blocks 0, 1 full; 2 partial
    assert hit == 0 and first == [0, 1, 2]
    second, hit = compute(tables, 1, [*range(8), 50, 51])
    assert hit == 8 and second[:2] == [0, 1] and second[2] not in first
    assert tables.pool.refs(0) == tables.pool.refs(1) == 2
    assert tables.counters.hit_tokens == 8 and tables.counters.lookup_tokens == 20
    tables.check_integrity()


def test_the_last_token_is_always_computed() -> None:
    tables = tables_with(10)
    compute(tables, 0, list(range(8)))  # exactly two full blocks
    assert tables.cached_prefix(1, list(range(8))) == 4  # the second block holds the last token: recomputed
    table, hit, end = tables.admit(1, list(range(8)), 1000)
    assert (hit, end) == (4, 8) and table[0] == 0 and table[1] != 1
    tables.commit(1, list(range(8)), 8)  # its own copy of block 1 stays unkeyed: block 1 keeps the key
    tables.free(1)
    assert tables.pool.lookup(extend_chain([], ROOT, list(range(8)), 4)) == [0, 1]
    tables.check_integrity()


def test_a_shared_block_is_never_freed_while_held() -> None:
    tables = tables_with(4)
    compute(tables, 0, list(range(9)))  # 3 blocks
    compute(tables, 1, [*range(8), 7])  # shares blocks 0, 1; one fresh block
    tables.free(0)
    assert tables.pool.refs(0) == tables.pool.refs(1) == 1  # still held by sequence 1
    assert tables.pool.num_free == 1  # only block 2 (partial, unkeyed): 0 and 1 cannot be evicted
    assert tables.pool.allocate(2) is None
    assert tables.pool.allocate(1) == [2]
    tables.pool.free([2])
    tables.check_integrity()


def test_cached_blocks_are_evicted_least_recently_released_first_and_tails_first() -> None:
    tables = tables_with(6)
    compute(tables, 0, list(range(9)))  # keyed blocks 0, 1; partial 2
    tables.free(0)  # released last block first: 2 (unkeyed: free), then 1, 0 cached in that order
    compute(tables, 1, [100 + i for i in range(9)])  # the free blocks first: 3, 4, 5
    tables.free(1)  # 5 free; 4, 3 cached after 1, 0
    assert tables.pool.num_cached == 4
    assert tables.pool.allocate(3) == [2, 5, 1]  # unkeyed free blocks, then the least recently released
    assert tables.pool.lookup(extend_chain([], ROOT, list(range(9)), 4)) == [0]  # the head outlives the tail
    assert tables.pool.allocate(2) == [0, 4]
    assert tables.pool.lookup(extend_chain([], ROOT, [100 + i for i in range(9)], 4)) == [3]


def test_a_cached_prefix_found_again_is_taken_back_not_evicted() -> None:
    tables = tables_with(3)
    compute(tables, 0, list(range(9)))
    tables.free(0)
    table, hit = compute(tables, 1, list(range(9)))
    assert hit == 8 and table[:2] == [0, 1]
    assert tables.pool.num_cached == 0
    tables.check_integrity()


def test_admission_that_does_not_fit_takes_nothing() -> None:
    tables = tables_with(3)
    compute(tables, 0, list(range(9)))
    assert tables.admit(1, [*range(8), *range(50, 60)], 1000) is None  # needs 2 shared + 3 fresh; 0 free
    assert tables.pool.refs(0) == 1 and tables.table(1) == []
    tables.check_integrity()


def test_two_sequences_computing_the_same_block_keep_one_key() -> None:
    tables = tables_with(6)
    a, _ = tables.admit(0, list(range(5)), 1000)[:2]
    b, _ = tables.admit(1, list(range(5)), 1000)[:2]
    tables.commit(0, list(range(5)), 5)
    tables.commit(1, list(range(5)), 5)
    assert tables.pool.lookup(extend_chain([], ROOT, list(range(5)), 4)) == [a[0]]
    tables.free(1)
    tables.free(0)
    assert tables.pool.num_cached == 1  # b's copy went back to the free list
    tables.check_integrity()


def test_without_a_root_nothing_is_shared() -> None:
    tables = BlockTables(BlockPool(6), 4)
    compute(tables, 0, list(range(9)))
    table, hit = compute(tables, 1, list(range(9)))
    assert hit == 0 and set(table).isdisjoint(tables.table(0))
    assert tables.cached_prefix(2, list(range(9))) == 0
    tables.check_integrity()


def test_random_workload_keeps_the_books() -> None:
    rng = random.Random(0)
    tables = tables_with(24)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    live: dict[int, list[int]] = {}
    for seq_id in range(300):
        if live and (rng.random() < 0.45 or len(live) > 5):
            tables.free(live.pop(rng.choice(list(live))))
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
        admitted = tables.admit(seq_id, tokens, 1000)
        if admitted is not None:
            tables.commit(seq_id, tokens, admitted[2])
            live[seq_id] = seq_id
            # every shared block holds what its key says: the same tokens at the same positions
            for i, block in enumerate(admitted[0][: admitted[1] // 4]):
                assert tables.pool._key_of[block] == tables.keys(seq_id, tokens)[i]
        tables.check_integrity()
    assert tables.counters.hit_tokens > 0


# --- the lower tiers ---------------------------------------------------------------------------------


class FakeLower:
    """A lower tier holding payloads by key; `bad` keys are counted but fail their check when fetched."""

    def __init__(self) -> None:
        self.held: dict[bytes, object] = {}
        self.bad: set[bytes] = set()
        self.on_disk: set[bytes] = set()  # of `held`, those only the disk holds

    def count(self, keys, disk: bool = True) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.held and (disk or keys[n] not in self.on_disk):
            n += 1
        return n

    def fetch(self, keys) -> list[object]:
        out = []
        for k in keys[: self.count(keys)]:
            if k in self.bad:
                break
            out.append(self.held[k])
        return out


def test_evictions_promotions_and_completions_are_logged_in_order() -> None:
    lower = FakeLower()
    tables = tables_with(3, lower=lower)
    tokens = list(range(9))
    compute(tables, 0, tokens)
    keys = tables.keys(0, tokens)
    assert tables.pool.take_events() == [Computed(keys[0], 0), Computed(keys[1], 1)]
    assert tables.pool.events == ()
    tables.free(0)
    compute(tables, 1, [100 + i for i in range(9)])  # takes every block: evicts 1 then 0
    assert tables.pool.events[:2] == (Evicted(keys[1], 1), Evicted(keys[0], 0))
    tables.free(1)
    tables.pool.take_events()
    for k in keys:
        lower.held[k] = f"payload {k.hex()[:6]}"
    table, hit = compute(tables, 2, tokens)
    assert hit == 8
    promotes = [e for e in tables.pool.events if isinstance(e, Promoted)]
    assert promotes == [Promoted(keys[i], table[i], lower.held[keys[i]]) for i in range(2)]
    assert tables.counters.promoted_blocks == 2 and tables.counters.device_hit_tokens == 0


def lower_holding_every_block():
    """Tables over 8 device blocks, and a lower tier holding every full block of a 13-token prompt (blocks of 4)."""
    lower = FakeLower()
    tables = tables_with(8, lower=lower)
    tokens = list(range(13))
    keys = extend_chain([], ROOT, tokens, 4)
    for k in keys:
        lower.held[k] = "ok"
    return lower, tables, tokens, keys


def test_a_bad_lower_block_ends_the_hit_there() -> None:
    lower, tables, tokens, keys = lower_holding_every_block()
    lower.bad.add(keys[1])
    assert tables.cached_prefix(0, tokens) == 12
    table, hit, end = tables.admit(0, tokens, 1000)
    assert (hit, end) == (4, 13) and len(table) == 4
    assert [type(e) for e in tables.pool.events] == [Promoted]


def test_blocks_only_the_disk_holds_count_only_where_reading_them_is_allowed() -> None:
    lower, tables, tokens, keys = lower_holding_every_block()
    lower.on_disk.add(keys[1])  # the first block above the disk, the second only on it
    assert tables.cached_prefix(0, tokens) == 12
    assert tables.cached_prefix(0, tokens, read_disk=False) == 4
    table, hit, end = tables.admit(0, tokens, 1000, read_disk=False)
    assert (hit, end) == (4, 13) and len(table) == 4
    assert [type(e) for e in tables.pool.events] == [Promoted]


def test_lower_tiers_need_a_pool_that_records() -> None:
    with pytest.raises(ValueError, match="record"):
        BlockTables(BlockPool(4), 4, ROOT, FakeLower())


def test_a_sequence_moves_down_and_up_through_fresh_blocks_logged_where_they_land() -> None:
    device = BlockTables(BlockPool(4, record=True), 4, ROOT)
    host = BlockTables(BlockPool(6, record=True), 4, ROOT)
    host.grow(9, 4)  # host block 0 taken: the moved blocks are not the device ones' numbers
    old = list(device.grow(0, 8))
    assert device.move_down(0, host) == [1, 2]
    assert host.pool.events == (MovedDown(1, old[0]), MovedDown(2, old[1])) and device.pool.events == ()
    assert device.table(0) == [] and device.pool.num_free == 4
    device.grow(1, 12)  # three of the device's four blocks: no room to come back up
    assert device.move_up(0, host) is None and host.table(0) == [1, 2]
    device.free(1)
    assert device.move_up(0, host) == device.table(0) and len(device.table(0)) == 2
    assert device.pool.events == tuple(MovedUp(b, s) for b, s in zip(device.table(0), [1, 2], strict=True))
    assert host.table(0) == [] and host.pool.num_free == 5
    assert device.move_down(0, BlockTables(BlockPool(1, record=True), 4)) is None and len(device.table(0)) == 2
    device.check_integrity()
    host.check_integrity()


@pytest.mark.parametrize("record", [False, True])
def test_events_are_recorded_only_for_a_consumer(record: bool) -> None:
    tables = BlockTables(BlockPool(2, record=record), 4, ROOT)
    compute(tables, 0, list(range(5)))
    (key,) = tables.keys(0, list(range(5)))
    tables.free(0)
    tables.pool.allocate(2)  # the free block, then the cached one
    assert tables.pool.events == ((Computed(key, 0), Evicted(key, 0)) if record else ())


def test_dropping_cached_blocks_frees_them_and_keeps_held_ones() -> None:
    tables = tables_with(8)
    compute(tables, 0, list(range(9)))
    compute(tables, 1, [50 + i for i in range(9)])
    tables.free(0)
    assert tables.pool.drop_cached() == 2
    assert tables.cached_prefix(2, list(range(9))) == 0
    assert tables.cached_prefix(3, [50 + i for i in range(9)]) == 8  # held by sequence 1: still shared
    assert tables.pool.num_free == 8 - 3
    tables.check_integrity()
