"""benchmarks/cpu_check.py: the goals judged from recorded results, and steps that fail or run too long failing
their goals (the steps themselves are the benchmarks, tested beside them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import benchmark_module

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def check():
    with benchmark_module("cpu_check") as module:
        yield module


def recorded(name: str) -> tuple[dict, str]:
    path = RESULTS / name
    return json.loads(path.read_text()), str(path)


def test_every_taken_path_is_judged_against_the_bound(check):
    report, source = recorded("native_cpu-epyc.json")
    (verdict,) = check.judge_kernels(report, source)
    assert verdict.met is True and verdict.measured.startswith(f"0 of {len(report['rows'])} rows below")
    slow = dict(report["rows"][3], taken_vs_other=0.95)
    (verdict,) = check.judge_kernels(report | {"rows": [*report["rows"], slow]}, source)
    assert verdict.met is False and "1 of" in verdict.measured and "worst 0.95x" in verdict.measured
    assert f"{slow['shape']} at {slow['rows']} rows" in verdict.measured


def test_the_amx_goals_are_judged_only_on_amx(check):
    report, source = recorded("prompt_rate-epyc-1.json")
    (shown,) = check.judge_prompt(report, source, amx=False)
    (judged,) = check.judge_prompt(report, source, amx=True)
    assert shown.met is None and judged.met is True and shown.measured == judged.measured
    assert shown.measured.startswith(f"{report['rows']['timed']['of_gemm']:.0%} ")
    slow = report | {"rows": {"timed": report["rows"]["timed"] | {"of_gemm": 0.58}}}
    assert check.judge_prompt(slow, source, amx=True)[0].met is False

    report, source = recorded("vs_llamacpp-b16-quiet-xeon-amx.json")  # batch 16 only
    batch16, batch1 = check.judge_llamacpp(report, source, amx=True)
    assert batch16.met is True and batch16.measured.startswith("4.04x (356.0 against 88.0 tokens/s")
    assert "repacking: off: the default died here" in batch16.measured
    assert batch1.met is None and batch1.measured == "not run"
    report, source = recorded("vs_llamacpp-xeon-amx.json")  # batch 1 at 0.85x there
    assert [v.met for v in check.judge_llamacpp(report, source, amx=True)] == [True, False]
    assert [v.met for v in check.judge_llamacpp(report, source, amx=False)] == [None, None]
    died = [r | {"status": "failed: signal 11"} if r["engine"] == "llama.cpp" else r for r in report["rows"]]
    batch16, _ = check.judge_llamacpp(report | {"rows": died}, source, amx=True)
    assert batch16.met is False and batch16.measured == "ours: ok; llama.cpp: failed: signal 11"


def test_a_step_that_fails_or_runs_past_its_bound_fails_its_goal_and_the_exit_status(check, tmp_path, monkeypatch):
    scripts = {"kernels": "echo measuring; exit 3", "prompt": "echo started; sleep 60"}
    monkeypatch.setattr(check, "commands", lambda step, out, quick, clone: ["bash", "-c", scripts[step]])
    monkeypatch.setitem(check.LIMIT_S, "prompt", 1)
    argv = ["--steps", "kernels,prompt", "--results", str(tmp_path), "--tag", "test"]
    assert check.main(argv) == 1
    report = json.loads((tmp_path / "cpu_check-test.json").read_text())
    assert [(s["step"], s["exit"]) for s in report["steps"]] == [("kernels", 3), ("prompt", 124)]
    assert report["steps"][1]["seconds"] < 45  # ended at its bound, not after the minute
    goals = {v["goal"]: v for v in report["verdicts"]}
    assert goals["kernels runs"]["met"] is False and goals["kernels runs"]["measured"] == "exit 3: measuring"
    assert goals["prompt runs"]["measured"] == "timed out: started"
    assert (tmp_path / "cpu_check-test-kernels.log").read_text() == "measuring\n"
    with pytest.raises(SystemExit, match="unknown step 'gpu'"):
        check.main(["--steps", "gpu", "--results", str(tmp_path)])


def test_the_cpu_is_named_by_its_family_and_amx(check, monkeypatch):
    facts = {"model name": "Intel(R) Xeon(R) Platinum 8480+", "flags": "fpu avx512_bf16 amx_bf16 amx_tile amx_int8"}
    monkeypatch.setattr(check, "cpuinfo", facts.get)
    assert check.cpu_tag() == "xeon-amx"
    facts.update({"model name": "AMD EPYC 9654 96-Core Processor", "flags": "fpu avx512_bf16"})
    assert check.cpu_tag() == "epyc"
