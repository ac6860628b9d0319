"""benchmarks/mixed_lengths.py: the padding arithmetic exactly, and both engines counted on a tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from conftest import benchmark_module, make_checkpoint


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("mixed_lengths") as module:
        yield module


def test_static_cost_counts_each_kind_of_padding(bench):
    R = bench.Request
    requests = [R((5,) * 3, 2), R((5,) * 5, 4), R((5,) * 4, 1)]
    # batch 1: longest prompt 5, longest count 4 -> 2 x (5 + 4 - 1) = 16 positions; batch 2 alone: 4 + 1 - 1 = 4
    cost = bench.static_cost(requests, batch=2)
    assert [r.positions for r in requests] == [4, 8, 4]
    assert cost == bench.PaddingCost(real=16, prompt_padding=2, decode_padding=2)
    assert cost.computed == 20 and cost.waste == 0.2
    assert bench.static_cost(requests, batch=1).waste == 0.0


def test_workload_is_seeded_and_in_range(bench):
    w = bench.Workload(requests=50, prompt_min=3, prompt_max=9, new_min=1, new_max=4, seed=7)
    requests = w.make(vocab=40)
    assert requests == w.make(vocab=40) != bench.Workload(requests=50, seed=8).make(vocab=40)
    assert {len(r.prompt_ids) for r in requests} <= set(range(3, 10))
    assert {r.new_tokens for r in requests} <= set(range(1, 5))
    assert all(3 <= t < 40 for r in requests for t in r.prompt_ids)
    with pytest.raises(ValueError, match="prompt lengths 9..3"):
        bench.Workload(prompt_min=9, prompt_max=3)


def test_agreement_counts_positions_and_prefixes(bench):
    got = bench.agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [7, 5]], first=2)
    assert got["rate_first_tokens"] == 3 / 4 and got["rate_all_tokens"] == 3 / 5
    assert got["requests_equal_over_first_tokens"] == 1 and got["requests_equal_throughout"] == 0
    assert got["mean_common_prefix"] == 1.0


def test_both_engines_compute_what_the_arithmetic_says(bench, tmp_path):
    make_checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    requests = bench.Workload(requests=5, prompt_min=2, prompt_max=20, new_min=1, new_max=6, seed=3).make(vocab=300)
    static = bench.static_cost(requests, batch=2)
    theirs = bench.run_transformers(tmp_path, requests, batch=2)
    ours = bench.run_ours(tmp_path, requests, batch=2, max_seqs=2, block=4)
    assert theirs.computed_positions == static.computed > static.real
    batches = bench.static_batches(requests, 2)
    assert theirs.prefill_passes == len(batches) == 3
    assert theirs.decode_passes == sum(max(r.new_tokens for r in b) - 1 for b in batches)
    assert ours.computed_positions == static.real
    assert ours.extra["preemptions"] == 0 and ours.extra["most_running"] == 2
    # uncapped, in the same KV memory: more run at once
    free = bench.run_ours(tmp_path, requests, batch=2, block=4)
    assert free.extra["kv_cache_bytes"] == ours.extra["kv_cache_bytes"]
    assert free.extra["most_running"] > 2
    assert free.computed_positions >= static.real  # plus what preemption made it recompute
    assert (free.computed_positions == static.real) == (free.extra["preemptions"] == 0)
    for result in (theirs, ours, free):
        assert [len(t) for t in result.token_ids] == [r.new_tokens for r in requests]
        assert result.generated_tokens == sum(r.new_tokens for r in requests)


def test_static_peak_pairs_a_batch_longest_prompt_with_its_longest_count(bench):
    R = bench.Request
    requests = [R((5,) * 9, 2), R((5,) * 3, 4), R((5,) * 4, 1)]
    # batch 2: [9+2, 3+4] -> 2 x (9 + 4) = 26, more than two copies of its longest request (11); [4+1] alone -> 5
    assert bench.static_peak_tokens(requests, 2) == 26
    assert bench.static_peak_tokens(requests, 1) == 11


def test_verdict_ratio_is_taken_within_each_round(bench):
    # the machine sped up in round 3: pairing the fastest of each engine would mix rounds; each round is a ratio
    theirs, ours = bench.RunResult("transformers"), bench.RunResult("ours")
    theirs.extra["runs"] = [{"wall_seconds": s} for s in (50.0, 52.0, 40.0)]
    ours.extra["runs"] = [{"wall_seconds": s} for s in (25.0, 20.0, 20.0)]
    assert bench.round_speedups(theirs, ours) == [2.0, 2.6, 2.0]
