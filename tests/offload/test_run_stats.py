"""RunStats: one wall clock around the whole generate call, and the rates derived from it."""

from __future__ import annotations

import time

import pytest

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.scheduler.batcher import Batcher

PAUSE = 0.02  # seconds the patched scheduler spends per step, outside engine.step


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama")
    return LLM(path, EngineConfig(kv_cache_bytes=1 << 22, block_size=4))


def test_wall_clock_covers_the_loop_around_the_steps(llm, monkeypatch):
    """Time spent scheduling (here: a pause in every schedule call) is in wall_seconds, not in the steps'."""
    schedule = Batcher.schedule

    def slow_schedule(self):
        time.sleep(PAUSE)
        return schedule(self)

    monkeypatch.setattr(Batcher, "schedule", slow_schedule)
    llm.generate_ids([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    s = llm.last_run
    assert s.steps >= 6
    assert s.wall_seconds >= s.step_seconds + s.steps * PAUSE
    assert s.step_seconds == pytest.approx(s.prefill_seconds + s.decode_seconds)
    assert s.tokens_per_second == pytest.approx(s.generated_tokens / s.wall_seconds)
    assert s.compute_seconds == pytest.approx(max(s.wall_seconds - s.stall_seconds, 0.0))


def test_the_wall_clock_is_the_calls_own(llm):
    """Measured from outside, the call takes at least its reported wall time, and each call reports only its own."""
    start = time.perf_counter()
    llm.generate_ids([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    outside = time.perf_counter() - start
    assert 0 < llm.last_run.wall_seconds <= outside
    assert llm.last_run.requests == 1 and llm.last_run.generated_tokens == 2
