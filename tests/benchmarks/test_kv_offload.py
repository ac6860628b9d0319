"""benchmarks/kv_offload.py: a small run holds more at once with the host part, without preempting."""

from __future__ import annotations

import json

from conftest import benchmark_module


def test_a_small_run_holds_more_with_the_host_part(tmp_path):
    out = tmp_path / "kv_offload.json"
    with benchmark_module("kv_offload") as bench:
        report = bench.main(["--quick", "--work-dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    device, over = report["device"], report["device_plus_one"]
    assert device["most_running"] == device["batch"] and over["most_running"] < over["batch"]  # the budget's limit
    (r,) = report["rounds"]
    assert r["offload"]["most_running"] == r["offload"]["batch"] and r["offload"]["all_tokens"]
    assert r["offload"]["preemptions"] == 0
    assert r["offload"]["kv_host_peak"] <= r["offload"]["kv_host_budget"]
    assert report["measured"]["capacity_ratio"] == r["offload"]["batch_x_context"] / device["batch_x_context"]
    assert report["measured"]["capacity_ratio"] >= 4
