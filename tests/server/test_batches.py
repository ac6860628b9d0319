"""The Batch API with the official openai client: upload, run, results, errors, cancel, resume after a restart."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from serving import BOUND, SERVER_FLAGS, eventually, start_server

from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams

MODEL = "demo-llama-v1"
ENDED = ("completed", "failed", "cancelled")


def chat_line(i: int, max_tokens: int, **extra) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"What is page {i}?"}], "max_tokens": max_tokens}
    body |= {"temperature": 0} | extra
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def client_of(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=BOUND)


def submit(client: openai.OpenAI, path: Path):
    with path.open("rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait(client: openai.OpenAI, batch_id: str, until=lambda b: b.status in ENDED, what: str = "the batch ended"):
    """The batch once `until` holds for it."""

    def reached():
        batch = client.batches.retrieve(batch_id)
        return batch if until(batch) else None

    return eventually(reached, f"{what} ({batch_id})", poll=0.1)


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def results(client: openai.OpenAI, file_id: str) -> dict[str, dict]:
    out = {}
    for line in client.files.content(file_id).text.splitlines():
        record = json.loads(line)
        assert record["custom_id"] not in out, "a result twice"
        out[record["custom_id"]] = record
    return out


def test_a_batch_runs_to_openai_results_and_errors(demo_model, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([chat_line(i, 12) for i in range(6)] + ["{bad", chat_line(9, 0)]) + "\n")
    served = start_server(demo_model, tmp_path / "log", *SERVER_FLAGS, "--batch-dir", str(tmp_path / "store"))
    try:
        client = client_of(served)
        batch = wait(client, submit(client, src).id)
        assert batch.status == "completed"
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (8, 6, 2)
        got = results(client, batch.output_file_id)
        llm = LLM(demo_model, EngineConfig(kv_cache_bytes=64 << 20))
        for i in range(6):
            want = llm.chat([[{"role": "user", "content": f"What is page {i}?"}]], SamplingParams(12))[0]
            body = got[f"c{i}"]["response"]["body"]
            assert body["choices"][0]["message"]["content"] == want.text
            assert body["usage"]["completion_tokens"] == len(want.token_ids)
        errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
        assert [e["line"] for e in errors] == [7, 8] and "max_tokens" in errors[1]["error"]
        assert [b.id for b in client.batches.list()] == [batch.id]
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_missing")
    finally:
        assert served.stop() == 0


def test_cancel_stops_a_batch_and_returns_its_blocks(demo_model, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(chat_line(i, 1500, ignore_eos=True) for i in range(8)) + "\n")
    served = start_server(demo_model, tmp_path / "log", *SERVER_FLAGS, "--batch-dir", str(tmp_path / "store"))
    try:
        client = client_of(served)
        batch = submit(client, src)
        wait(client, batch.id, until=lambda b: b.status == "in_progress", what="the batch in progress")
        client.batches.cancel(batch.id)
        assert wait(client, batch.id).status == "cancelled"
        eventually(lambda: served.metrics()["offload_kv_blocks_used"] == 0, "the cancelled batch's KV blocks free")
    finally:
        assert served.stop() == 0


def test_a_batch_cut_by_a_restart_resumes_and_answers_each_request_once(demo_model, tmp_path):
    # the cut comes once the output holds 2 results (appended as each request ends, unlike the counts, which are
    # saved at most every SAVE_SECONDS); 4 run at a time, so 28 more are at least 7 rounds of 100 steps away
    n, tokens = 32, 100
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(chat_line(i, tokens, ignore_eos=True) for i in range(n)) + "\n")
    store = tmp_path / "store"
    flags = (*SERVER_FLAGS, "--batch-dir", str(store))
    first = start_server(demo_model, tmp_path / "log1", *flags)
    try:
        client = client_of(first)
        batch = submit(client, src)
        output = store / "files" / f"{batch.output_file_id}.jsonl"
        eventually(lambda: lines(output) >= 2, "2 results in the batch's output", poll=0.01)
    finally:
        assert first.stop() == 0  # SIGTERM: the batch stops where it is, still in progress
    stored = json.loads((store / "batches" / f"{batch.id}.json").read_text())
    assert stored["status"] == "in_progress" and lines(output) < n, "the batch ended before the cut: nothing tested"
    second = start_server(demo_model, tmp_path / "log2", *flags)
    try:
        client = client_of(second)
        done = wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == n
        got = results(client, done.output_file_id)
        assert sorted(got) == sorted(f"c{i}" for i in range(n))
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == tokens for r in got.values())
    finally:
        assert second.stop() == 0
