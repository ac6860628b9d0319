"""A request's state machine: WAITING -> RUNNING -> FINISHED, back to WAITING when preempted."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from offload.config import SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"  # not in the KV cache: new, or preempted (its KV is recomputed on return)
    RUNNING = "running"  # its KV is cached; it prefills, then decodes one token per step
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    state: SeqState = SeqState.WAITING
    num_cached: int = 0  # tokens whose K and V are in the cache
    finish_reason: str | None = None  # "stop" (eos or stop string) or "length"

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is SeqState.FINISHED
