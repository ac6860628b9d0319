"""How a mixture's routing met its expert cache (offload/planner/routing.py): what runs measured, kept per model, and
the cost model's hit rate from it."""

from __future__ import annotations

import dataclasses
import math

import pytest

from offload.planner.models import load_model_spec
from offload.planner.routing import KEPT_LOOKUPS, exponent, record, with_measured_routing
from offload.scheduler.cost.moe_cost import hit_rate, sparse_layers


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_runs_hit_rate_at_its_cache_share_gives_the_exponent():
    assert exponent(968, 32, 200 / 256) == pytest.approx(math.log(0.968) / math.log(200 / 256))
    assert exponent(780, 220, 0.78) == pytest.approx(1.0, abs=0.01)  # uniform routing: the share itself
    for nothing in ((0, 10, 0.5), (10, 0, 0.5), (5, 5, 0.0), (5, 5, 1.0), (0, 0, 0.5)):
        assert exponent(*nothing) is None  # no hits, no misses, no cache or all of it: nothing measured


def test_the_cost_models_hit_rate_takes_the_measured_exponent():
    spec = load_model_spec("mixtral-8x7b")
    routed = sparse_layers(spec) * spec.num_experts
    assert hit_rate(spec, routed // 2) == pytest.approx(0.5)  # uniform: the cache's share
    skewed = dataclasses.replace(spec, expert_hit_exponent=0.25)
    assert hit_rate(skewed, routed // 2) == pytest.approx(0.5**0.25)
    assert hit_rate(skewed, routed) == 1.0 and hit_rate(skewed, 2 * routed) == 1.0


def test_runs_are_kept_per_model_and_price_its_later_plans(cache, tmp_path):
    model, other = tmp_path / "moe", tmp_path / "other"
    model.mkdir(), other.mkdir()
    spec = load_model_spec("mixtral-8x7b")
    assert with_measured_routing(spec, model) == (spec, None)  # nothing measured yet
    record(model, 900, 100, 0.5)
    priced, said = with_measured_routing(spec, model)
    assert priced.expert_hit_exponent == pytest.approx(math.log(0.9) / math.log(0.5))
    assert "measured by runs up to" in said and "1000 lookups" in said
    assert with_measured_routing(spec, other) == (spec, None)  # another model's record is its own
    dense = load_model_spec("llama-3.1-8b")
    assert with_measured_routing(dense, model) == (dense, None)  # a dense model has no experts to price
    # a later run adds to it; a run of KEPT_LOOKUPS lookups outweighs everything before it
    record(model, 500, 500, 0.5)
    assert with_measured_routing(spec, model)[0].expert_hit_exponent == pytest.approx(
        (1000 * math.log(0.9) / math.log(0.5) + 1000 * 1.0) / 2000
    )
    record(model, KEPT_LOOKUPS // 2, KEPT_LOOKUPS // 2, 0.5)
    assert with_measured_routing(spec, model)[0].expert_hit_exponent == pytest.approx(1.0)


def test_a_cache_that_hit_less_than_its_share_is_priced_so_within_bounds():
    assert exponent(10, 90, 0.5) == pytest.approx(math.log(0.1) / math.log(0.5))  # worse than uniform: above 1
    assert exponent(1, 10**6, 0.5) == 4.0 and exponent(10**6, 1, 0.01) == 0.02  # clamped both ways


def test_each_decode_batch_keeps_its_own_exponent_and_prices_steps_of_its_size(cache, tmp_path):
    """A batch's step touches more of a layer's experts than one sequence's: the same cache hits less often for it.
    Runs at batch 1 and 8 keep their exponents apart; a step of 1 token is priced at batch 1's, of 8 at batch 8's,
    between them in log(batch), beyond them at the nearest; the pooled exponent stays for what has no batch."""
    model = tmp_path / "moe"
    model.mkdir()
    spec = load_model_spec("mixtral-8x7b")
    routed = sparse_layers(spec) * spec.num_experts
    record(model, 968, 32, 0.8, batch=1)
    record(model, 7440, 560, 0.8, batch=8)  # eight lookups a step for one of batch 1
    priced, said = with_measured_routing(spec, model)
    one, eight = exponent(968, 32, 0.8), exponent(7440, 560, 0.8)
    assert [b for b, _ in priced.expert_hit_exponents] == [1, 8] and "by decode batch 1: " in said
    slots = int(0.8 * routed)
    share = slots / routed
    assert hit_rate(priced, slots, 1) == pytest.approx(share**one)
    assert hit_rate(priced, slots, 8) == pytest.approx(share**eight)
    assert share**eight < hit_rate(priced, slots, 3) < share**one
    assert hit_rate(priced, slots, 256) == pytest.approx(share**eight)  # a prompt's step: the largest batch's
    pooled = (1000 * one + 8000 * eight) / 9000
    assert hit_rate(priced, slots) == pytest.approx(share**pooled)
    # a record of one batch prices every step alike, as before
    single = tmp_path / "single"
    single.mkdir()
    record(single, 968, 32, 0.8, batch=1)
    alone, _ = with_measured_routing(spec, single)
    assert alone.expert_hit_exponents == ((1, pytest.approx(one)),)
    assert hit_rate(alone, slots, 8) == pytest.approx(hit_rate(alone, slots))
