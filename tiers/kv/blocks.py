"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, a block table per sequence, and the prefix cache.

Block ids index the KV cache tensors' block dimension (tiers/kv/kv_cache.py). Plain Python: the scheduler reasons with
it.

Prefix reuse (on when the tables get a chain root): a full block, once computed, is registered under its key (the
hash chain of tiers/kv/prefix.py). A block has a reference count, one per sequence whose table holds it; a sequence
admitted with a prefix whose keys are registered takes those blocks into its table (copy-free) and computes only
the rest. A keyed block whose last holder lets go stays cached: findable by its key, and evicted, least recently
released first, only when an allocation finds no unkeyed free block. With lower tiers (tiers/kv/lower_tiers.py), the
pool logs what they must do before the next step (`BlockPool.events`, typed in tiers/kv/events.py), and only these verbs
log it: copy an evicted block's bytes down before the step overwrites it (Evicted), copy a prefix found below into
the fresh blocks it was given (Promoted), write computed blocks through (Computed), copy a running sequence's blocks
between the device and host parts (MovedDown, MovedUp).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from offload.tiers.kv.events import Computed, Evicted, KVEvent, MovedDown, MovedUp, Promoted
from offload.tiers.kv.prefix import LowerTiers, PrefixCounters, extend_chain


class BlockPool:
    """Block ids 0..num_blocks-1 with reference counts. Unkeyed blocks are handed out lowest-first and reused in the
    order they are freed; cached (keyed, unreferenced) blocks only when no unkeyed one is left, least recent first."""

    def __init__(self, num_blocks: int, record: bool = False) -> None:
        """`record`: log what the lower tiers must do (`events`): there are some to take it."""
        self.num_blocks = num_blocks
        self.record = record
        self._free: deque[int] = deque(range(num_blocks))  # unkeyed, unreferenced
        self._refs: dict[int, int] = {}  # block -> holders (> 0)
        self._cached: OrderedDict[int, bytes] = OrderedDict()  # keyed, unreferenced: block -> key, least recent first
        self._key_of: dict[int, bytes] = {}  # every keyed block, held or cached
        self._by_key: dict[bytes, int] = {}
        self._events: list[KVEvent] = []  # what the lower tiers must do before the next step, in order

    @property
    def events(self) -> tuple[KVEvent, ...]:
        """What was logged since the last `take_events`, oldest first (empty unless `record`)."""
        return tuple(self._events)

    def take_events(self) -> list[KVEvent]:
        """Hand over the log, oldest first, and start an empty one: for the lower tiers, to carry it out."""
        events, self._events = self._events, []
        return events

    def _log(self, event: KVEvent) -> None:
        """Log `event` where there are lower tiers to take it (`record`). Only this module's verbs log."""
        if self.record:
            self._events.append(event)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: unkeyed free ones and cached ones (evicted to serve it)."""
        return len(self._free) + len(self._cached)

    @property
    def num_empty(self) -> int:
        """Blocks holding nothing: neither held nor cached."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh block ids (one reference each), or None (and nothing taken) when fewer are free."""
        if n > self.num_free:
            return None
        blocks = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(blocks) < n:
            block, key = self._cached.popitem(last=False)
            del self._key_of[block], self._by_key[key]
            self._log(Evicted(key, block))
            blocks.append(block)
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Take one more reference to each of `blocks` (keyed ones found by `lookup`, held or cached)."""
        for b in blocks:
            if b in self._refs:
                self._refs[b] += 1
            elif self._cached.pop(b, None) is not None:
                self._refs[b] = 1
            else:
                raise ValueError(f"block {b} is neither held nor cached")

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block no one holds is free again, or cached when it has a key."""
        for b in blocks:
            refs = self._refs.get(b)
            if refs is None:
                raise ValueError(f"block {b} is not allocated")
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._key_of:
                self._cached[b] = self._key_of[b]
            else:
                self._free.append(b)

    def register(self, block: int, key: bytes) -> bool:
        """Make a held, computed block findable by `key`. False (nothing changes) when the key already names
        another block (two sequences computed the same prefix at once) or the block already has a key."""
        if block not in self._refs:
            raise ValueError(f"block {block} is not allocated")
        if key in self._by_key or block in self._key_of:
            return False
        self._key_of[block] = key
        self._by_key[key] = block
        return True

    def register_computed(self, block: int, key: bytes) -> bool:
        """`register` a block the step computed; where that registers it, log it (Computed): its bytes may be
        written through."""
        registered = self.register(block, key)
        if registered:
            self._log(Computed(key, block))
        return registered

    def register_promoted(self, block: int, key: bytes, payload: object) -> None:
        """Fill a fresh block with a block found below, logging it (Promoted): `payload`, its row from the lower
        tiers, is copied into it before the next step. It is `register`ed too, unless `key` names another block
        already (then it is only its holder's)."""
        self.register(block, key)
        self._log(Promoted(key, block, payload))

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of `keys`, from the first, registered here."""
        blocks = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def drop_cached(self) -> int:
        """Forget every cached block (keyed, unreferenced): back to the free list, nothing handed down. Returns how
        many. Held blocks keep their keys."""
        dropped = list(self._cached.items())
        for block, key in dropped:
            del self._key_of[block], self._by_key[key]
            self._free.append(block)
        self._cached.clear()
        return len(dropped)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def check_integrity(self) -> None:
        free, used, cached = set(self._free), set(self._refs), set(self._cached)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & used, "a block is both free and used"
        assert not cached & (free | used), "a cached block is also free or used"
        assert free | used | cached == set(range(self.num_blocks)), "a block is lost"
        assert all(n > 0 for n in self._refs.values()), "a held block has no reference"
        assert {b: k for b, k in self._key_of.items()} == {b: k for k, b in self._by_key.items()}, "key maps disagree"
        assert all(self._key_of.get(b) == k for b, k in self._cached.items()), "a cached block lost its key"


class BlockTables:
    """Each sequence's ordered list of blocks; token t of a sequence lives in block t // block_size.

    With a chain `root` (tiers/kv/prefix.py), full blocks are shared by prefix: `admit` starts a sequence from the
    longest cached prefix of its tokens (on the device, else fetched from `lower`), `commit` registers the blocks
    a step completed. Without one, every block is the sequence's own. Lower tiers need a pool that records what they
    must do (`BlockPool.record`)."""

    def __init__(
        self, pool: BlockPool, block_size: int, root: bytes | None = None, lower: LowerTiers | None = None
    ) -> None:
        if lower is not None and not pool.record:
            raise ValueError("block tables over lower tiers need a pool that records their events (record=True)")
        self.pool = pool
        self.block_size = block_size
        self.root = root
        self.lower = lower
        self.counters = PrefixCounters()
        self._tables: dict[int, list[int]] = {}
        self._keys: dict[int, list[bytes]] = {}  # each sequence's chain over its full blocks, extended as it grows
        self._registered: dict[int, int] = {}  # leading blocks of each table that are keyed (cached or registered)

    @property
    def prefix_caching(self) -> bool:
        return self.root is not None

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

    # ---- prefix reuse -----------------------------------------------------------------------------

    def keys(self, seq_id: int, token_ids: Sequence[int]) -> list[bytes]:
        """The chain keys of the full blocks of `token_ids` (the tokens of `seq_id`, which only ever grow)."""
        if self.root is None:
            return []
        return extend_chain(self._keys.setdefault(seq_id, []), self.root, token_ids, self.block_size)

    def cached_prefix(
        self, seq_id: int, token_ids: Sequence[int], read_disk: bool = True, most: int | None = None
    ) -> int:
        """Tokens of `token_ids` an admission now would take from cached blocks (device or lower tiers, without
        reading them): whole blocks, short of the last token, which is always computed (its logits are needed).
        `read_disk` and `most`: as `admit` would be given them."""
        if self.root is None:
            return 0
        keys = self._lookup_keys(seq_id, token_ids, most)
        on_device = len(self.pool.lookup(keys))
        below = self._below(keys[on_device:], read_disk)
        return (on_device + below) * self.block_size

    def _lookup_keys(self, seq_id: int, token_ids: Sequence[int], most: int | None) -> list[bytes]:
        """The keys of the blocks an admission may take from the cache: whole blocks short of the last token and of
        `most` tokens."""
        limit = len(token_ids) - 1 if most is None else min(len(token_ids) - 1, most)
        return self.keys(seq_id, token_ids)[: limit // self.block_size]

    def prefetch(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Have the lower tiers start bringing up the cached blocks an admission of `seq_id` now would fetch from
        them (the leading blocks the pool holds left out)."""
        if self.root is None or self.lower is None:
            return
        keys = self.keys(seq_id, token_ids)[: (len(token_ids) - 1) // self.block_size]
        on_device = len(self.pool.lookup(keys))
        if on_device < len(keys):
            self.lower.prefetch(keys[on_device:], self.pool)

    @property
    def reads_ahead(self) -> bool:
        """Whether `prefetch` can bring anything up: prefix reuse over lower tiers that read ahead."""
        return self.root is not None and self.lower is not None and self.lower.reads_ahead

    def land(self) -> None:
        """Make the blocks the lower tiers brought up since the last call findable, before this step's admissions."""
        if self.root is not None and self.lower is not None:
            self.lower.land(self.pool)

    def admit(
        self, seq_id: int, token_ids: Sequence[int], budget: int, read_disk: bool = True, most: int | None = None
    ) -> tuple[list[int], int, int] | None:
        """Start the table of a sequence not in the cache: its longest cached prefix (short of the last token, and of
        `most` tokens if given: the positions from there on are computed, for their logits), then fresh blocks for up
        to `budget` more tokens. Returns (table, cached tokens, end of the first chunk), or None (nothing taken) when
        the blocks do not fit. `read_disk`: whether blocks only the disk holds count as cached (False: they are
        computed again; the scheduler prices which is faster)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a table")
        keys = self._lookup_keys(seq_id, token_ids, most)
        device = self.pool.lookup(keys)
        below = self._below(keys[len(device) :], read_disk)
        room = self.pool.num_free - sum(1 for b in device if not self.pool.refs(b))  # sharing takes cached ones

        def fit(hit: int) -> tuple[int, int] | None:
            """(end of the first chunk, fresh blocks) after `hit` cached blocks, or None when they do not fit."""
            end = min(len(token_ids), hit * self.block_size + budget)
            fresh = self.blocks_for(end) - len(device)
            return (end, fresh) if fresh <= room else None

        hit = len(device) + below
        if (fitted := fit(hit)) is None:
            return None
        payloads = self.lower.fetch(keys[len(device) : hit]) if below else []
        if len(payloads) < below:  # a lower block went bad between count and fetch: compute from there
            hit = len(device) + len(payloads)
            if (fitted := fit(hit)) is None:
                return None
        end, fresh = fitted
        self.pool.share(device)
        blocks = self.pool.allocate(fresh)
        assert blocks is not None  # checked above
        for block, key, payload in zip(blocks, keys[len(device) : hit], payloads, strict=False):
            self.pool.register_promoted(block, key, payload)
        table = self._tables[seq_id] = device + blocks
        self._registered[seq_id] = hit
        c = self.counters
        c.lookup_tokens += len(token_ids)
        c.hit_tokens += hit * self.block_size
        c.device_hit_tokens += len(device) * self.block_size
        c.promoted_blocks += hit - len(device)
        return table, hit * self.block_size, end

    def _below(self, keys: Sequence[bytes], read_disk: bool) -> int:
        """Leading `keys` the lower tiers hold (0 without lower tiers; they are not asked about no keys)."""
        return self.lower.count(keys, disk=read_disk) if self.lower is not None and keys else 0

    def commit(self, seq_id: int, token_ids: Sequence[int], num_cached: int) -> None:
        """Register the full blocks among the first `num_cached` tokens of `seq_id` (their keys and values are now
        in the cache) so later sequences with the same prefix can share them."""
        if self.root is None:
            return
        full = num_cached // self.block_size
        done = self._registered.get(seq_id, 0)
        if full <= done:
            return
        keys, table = self.keys(seq_id, token_ids), self._tables[seq_id]
        for b in range(done, full):
            self.pool.register_computed(table[b], keys[b])
        self._registered[seq_id] = full

    # ---- a running sequence's KV between the device and host parts -----------------------------------

    def move_down(self, seq_id: int, host: BlockTables) -> list[int] | None:
        """Move the blocks of `seq_id` from these tables (the device part's) to `host` (the host part's): fresh
        blocks there, each logged in its pool to take its device block's bytes before the next step (MovedDown),
        then the device ones freed. Returns its host table, or None (nothing changes) when they do not fit there."""
        return _move(seq_id, self, host, MovedDown)

    def move_up(self, seq_id: int, host: BlockTables) -> list[int] | None:
        """Move the blocks of `seq_id` from `host` (the host part's tables) back to these (the device part's): fresh
        blocks here, each logged in this pool to take its host block's bytes before the next step (MovedUp), then
        the host ones freed. Returns its device table, or None (nothing changes) when they do not fit here."""
        return _move(seq_id, host, self, MovedUp)

    def free(self, seq_id: int) -> None:
        """Let go of every block of `seq_id`, its last ones first (so, cached, they are evicted first: a prefix's
        head is the part other sequences share)."""
        table = self._tables.pop(seq_id, [])
        self.pool.free(table[::-1] if self.prefix_caching else table)
        self._keys.pop(seq_id, None)
        self._registered.pop(seq_id, None)

    @property
    def num_used(self) -> int:
        """Blocks held by some sequence (cached ones are not)."""
        return self.pool.num_blocks - self.pool.num_free

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        owned = [b for t in self._tables.values() for b in t]
        held = {b: owned.count(b) for b in set(owned)}
        assert all(self.pool.refs(b) == n for b, n in held.items()), "a block's references do not match its tables"
        assert sum(held.values()) == sum(self.pool.refs(b) for b in range(self.pool.num_blocks)), (
            "an allocated block belongs to no sequence"
        )
        if not self.prefix_caching:
            assert len(owned) == len(set(owned)), "a block belongs to two sequences"


def _move(seq_id: int, src: BlockTables, dst: BlockTables, moved: type[MovedDown] | type[MovedUp]) -> list[int] | None:
    """`seq_id`'s table in `src` moved to fresh blocks of `dst`, each logged there; None when they do not fit."""
    source = list(src.table(seq_id))
    blocks = dst.grow(seq_id, len(source) * dst.block_size)
    if blocks is None:
        return None
    for block, from_block in zip(blocks, source, strict=True):
        dst.pool._log(moved(block, from_block))
    src.free(seq_id)
    return blocks
