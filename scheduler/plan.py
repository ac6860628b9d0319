"""StepPlan: the only object the engine receives. Plain Python values; no tensors."""

from __future__ import annotations

from dataclasses import dataclass, replace

from offload.common.tier import Tier


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a micro-batch: the tokens it computes this step."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int  # position of token_ids[0]; the cache already holds positions < start_pos
    # blocks holding positions 0 .. start_pos + len(token_ids) - 1; the head of a chunk cut across
    # micro-batches keeps the whole chunk's table
    block_table: tuple[int, ...]
    wants_logits: bool = True  # logits of the last token (the next token is sampled from them)
    # one token sampled the step before; False for known tokens (a prompt chunk, or prompt + outputs
    # recomputed after a preemption), which count as prefill
    is_decode: bool = False
    kv_tier: str = Tier.DEVICE  # whose cache block_table indexes: the device part's, or the host part's
    # positions [lo, hi) of the sequence whose logits are wanted besides the sampled one (a prompt's logprobs); the
    # engine returns those that fall in this chunk (a chunk cut across micro-batches keeps the range in each piece)
    scored: tuple[int, int] | None = None
    # of token_ids, the last `drafted` are a drafter's guesses (speculative decoding): verified by the logits at the
    # chunk's scored positions and its last one, and uncached until the core accepts them
    drafted: int = 0
    # the drafted tokens' parents where they are a tree (scheduler/drafts.py), None for a chain: each attends the
    # sequence's cached positions and its ancestors, at the position of its depth
    parents: tuple[int, ...] | None = None

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def scored_positions(self) -> range:
        """The positions of `scored` this chunk computes (empty without)."""
        if self.scored is None:
            return range(0)
        return range(max(self.scored[0], self.start_pos), min(self.scored[1], self.context_len))


@dataclass(frozen=True, slots=True)
class MicroBatch:
    chunks: tuple[SeqChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def kv_tier(self) -> str:
        """Every chunk of a micro-batch has its KV in the same part of the pool."""
        return self.chunks[0].kv_tier if self.chunks else Tier.DEVICE


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: decode tokens and prefill chunks, in any mix, packed into micro-batches run in order."""

    micro_batches: tuple[MicroBatch, ...]
    all_logits: bool = False  # logits at every computed position, not just each chunk's last (scoring)

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decoding sequences: their last sampled one and any drafted after it."""
        return sum(len(c.token_ids) for c in self.chunks if c.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def is_prefill(self) -> bool:
        """Whether the step computes any prefill tokens; a mixed step does."""
        return self.num_prefill_tokens > 0

    @property
    def chunks(self) -> tuple[SeqChunk, ...]:
        """In plan order; a chunk cut across micro-batches appears once per piece."""
        return tuple(c for mb in self.micro_batches for c in mb.chunks)


def split_micro_batches(chunks: list[SeqChunk], max_tokens: int) -> tuple[MicroBatch, ...]:
    """Pack chunks, in order, into micro-batches of exactly `max_tokens` tokens (the last may hold fewer); chunks whose
    KV is in host RAM go after the device's, in micro-batches of their own.

    A chunk that overflows a micro-batch is cut there: its head fills that micro-batch without logits and
    its tail goes on in the next. The cut is exact because the engine runs layer-major: at every layer the
    head's micro-batch writes its keys and values to the cache before the tail's attends to them.
    """
    by_tier = [c for c in chunks if c.kv_tier == Tier.DEVICE], [c for c in chunks if c.kv_tier != Tier.DEVICE]
    return tuple(mb for group in by_tier for mb in _pack(group, max_tokens))


def _pack(chunks: list[SeqChunk], max_tokens: int) -> list[MicroBatch]:
    batches: list[MicroBatch] = []
    current: list[SeqChunk] = []
    room = max_tokens
    for c in chunks:
        while len(c.token_ids) > room:
            if room:
                current.append(replace(c, token_ids=c.token_ids[:room], wants_logits=False))
                c = replace(c, token_ids=c.token_ids[room:], start_pos=c.start_pos + room)
            batches.append(MicroBatch(tuple(current)))
            current, room = [], max_tokens
        current.append(c)
        room -= len(c.token_ids)
    if current:
        batches.append(MicroBatch(tuple(current)))
    return batches
