"""`offload serve` as its clients see it: the official openai client against a real server process on loopback."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serving import API_KEY, BOUND, SERVER_FLAGS, Served, eventually, start_server

from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.demo import DEMO_PROMPTS

MODEL = "demo-llama-v1"


@pytest.fixture(scope="module")
def server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_server(
        demo_model, tmp_path_factory.mktemp("serve") / "server.log", *SERVER_FLAGS, "--api-key", API_KEY
    )
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=BOUND)


@pytest.fixture(scope="module")
def llm(demo_model) -> LLM:
    """The same model and engine settings in this process: what the server must answer."""
    return LLM(demo_model, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=4))


def idle(server: Served) -> dict[str, float] | None:
    """The server's metrics once nothing runs and no KV block is held, else None."""
    now = server.metrics()
    return now if now["offload_requests_running"] == 0 and now["offload_kv_blocks_used"] == 0 else None


def test_completion_equals_llm_generate(client, llm):
    for prompt in DEMO_PROMPTS[:3]:
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        want = llm.generate(prompt, SamplingParams(max_new_tokens=24))[0]
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids) and got.usage.prompt_tokens == want.prompt_tokens


def test_streamed_chat_concatenates_to_the_whole_answer(client, llm):
    messages = [{"role": "user", "content": DEMO_PROMPTS[1]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want = llm.chat([messages], SamplingParams(max_new_tokens=30))[0]
    assert text == whole.choices[0].message.content == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_stop_strings_cut_the_text_streamed_or_not(client, llm):
    full = llm.generate(DEMO_PROMPTS[0], SamplingParams(max_new_tokens=24))[0].text
    stop = full[6:10]
    cut = full[: full.index(stop)]
    got = client.completions.create(model=MODEL, prompt=DEMO_PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
    stream = client.completions.create(
        model=MODEL, prompt=DEMO_PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == cut


def test_n_seed_and_logprobs(client):
    got = client.completions.create(
        model=MODEL, prompt=DEMO_PROMPTS[2], max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=2
    )
    again = client.completions.create(
        model=MODEL, prompt=DEMO_PROMPTS[2], max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=2
    )
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [c.text for c in again.choices]  # seeded: reproducible
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == got.usage.completion_tokens // 2 or (
        len(lp.tokens) > 0
    )
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{server.url}/health", timeout=BOUND).json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": 3.5}, "temperature"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        ({"model": "gpt-4", "prompt": "hi"}, "model"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "word " * 3000}, "prompt"),
        ({"model": MODEL, "prompt": [5, 99999]}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": MODEL, "prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
    ],
)
def test_bad_requests_get_400_naming_the_field(server, body, param):
    r = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=BOUND
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_malformed_json_and_bad_messages(server):
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": ', headers=auth, timeout=BOUND)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/batches", content=b"\xff\xfe{}", headers=auth, timeout=BOUND)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "x"}]},
        headers=auth,
        timeout=BOUND,
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0")
    assert httpx.get(f"{server.url}/health", timeout=BOUND).status_code == 200  # still serving


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.post(
            f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=headers, timeout=BOUND
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=BOUND)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_a_full_queue_answers_429_with_retry_after(server):
    """4 sequences run, 4 may wait: of 16 long requests sent at once, some are turned away, the rest finish."""
    body = {"model": MODEL, "prompt": "The engine", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=BOUND) as http:
            return await asyncio.gather(*(http.post(f"{server.url}/v1/completions", json=body) for _ in range(16)))

    responses = asyncio.run(flood())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429} and codes.count(200) >= 8, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 200


def test_a_client_gone_mid_stream_frees_its_kv_blocks(server):
    before = server.metrics()
    body = {
        "model": MODEL,
        "prompt": "The engine",
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(headers=auth, timeout=BOUND) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        chunks = [next(lines) for _ in range(10)]
        assert any(c.startswith("data: ") for c in chunks)
        assert server.metrics()["offload_kv_blocks_used"] > 0
    now = eventually(lambda: idle(server), "the aborted request's KV blocks free")
    assert now["offload_requests_aborted_total"] == before["offload_requests_aborted_total"] + 1
    assert now["offload_generation_tokens_total"] - before["offload_generation_tokens_total"] < 1500


def test_metrics_count_what_ran(server, client):
    before = server.metrics()
    client.completions.create(
        model=MODEL, prompt="The engine", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    assert after["offload_generation_tokens_total"] - before["offload_generation_tokens_total"] == 5
    looked_up = after["offload_prefix_cache_lookup_tokens_total"] - before["offload_prefix_cache_lookup_tokens_total"]
    computed = after["offload_prefill_tokens_computed_total"] - before["offload_prefill_tokens_computed_total"]
    hits = after["offload_prefix_cache_hit_tokens_total"] - before["offload_prefix_cache_hit_tokens_total"]
    assert looked_up > 0 and computed == looked_up - hits
    assert after["offload_time_to_first_token_seconds_count"] == before["offload_time_to_first_token_seconds_count"] + 1
    assert after["offload_inter_token_latency_seconds_count"] - before["offload_inter_token_latency_seconds_count"] == 4
    for name in (
        "offload_requests_waiting",
        "offload_kv_blocks_free",
        'offload_weight_bytes_read_total{tier="nvme"}',
        "offload_read_stall_seconds_total",
        "offload_weight_read_seconds_total",
        "offload_preemptions_total",
        "offload_tokens_per_second",
        'offload_kv_bytes_moved_total{way="down"}',
    ):
        assert name in after


def test_sigterm_drains_running_requests_and_refuses_new_ones(demo_model, tmp_path):
    # the drain's bound is the test's: what is tested is that the running request finishes, however slowly
    served = start_server(demo_model, tmp_path / "server.log", *SERVER_FLAGS, "--drain-timeout", str(BOUND))
    body = {
        "model": MODEL,
        "prompt": "The engine",
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with httpx.Client(timeout=BOUND) as http, http.stream("POST", f"{served.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            served.process.send_signal(signal.SIGTERM)

            def not_ok() -> httpx.Response | None:
                health = http.get(f"{served.url}/health")
                return health if health.status_code != 200 else None

            health = eventually(not_ok, "/health answers other than 200 after SIGTERM")
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            refused = http.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert refused.status_code == 503
            rest = list(lines)
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        finals = [ln for ln in rest if '"finish_reason": "length"' in ln]
        assert len(finals) == 1  # the running request finished whole
        assert served.process.wait(BOUND) == 0  # and the server exits by itself, cleanly
    finally:
        served.stop()


def test_a_client_gone_before_a_whole_answer_frees_its_kv_blocks(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "The engine", "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
    gone = httpx.Timeout(BOUND, read=1.0)  # only the wait for the answer runs out: after 1 s, long before 1900 tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=gone
        )
    now = eventually(lambda: idle(server), "the aborted request's KV blocks free")
    assert now["offload_requests_aborted_total"] == before["offload_requests_aborted_total"] + 1
