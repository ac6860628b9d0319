"""benchmarks/speculative_serve.py: what it reads from the client's timings and the server's counters."""

from __future__ import annotations

import pytest

from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("speculative_serve") as module:
        yield module


def test_time_between_tokens_is_each_streams_own_over_the_requests_after_the_first_quarter(bench):
    from served import Timed

    # 8 streams: the first two (the warm-up quarter) slow; stream i: 11 tokens over 1 + i seconds after its first
    seen = [Timed(i, i + 0.5, i + 0.5 + (50 if i < 2 else 1 + i), 11) for i in range(8)]
    st = bench.stats(seen)
    gaps = sorted((1 + i) / 10 for i in range(2, 8))  # 0.3 ... 0.8 s between tokens
    assert st["tbt_p50"] == pytest.approx((gaps[2] + gaps[3]) / 2)
    assert st["tbt_p90"] == pytest.approx(gaps[5])
    assert st["ttft_p50"] == pytest.approx(0.5)
    assert st["completion_rate"] == pytest.approx(6 / (7 + 0.5 + 8 - 2))
    assert len(st["streams"]) == 8


def test_the_servers_counters_are_taken_over_the_timed_requests_only(bench):
    before = {"offload_spec_drafted_tokens_total": 10.0, "offload_steps_total": 3.0}
    after = {"offload_spec_drafted_tokens_total": 70.0, "offload_spec_accepted_tokens_total": 50.0,
             "offload_steps_total": 13.0}  # fmt: skip
    assert bench.counts(before, after) == {"drafted": 60.0, "accepted": 50.0, "steps": 10.0}
