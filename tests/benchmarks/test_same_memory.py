"""benchmarks/same_memory.py: the peers' batches tried up to the first over the cap, the best under it, the table
and the goals, from hand-made results (no engine runs)."""

from __future__ import annotations

import pytest

from conftest import benchmark_module

CAP = 2 << 30  # bytes
MB = 10**6


@pytest.fixture(scope="module")
def same():
    with benchmark_module("same_memory") as module:
        yield module


def result(same, engine: str, peak_mb: int, tokens_per_second: float = 1.0, status: str = "ok", **fields):
    """A run of 10 s with `peak_mb` MB of peak RSS and `tokens_per_second`."""
    return same.EngineResult(
        engine=engine,
        status=status,
        wall_seconds=10.0,
        generated_tokens=round(10 * tokens_per_second),
        peak_rss_bytes=peak_mb * MB,
        **fields,
    )


def trials_at(same, engine: str, peaks: dict[int, int], cap: int = CAP, speed: float = 1.0):
    """The trials try_batches makes for a peer whose run at batch b peaks at peaks[b] MB (b / 8 * speed tokens/s);
    also the batches it ran."""
    ran = []

    def run(batch: int):
        ran.append(batch)
        return result(same, engine, peaks[batch], batch / 8 * speed)

    return same.try_batches(engine, cap, list(peaks), run), ran


def test_peers_try_batches_up_to_the_first_over_the_cap(same):
    peaks = {8: 1500, 16: 1900, 32: 2100, 64: 2500, 128: 4000}  # 2 GiB is 2147 MB
    trials, ran = trials_at(same, "accelerate", peaks)
    assert ran == [8, 16, 32, 64]  # 64 is the first over: 128 is never tried
    assert [t.under_cap for t in trials] == [True, True, True, False]
    assert same.best_trial(trials).batch == 32
    assert trials[-1].verdict == "OVER the cap"


def test_a_failed_run_ends_the_trials_and_is_not_under_the_cap(same):
    def run(batch: int):
        return result(same, "zero", 1000, status="failed: MemoryError: boom" if batch == 16 else "ok")

    trials = same.try_batches("zero", CAP, [32, 16, 8], run)
    assert [t.batch for t in trials] == [8, 16]
    assert same.best_trial(trials).batch == 8 and trials[-1].verdict == "failed: MemoryError: boom"


def test_no_batch_under_the_cap_has_no_best(same):
    trials, ran = trials_at(same, "zero", {8: 5000, 16: 5200})
    assert ran == [8] and same.best_trial(trials) is None


def sweep(same, ours_peak: int = 1800, ours_speed: float = 10.0, zero_peaks: dict[int, int] | None = None):
    """Ours at batch 128 (ours_speed tokens/s), Accelerate best at batch 32 (4 tokens/s), ZeRO as given."""
    ours = result(same, "ours-capped", ours_peak, ours_speed, extra={"batch": 128})
    acc, _ = trials_at(same, "accelerate", {8: 1500, 16: 1900, 32: 2100, 64: 2500})
    zero, _ = trials_at(same, "zero", zero_peaks or {8: 1000, 16: 1100, 32: 1200}, speed=0.5)
    return {"ours": [same.Trial("ours", CAP, 128, ours)], "accelerate": acc, "zero": zero}


def test_the_table_shows_each_engine_at_its_best_and_where_peers_stopped(same):
    lines = same.table(CAP, sweep(same, zero_peaks={8: 5000})).splitlines()
    assert lines[0].split() == ["engine", "batch", "tok/s", "peak", "RSS", "MB", "GB", "read", "ours/engine", "verdict"]
    assert lines[2].split() == ["ours", "128", "10.00", "1800", "0.00", "1.00x", "under", "the", "cap"]
    assert lines[3].split() == ["accelerate", "32", "4.00", "2100", "0.00", "2.50x", "under", "the", "cap"]
    assert lines[4].split() == ["zero", "-", "no", "batch", "of", "8", "or", "more", "under", "the", "cap"]
    assert lines[5:] == [
        "  accelerate stopped at batch 64: peak RSS 2500 MB (OVER the cap)",
        "  zero stopped at batch 8: peak RSS 5000 MB (OVER the cap)",
    ]


def test_ours_over_the_cap_is_shown_over_and_gets_no_ratio(same):
    lines = same.table(CAP, sweep(same, ours_peak=2200)).splitlines()
    assert lines[2].split()[-4:] == ["-", "OVER", "the", "cap"]
    assert lines[3].split()[-4] == "-"


def test_goals(same):
    rows = same.goals(CAP, sweep(same))  # ours 10 tokens/s; Accelerate 4 at batch 32; ZeRO 2 at batch 32
    assert [g for g, _, _ in rows] == [
        "tokens/s >= 2x accelerate at its best batch under 2 GiB",
        "tokens/s >= 2x zero at its best batch under 2 GiB",
    ]
    assert [(v, x) for _, v, x in rows] == [
        ("2.50 (ours batch 128, accelerate batch 32)", "PASS"),
        ("5.00 (ours batch 128, zero batch 32)", "PASS"),
    ]
    verdicts = [(v, x) for _, v, x in same.goals(CAP, sweep(same, ours_speed=6.0, zero_peaks={8: 5000}))]
    assert verdicts == [
        ("1.50 (ours batch 128, accelerate batch 32)", "FAIL"),
        ("zero ran no batch under the cap (batch 8: peak RSS 5000 MB)", "n/a"),
    ]
    over = same.goals(CAP, sweep(same, ours_peak=2200))
    assert {x for _, _, x in over} == {"FAIL"} and over[0][1] == "ours OVER the cap (peak RSS 2200 MB)"
    only_acc = {k: v for k, v in sweep(same).items() if k != "zero"}
    assert same.goals(CAP, only_acc)[1][1:] == ("-", "n/a")


def test_flags(same):
    args = same.parse_args([])
    assert args.caps == [2 << 30, 4 << 30] and args.batches == [8, 16, 32, 64, 128, 256]
    assert args.engines == ["ours", "accelerate", "zero"] and args.peer_budget_bytes == 600 * MB
    assert same.parse_args(["--batches", "16,8", "--caps", "1.5GiB"]).batches == [8, 16]
    with pytest.raises(SystemExit, match="'vllm' is not one of"):
        same.parse_args(["--engines", "ours,vllm"])
