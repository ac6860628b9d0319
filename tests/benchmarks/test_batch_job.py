"""benchmarks/batch_job.py: a small run on the demo model writes both rates, the ratio and same results."""

from __future__ import annotations

import json

from conftest import benchmark_module


def test_a_small_run_compares_the_job_with_generate(demo_model, tmp_path):
    with benchmark_module("batch_job") as bench:
        assert len(set(bench.prompts(50))) == 50
        out = tmp_path / "batch_job.json"
        report = bench.main(
            ["--requests", "12", "--max-tokens", "4", "--rounds", "1", "--model", str(demo_model), "--out", str(out)]
        )
    assert json.loads(out.read_text()) == report
    (r,) = report["rounds"]
    assert report["same_results"] and r["job_tokens"] == r["generate_tokens"] > 0
    assert report["ratio"] == report["job_tokens_per_second"] / report["generate_tokens_per_second"] > 0
