"""A request's state machine: WAITING -> PREFILLING -> DECODING -> FINISHED, back to WAITING when preempted.

    WAITING     not in the KV cache: new, or preempted (its KV is recomputed from scratch on return)
    PREFILLING  admitted: its first num_cached tokens are in the cache, more of its known tokens to compute
    DECODING    every token but the last sampled one is cached; it computes one token per step
    FINISHED    ended by eos, a stop string or a length limit; holds no blocks

A sequence computes its known tokens (the prompt, or prompt + outputs after a preemption) in one or
more chunks; the chunk that reaches its last token samples the next one and makes it DECODING.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from offload.common.config import SamplingParams
from offload.common.tier import Tier
from offload.scheduler.drafts import depth


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    state: SeqState = SeqState.WAITING
    num_cached: int = 0  # leading tokens whose K and V are in the cache; 0 unless PREFILLING or DECODING
    finish_reason: str | None = None  # "stop" (eos or stop string) or "length"
    kv_tier: str = Tier.DEVICE  # where its KV blocks are while admitted: DEVICE, or HOST when the device's were full
    skipped: int = 0  # admissions that passed it over for a sequence with a longer cached prefix
    priority: int = 0  # admission class: a lower one is admitted first (interactive 0, background batch jobs 1)
    prompt_cached: int = 0  # prompt tokens its last admission took from the prefix cache (not computed)
    draft: tuple[int, ...] = ()  # a drafter's guesses at the tokens after its last one, for the next step to verify
    draft_parents: tuple[int, ...] | None = None  # a tree's: each drafted token's parent (drafts.py); None: a chain

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def draft_depth(self) -> int:
        """How deep its draft goes: a chain's length, a tree's deepest node's depth."""
        return depth(self.draft_parents, len(self.draft))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens still to compute: the rest of a prefill, 1 when decoding (the last sampled token)."""
        return self.num_tokens - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.state is SeqState.FINISHED

    @property
    def scored(self) -> tuple[int, int] | None:
        """Positions [lo, hi) whose logits its prompt's logprobs need (position p's give token p + 1's), until its
        first token is sampled; None when it asked for none or has them."""
        if self.params.prompt_logprobs is None or self.output_ids:
            return None
        lo, hi = max(self.params.prompt_logprobs_start, 1) - 1, len(self.prompt_ids) - 1
        return (lo, hi) if lo < hi else None

    @property
    def most_cached(self) -> int | None:
        """The most tokens an admission may take from the prefix cache: those before its `scored` positions (None: no
        limit)."""
        scored = self.scored
        return None if scored is None else scored[0]
