"""`echo` on /v1/completions, in-process (the app over a tiny random model): the prompt's text and, with `logprobs`, its
tokens' logprobs before the completion's, as OpenAI and vLLM return them and lm-evaluation-harness reads them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from serving import eventually

from offload.api import LLM
from offload.batch.job_files import read_input
from offload.common.config import EngineConfig
from offload.server.app import Server, create_app
from offload.server.settings import ServeSettings

MODEL = "demo"
PROMPT = "The engine streams each layer"
CONFIG = EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=4)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LLM:
    """The same model in this process, scoring alone (the served one runs in the app's own thread)."""
    return LLM(tiny_llama, CONFIG)


@pytest.fixture(scope="module")
def http(tiny_llama: Path) -> Iterator[TestClient]:
    server = Server(lambda: LLM(tiny_llama, CONFIG), ServeSettings(model_name=MODEL))
    with TestClient(create_app(server)) as client:
        eventually(lambda: client.get("/health").status_code == 200, "the model loaded")
        yield client


def complete(http: TestClient, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    """log p(ids[p] | ids[:p]) for p = 1 .., from the engine's scoring path."""
    lp = llm.score([ids])[0].log_softmax(-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(http, reference):
    ids = reference.encode(PROMPT)
    plain = complete(http, prompt=PROMPT, max_tokens=3, logprobs=2)["choices"][0]
    got = complete(http, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True)
    (choice,) = got["choices"]
    assert choice["text"] == PROMPT + plain["text"]
    lp, n = choice["logprobs"], len(ids)
    assert lp["tokens"][:n] == [reference.token_text(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    close(lp["token_logprobs"][1:n], prompt_logprobs(reference, ids))
    for value, top in zip(lp["token_logprobs"][1:n], lp["top_logprobs"][1:n], strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) >= value
    # the generated tokens follow, as a request without echo gets them, their offsets after the prompt's text
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    close(lp["token_logprobs"][n:], plain["logprobs"]["token_logprobs"])
    for top, want in zip(lp["top_logprobs"][n:], plain["logprobs"]["top_logprobs"], strict=True):
        assert list(top) == list(want) and close(list(top.values()), list(want.values())) is None
    assert lp["text_offset"][n:] == [len(PROMPT) + at for at in plain["logprobs"]["text_offset"]]
    assert lp["text_offset"][:n] == sorted(lp["text_offset"][:n]) and lp["text_offset"][0] == 0
    assert got["usage"]["prompt_tokens"] == n and got["usage"]["completion_tokens"] == 3


def test_max_tokens_0_with_echo_is_the_prompt_alone(http, reference):
    ids = reference.encode(PROMPT)
    got = complete(http, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    (choice,) = got["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["top_logprobs"][1:] == [{}] * (
        len(ids) - 1
    )
    torch.testing.assert_close(
        choice["logprobs"]["token_logprobs"][1:], prompt_logprobs(reference, ids), atol=1e-4, rtol=0
    )
    assert got["usage"]["completion_tokens"] == 0
    bare = complete(http, prompt=PROMPT, max_tokens=0, echo=True)["choices"][0]
    assert (bare["text"], bare["logprobs"], bare["finish_reason"]) == (PROMPT, None, "length")


def test_a_batch_of_token_id_prompts_with_n_comes_back_in_index_order(http, reference):
    """What lm-evaluation-harness sends: token id lists, echo, logprobs 1, max_tokens 1; it sorts choices by index
    and reads token_logprobs[ctxlen:-1]."""
    prompts = [reference.encode(PROMPT), reference.encode("A page of memory")[:3], [5, 6, 7, 8, 9]]
    got = complete(http, prompt=prompts, n=2, max_tokens=1, logprobs=1, echo=True, seed=1234)
    assert [c["index"] for c in got["choices"]] == list(range(6))
    for c in got["choices"]:
        ids = prompts[c["index"] // 2]
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["tokens"][: len(ids)] == [reference.token_text(t) for t in ids]
        torch.testing.assert_close(
            lp["token_logprobs"][1 : len(ids)], prompt_logprobs(reference, ids), atol=1e-4, rtol=0
        )
        assert c["text"].startswith(reference.prompts.decode(ids, skip_special_tokens=False))
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    ctxlens = [1, 1, 2, 2, 3, 3]
    for (total, _), c, ctxlen in zip(
        LocalCompletionsAPI.parse_logprobs(got, ctxlens=ctxlens), got["choices"], ctxlens, strict=True
    ):
        ids = prompts[c["index"] // 2]
        assert total == pytest.approx(sum(prompt_logprobs(reference, ids)[ctxlen - 1 :]), abs=1e-4)


def test_a_streamed_echo_sends_the_prompt_first(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "echo": True, "temperature": 0}
    got = complete(http, **body)
    whole, n = got["choices"][0]["logprobs"], got["usage"]["prompt_tokens"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln)["choices"][0] for ln in lines[:-1]]
    assert chunks[0]["text"].startswith(PROMPT) and len(chunks[0]["logprobs"]["tokens"]) == n + 1
    assert "".join(c["text"] for c in chunks) == got["choices"][0]["text"]
    streamed = {key: [v for c in chunks for v in c["logprobs"][key]] for key in whole}
    assert streamed["tokens"] == whole["tokens"] and streamed["text_offset"][:n] == whole["text_offset"][:n]
    assert streamed["token_logprobs"][0] is None and streamed["top_logprobs"][0] is None
    close(streamed["token_logprobs"][1:], whole["token_logprobs"][1:])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "echo": True, "best_of": 2}, "best_of"),
        ({"prompt": PROMPT, "echo": True, "logprobs": 6}, "logprobs"),
        ({"prompt": PROMPT, "echo": "yes"}, "echo"),
    ],
)
def test_what_echo_cannot_take_is_refused_by_field(http, body, param):
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_batch_job_refuses_an_echo_line(tmp_path):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": True}
    line = {"custom_id": "e", "method": "POST", "url": "/v1/completions", "body": body}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(line) + "\n" + json.dumps({**line, "custom_id": "f", "body": {**body, "echo": False}}))
    requests, bad = read_input(src, MODEL)
    assert [r.id for r in requests] == ["f"]
    assert [(b.id, b.error.split(":")[0]) for b in bad] == [("e", "body.echo")]
