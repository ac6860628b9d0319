"""benchmarks/quant_accuracy.py: a small run, int8 per channel and int4 in groups of 32 against the bf16 model."""

from __future__ import annotations

import json

from conftest import benchmark_module


def test_a_small_run_measures_int8_closer_than_int4(tmp_path):
    out = tmp_path / "quant_accuracy.json"
    with benchmark_module("quant_accuracy") as bench:
        report = bench.main(["--quick", "--work-dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert list(tmp_path.iterdir()) == [out]  # the checkpoints and conversions are removed
    model = report["models"]["llama"]
    assert model["prompt_lengths"] == [8, 16, 24, 32]
    assert set(model["formats"]) == {"int8-channel-cpu", "int4-g32-cpu"}
    int8, int4 = model["formats"]["int8-channel-cpu"], model["formats"]["int4-g32-cpu"]
    assert 0 < int8["logits"]["mean_abs"] < int4["logits"]["mean_abs"]
    assert int8["logits"]["max_abs"] < int4["logits"]["max_abs"]
    assert int8["greedy"]["prefix_agreement"] >= int4["greedy"]["prefix_agreement"]
    for f in (int8, int4):
        lg, gr = f["logits"], f["greedy"]
        assert lg["positions"] == sum(n + 16 for n in model["prompt_lengths"])
        assert lg["max_abs"] >= lg["mean_abs"] and lg["max_rel"] == lg["max_abs"] / lg["ref_std"]
        assert 0 <= gr["prefix_agreement"] <= 1 and 0 <= gr["identical_prompts"] <= 4
        for p in gr["per_prompt"]:
            assert p["identical"] == (p["prefix_agreement"] == 1)
            assert p["identical"] or (p["diverges_at"] == p["prefix_agreement"] * 16 and p["ref_top2_margin"] >= 0)
        assert f["tensors_quantized"] == 3 * 7  # q, k, v, o, gate, up, down in each of TINY's 3 layers
        assert f["bytes_ratio"] == f["weight_bytes"] / f["source_weight_bytes"]
    assert int4["weight_bytes"] < int8["weight_bytes"]
    f32 = model["float32_arithmetic"]  # the same weights computed in float32: bf16 rounding's own effect
    assert f32["logits"]["mean_abs"] > 0 and f32["logits"]["positions"] == int8["logits"]["positions"]
    assert 0 <= f32["greedy"]["prefix_agreement"] <= 1
    assert 0 < model["ref_scores_pick_ref_tokens"] <= 1
