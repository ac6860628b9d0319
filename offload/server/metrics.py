"""GET /metrics: the server's state in Prometheus' text format (prometheus-client, one registry per app).

Gauges and totals are read from the front's snapshot of the core at scrape time (the core thread takes it after
every step); latencies are observed as deltas reach the event loop: time to first token, the time between a
request's tokens, and each request's whole time.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from offload.common.outputs import Delta
from offload.common.tier import Tier
from offload.server.front import AsyncFront

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)  # seconds
RATE_WINDOW = 10.0  # seconds over which tokens/s is measured


class Metrics:
    def __init__(self, front: AsyncFront | None = None) -> None:
        self.front = front  # None until the model is loaded
        self.registry = CollectorRegistry()
        self.registry.register(_CoreCollector(self))
        self.ttft = Histogram(
            "offload_time_to_first_token_seconds",
            "Request arrival to its first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "offload_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "offload_request_latency_seconds",
            "Request arrival to its last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._rates: deque[tuple[float, int]] = deque()  # (time, generated tokens) at recent scrapes

    def observe(self, delta: Delta, previous: float | None) -> None:
        """A request's delta reached the event loop; `previous`: when its last token came (None: none yet)."""
        if delta.token_ids and previous is not None:
            self.itl.observe(delta.time - previous)
        m = delta.metrics
        if m is not None:
            if m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
            if m.first_token is not None:
                self.e2e.observe(m.finished - m.arrival)

    def tokens_per_second(self, generated: int) -> float:
        now = time.monotonic()
        self._rates.append((now, generated))
        while len(self._rates) > 2 and now - self._rates[1][0] >= RATE_WINDOW:
            self._rates.popleft()
        (t0, g0), (t1, g1) = self._rates[0], self._rates[-1]
        return (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CoreCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        front = self.metrics.front
        if front is None:
            return
        snap = front.snapshot
        c = snap.counters

        def gauge(name: str, doc: str, value: float, labels: dict | None = None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
            family.add_metric(list((labels or {}).values()), value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("offload_requests_running", "Requests admitted to the batch", snap.running)
        yield gauge("offload_requests_waiting", "Requests queued for admission", front.num_waiting)
        yield gauge("offload_kv_blocks_used", "KV cache blocks holding tokens", snap.kv_blocks_used)
        yield gauge("offload_kv_blocks_free", "KV cache blocks free", snap.kv_blocks_free)
        yield gauge(
            "offload_tokens_per_second",
            f"Generated tokens per second over about {RATE_WINDOW:.0f} s",
            self.metrics.tokens_per_second(c.generated_tokens),
        )
        yield counter("offload_requests_added", "Requests handed to the engine core", c.requests_added)
        yield counter("offload_requests_finished", "Requests ended (aborted ones included)", c.requests_finished)
        yield counter("offload_requests_aborted", "Requests aborted (client gone, shutdown)", c.requests_aborted)
        yield counter("offload_prompt_tokens", "Prompt tokens of requests added", c.prompt_tokens)
        yield counter("offload_generation_tokens", "Tokens generated", c.generated_tokens)
        yield counter("offload_steps", "Engine steps", c.steps)
        yield counter("offload_spec_drafted_tokens", "Drafted tokens verified (speculative decoding)", c.drafted_tokens)
        yield counter(
            "offload_spec_accepted_tokens", "Drafted tokens accepted (speculative decoding)", c.accepted_tokens
        )
        yield counter("offload_preemptions", "Sequences preempted for KV space", c.preemptions)
        tiers = CounterMetricFamily(
            "offload_weight_bytes_read", "Weight bytes moved, by the tier they came from", labels=["tier"]
        )
        tiers.add_metric([Tier.NVME], c.bytes_read)
        tiers.add_metric([Tier.HOST], c.h2d_bytes)
        yield tiers
        yield counter("offload_read_stall_seconds", "Time the engine waited for weight reads", c.stall_seconds)
        yield counter("offload_weight_read_seconds", "Time with at least one weight read in flight", c.read_seconds)
        yield counter("offload_step_seconds", "Time inside engine steps", c.prefill_seconds + c.decode_seconds)
        yield counter(
            "offload_prefill_tokens_computed",
            "Prompt tokens computed (not found in the prefix cache)",
            c.prefill_tokens,
        )
        yield counter(
            "offload_prefix_cache_lookup_tokens", "Prompt tokens of admitted requests looked up", c.prefix_lookup_tokens
        )
        yield counter(
            "offload_prefix_cache_hit_tokens", "Prompt tokens served from cached KV blocks", c.prefix_hit_tokens
        )
        kv = CounterMetricFamily("offload_kv_bytes_moved", "KV bytes moved below the device and back", labels=["way"])
        kv.add_metric(["down"], c.kv_bytes_down)
        kv.add_metric(["up"], c.kv_bytes_up)
        yield kv
        yield counter(
            "offload_kv_blocks_prefetched",
            "Cached KV blocks read from disk while a step computed, ahead of their admission",
            c.kv_blocks_prefetched,
        )
