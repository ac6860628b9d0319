"""benchmarks/serve_load.py: the job mix, the tally and percentiles exactly, and a --quick run against a real server
on the demo model (every request accounted for, the bad ones refused, no KV block left after the cancellations)."""

from __future__ import annotations

import json

import pytest

from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("serve_load") as module:
        yield module


def test_jobs_mix_apis_streams_and_cancellations_over_every_client(bench):
    jobs = bench.client_jobs(clients=4, rounds=3, prompts=5)
    assert [len(js) for js in jobs] == [3, 3, 3, 3]
    flat = sorted((j for js in jobs for j in js), key=lambda j: (j.prompt, j.api, j.stream, j.cancel_after or 0))
    assert len(flat) == 12 and {j.prompt for j in flat} == set(range(5))
    kinds = {(j.api, j.stream, j.cancel_after) for j in flat}
    assert kinds == {
        ("completions", False, None),
        ("completions", True, None),
        ("completions", True, bench.CANCEL_AFTER),
        ("chat", False, None),
        ("chat", True, None),
        ("chat", True, bench.CANCEL_AFTER),
    }
    assert jobs[1][0] == bench.Job("completions", 1, True)  # job k goes to client k % clients


def test_tally_counts_each_request_once(bench):
    class Want:
        text, token_ids = "abc", (1, 2, 3)

    job = bench.Job("completions", 0, False)
    ok = dict(text="abc", completion_tokens=3, finishes=1)
    answers = [
        bench.Answer(job, 0.0, 1.0, response_id="a", **ok),
        bench.Answer(job, 0.0, 1.0, response_id="b", **ok | {"text": "abd"}),
        bench.Answer(job, 0.0, 1.0, response_id="c", **ok | {"completion_tokens": 4}),
        bench.Answer(job, 0.0, 1.0, response_id="d", **ok | {"finishes": 2}),
        bench.Answer(job, 0.0, 1.0, response_id="e", **ok),
        bench.Answer(job, 0.0, 1.0, response_id="e", **ok),
        bench.Answer(job, 0.0, 1.0, response_id="f", text="ab"),
        bench.Answer(job, 0.0, 1.0, response_id="g", text="a", cancelled=True),
        bench.Answer(job, 0.0, 1.0, error="APIConnectionError: Connection error."),
    ]
    t = bench.tally(answers, {("completions", 0): Want()})
    assert t == bench.Tally(requests=9, answered=1, cancelled=1, failed=1, lost=1, duplicated=3, mismatched=2)


def test_percentiles_and_gaps(bench):
    assert bench.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert bench.percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert bench.percentile([7.0], 0.99) == 7.0
    a = bench.Answer(bench.Job("chat", 0, True), 10.0, 11.0, chunk_times=(10.25, 10.5, 11.0))
    assert a.first_token == 0.25 and a.gaps == [0.25, 0.5]


def test_serve_flags_give_back_the_peer_config(bench):
    from offload.common.config import EngineConfig

    config = EngineConfig(
        device_memory=600 * 10**6 + 2**20,
        kv_cache_bytes=2**20,
        io_backend="pread",
        dtype="bfloat16",
        max_num_seqs=8,
    )
    flags = bench.serve_flags(config)
    assert bench.served_config(flags) == config
    with pytest.raises(SystemExit, match="give --max-num-seqs and --kv-cache-memory"):
        bench.served_config(["--device-memory", "600MB"])


def test_quick_run_against_a_real_server(bench, demo_model, tmp_path):
    out = tmp_path / "serve_load.json"
    argv = ["--quick", "--model", str(demo_model), "--work-dir", str(tmp_path), "--out", str(out)]
    # 64 tokens a request: a stream cancelled after 3 chunks is still generating when the server notices
    bench.main([*argv, "--rate", "20", "--max-tokens", "64"])
    report = json.loads(out.read_text())
    tally, latency, ratio = report["load"]["tally"], report["load"]["latency"], report["ratio"]
    assert tally["requests"] == 16 and tally["cancelled"] > 0
    assert (tally["lost"], tally["duplicated"], tally["failed"], tally["mismatched"]) == (0, 0, 0, 0)
    assert tally["answered"] + tally["cancelled"] == tally["requests"]
    assert all(400 <= status < 500 for status in report["load"]["bad_requests"].values())
    assert len(report["load"]["bad_requests"]) == 4
    after = report["load"]["metrics_after"]
    assert after["offload_kv_blocks_used"] == 0 and after["offload_requests_running"] == 0
    assert after["offload_requests_aborted_total"] > 0  # the cancellations reached the engine
    assert report["load"]["server_exit_status"] == 0
    for key in ("first_token_p50", "first_token_p99", "inter_chunk_p50", "inter_chunk_p99", "tokens_per_second"):
        assert latency[key] > 0
    assert latency["first_token_p50"] <= latency["first_token_p99"]
    assert ratio["ratio"] > 0 and ratio["failed"] == 0
    assert ratio["served_tokens"] == ratio["in_process_tokens"]  # greedy: both sides generate the same tokens
    assert report["streamed"] is None and report["machine"]["cores"] > 0
    rate = report["rate"]  # 8 requests at 20/s, Poisson, each 8 new tokens streamed
    assert (rate["rate"], rate["arrival"], rate["requests"]) == (20, "poisson", 8)
    stats = rate["stats"]
    assert 0 < stats["ttft_p50"] <= stats["ttft_p90"] and stats["stream_tps_p50"] > 0 and stats["completion_rate"] > 0
    assert {g["metric"] for g in report["goals"]} >= {"served / in-process", "lost / duplicated / failed"}


def test_rate_stats_read_first_tokens_streams_and_the_full_queue_s_completions(bench):
    from served import Timed, rate_stats

    # 10 requests sent 1 s apart, each first token 0.5 s after it is sent, 9 more tokens over the next 0.9 s
    seen = [Timed(sent=i, first=i + 0.5, last=i + 1.4, tokens=10) for i in range(10)]
    stats = rate_stats(seen)
    assert stats["ttft_p50"] == pytest.approx(0.5) and stats["ttft_p90"] == pytest.approx(0.5)
    assert stats["stream_tps_p50"] == pytest.approx(10.0)  # 9 tokens in 0.9 s
    assert stats["completion_rate"] == pytest.approx(1.0)  # the 2nd to the 9th completion, one a second
