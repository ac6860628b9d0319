"""benchmarks/native_cpu.py: a quick run prints its table and writes every kind's rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
    # each row names the path the engine takes here, by its own timings, and how that path compares with the others
    from offload.kernels import choice

    for row in report["rows"]:
        assert row["taken"] in ("native", "torch", "dense") and row["taken_vs_other"] > 0, row
    # the quick run's int4 matrix (576 x 576) timed at its own shape, as a model of it would have it timed
    timed = [choice.Timing(t["rows"], t["us"]) for t in report["choices"]["timings"] if t["kernel"] == "int4 576x576"]
    taken = next(r["taken"] for r in report["rows"] if r["kind"] == "int4" and r["rows"] == 1)
    assert choice.Choices({"int4 576x576": tuple(timed)}).path("int4", 1, (576, 576)) == taken
    assert "worst taken path" in capsys.readouterr().out


def test_rechoose_takes_a_recorded_runs_paths_again_under_this_rule(monkeypatch, capsys, tmp_path):
    """The Xeon's recorded run (AMX, 2 cores): under the rule of at most two switches its int4 products take torch's
    kernel for a decode step's few rows, where one switch had left eight of them on the native kernel at 0.74-0.93x;
    nothing is measured or written. A file that is not such a run is one line and a non-zero exit."""
    results = Path(__file__).parents[2] / "benchmarks" / "results" / "native_cpu-xeon-amx-quiet.json"
    with benchmark_module("native_cpu") as bench:
        monkeypatch.setattr(sys, "argv", ["native_cpu.py", "--rechoose", str(results)])
        bench.main()
        out = capsys.readouterr().out
        assert "int4 14336x4096: torch 1-15, native 16-127, dense from 128" in out
        assert "below 0.97x the best other: 1 of 59" in out
        bad = tmp_path / "other.json"
        bad.write_text("{}")
        monkeypatch.setattr(sys, "argv", ["native_cpu.py", "--rechoose", str(bad)])
        with pytest.raises(SystemExit, match="other.json: not a native_cpu.py results file"):
            bench.main()
