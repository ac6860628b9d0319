"""benchmarks/step_profile.py: exclusive time per kind of call, and a small run's steps broken down by it."""

from __future__ import annotations

import time

import pytest

from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("step_profile") as module:
        yield module


def test_a_call_is_charged_its_own_time_and_not_its_timed_callees(bench, monkeypatch):
    class Work:
        def inner(self):
            time.sleep(0.05)

        def outer(self):
            time.sleep(0.01)
            self.inner()

    clock = bench.KindClock()
    clock.wrap(Work, "inner", "inner", monkeypatch.setattr)
    clock.wrap(Work, "outer", "outer", monkeypatch.setattr)
    Work().outer()
    seconds, calls = clock.take()
    assert calls == {"inner": 1, "outer": 1}
    assert seconds["inner"] >= 0.05 and 0.01 <= seconds["outer"] < 0.04  # the inner 0.05 s is not the outer's
    assert clock.take() == ({}, {})  # taking resets


def test_a_small_run_breaks_each_step_into_the_engines_calls(bench, tiny_llama, monkeypatch):
    from peer_engines import Workload

    clock = bench.KindClock()
    bench.instrument(clock, monkeypatch.setattr)
    run = bench.profile(tiny_llama, None, Workload(prompts=2, prompt_tokens=8, new_tokens=3), 2, clock)
    kinds = [s["kind"] for s in run["steps"]]
    assert kinds == ["prefill", "decode", "decode"]
    prefill = run["steps"][0]
    # one micro-batch through 3 layers of 4 products each (q/k/v and gate/up stacked: the layers are held whole),
    # then the LM head
    calls = prefill["calls"]
    assert calls["GEMMs (projections, LM head)"] == 3 * 4 + 1 and calls["head: final norm"] == 1
    assert calls["attention: gathers, masks, copies"] == 3 and calls["KV write"] == 3
    summary = bench.summarize(run["steps"], "decode")
    assert summary["steps"] == 2
    assert sum(summary["parts"].values()) == pytest.approx(summary["wall_seconds"])
    assert all(v >= 0 for k, v in summary["parts"].items() if not k.startswith("rest"))


def test_a_run_with_no_decode_step_summarizes_its_prefill_alone(bench, tiny_llama, monkeypatch, capsys):
    """A prompt that fills the checkpoint's positions (2047 tokens of 2048) gets its one token from the prefill: the
    report holds the prefill and says there was no decode step."""
    from peer_engines import Workload

    clock = bench.KindClock()
    bench.instrument(clock, monkeypatch.setattr)
    run = bench.profile(tiny_llama, None, Workload(prompts=1, prompt_tokens=8, new_tokens=1), 0, clock)
    assert [s["kind"] for s in run["steps"]] == ["prefill"]
    summary = bench.summaries({"every weight in RAM": run}, 1)
    assert list(summary) == ["prefill"] and summary["prefill"]["every weight in RAM"]["steps"] == 1
    assert "no decode step" in capsys.readouterr().out
