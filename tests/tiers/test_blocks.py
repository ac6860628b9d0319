"""BlockPool and BlockTables: exact block ids, reuse order, integrity checks."""

from __future__ import annotations

import pytest

from offload.tiers.kv.blocks import BlockPool, BlockTables

# --- BlockPool ---------------------------------------------------------------------------------


def test_pool_hands_out_lowest_ids_first() -> None:
    pool = BlockPool(6)
    assert pool.num_free == 6
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free == 1
    pool.check_integrity()


def test_pool_reuses_blocks_in_the_order_they_were_freed() -> None:
    pool = BlockPool(8)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    pool.free([3])
    pool.free([0, 4])
    # never-used blocks 5..7 come first, then the freed ones in the order they were freed
    assert pool.allocate(6) == [5, 6, 7, 3, 0, 4]
    assert pool.num_free == 0
    pool.check_integrity()


def test_pool_allocate_of_zero_blocks_is_empty() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free == 2


def test_pool_allocate_returns_none_and_takes_nothing_when_short() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert not pool.can_allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    assert pool.can_allocate(1)
    assert pool.allocate(1) == [3]  # the failed call took nothing
    pool.check_integrity()


def test_pool_can_allocate_boundary() -> None:
    pool = BlockPool(3)
    assert pool.can_allocate(3)
    assert not pool.can_allocate(4)


@pytest.mark.parametrize("blocks", [[5], [0, 5]])
def test_pool_free_of_unallocated_block_raises(blocks: list[int]) -> None:
    pool = BlockPool(8)
    pool.allocate(2)
    with pytest.raises(ValueError, match="block 5 is not allocated"):
        pool.free(blocks)


def test_pool_double_free_raises() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError, match="block 0 is not allocated"):
        pool.free(blocks)
    pool.check_integrity()


def test_pool_integrity_holds_through_normal_use() -> None:
    pool = BlockPool(10)
    held: list[list[int]] = []
    for n in (3, 1, 4, 2):
        blocks = pool.allocate(n)
        assert blocks is not None
        held.append(blocks)
        pool.check_integrity()
    for blocks in (held[1], held[3], held[0]):
        pool.free(blocks)
        pool.check_integrity()
    assert pool.num_free == 10 - 4


def test_pool_integrity_detects_a_block_free_twice() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    pool._free.append(2)  # block 2 is already on the free list
    with pytest.raises(AssertionError, match="free twice"):
        pool.check_integrity()


def test_pool_integrity_detects_a_block_both_free_and_used() -> None:
    pool = BlockPool(4)
    pool._refs[3] = 1
    with pytest.raises(AssertionError, match="both free and used"):
        pool.check_integrity()


def test_pool_integrity_detects_a_lost_block() -> None:
    pool = BlockPool(4)
    pool._free.pop()  # block 3 is neither free nor used
    with pytest.raises(AssertionError, match="lost"):
        pool.check_integrity()


# --- BlockTables -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "tokens", "blocks"),
    [(4, 0, 0), (4, 1, 1), (4, 4, 1), (4, 5, 2), (4, 8, 2), (4, 9, 3), (1, 7, 7), (16, 17, 2), (3, 10, 4)],
)
def test_blocks_for_rounds_up(block_size: int, tokens: int, blocks: int) -> None:
    assert BlockTables(BlockPool(1), block_size).blocks_for(tokens) == blocks


def test_grow_extends_exactly_to_the_blocks_needed() -> None:
    tables = BlockTables(BlockPool(10), block_size=4)
    assert tables.grow(7, 5) == [0, 1]
    assert tables.grow(8, 1) == [2]
    assert tables.grow(7, 8) == [0, 1]  # 8 tokens still fit two blocks
    assert tables.grow(7, 9) == [0, 1, 3]
    assert tables.grow(7, 3) == [0, 1, 3]  # never shrinks
    assert tables.grow(8, 16) == [2, 4, 5, 6]
    assert tables.table(7) == [0, 1, 3]
    assert tables.table(8) == [2, 4, 5, 6]
    assert tables.num_used == 7
    tables.check_integrity()


def test_table_of_unknown_sequence_is_empty() -> None:
    tables = BlockTables(BlockPool(2), block_size=4)
    assert tables.table(42) == []


def test_grow_that_does_not_fit_takes_nothing_and_keeps_the_table() -> None:
    tables = BlockTables(BlockPool(4), block_size=2)
    assert tables.grow(0, 3) == [0, 1]
    assert tables.grow(1, 2) == [2]
    assert tables.can_grow(0, 6)
    assert not tables.can_grow(0, 7)  # needs 4 blocks, has 2, 1 free
    assert tables.grow(0, 7) is None
    assert tables.table(0) == [0, 1]
    assert tables.pool.num_free == 1
    assert tables.grow(0, 6) == [0, 1, 3]
    tables.check_integrity()


def test_can_grow_of_a_fitting_request_needs_no_free_blocks() -> None:
    tables = BlockTables(BlockPool(2), block_size=4)
    assert tables.grow(0, 8) == [0, 1]
    assert tables.pool.num_free == 0
    assert tables.can_grow(0, 8)
    assert tables.grow(0, 8) == [0, 1]
    assert not tables.can_grow(0, 9)
    assert not tables.can_grow(1, 1)


def test_failed_grow_of_a_new_sequence_leaves_no_table() -> None:
    tables = BlockTables(BlockPool(3), block_size=4)
    assert tables.grow(0, 9) == [0, 1, 2]
    assert tables.grow(1, 1) is None
    assert 1 not in tables._tables
    assert tables.table(1) == []
    tables.check_integrity()
    tables.free(0)
    assert tables.grow(1, 1) == [0]


def test_free_returns_blocks_to_the_pool_in_table_order() -> None:
    tables = BlockTables(BlockPool(6), block_size=2)
    tables.grow(0, 4)  # [0, 1]
    tables.grow(1, 2)  # [2]
    tables.grow(0, 6)  # [0, 1, 3]
    tables.free(0)
    assert tables.table(0) == []
    assert tables.pool.num_free == 5
    tables.check_integrity()
    assert tables.pool.allocate(5) == [4, 5, 0, 1, 3]


def test_free_of_unknown_sequence_does_nothing() -> None:
    tables = BlockTables(BlockPool(2), block_size=2)
    tables.grow(0, 2)
    tables.free(99)
    assert tables.pool.num_free == 1
    tables.check_integrity()


def test_tables_integrity_detects_a_shared_block() -> None:
    tables = BlockTables(BlockPool(4), block_size=2)
    tables.grow(0, 4)
    tables._tables[1] = [1]  # a second holder the pool never counted
    with pytest.raises(AssertionError, match="references do not match"):
        tables.check_integrity()


def test_tables_integrity_detects_an_orphan_block() -> None:
    tables = BlockTables(BlockPool(4), block_size=2)
    tables.grow(0, 4)
    tables.pool.allocate(1)  # allocated behind the tables' back
    with pytest.raises(AssertionError, match="no sequence"):
        tables.check_integrity()


def test_tables_integrity_runs_the_pool_check() -> None:
    tables = BlockTables(BlockPool(4), block_size=2)
    tables.pool._free.append(0)
    with pytest.raises(AssertionError, match="free twice"):
        tables.check_integrity()


def test_grow_of_a_new_sequence_to_zero_tokens_leaves_no_table() -> None:
    tables = BlockTables(BlockPool(2), block_size=4)
    assert tables.grow(0, 0) == []
    assert 0 not in tables._tables
    tables.check_integrity()
