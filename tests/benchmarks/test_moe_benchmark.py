"""benchmarks/moe.py: a tiny Mixtral streamed by expert, by whole layer and by Accelerate, each with its limit."""

from __future__ import annotations

import json

import pytest

from conftest import benchmark_module


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The planner's profile of this machine, which the benchmark measures and saves, goes to a cache folder of the
    test's own: a saved profile changes what later tests' engines choose (io_backend "auto")."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.slow
def test_a_small_run_reads_fewer_bytes_by_expert_than_by_layer(tmp_path):
    out = tmp_path / "moe.json"
    with benchmark_module("moe") as bench:
        argv = ["--quick", "--batches", "1", "--new-tokens", "4", "--repeats", "1"]
        argv += ["--work-dir", str(tmp_path), "--out", str(out)]
        report = bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    experts, layers, accelerate = (report["results"][name]["1"] for name in ("experts", "layers", "accelerate"))
    assert experts["status"] == layers["status"] == accelerate["status"] == "ok"
    assert experts["experts"]["misses"] > 0 and experts["expert_cache_memory"] > 0
    assert 0 < experts["bytes_per_token"] < layers["bytes_per_token"]  # only the chosen experts are read
    assert experts["token_ids"] == layers["token_ids"]  # the same model, computed the same way
    frequency = report["results"]["experts-frequency"]["1"]
    assert frequency["token_ids"] == experts["token_ids"] and experts["experts"]["prefetches"] > 0
    assert experts["rounds_tokens_per_second"] == [experts["tokens_per_second"]]
    assert experts["predicted_bytes_per_token"] > 0 and "predicted_bytes_per_token" not in layers
    assert all(r["limit_seconds"] > 0 and r["limit_binds"] in ("disk", "compute") for r in (experts, layers))
    assert {g["goal"] for g in report["goals"]} == {"bytes_fraction", "speedup_vs_layers", "speedup_vs_accelerate"}


@pytest.mark.slow
def test_a_small_deepseek_run_prints_the_planners_tokens_per_second_beside_ours(tmp_path):
    out = tmp_path / "moe-deepseek.json"
    with benchmark_module("moe") as bench:
        argv = ["--family", "deepseek_v3", "--quick", "--batches", "1", "--new-tokens", "4", "--repeats", "1"]
        argv += ["--engines", "experts,layers", "--work-dir", str(tmp_path), "--out", str(out)]
        report = bench.main(argv)
    assert report["family"] == "deepseek_v3" and report["checkpoint"]["n_routed_experts"] == 32
    experts, layers = (report["results"][name]["1"] for name in ("experts", "layers"))
    assert experts["status"] == layers["status"] == "ok" and experts["token_ids"] == layers["token_ids"]
    assert experts["planned_tokens_per_second"] > 0 and layers["planned_tokens_per_second"] > 0
    assert experts["planner_error"] == experts["planned_tokens_per_second"] / experts["tokens_per_second"] - 1
    assert {g["goal"] for g in report["goals"]} == {"speedup_vs_layers", "planner_error"}
