"""Speculative decoding in the plan (offload/planner/speculation.py): `offload plan --speculate`, the acceptance runs
measured and kept per model and drafter, and the engine's chain length when the user gives none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.cli import main
from offload.common.config import EngineConfig, Policy
from offload.common.errors import OffloadError
from offload.common.outputs import CoreCounters
from offload.planner.models import load_model_spec
from offload.planner.profiles import load_profile
from offload.planner.speculation import ASSUMED, DEFAULT_K, KEPT_PASSES, acceptance, engine_k, measured_trees, record
from offload.scheduler.cost.predict import Candidate, decode_step_seconds, make_context
from offload.scheduler.cost.speculation_cost import best_k, speculate, tokens_per_pass

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_plan_prices_speculation_at_batch_one_and_at_the_best_batch(capsys):
    argv = ["plan", "--model", "llama-3.1-70b", "--hardware", "rtx4090-24gb", "--speculate", "self"]
    assert main([*argv, "--acceptance", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "speculate self at batch 1: k = " in out and "acceptance 0.900 a draft (given)" in out
    assert main([*argv, "--acceptance", "0.9", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["speculation"]
    one = next(r for r in rows if r["candidate"]["batch"] == 1)
    assert (
        one["k"] > 1
        and one["speedup"] > 2
        and one["tokens_per_pass"] == pytest.approx((1 - 0.9 ** (one["k"] + 1)) / 0.1)
    )
    assert one["acceptance_source"] == "given"


def test_plan_refuses_an_acceptance_that_is_not_a_share(capsys):
    argv = ["plan", "--model", "llama-3.1-8b", "--hardware", "l4-24gb", "--speculate", "ngram", "--acceptance", "1.5"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert "--acceptance must be a share between 0 and 1, got 1.5" in err and len(err.strip().splitlines()) == 1


def test_runs_acceptance_is_kept_for_the_models_later_plans(cache, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert acceptance(model, "self").source.startswith("assumed") and acceptance(model, "self").value == ASSUMED["self"]
    record(model, "self", CoreCounters(drafted_tokens=8 * 20, accepted_tokens=8 * 20 - 10, verify_passes=20))
    got = acceptance(model, "self")
    assert got.source.startswith("measured") and "150 of 160 drafts accepted in 20 passes" in got.source
    assert (1 - got.value**9) / (1 - got.value) == pytest.approx((150 + 20) / 20, rel=1e-6)
    # a later run adds to it
    record(model, "self", CoreCounters(drafted_tokens=8 * 10, accepted_tokens=40, verify_passes=10))
    assert "190 of 240 drafts accepted in 30 passes" in acceptance(model, "self").source
    # a long run outweighs the earlier ones: they keep what KEPT_PASSES leaves it
    record(
        model,
        "self",
        CoreCounters(drafted_tokens=8 * (KEPT_PASSES - 3), accepted_tokens=0, verify_passes=KEPT_PASSES - 3),
    )
    got = acceptance(model, "self")
    assert f"drafts accepted in {KEPT_PASSES} passes" in got.source and got.value < 0.1
    assert acceptance(model, "ngram").source.startswith("assumed")  # kept per drafter
    assert acceptance(model, "self", 0.5) == (0.5, "given")


def test_trees_are_recorded_apart_and_priced_per_depth(cache, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    record(model, "self", CoreCounters(drafted_tokens=8 * 20, accepted_tokens=60, verify_passes=20, draft_depth=160))
    chain = acceptance(model, "self")
    # no tree measured yet: a tree of 3 is priced at the chain's rate, and says so
    assert acceptance(model, "self", topk=3).value == chain.value and measured_trees(model, "self") == []
    assert "the chain's, as no run measured trees of 3" in acceptance(model, "self", topk=3).source
    # 20 passes of trees 4 deep (12 drafts each) that kept 3 drafts a pass: a per depth makes a 4-chain yield 4 a pass
    record(model, "self", CoreCounters(drafted_tokens=240, accepted_tokens=60, verify_passes=20, draft_depth=80), 3)
    tree = acceptance(model, "self", topk=3)
    assert tokens_per_pass(tree.value, 4) == pytest.approx(4.0, rel=1e-6) and "from trees 4.0 deep" in tree.source
    assert acceptance(model, "self") == chain and measured_trees(model, "self") == [3]  # the chain's record as it was


def test_a_tree_verifies_its_depth_times_its_candidates_and_yields_by_its_depth():
    spec = load_model_spec("tinyllama-1.1b")
    ctx = make_context(spec, load_profile("rtx4090-24gb"), "bfloat16", 16)
    cand = Candidate(1, 1, Policy.from_counts(0, 0, spec.num_layers, ring_slots=2))
    chain, tree = (speculate(ctx, cand, 600, 512, 4, 0.7, None, topk) for topk in (1, 3))
    assert tree.tokens_per_pass == chain.tokens_per_pass == pytest.approx(tokens_per_pass(0.7, 4))
    assert tree.drafted == 12 and chain.drafted == 4
    wide = Candidate(13, 1, cand.policy)  # 4 x 3 drafted rows and the sequence's own: a step of 13 rows
    assert tree.verify_seconds == pytest.approx(decode_step_seconds(ctx, wide, 600, 512))
    # a batch of 8 verifies at most 256 drafted rows: trees of 8 go at most 4 deep
    assert best_k(ctx, Candidate(8, 1, cand.policy), 600, 512, 0.99, None, topk=8).k <= 4


def test_plan_prices_the_tree_sizes_runs_measured_and_the_one_asked_for(cache, capsys):
    argv = ["plan", "--model", "llama-3.1-70b", "--hardware", "rtx4090-24gb", "--speculate", "ngram"]
    assert main([*argv, "--speculative-topk", "3", "--acceptance", "0.6", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["speculation"]
    assert all(r["topk"] == 3 for r in rows)
    assert main([*argv, "--speculative-topk", "3"]) == 0
    out = capsys.readouterr().out
    assert "trees of the top 3, k = " in out and "the chain's, as no run measured trees of 3" in out
    assert main([*argv, "--speculative-topk", "9"]) != 0
    assert "--speculative-topk must be in 1..8, got 9" in capsys.readouterr().err


def test_the_engine_drafts_what_it_was_given_else_the_planners_k(cache, tmp_path):
    spec = load_model_spec("tinyllama-1.1b")
    policy = Policy.from_counts(0, 0, spec.num_layers, ring_slots=2)
    given = EngineConfig(speculate="self", num_speculative_tokens=3)
    assert engine_k(tmp_path, spec, "bfloat16", given, policy) == (3, "given")
    unset = EngineConfig(speculate="self")
    k, why = engine_k(tmp_path, spec, "bfloat16", unset, policy)
    assert k == DEFAULT_K and "no hardware profile" in why  # nothing to plan by in a fresh cache
    (cache / "hardware").mkdir(parents=True)
    (cache / "hardware" / "local.json").write_text((CONFIGS / "hardware" / "rtx4090-24gb.json").read_text())
    k, why = engine_k(tmp_path, spec, "bfloat16", unset, policy)
    assert why.startswith("planned:") and 1 <= k <= 64


def test_a_bad_chain_length_is_refused():
    with pytest.raises(OffloadError, match="num_speculative_tokens must be in 1..64, got 0"):
        EngineConfig(speculate="ngram", num_speculative_tokens=0)


def test_probe_measures_a_drafters_acceptance_for_the_models_plans(cache, smollm2_gguf, capsys):
    """`offload probe --model M --speculate ngram`: the built-in prompts generated with the drafter, its counts kept in
    M's record, which the plan then prices with instead of the assumed rate."""
    argv = ["--model", str(smollm2_gguf), "--speculate", "ngram"]
    assert main(["probe", *argv, "--new-tokens", "8", "--num-speculative-tokens", "4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("speculate ngram on ") and "measured by runs up to" in line
    records = list((cache / "speculation").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["verify_passes"] > 0
    assert main(["plan", *argv, "--hardware", "rtx4090-24gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speculation"][0]["acceptance_source"].startswith("measured")
    assert main(["probe", *argv, "--speculative-topk", "9"]) != 0
    err = capsys.readouterr().err
    assert "speculative_topk must be in 1..8, got 9" in err and len(err.strip().splitlines()) == 1
