"""benchmarks/prefix_cache.py: a small run measures cold, reuse and restart runs in their own processes."""

from __future__ import annotations

import json

from conftest import benchmark_module


def test_a_small_run_reports_the_three_runs(tmp_path):
    out = tmp_path / "prefix_cache.json"
    with benchmark_module("prefix_cache") as bench:
        report = bench.main(["--quick", "--work-dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    med, settings = report["medians"], report["settings"]
    prompt_tokens = settings["requests"] * (settings["system_tokens"] + settings["question_tokens"])
    assert med["cold"]["prefill_tokens"] == prompt_tokens
    # reuse: the system prompt once (its blocks short of the last token are shared), then each question
    assert med["reuse"]["prefill_tokens"] < prompt_tokens / 3
    assert med["restart"]["prefill_tokens"] <= med["reuse"]["prefill_tokens"]  # warm from disk
    (r,) = report["rounds"]
    assert r["restart"]["kv_bytes_up"] > 0 and r["restart"]["seeded_blocks"] > 0
    assert report["measured"]["prefill_reduction"] == med["cold"]["prefill_tokens"] / med["reuse"]["prefill_tokens"]
