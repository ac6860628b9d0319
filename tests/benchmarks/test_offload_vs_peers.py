"""benchmarks/offload_vs_peers.py: rounds, medians, the physical limit and its verdicts, the budget check, and the
re-read of exactly the bytes our engine streams."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import benchmark_module, make_checkpoint


@pytest.fixture(scope="module")
def peers():
    with benchmark_module("offload_vs_peers") as module:
        yield module


def result(peers, engine: str, wall: float, **fields):
    return peers.EngineResult(engine=engine, wall_seconds=wall, generated_tokens=128, **fields)


def test_every_engine_runs_once_per_round_and_none_always_first(peers):
    order = peers.rounds(["resident", "ours", "accelerate", "zero"], 3)
    assert order == [
        ["resident", "ours", "accelerate", "zero"],
        ["ours", "accelerate", "zero", "resident"],
        ["accelerate", "zero", "resident", "ours"],
    ]


def test_median_run_and_spread(peers):
    runs = [result(peers, "x", w) for w in (30.0, 10.0, 20.0)] + [peers.EngineResult("x", status="failed: boom")]
    assert peers.median_run(runs).wall_seconds == 20.0
    s = peers.spread(runs)
    assert (s["runs"], s["ok"], s["median_wall_seconds"], s["min_wall_seconds"], s["max_wall_seconds"]) == (
        4,
        3,
        20.0,
        10.0,
        30.0,
    )
    assert peers.median_run([peers.EngineResult("x", status="failed: boom")]).status.startswith("failed")


def test_the_limit_takes_the_fastest_compute_of_each_pass(peers):
    resident = [result(peers, "r", 0, pass_seconds=p) for p in ([5.0, 1.0, 2.0], [6.0, 0.5, 3.0])]
    assert peers.fastest_passes(resident) == [5.0, 0.5, 2.0]
    # 1e9 bytes per pass at 1 GB/s: 1 s of reads per pass, each pass its slower half
    assert peers.physical_limit(10**9, 1.0, [5.0, 0.5, 2.0]) == pytest.approx(5.0 + 1.0 + 2.0)


def test_an_engine_under_the_limit_invalidates_it_instead_of_a_ratio(peers):
    ours = result(peers, "ours", 9.0, extra={"overlap_efficiency": 0.9})
    acc = result(peers, "accelerate", 20.0)
    rows = peers.goals({"ours": ours, "accelerate": acc}, {"ours": 9.0, "accelerate": 20.0}, 10.0, 0.9)
    by_goal = {goal: (value, verdict) for goal, value, verdict in rows}
    limit_rows = [(v, x) for g, (v, x) in by_goal.items() if "physical limit" in g]
    assert limit_rows == [("ran faster than 10.00 s: ours 9.00 s", "INVALID")]
    assert by_goal["tokens/s >= 1.25x accelerate"] == ("2.22", "PASS")
    assert by_goal["tokens/s >= 1.1x zero"] == ("-", "n/a")
    rows = peers.goals({"ours": ours}, {"ours": 12.0}, 10.0, 0.9)
    assert [(v, x) for g, v, x in rows if "physical limit" in g] == [("1.20", "PASS")]


def test_over_budget_counts_what_the_weight_budget_and_kv_cache_do_not_allow(peers):
    r = result(peers, "x", 1.0, peak_rss_bytes=1_500, baseline_rss_bytes=300)
    assert peers.over_budget(r, budget=600, kv_bytes=100) == 500
    assert peers.over_budget(r, budget=2_000, kv_bytes=100) == 0
    # 8 sequences of 144 tokens, 22 layers, K and V, 8 heads of 64 in bf16
    assert peers.workload_kv_bytes(peers.Workload(), 22) == 8 * 144 * 2 * 22 * 8 * 64 * 2


def test_streamed_read_reads_exactly_the_streamed_bytes_each_pass(peers, tmp_path, monkeypatch):
    from offload.model.loader import load_spec
    from offload.model.registry import model_tensors
    from offload.tiers.io.buffered import BufferedReader
    from offload.tiers.weights.checkpoint import Checkpoint
    from offload.tiers.weights.layout import model_layout

    make_checkpoint(tmp_path, "llama")
    monkeypatch.setattr(peers, "drop_page_cache", lambda paths: "none")
    spec, family = load_spec(tmp_path)
    with BufferedReader() as reader:
        layout = model_layout(Checkpoint(tmp_path, reader), model_tensors(family, spec))
    tiers = ["device", "nvme", "nvme"]
    out = peers.streamed_read(tmp_path, tiers, passes=3, depth=2, repeats=2)
    per_pass = sum(r.nbytes for g in layout.layers[1:] for r in g.runs)
    assert out["bytes"] == 3 * per_pass
    assert len(out["runs_gbps"]) == 2 and out["best_gbps"] == max(out["runs_gbps"]) > 0
    assert peers.streamed_read(tmp_path, ["device"] * 3, passes=3)["bytes"] == 0


def test_a_fresh_copy_holds_the_checkpoints_bytes_and_replaces_the_last_copy(peers, tmp_path):
    src = tmp_path / "model"
    make_checkpoint(src, "llama")
    dest = tmp_path / "fresh"
    dest.mkdir()
    (dest / "left-from-last-run.safetensors").write_bytes(b"stale")
    assert peers.fresh_copy(src, dest) == dest
    names = sorted(p.name for p in dest.iterdir())
    assert names == sorted(p.name for p in src.iterdir())
    for name in names:
        assert (dest / name).read_bytes() == (src / name).read_bytes()


def test_only_engines_reading_the_checkpoint_while_generating_get_a_fresh_copy(peers, tmp_path, monkeypatch):
    import argparse

    copies, models = [], []
    monkeypatch.setattr(peers, "fresh_copy", lambda src, dest: copies.append(src) or dest)
    monkeypatch.setattr(peers, "drop_page_cache", lambda paths: "none")

    def run(cmd, **kw):
        models.append(Path(cmd[cmd.index("--model") + 1]).name)
        return argparse.Namespace(stderr="", stdout="", returncode=1)

    monkeypatch.setattr(peers.subprocess, "run", run)
    args = argparse.Namespace(work_dir=tmp_path, budget="600MB", prompts=1)
    for name in ("ours", "accelerate", "zero", "resident"):
        peers.run_worker(name, tmp_path / "model", args, [], fresh=True)
    peers.run_worker("ours", tmp_path / "model", args, [], fresh=False)
    assert copies == [tmp_path / "model"] * 2  # ours and Accelerate with fresh; ZeRO writes its own swap files
    assert models == ["fresh-copy", "fresh-copy", "model", "model", "model"]
