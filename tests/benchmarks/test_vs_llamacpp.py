"""benchmarks/vs_llamacpp.py: the search for the smallest budget, and a quick run of llama.cpp and ours on the real
model (skipped where llama-cpp-python, an optional peer, is not installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("vs_llamacpp") as module:
        yield module


def test_the_smallest_budget_is_the_asked_one_when_it_fits_else_found_to_the_resolution(bench):
    probes: list[int] = []

    def fits(budget: int) -> bool:
        probes.append(budget)
        return budget >= 1000

    assert bench.smallest_fitting(fits, 2000, resolution=10) == 2000 and probes == [2000]
    probes.clear()
    assert bench.smallest_fitting(fits, 100, resolution=10) == 1000
    assert probes == [100, 200, 400, 800, 1600, 1200, 1000, 900, 950, 975, 987, 993]
    with pytest.raises(ValueError, match="no budget up to 800 bytes fits"):
        bench.smallest_fitting(lambda b: False, 100, limit=800)


@pytest.mark.slow
def test_a_quick_run_times_every_engine_on_the_same_prompts(bench, smollm2_gguf: Path, tmp_path: Path):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "vs_llamacpp.json"
    argv = ["--quick", "--stream-budget", "90MB", "--work-dir", str(tmp_path), "--out", str(out)]
    report = bench.main(argv)
    assert json.loads(out.read_text()) == report
    assert report["stream_budget"] == {"asked_bytes": 90_000_000, "used_bytes": 90_000_000, "asked_fits": True}
    rows = {(r["engine"], r["setting"], r["batch"]): r for r in report["rows"]}
    ram = {(e, "ram", b) for e in bench.ENGINES for b in (1, 4)}
    assert set(rows) == ram | {(e, "streamed", b) for e in bench.STREAMED for b in (1, 4)}
    for r in rows.values():
        assert r["status"] == "ok" and r["tokens_per_second"] > 0 and r["peak_rss_bytes"] > r["baseline_rss_bytes"]
        assert r["wall_seconds"] >= r["decode_seconds"] > 0 and r["prefill_seconds"] > 0
        peer = rows["llama.cpp", r["setting"], r["batch"]]
        assert r["vs_llama_cpp"] == pytest.approx(r["tokens_per_second"] / peer["tokens_per_second"])
    for p in report["processes"]:
        assert p["generated_tokens"] == 8 * p["batch"] and [len(t) for t in p["token_ids"]] == [8] * p["batch"]
        assert len(p["runs"]) == 1 and p["threads"] >= 1
        if p["engine"] == "llama.cpp":
            assert p["extra"]["load_mode"] == ("mmap" if p["setting"] == "streamed" else "none (read into its buffers)")
            assert p["extra"]["n_seq_max"] == p["batch"] and p["extra"]["n_ctx"] >= p["batch"] * (16 + 8)
        elif p["setting"] == "streamed":
            assert p["extra"]["layers_streamed"] > 0
            assert p["extra"]["device_memory"] == 90_000_000 + p["extra"]["kv_cache_bytes"]
    # the same prompts to every engine: the imported codes pick llama.cpp's first token for each of them
    firsts = {
        (p["engine"], p["batch"]): [t[0] for t in p["token_ids"]] for p in report["processes"] if p["setting"] == "ram"
    }
    assert firsts["ours int4", 4] == firsts["llama.cpp", 4] and firsts["ours int4", 1] == firsts["llama.cpp", 1]


def test_without_llama_cpp_python_it_says_how_to_install_it(bench, smollm2_gguf: Path, monkeypatch, tmp_path: Path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(SystemExit, match="llama-cpp-python is not installed: .*pip install llama-cpp-python"):
        bench.main(["--quick", "--work-dir", str(tmp_path), "--out", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()
