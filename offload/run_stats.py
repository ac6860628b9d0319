"""RunStats: what one `generate` call did, and how fast: the core's counters over the call (`after - before`) and what
only the call knows (its wall clock, its peak of KV blocks, the expert cache's counters)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from offload.common.outputs import CoreCounters
from offload.tiers.experts.expert_cache import ExpertStats


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStats(CoreCounters):
    """What the last `generate` call did, and how fast; the counters (CoreCounters') cover this call only."""

    peak_kv_blocks: int = 0
    # the whole generate call, start to return: scheduling, steps, sampling, stop checks (what a caller waits)
    wall_seconds: float = 0.0
    experts: ExpertStats | None = None  # the expert cache's counters over the run (None: expert streaming off)

    @classmethod
    def of(
        cls, counters: CoreCounters, peak_kv_blocks: int, wall_seconds: float, experts: ExpertStats | None
    ) -> RunStats:
        """The call's statistics from the core's counters over it (`after - before`)."""
        return cls(
            **{f.name: getattr(counters, f.name) for f in fields(CoreCounters)},
            peak_kv_blocks=peak_kv_blocks,
            wall_seconds=wall_seconds,
            experts=experts,
        )

    @property
    def requests(self) -> int:
        """Requests the call ran: one per prompt."""
        return self.requests_added

    @property
    def bytes_per_token(self) -> float:
        """Weight bytes read from storage per generated token."""
        return self.bytes_read / max(self.generated_tokens, 1)

    @property
    def step_seconds(self) -> float:
        """Time inside steps (the engine's pass and sampling); wall_seconds minus this is the loop around them."""
        return self.prefill_seconds + self.decode_seconds

    @property
    def compute_seconds(self) -> float:
        """Wall time not spent waiting for reads."""
        return max(self.wall_seconds - self.stall_seconds, 0.0)

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / max(self.read_seconds, 1e-9) / 1e9

    @property
    def overlap_efficiency(self) -> float:
        """max(io, compute) / wall: 1.0 when reads hide entirely behind compute or the reverse."""
        return max(self.read_seconds, self.compute_seconds) / max(self.wall_seconds, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over the whole call's wall time (prefill included)."""
        return self.generated_tokens / max(self.wall_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of decode-only steps."""
        return self.decode_tokens / max(self.decode_seconds, 1e-9)
