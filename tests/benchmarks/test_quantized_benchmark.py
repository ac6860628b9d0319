"""benchmarks/quantized.py: a small run converts the checkpoint, streams each format and reports its limit."""

from __future__ import annotations

import json

import pytest

from conftest import benchmark_module


@pytest.mark.slow
def test_a_small_run_reports_each_format_against_bf16_and_its_limit(tmp_path):
    out = tmp_path / "quantized.json"
    with benchmark_module("quantized") as bench:
        argv = ["--quick", "--formats", "bf16,int4", "--repeats", "1", "--work-dir", str(tmp_path), "--out", str(out)]
        report = bench.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    bf16, int4 = report["results"]["bf16"], report["results"]["int4"]
    assert bf16["status"] == int4["status"] == "ok"
    assert bf16["layers_streamed"] == 4 and bf16["streamed_bytes_per_pass"] > 0  # the 4 MB budget streams bf16
    assert int4["weight_bytes"] < 0.5 * bf16["weight_bytes"]
    assert int4["streamed_bytes_per_pass"] < bf16["streamed_bytes_per_pass"]
    assert bf16["speedup_vs_bf16"] == 1.0
    assert bf16["limit"]["binds"] in ("disk", "compute") and bf16["limit"]["seconds"] > 0
    assert 0.0 <= int4["token_agreement_with_bf16"] <= 1.0
    assert report["conversion_seconds"]["int4"] > 0  # converted once, in the work dir
    assert {g["goal"].split(":")[0] for g in report["goals"]} == {"int4"}
