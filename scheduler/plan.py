"""StepPlan: the only object the engine receives. Plain Python values; no tensors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One sequence's share of a micro-batch: the tokens it computes this step."""

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int  # position of token_ids[0]; the cache already holds positions < start_pos
    block_table: tuple[int, ...]  # blocks holding positions 0 .. start_pos + len(token_ids) - 1
    wants_logits: bool = True  # logits of the last token (the next token is sampled from them)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    chunks: tuple[SeqChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True, slots=True)
class StepPlan:
    micro_batches: tuple[MicroBatch, ...]
    is_prefill: bool
    all_logits: bool = False  # logits at every computed position, not just each chunk's last (scoring)

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    @property
    def chunks(self) -> tuple[SeqChunk, ...]:
        return tuple(c for mb in self.micro_batches for c in mb.chunks)


def pack_micro_batches(chunks: list[SeqChunk], max_tokens: int) -> tuple[MicroBatch, ...]:
    """Split chunks, in order, into micro-batches of at most `max_tokens` tokens (a larger chunk goes alone)."""
    batches: list[MicroBatch] = []
    current: list[SeqChunk] = []
    size = 0
    for c in chunks:
        if current and size + len(c.token_ids) > max_tokens:
            batches.append(MicroBatch(tuple(current)))
            current, size = [], 0
        current.append(c)
        size += len(c.token_ids)
    if current:
        batches.append(MicroBatch(tuple(current)))
    return tuple(batches)
