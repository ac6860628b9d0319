"""What the engine core hands out (offload/core.py): each request's deltas (tokens, text, logprobs, its timeline on
the last) and the core's lifetime counters. Plain values, no tensors: every face (the API, the server, batch jobs)
reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (before temperature and top-k/top-p), and the top
    alternatives', most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One request's timeline, in time.perf_counter() seconds."""

    arrival: float
    first_token: float | None  # None: finished (aborted) before its first token
    finished: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens its (last) admission took from the prefix cache, not computed

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first; None with fewer than two."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step added to one request. The last delta of a request has its finish_reason and metrics."""

    request_id: int
    token_ids: tuple[int, ...]  # new tokens (at most one per step)
    text: str  # new text; "" where the model has no tokenizer
    time: float  # time.perf_counter() when the step ended
    finish_reason: str | None = None  # "stop" (eos or a stop string), "length" or "abort"
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request asked for them
    metrics: RequestMetrics | None = None
    # on a request's first delta, when it asked for them (SamplingParams.prompt_logprobs): one per prompt position
    # from prompt_logprobs_start on, each its prompt token's logprob given the tokens before it; position 0's is None
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()


@dataclass(frozen=True, slots=True)
class CoreCounters:
    """Totals over the core's life; two snapshots subtract into the statistics of what ran between them."""

    requests_added: int = 0
    requests_finished: int = 0  # aborted ones included
    requests_aborted: int = 0
    prompt_tokens: int = 0  # of requests added
    generated_tokens: int = 0
    # a step that computed any prefill tokens counts as prefill, a mixed one too (it costs about what a decode
    # step costs plus its prompt tokens), so that decode_* measure decode-only steps cleanly
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # decode-only steps
    decode_tokens: int = 0  # tokens sampled by decode-only steps
    steps: int = 0
    preemptions: int = 0
    moved_down: int = 0  # running sequences whose KV moved to host RAM instead of being preempted
    moved_up: int = 0  # running sequences whose KV came back from host RAM to the device part
    bytes_read: int = 0  # weight bytes read from storage
    h2d_bytes: int = 0  # weight bytes copied host -> device
    read_seconds: float = 0.0  # wall time with at least one weight read in flight
    stall_seconds: float = 0.0  # time the engine waited for weight reads
    prefill_tokens: int = 0  # known tokens computed (prompts, and recomputation after preemptions)
    prefix_lookup_tokens: int = 0  # tokens of admitted sequences looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens whose keys and values came from cached blocks, not computed
    kv_bytes_down: int = 0  # KV bytes moved from the device part of the pool to host RAM or disk
    kv_bytes_up: int = 0  # KV bytes brought back to the device
    kv_blocks_prefetched: int = 0  # cached KV blocks read from disk while a step computed, ahead of their admission
    drafted_tokens: int = 0  # speculative decoding: drafted tokens verified (the step's extra rows)
    accepted_tokens: int = 0  # of those, accepted: tokens a sequence took beyond one per step
    verify_passes: int = 0  # a sequence's drafts verified by a step: once per sequence and step
    draft_depth: int = 0  # their depths summed: a chain's length, a tree's deepest path (a tree of 3 x 4 drafts: 4)

    @property
    def acceptance_rate(self) -> float:
        """Of the drafted tokens verified, the share accepted (speculative decoding)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_lookup_tokens if self.prefix_lookup_tokens else 0.0

    def __sub__(self, before: CoreCounters) -> CoreCounters:
        """What ran between snapshot `before` and this one."""
        return CoreCounters(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(CoreCounters)})
