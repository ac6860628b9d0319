"""`offload plan --qps`: policies ranked by what the endpoint's users feel, time to first token and each stream's rate,
among those that sustain the rate and meet the targets."""

from __future__ import annotations

import json

from offload.cli import main

L4_8B = ["plan", "--model", "llama-3.1-8b", "--hardware", "l4-24gb", "--qps", "0.2", "--gen-len", "128"]


def _plan(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_at_a_light_rate_all_layers_on_the_device_come_first(capsys) -> None:
    """Llama-3.1-8B on an L4 at 0.2 requests/s: every layer on the device answers first and streams fastest, and
    comes first however much headroom the others have."""
    out = _plan(capsys, L4_8B)
    first, rows = out["policies"][0], out["policies"]
    assert first["policy"]["layers"] == [32, 0, 0] and first["meets"]
    assert first["ttft_p90_seconds"] == min(r["ttft_p90_seconds"] for r in rows if r["meets"])
    assert out["ranked_by"].startswith("ranked by p90 time to first token, then tokens/s a stream")
    assert main(L4_8B) == 0
    text = capsys.readouterr().out
    assert out["ranked_by"] in text
    assert text.split("\n # batch")[1].splitlines()[1].split()[:3] == ["1", str(first["policy"]["batch"]), "32/0/0"]


def test_those_that_meet_rank_by_p90_ttft_then_stream_rate_and_those_that_miss_come_after(capsys) -> None:
    out = _plan(capsys, [*L4_8B, "--max-ttft", "0.3", "--min-stream-tps", "10"])
    rows = out["policies"]
    assert out["targets"] == {"max_ttft_p90_seconds": 0.3, "min_stream_tokens_per_second": 10.0}
    assert "sustain 0.2 requests/s and meet the targets" in out["ranked_by"]
    meets = [r for r in rows if r["meets"]]
    assert meets and rows[: len(meets)] == meets  # those that meet, then the rest
    shown = [(float(f"{r['ttft_p90_seconds']:.3g}"), -float(f"{r['stream_tokens_per_second']:.3g}")) for r in meets]
    assert shown == sorted(shown)
    for r in rows:
        assert r["meets"] == (r["sustains"] and r["ttft_p90_seconds"] <= 0.3 and r["stream_tokens_per_second"] >= 10)
        assert r["meets"] == (not r["misses"])
    missed = [len(r["misses"]) for r in rows[len(meets) :]]
    assert missed and missed == sorted(missed)  # the nearest first
    assert any(not r["sustains"] for r in rows)  # batch 1 cannot keep up at 0.2 requests/s
