"""The cost model's price of speculative decoding (scheduler/cost/speculation_cost.py): tokens a pass from the
acceptance, a pass's cost from the model's own steps, and the chain length it prices best."""

from __future__ import annotations

import pytest

from offload.common.config import Policy
from offload.planner.models import load_model_spec
from offload.planner.profiles import load_profile
from offload.planner.speculation import draft_for
from offload.scheduler.cost.predict import Candidate, decode_step_seconds, make_context
from offload.scheduler.cost.speculation_cost import acceptance_for, best_k, speculate, tokens_per_pass


def test_tokens_a_pass_follow_the_chain_formula():
    assert tokens_per_pass(0.0, 8) == 1.0  # every draft rejected: the target's own token only
    assert tokens_per_pass(1.0, 8) == 9.0  # every draft accepted, then the target's token
    assert tokens_per_pass(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)


@pytest.mark.parametrize(("rate", "k"), [(0.3, 2), (0.8, 4), (0.95, 8), (0.99, 16)])
def test_the_acceptance_a_run_measured_is_recovered_from_its_tokens_a_pass(rate, k):
    assert acceptance_for(tokens_per_pass(rate, k), k) == pytest.approx(rate, abs=1e-9)


def streamed_70b():
    """Llama-3.1-70B on an RTX 4090: its layers stream from host RAM over PCIe at batch 1."""
    shape, hw = load_model_spec("llama-3.1-70b"), load_profile("rtx4090-24gb")
    ctx = make_context(shape, hw, "bfloat16", 16)
    policy = Policy.from_counts(0, shape.num_layers, 0, ring_slots=2)
    return shape, hw, ctx, Candidate(1, 1, policy)


def test_where_weights_stream_a_verify_pass_costs_about_a_plain_step_and_drafts_pay():
    shape, hw, ctx, cand = streamed_70b()
    draft = draft_for(shape, hw, "bfloat16", "self")
    price = speculate(ctx, cand, 600, 512, 8, 0.9, draft)
    plain = decode_step_seconds(ctx, cand, 600, 512)
    assert price.plain_seconds == plain
    assert plain <= price.verify_seconds <= 1.2 * plain  # nine rows against one: the weights' transfer dominates
    # the int4 copy on the CPU, resident: a catch-up prefill of about a pass's tokens, then 7 decode steps
    one = price.draft_seconds / 8
    assert 0 < one < price.verify_seconds / 4
    assert price.speedup == pytest.approx(price.tokens_per_pass * plain / (price.verify_seconds + price.draft_seconds))
    assert price.speedup > 2.5


def test_the_best_chain_is_long_when_drafts_pass_and_short_when_they_do_not():
    shape, hw, ctx, cand = streamed_70b()
    draft = draft_for(shape, hw, "bfloat16", "self")
    good, bad = best_k(ctx, cand, 600, 512, 0.95, draft), best_k(ctx, cand, 600, 512, 0.05, draft)
    assert good.k > 4 and good.speedup > 3
    assert bad.k == 1 and bad.speedup < 1  # a pass that yields nothing more still pays the draft and the row
    # prompt lookup drafts for free: with every draft rejected it costs only the extra rows
    free = best_k(ctx, cand, 600, 512, 0.0, None)
    assert free.draft_seconds == 0 and free.speedup == pytest.approx(free.plain_seconds / free.verify_seconds)


def test_a_large_batch_drafts_within_what_a_step_verifies():
    shape, hw, ctx, cand = streamed_70b()
    big = Candidate(128, 1, cand.policy)
    assert best_k(ctx, big, 600, 512, 0.99, None).k <= 2  # 256 drafted tokens a step at most (scheduler/batcher.py)
