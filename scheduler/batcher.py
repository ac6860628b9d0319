"""Continuous batching with chunked prefill: which tokens of which sequences the next step computes.

Each step has a budget of `max_step_tokens` tokens. Decoding sequences come first, one token each; what
is left goes to prefill chunks, first of the admitted sequences still prefilling, then of waiting ones,
in FIFO order. A prompt longer than what is left gets a chunk of what is left and continues next step,
so long prompts interleave with decoding instead of stalling it, and a step's activations stay bounded.
A chunk's blocks are allocated when it is planned, for its tokens only.

Finished sequences leave after their step and free their blocks; waiting ones join at the next step if
their first chunk fits in the free blocks (FIFO within a priority class, a lower class first: one that does not
fit blocks those behind it). When an
admitted sequence's next chunk does not fit, the most recently admitted sequence not yet planned this
step is preempted, possibly the one asking: its blocks are freed and it waits at the front of the queue,
to be recomputed from scratch (prompt and outputs so far). No sequence is admitted in a step that
preempted one.

With prefix reuse (tables with a chain root, tiers/kv/blocks.py), a sequence is admitted at the end of its longest
cached prefix and computes only the rest; among the waiting sequences of the head's class the one with the longest
cached prefix goes first, unless one ahead of it has been passed over MAX_SKIPS times; a sequence whose next block
a chunk of this step is computing waits one step and then shares it. The cached blocks that only a lower tier
holds, of the waiting sequences likely admitted next (as many as can run at once), start coming up while the step
computes (`BlockTables.prefetch`), and are placed before the next step's admissions (`BlockTables.land`). A
preempted sequence's full blocks stay cached (and go down to host RAM or disk when evicted, with lower tiers), so
it comes back to them instead of recomputing. Whether a block only the disk holds is read back (or computed again),
and whether a running sequence moves down to host RAM (or is preempted), the KV prices say (scheduler/kv_prices.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from offload.common.tier import Tier
from offload.scheduler.drafts import kept_in_place
from offload.scheduler.kv_prices import KVPrices
from offload.scheduler.plan import SeqChunk, StepPlan, split_micro_batches
from offload.scheduler.sequence import SeqState, Sequence
from offload.tiers.kv.blocks import BlockTables

LOOKAHEAD = 64  # waiting sequences compared by cached prefix at each admission
MAX_SKIPS = 16  # admissions a waiting sequence may be passed over for a longer cached prefix
# drafted tokens one step verifies at most, over all its sequences: where weights stream, a pass costs about the same
# up to many rows, while a batch this large fills the pass with decode tokens by itself
MAX_DRAFTED = 256


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_num_seqs: int  # sequences admitted (prefilling or decoding) at once
    max_step_tokens: int  # tokens computed per step: one per decoding sequence, the rest prefill chunks
    micro_batch_tokens: int  # tokens per micro-batch
    max_model_len: int  # prompt + output tokens of one sequence; must fit one part of the KV pool alone

    @property
    def max_running(self) -> int:
        """Admitted sequences: every one may decode in the same step, so at most max_step_tokens of them."""
        return min(self.max_num_seqs, self.max_step_tokens)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the core found in a sequence's sampled token that the scheduler cannot see (it reads no text and runs no
    grammar); end-of-sequence and length the batcher checks itself."""

    stop_string: bool = False  # its text reached a stop string: "stop", whatever else holds
    grammar_done: bool = False  # its grammar is complete: "stop", unless eos or a length limit ended it first


NO_VERDICT = Verdict()


class Batcher:
    def __init__(
        self,
        tables: BlockTables,
        limits: BatchLimits,
        eos_ids: tuple[int, ...] = (),
        host_tables: BlockTables | None = None,
        prices: KVPrices | None = None,
    ) -> None:
        """`host_tables`: blocks in host RAM for sequences admitted when the device's do not fit (their KV lives
        there and their attention runs there); None: the device's only. `prices`: whether moving KV between tiers
        is predicted cheaper than computing it again (None: a sequence always moves down when there is room, and
        cached blocks on disk are always read)."""
        largest = max(tables.pool.num_blocks, host_tables.pool.num_blocks if host_tables is not None else 0)
        if tables.blocks_for(limits.max_model_len) > largest:
            raise ValueError(f"max_model_len {limits.max_model_len} does not fit the KV cache")
        self.tables = tables
        self.host_tables = host_tables
        self.limits = limits
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()  # WAITING, in the order they are to be admitted
        self.running: deque[Sequence] = deque()  # PREFILLING or DECODING, in admission order
        self.num_preemptions = 0
        self.num_moved_down = 0  # running sequences whose blocks went to the host part instead of being preempted
        self.num_moved_up = 0  # running sequences whose blocks came back from the host part
        self.num_priced_out = 0  # preemptions where the host part had room but recomputing was predicted cheaper
        self.prices = prices

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.limits.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens, max_model_len is {self.limits.max_model_len}"
            )
        # ahead of every waiting sequence of a later priority class (FIFO within a class)
        later = next((i for i, w in enumerate(self.waiting) if w.priority > seq.priority), len(self.waiting))
        self.waiting.insert(later, seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """Plan the next step; it computes something whenever there is work."""
        budget = self.limits.max_step_tokens
        drafts = MAX_DRAFTED  # drafted tokens the step may verify
        chunks: list[SeqChunk] = []
        planned: set[int] = set()
        preemptions = self.num_preemptions
        self.tables.land()
        self._move_up()
        for state in (SeqState.DECODING, SeqState.PREFILLING):
            for seq in [s for s in self.running if s.state is state]:
                if budget == 0:
                    break
                if seq.state is not state:  # preempted earlier in this step
                    continue
                end = seq.num_cached + min(budget, seq.num_uncached)
                drafted = self._draft_room(seq, budget - (end - seq.num_cached), drafts)
                table = self._tables_of(seq).grow(seq.seq_id, end + drafted) if drafted else None
                if table is None:
                    drafted, table = 0, self._grow_or_preempt(seq, end, planned)
                if table is not None:
                    chunks.append(self._chunk(seq, end, table, drafted))
                    planned.add(seq.seq_id)
                    budget -= end + drafted - seq.num_cached
                    drafts -= drafted
        in_flight = self._in_flight(chunks)
        deferred: list[Sequence] = []
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.limits.max_running
            and self.num_preemptions == preemptions
        ):
            seq = self._next_waiting()
            keys = self.tables.keys(seq.seq_id, seq.token_ids)
            hit = self._cached_prefix(seq) // self.tables.block_size
            if hit < len(keys) and keys[hit] in in_flight:  # a block it needs is being computed: share it next step
                self.waiting.remove(seq)
                deferred.append(seq)
                continue
            admitted = self.tables.admit(seq.seq_id, seq.token_ids, budget, self._reads_disk(), seq.most_cached)
            if admitted is None and self.host_tables is not None:  # the device part is full: its KV goes to host RAM
                admitted = self.host_tables.admit(
                    seq.seq_id, seq.token_ids, budget, self._reads_disk(), seq.most_cached
                )
                seq.kv_tier = Tier.HOST if admitted is not None else Tier.DEVICE
            if admitted is None:
                break
            table, seq.num_cached, end = admitted
            seq.prompt_cached = min(seq.num_cached, len(seq.prompt_ids))
            self.waiting.remove(seq)
            seq.state = SeqState.PREFILLING
            self.running.append(seq)
            chunks.append(self._chunk(seq, end, table))
            in_flight |= self._in_flight(chunks[-1:])
            budget -= end - seq.num_cached
        for seq in reversed(deferred):  # back where they were, ahead of later arrivals
            self._requeue(seq)
        if self.tables.reads_ahead and self._reads_disk():  # those next in line: their blocks come up meanwhile
            for seq in self._next_in_line(self.limits.max_running):
                self.tables.prefetch(seq.seq_id, seq.token_ids)
        return StepPlan(split_micro_batches(chunks, self.limits.micro_batch_tokens))

    def _reads_disk(self) -> bool:
        """Whether cached blocks only the disk holds are read back rather than computed again, at the prices now."""
        return self.prices is None or self.prices.disk_pays()

    def _cached_prefix(self, seq: Sequence) -> int:
        """Tokens of `seq` an admission now would take from cached blocks (`BlockTables.cached_prefix`)."""
        return self.tables.cached_prefix(seq.seq_id, seq.token_ids, self._reads_disk(), seq.most_cached)

    def _next_in_line(self, n: int) -> list[Sequence]:
        """The `n` waiting sequences likely admitted next, in that order: without prefix reuse the queue's first;
        with it, as `_next_waiting` picks them (the longest cached prefix first among the head's class), not counting
        skips. As many as can run at once: what lands for sequences further back would be evicted for the blocks of
        those admitted before them."""
        if not self.tables.prefix_caching or not self.waiting or n <= 0:
            return list(itertools.islice(self.waiting, n))
        head = self.waiting[0].priority
        same = list(itertools.takewhile(lambda s: s.priority == head, itertools.islice(self.waiting, LOOKAHEAD)))
        cached = {s.seq_id: self._cached_prefix(s) for s in same}
        ranked = sorted(same, key=lambda s: -cached[s.seq_id])  # stable: queue order among equals
        return list(itertools.islice(itertools.chain(ranked, itertools.islice(self.waiting, len(same), None)), n))

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next: the head of the queue, or, with prefix reuse, the one of the head's
        priority class (among the first LOOKAHEAD) with the longest cached prefix (SGLang's longest-prefix-match:
        it computes least, and uses cached blocks before they are evicted). A sequence passed over MAX_SKIPS
        times is admitted next, so none starves."""
        head = self.waiting[0]
        if not self.tables.prefix_caching or head.skipped >= MAX_SKIPS:
            return head
        best, best_hit = head, self._cached_prefix(head)
        for seq in itertools.islice(self.waiting, 1, LOOKAHEAD):
            if seq.priority != head.priority:
                break
            if seq.skipped >= MAX_SKIPS:  # overdue: nothing behind it may pass it
                break
            hit = self._cached_prefix(seq)
            if hit > best_hit:
                best, best_hit = seq, hit
        if best is not head:
            for seq in self.waiting:
                if seq is best:
                    break
                seq.skipped += 1
        return best

    def _in_flight(self, chunks: list[SeqChunk]) -> set[bytes]:
        """Keys of the blocks `chunks` fill this step (prefix reuse only): a sequence that needs one waits a step."""
        keys: set[bytes] = set()
        size = self.tables.block_size
        completing = [c for c in chunks if -(-c.start_pos // size) < c.context_len // size]  # complete a block
        running = {s.seq_id: s for s in self.running} if completing else {}
        for c in completing:
            seq = running[c.seq_id]
            keys.update(
                self._tables_of(seq).keys(c.seq_id, seq.token_ids)[-(-c.start_pos // size) : c.context_len // size]
            )
        return keys

    def _requeue(self, seq: Sequence) -> None:
        """Put a waiting sequence back ahead of every later priority class and behind its own class's overdue ones
        (FIFO order within a class is kept by requeueing in reverse)."""
        later = next((i for i, w in enumerate(self.waiting) if w.priority >= seq.priority), len(self.waiting))
        self.waiting.insert(later, seq)

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, planned: set[int]) -> list[int] | None:
        """Grow `seq` to `num_tokens`, preempting the latest unplanned sequences; None if `seq` itself went."""
        while (table := self._tables_of(seq).grow(seq.seq_id, num_tokens)) is None:
            # a victim whose blocks are in the same part of the pool: moved down to host RAM if it has room, else
            # preempted
            victim = next(s for s in reversed(self.running) if s.seq_id not in planned and s.kv_tier == seq.kv_tier)
            if self._move_down(victim):
                continue
            self._preempt(victim)
            if victim is seq:
                return None
        return table

    def _move_down(self, seq: Sequence) -> bool:
        """Give `seq`'s blocks in the device part copies in the host part (made before the next step) and free the
        device ones: it keeps running from host RAM instead of being preempted. False if the host part lacks room,
        or if copying them is predicted dearer than computing its cached tokens again (`KVPrices.swap_pays`)."""
        if self.host_tables is None or seq.kv_tier != Tier.DEVICE:
            return False
        blocks = len(self.tables.table(seq.seq_id))
        if self.prices is not None and not self.prices.swap_pays(blocks, seq.num_cached):
            self.num_priced_out += 1
            return False
        if self.tables.move_down(seq.seq_id, self.host_tables) is None:
            return False
        seq.kv_tier = Tier.HOST
        self.num_moved_down += 1
        return True

    def _move_up(self) -> None:
        """Bring running sequences whose KV lives in the host part back to the device part, oldest first, while it
        has room for a sequence's blocks and for everything every device sequence (it included) could grow by in
        this step, so that planning the step never has to move or preempt one (a sequence moved up and down in one
        step would copy blocks not yet written), and no waiting sequence could be admitted into that room instead.
        Their blocks are copied up before the next step (`BlockTables.move_up`: read before anything is written)."""
        if self.host_tables is None or (self.waiting and len(self.running) < self.limits.max_running):
            return
        growth = sum(self._growth(s, self.tables) for s in self.running if s.kv_tier == Tier.DEVICE)
        for seq in [s for s in self.running if s.kv_tier == Tier.HOST]:
            blocks = len(self.host_tables.table(seq.seq_id))
            need = blocks + self._growth(seq, self.host_tables)
            if self.tables.pool.num_free < need + growth:
                return
            growth += need - blocks
            moved = self.tables.move_up(seq.seq_id, self.host_tables)
            assert moved is not None  # room checked above
            seq.kv_tier = Tier.DEVICE
            self.num_moved_up += 1

    def _growth(self, seq: Sequence, tables: BlockTables) -> int:
        """Blocks `seq` could add to its table in `tables` this step (the whole step's tokens, if it prefills)."""
        end = seq.num_cached + min(self.limits.max_step_tokens, seq.num_uncached)
        return max(tables.blocks_for(end) - len(tables.table(seq.seq_id)), 0)

    def _draft_room(self, seq: Sequence, budget: int, drafts: int) -> int:
        """How many of its drafted tokens a decoding `seq` verifies this step: what the step's budget leaves after one
        token for each decoding sequence not yet planned, within the step's drafted tokens and the context window."""
        if seq.state is not SeqState.DECODING or not seq.draft:
            return 0
        others = sum(1 for s in self.running if s.state is SeqState.DECODING) - 1  # an upper bound: planned ones too
        window = self.limits.max_model_len - 1 - seq.num_tokens
        return max(0, min(len(seq.draft), budget - others, drafts, window))

    def _chunk(self, seq: Sequence, end: int, table: list[int], drafted: int = 0) -> SeqChunk:
        """Tokens num_cached .. end - 1 of `seq`, then `drafted` of its draft; the chunk that reaches its last token
        samples the next (and, with a draft, has the logits that verify it at its scored positions)."""
        start = seq.num_cached
        scored = (end - 1, end - 1 + drafted) if drafted else seq.scored
        return SeqChunk(
            seq.seq_id,
            tuple(seq.token_ids[start:end]) + seq.draft[:drafted],
            start,
            tuple(table),
            wants_logits=end == seq.num_tokens,
            is_decode=seq.state is SeqState.DECODING,
            kv_tier=seq.kv_tier,
            scored=scored,
            drafted=drafted,
            parents=seq.draft_parents[:drafted] if drafted and seq.draft_parents is not None else None,
        )

    def _tables_of(self, seq: Sequence) -> BlockTables:
        return self.host_tables if seq.kv_tier == Tier.HOST else self.tables

    def _free(self, seq: Sequence) -> None:
        """Let go of the blocks of `seq` (and of the prefix keys any tables computed for it)."""
        for tables in (self.tables, self.host_tables):
            if tables is not None:
                tables.free(seq.seq_id)
        seq.kv_tier = Tier.DEVICE  # where its KV goes is decided again at its next admission

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        self.running.remove(seq)
        seq.state = SeqState.WAITING
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(
        self, plan: StepPlan, next_tokens: dict[int, int | tuple[int, ...]], verdicts: dict[int, Verdict] | None = None
    ) -> list[Sequence]:
        """Record what the step cached and each sampled token, and end the sequences it finished, every finish reason
        decided here; `verdicts`: what the caller found in a sequence's token (none: nothing). Returns the sequences
        that finished this step."""
        verdicts = verdicts or {}
        by_id = {s.seq_id: s for s in self.running}
        finished = []
        for chunk in plan.chunks:
            seq = by_id[chunk.seq_id]
            seq.draft, seq.draft_parents = (), None
            # drafted positions hold keys and values only once accepted: cached up to the first of them for now
            verified = chunk.scored[1] + 1 - chunk.drafted if chunk.drafted else chunk.context_len
            seq.num_cached = min(chunk.context_len, verified)
            self._tables_of(seq).commit(seq.seq_id, seq.token_ids, seq.num_cached)
            if not chunk.wants_logits:  # a prefill chunk short of the last known token
                continue
            if seq.params.max_new_tokens == 0:  # the prompt only: its blocks stay cached for the requests after it
                self.finish(seq, "length")
                finished.append(seq)
                continue
            tokens = next_tokens[chunk.seq_id]
            tokens = (tokens,) if isinstance(tokens, int) else tuple(tokens)
            assert 1 <= len(tokens) <= chunk.drafted + 1
            seq.output_ids.extend(tokens)  # the accepted drafts, then the target's own token after them
            seq.num_cached += kept_in_place(chunk.parents, chunk.token_ids[-chunk.drafted :], tokens)  # of a tree: some
            self._tables_of(seq).commit(seq.seq_id, seq.token_ids, seq.num_cached)
            seq.state = SeqState.DECODING
            reason = self.finish_reason(seq, verdicts.get(seq.seq_id, NO_VERDICT))
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def finish_reason(self, seq: Sequence, verdict: Verdict = NO_VERDICT, ahead: tuple[int, ...] = ()) -> str | None:
        """What its last output token ends `seq` with ("stop" or "length"), or None; `ahead`: as if these tokens
        followed its outputs (the core asks of each accepted draft token, so that none follows one that ends it)."""
        last = ahead[-1] if ahead else seq.output_ids[-1]
        if (
            verdict.stop_string
            or (not seq.params.ignore_eos and last in self.eos_ids)
            or last in seq.params.stop_token_ids
        ):
            return "stop"
        produced, total = len(seq.output_ids) + len(ahead), seq.num_tokens + len(ahead)
        if produced >= seq.params.max_new_tokens or total >= self.limits.max_model_len:
            return "length"
        if verdict.grammar_done:  # only the end of the sequence may follow
            return "stop"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` now with `reason` ("stop" or "length" from `postprocess`, or "abort") and free its blocks."""
        self._free(seq)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        seq.num_cached = 0
