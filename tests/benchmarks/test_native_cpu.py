"""benchmarks/native_cpu.py: a quick run prints its table and writes every kind's rows."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import benchmark_module


def test_a_quick_run_measures_each_kernel_against_torch(tmp_path, monkeypatch, capsys):
    with benchmark_module("native_cpu") as bench:
        from offload.kernels import native

        if native.cpu_missing() is not None or native._int4_mm() is None:
            pytest.skip("the native kernels cannot run here")
        out = tmp_path / "native_cpu.json"
        monkeypatch.setattr(sys, "argv", ["native_cpu.py", "--quick", "--repeats", "1", "--out", str(out)])
        bench.main()
    report = json.loads(out.read_text())
    kinds = {r["kind"] for r in report["rows"]}
    assert kinds == {"int4", "bf16", "attention", "prompt", "rows"} and report["machine"]["threads"] >= 1
    for row in report["rows"]:
        assert row["native_us"] > 0 and row["torch_us"] > 0 and row["max_relative_difference"] < 2.0**-6, row
    assert {r["dispatch"] for r in report["rows"] if r["kind"] == "int4"} == {"native"}  # 1 and 16 rows
    assert "speedup" in capsys.readouterr().out
