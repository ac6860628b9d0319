"""benchmarks/batch_sweep.py: the goals it prints are judged from the rows exactly, and its table names both
predictions (from compute measured at the point, and from the start-of-sweep profile)."""

from __future__ import annotations

import pytest

from conftest import benchmark_module


@pytest.fixture(scope="module")
def sweep():
    with benchmark_module("batch_sweep") as module:
        yield module


def row(batch: int, tps: float, predicted: float, wall: float, limit: float, bound: str = "disk", **extra) -> dict:
    return {
        "batch": batch,
        "tokens_per_second": tps,
        "predicted_tokens_per_second": predicted,
        "prediction_error": predicted / tps - 1,
        "prediction_error_start_profile": 2 * predicted / tps - 1,
        "wall_seconds": wall,
        "limit_seconds": limit,
        "predicted_bound": bound,
        "peak_rss_bytes": 1e9,
        "resident_seconds": 0.95 * wall,
        **extra,
    }


def test_goals_pass_and_fail_on_the_rows(sweep):
    good = [row(8, 4.0, 4.4, 30.0, 28.0), row(16, 7.0, 6.0, 33.0, 31.0), row(32, 6.9, 7.5, 40.0, 39.0)]
    verdicts = [v for _, _, v in sweep.goals(good)]
    assert verdicts == ["PASS", "PASS", "PASS", "PASS"]  # 6.9 >= 0.97 x 7.0: a dip inside timing noise still rises

    # 1.27x the limit, +25% predicted, a 14% drop while disk-bound, and the best batch (16) 1.2x its resident time
    slow = [good[0], row(16, 7.0, 6.0, 33.0, 31.0, resident_seconds=27.5), row(32, 6.0, 7.5, 52.0, 41.0)]
    goals = sweep.goals(slow)
    assert [v for _, _, v in goals] == ["FAIL", "FAIL", "FAIL", "FAIL"]
    assert [value for _, value, _ in goals] == ["1.27x", "25%", "no", "1.20x at batch 16"]

    beaten = [row(8, 4.0, 4.4, 30.0, 32.0), row(16, 7.0, 6.0, 33.0, 31.0)]  # ours under the limit at batch 8
    assert sweep.goals(beaten)[0][1:] == ("ours ran under it at batch 8", "INVALID")
    assert "UNDER" in sweep.table(beaten).splitlines()[2].split()

    compute_bound = [row(8, 4.0, 4.4, 30.0, 28.0, bound="compute"), row(16, 3.0, 3.1, 30.0, 28.0)]
    assert sweep.goals(compute_bound)[2][1:] == ("yes", "PASS")  # past the compute bound a drop is allowed


def test_table_shows_both_predictions_and_the_peer(sweep):
    acc = {"status": "ok", "tokens_per_second": 2.0, "peak_rss_bytes": 2.1e9}
    rows = [
        row(8, 4.0, 4.4, 30.0, 32.0, accelerate=acc, resident_prediction_error=-0.07),
        row(16, 7.0, 6.3, 33.0, 35.0),
    ]
    lines = sweep.table(rows).splitlines()
    assert lines[0].split()[:6] == ["batch", "ours", "tok/s", "predicted", "error", "@start"]
    first, second = lines[2].split(), lines[3].split()
    assert first[:5] == ["8", "4.000", "4.400", "+10%", "+120%"]
    assert "2.00x" in first and "2100" in first  # Accelerate's rate ratio and its peak RSS in MB
    assert first[first.index("disk") + 1] == "-7%"  # the all-resident run's prediction error
    assert second[second.index("disk") + 1] == "-"  # a JSON from before that column: no number to show
    assert second[:5] == ["16", "7.000", "6.300", "-10%", "+80%"] and second[-4:-1] == ["-", "-", "-"]


def test_mean_profile_averages_each_rate_and_keeps_the_rest(sweep):
    from offload.common.hardware import ComputeUnit, HardwareProfile

    def profile(scale: float) -> HardwareProfile:
        unit = ComputeUnit(
            memory=8 << 30,
            memory_bandwidth=10e9 * scale,
            matmul_flops={"bfloat16": 4e11 * scale},
            matmul_curve={"bfloat16": ((1, 1e10 * scale), (2048, 4e11 * scale))},
        )
        return HardwareProfile("p", "cpu", unit, unit, 0.0, 0.0, 1e9 * scale, 5e8 * scale, "test")

    mean = sweep.mean_profile(profile(1.0), profile(2.0))
    assert mean.device == mean.host
    assert mean.device.memory_bandwidth == 15e9 and mean.device.matmul_flops == {"bfloat16": 6e11}
    assert mean.device.matmul_curve == {"bfloat16": ((1, 1.5e10), (2048, 6e11))}
    assert (mean.disk_read, mean.disk_write, mean.device.memory) == (1.5e9, 7.5e8, 8 << 30)
