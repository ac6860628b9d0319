"""benchmarks/kv_prefetch.py: a small run reads a seeded disk tier at admission and ahead of it, with equal tokens."""

from __future__ import annotations

import json

from conftest import benchmark_module


def test_a_small_run_reads_the_seeded_blocks_both_ways(tmp_path):
    out = tmp_path / "kv_prefetch.json"
    with benchmark_module("kv_prefetch") as bench:
        report = bench.main(["--quick", "--work-dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    settings, med = report["settings"], report["medians"]
    (r,) = report["rounds"]
    history_blocks = settings["history_tokens"] // 16  # the default block size
    assert r["seeded_blocks"] >= settings["requests"] * history_blocks
    for run in ("admission", "prefetch"):  # every history from disk, only the follow-ups computed
        assert r[run]["hit_tokens"] == settings["requests"] * settings["history_tokens"]
        read = r[run]["blocks_read_ahead"] + r[run]["blocks_read_at_admission"]
        assert read == settings["requests"] * history_blocks
    assert med["admission"]["blocks_read_ahead"] == 0
    # the requests admitted at the first step read at admission; those waiting behind them, ahead
    assert med["prefetch"]["blocks_read_ahead"] > 0
    assert report["same_tokens"]
