"""RunStats: what one `generate` call did, and how fast (offload/api.py fills it from counters before and after)."""

from __future__ import annotations

from dataclasses import dataclass

from offload.tiers.experts.expert_cache import ExpertStats

KV_COUNTERS = (
    "prefill_tokens",
    "prefix_hit_tokens",
    "prefix_lookup_tokens",
    "kv_bytes_down",
    "kv_bytes_up",
    "kv_blocks_prefetched",
)


@dataclass(frozen=True, slots=True)
class RunStats:
    """What the last `generate` call did, and how fast."""

    requests: int
    prompt_tokens: int
    generated_tokens: int
    # a step that computed any prefill tokens counts as prefill, a mixed one too (it costs about what a
    # decode step costs plus its prompt tokens), so that decode_* measure decode-only steps cleanly
    prefill_seconds: float
    decode_seconds: float  # decode-only steps
    decode_tokens: int  # tokens sampled by decode-only steps
    steps: int
    preemptions: int
    peak_kv_blocks: int
    bytes_read: int  # weight bytes read from storage during the run
    read_seconds: float  # wall time with at least one weight read in flight
    stall_seconds: float  # time the engine waited for weight reads
    # the whole generate call, start to return: scheduling, steps, sampling, stop checks (what a caller waits)
    wall_seconds: float
    prefill_tokens: int = 0  # known tokens computed (prompt tokens not found in the prefix cache, recomputation)
    prefix_hit_tokens: int = 0  # prompt tokens whose keys and values came from cached blocks
    prefix_lookup_tokens: int = 0  # prompt tokens looked up (admissions; a re-admission after preemption too)
    kv_bytes_down: int = 0  # KV bytes moved to host RAM or disk
    kv_bytes_up: int = 0  # KV bytes brought back to the device
    kv_blocks_prefetched: int = 0  # cached KV blocks read from disk while a step computed, ahead of their admission
    moved_down: int = 0  # running sequences whose KV moved to host RAM instead of being preempted
    moved_up: int = 0  # running sequences whose KV came back to the device part
    experts: ExpertStats | None = None  # the expert cache's counters over the run (None: expert streaming off)

    @property
    def bytes_per_token(self) -> float:
        """Weight bytes read from storage per generated token."""
        return self.bytes_read / max(self.generated_tokens, 1)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

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
