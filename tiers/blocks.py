"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and a block table per sequence.

Block ids index the KV cache tensors' block dimension (tiers/kv.py). Plain Python: the scheduler reasons with it.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Block ids 0..num_blocks-1, handed out lowest-first and reused in the order they are freed."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh block ids, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
            self._used.remove(b)
            self._free.append(b)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & self._used, "a block is both free and used"
        assert free | self._used == set(range(self.num_blocks)), "a block is lost"


class BlockTables:
    """Each sequence's ordered list of blocks; token t of a sequence lives in block t // block_size."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[int, list[int]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        """Whether `seq_id` can hold `num_tokens` tokens in total."""
        return self.pool.can_allocate(self.blocks_for(num_tokens) - len(self.table(seq_id)))

    def grow(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """Extend the table of `seq_id` to hold `num_tokens` tokens; None (nothing taken) if it does not fit."""
        table = self._tables.setdefault(seq_id, [])
        extra = self.pool.allocate(max(0, self.blocks_for(num_tokens) - len(table)))
        table.extend(extra or [])
        if not table:
            del self._tables[seq_id]
        return None if extra is None else table

    def free(self, seq_id: int) -> None:
        self.pool.free(self._tables.pop(seq_id, []))

    @property
    def num_used(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owned = [b for t in self._tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block belongs to two sequences"
        assert len(owned) == self.num_used, "an allocated block belongs to no sequence"
