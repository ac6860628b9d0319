"""Latency under a request rate: the continuous-batching simulation over the cost model, and `offload plan --qps`."""

from __future__ import annotations

import json
import statistics

import pytest

from offload.cli import main
from offload.planner.models import load_model_spec
from offload.planner.profiles import load_profile
from offload.scheduler.cost.predict import Workload, _step, make_context, mixed_step_seconds
from offload.scheduler.cost.queueing import arrival_times, simulate
from offload.scheduler.cost.search import search

SHAPE = load_model_spec("llama-3.1-8b")
HW = load_profile("rtx4090-24gb")
WORK = Workload(512, 64)


@pytest.fixture(scope="module")
def per_batch():
    preds = search(SHAPE, HW, WORK, dtype="bfloat16", batches=[1, 4, 16, 64])
    out = {}
    for p in preds:
        if p.fits and not p.unsupported:
            out.setdefault(p.candidate.batch, p)
    return out


def test_a_step_of_one_kind_costs_what_the_cost_model_says(per_batch) -> None:
    ctx = make_context(SHAPE, HW, "bfloat16", 16)
    for p in per_batch.values():
        cand = p.candidate
        prefill = mixed_step_seconds(ctx, cand, 0, 512, cand.batch, 512)
        assert prefill == pytest.approx(_step(ctx, cand, 512, True, 512)["wall"])
        decode = mixed_step_seconds(ctx, cand, cand.batch, 600, 0, 512)
        assert decode == pytest.approx(_step(ctx, cand, 600, False, 512)["wall"])
        both = mixed_step_seconds(ctx, cand, cand.batch, 600, 1, 512)
        assert decode < both < decode + mixed_step_seconds(ctx, cand, 0, 512, 1, 512) + 1e-12  # one read serves both


def test_poisson_arrivals_come_at_the_rate_and_bursts_together() -> None:
    times = arrival_times(2.0, 4000, "poisson", seed=1)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.05)
    burst = arrival_times(2.0, 16, "burst")
    assert burst[:8] == [0.0] * 8 and burst[8:] == [4.0] * 8
    with pytest.raises(ValueError, match="arrival pattern"):
        arrival_times(1.0, 3, "uniform")


def test_a_light_rate_waits_for_one_prompt_and_a_heavy_one_queues(per_batch) -> None:
    ctx = make_context(SHAPE, HW, "bfloat16", 16)
    p = per_batch[16]
    light = simulate(ctx, p, 512, 64, rate=0.01)
    one_prompt = mixed_step_seconds(ctx, p.candidate, 0, 512, 1, 512)
    assert light.ttft_p50 == pytest.approx(one_prompt, rel=0.05)  # nothing else running: its own prefill
    one_token = mixed_step_seconds(ctx, p.candidate, 1, 512 + 32, 0, 512)
    assert light.stream_tps_p50 == pytest.approx(1 / one_token, rel=0.1)
    assert light.mean_batch == pytest.approx(1.0, abs=0.05) and not light.saturated
    busy = simulate(ctx, p, 512, 64, rate=0.6 * light.max_rate)
    assert busy.mean_batch > 3 and busy.stream_tps_p50 < light.stream_tps_p50  # bigger steps, slower streams
    over = simulate(ctx, p, 512, 64, rate=2 * light.max_rate)
    assert over.saturated and over.ttft_p90 > 10 * busy.ttft_p90  # the queue grows
    assert over.throughput == pytest.approx(light.max_rate * 64, rel=0.5)  # it serves about its capacity


def test_the_served_engine_s_own_costs_slow_each_step_and_each_first_token(per_batch) -> None:
    import dataclasses

    from offload.common.hardware import ServedStep

    p, served = per_batch[16], ServedStep(step=2e-3, per_stream=1e-3, per_prompt_token=1e-5, request=0.05)
    ctx = make_context(SHAPE, HW, "bfloat16", 16)
    costed = make_context(SHAPE, dataclasses.replace(HW, served_step=served), "bfloat16", 16)
    bare, light = simulate(ctx, p, 512, 64, rate=0.01), simulate(costed, p, 512, 64, rate=0.01)
    # alone: the request's handling, then its prefill step with the step's, its stream's and its tokens' costs
    assert light.ttft_p50 == pytest.approx(bare.ttft_p50 + 0.05 + 2e-3 + 1e-3 + 512 * 1e-5, rel=1e-3)
    one_token = mixed_step_seconds(ctx, p.candidate, 1, 512 + 32, 0, 512)
    assert light.stream_tps_p50 == pytest.approx(1 / (one_token + 3e-3), rel=0.1)
    assert light.max_rate < bare.max_rate
    # staggered arrivals prefill beside running decode: near a full batch's lockstep round, not the same
    round_ = p.round_seconds + 64 * (2e-3 + 16 * 1e-3) + 16 * 512 * 1e-5
    assert 0.5 < light.max_rate / (16 / round_) < 2
    below, above = (simulate(costed, p, 512, 64, rate=f * light.max_rate) for f in (0.5, 2.0))
    assert not below.saturated and above.saturated and above.ttft_p50 > 10 * below.ttft_p50  # the queue grows


def test_plan_qps_lists_policies_by_targets_with_their_serve_commands(capsys) -> None:
    argv = ["plan", "--model", "llama-3.1-8b", "--hardware", "rtx4090-24gb", "--gen-len", "64", "--qps", "1"]
    argv += ["--max-ttft", "2", "--min-stream-tps", "10"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["policies"]
    meets = [r["meets"] for r in rows]
    assert meets[0] and meets == sorted(meets, reverse=True)  # those that meet first
    for r in rows:
        assert r["command"].startswith("offload serve --model MODEL_DIR ")
        assert r["meets"] == (not r["misses"])
        if r["ttft_p90_seconds"] > 2:
            assert any("p90 TTFT" in m for m in r["misses"])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "run the first: offload serve" in out and "simulating the engine's continuous batching" in out
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "rtx4090-24gb", "--qps", "0"]) != 0
    assert "--qps must be a positive number" in capsys.readouterr().err
