"""benchmarks/kv_swap.py: a small run under a KV budget that preempts, swap against recompute."""

from __future__ import annotations

import json

from conftest import benchmark_module


def test_a_small_run_preempts_and_reports_both_modes(tmp_path):
    out = tmp_path / "kv_swap.json"
    with benchmark_module("kv_swap") as bench:
        report = bench.main(["--quick", "--work-dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    med = report["medians"]
    assert med["recompute"]["preemptions"] > 0 and med["recompute"]["recomputed_tokens"] > 0
    assert med["recompute"]["kv_bytes_down"] == med["recompute"]["hit_tokens"] == 0
    assert med["swap"]["moved_down"] > 0 and med["swap"]["preemptions"] < med["recompute"]["preemptions"]
    assert med["swap"]["recomputed_tokens"] < med["recompute"]["recomputed_tokens"]
    assert med["recompute"]["moved_down"] == 0
    assert med["swap"]["kv_host_peak"] <= med["swap"]["kv_host_budget"]
