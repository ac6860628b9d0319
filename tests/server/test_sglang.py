"""SGLang's native API: /generate's wire format without a model (offload/sglang/), then an unmodified SGLang program
(gen with stop, select, regex, fork; alone, streamed, run_batch) against `offload serve` of the real model."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serving import API_KEY, BOUND, Served, start_server

from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.outputs import Delta, RequestMetrics, TokenLogprob
from offload.openai.protocol import RequestError
from offload.sglang.sglang_reply import Reply, replies_body
from offload.sglang.sglang_request import MAX_BATCH, parse


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def refusal(raw: bytes) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse(raw)
    assert caught.value.status == 400 and "\n" not in caught.value.message
    return caught.value


def test_the_frontends_own_gen_body_is_accepted_and_converted():
    ir = pytest.importorskip("sglang.lang.ir")
    from sglang.global_config import global_config

    sent = ir.SglSamplingParams(max_new_tokens=12, stop=["\n", "."], temperature=0.0).to_srt_kwargs()
    sent["skip_special_tokens"] = global_config.skip_special_tokens_in_output  # as RuntimeEndpoint.generate sends
    sent["spaces_between_special_tokens"] = global_config.spaces_between_special_tokens_in_out
    req = parse(json.dumps({"text": "Hello", "sampling_params": sent}).encode())  # tuples travel as JSON lists
    params = req.engine_params(prompt_len=3, context_left=100, index=0)
    assert params == SamplingParams(max_new_tokens=12, temperature=0.0, top_k=0, stop=("\n", "."))
    assert not req.is_batch() and req.prompts() == ["Hello"]


def test_sglangs_defaults_and_their_engine_meaning():
    req = parse(body(input_ids=[5, 6, 7], sampling_params=None, return_logprob=None, logprob_start_len=None))
    params = req.engine_params(prompt_len=3, context_left=1000, index=0)
    assert (params.max_new_tokens, params.temperature, params.top_k, params.logprobs) == (128, 1.0, 0, None)
    assert req.prompts() == [[5, 6, 7]] and req.input_field() == "input_ids"
    tiny = parse(body(text="x", sampling_params={"temperature": 1e-7, "top_k": 5, "min_p": 0.1})).engine_params(1, 9, 0)
    assert (tiny.temperature, tiny.top_k, tiny.min_p) == (0.0, 5, 0.1)  # greedy below 1e-6, as SGLang takes it
    unbounded = parse(body(text="x", sampling_params={"max_new_tokens": None, "stop_token_ids": [7, 9]}))
    assert unbounded.engine_params(4, 60, 0).max_new_tokens == 60  # the context's room
    assert unbounded.engine_params(4, 60, 0).stop_token_ids == (7, 9)
    assert parse(body(text="x", sampling_params={"max_new_tokens": 500})).engine_params(4, 60, 0).max_new_tokens == 60
    assert parse(body(text="x", sampling_params={"max_new_tokens": 0})).engine_params(4, 60, 0).max_new_tokens == 0


def test_logprob_start_len_asks_the_engine_for_the_positions_after_it():
    default = parse(body(text="x", return_logprob=True, top_logprobs_num=3)).engine_params(10, 50, 0)
    assert default.logprobs == 3 and default.prompt_logprobs is None  # -1: the last prompt token only, no logprob
    from_four = parse(body(text="x", return_logprob=True, logprob_start_len=4)).engine_params(10, 50, 0)
    assert (from_four.prompt_logprobs, from_four.prompt_logprobs_start, from_four.logprobs) == (0, 5, 0)
    whole = parse(body(text="x", return_logprob=True, logprob_start_len=0)).engine_params(10, 50, 0)
    assert whole.prompt_logprobs_start == 1
    assert parse(body(text="x", logprob_start_len=2)).engine_params(10, 50, 0).prompt_logprobs is None
    with pytest.raises(RequestError, match="logprob_start_len 10 is past the last token of prompt 0") as caught:
        parse(body(text="x", return_logprob=True, logprob_start_len=10)).engine_params(10, 50, 0)
    assert caught.value.param == "logprob_start_len"


def test_batches_and_n_answer_with_a_list():
    texts = parse(body(text=["a", "b"], rid=["r1", "r2"]))
    assert texts.is_batch() and texts.prompts() == ["a", "b"] and texts.reply_ids() == ["r1", "r2"]
    ids = parse(body(input_ids=[[1, 2], [3]]))
    assert ids.is_batch() and ids.prompts() == [[1, 2], [3]]
    sampled = parse(body(text="a", rid="q", sampling_params={"n": 3}))
    assert sampled.is_batch() and sampled.prompts() == ["a"] and sampled.reply_ids() == ["q-0", "q-1", "q-2"]
    assert parse(body(text="a", rid="q")).reply_ids() == ["q"]
    assert parse(body(text=["x"] * MAX_BATCH)).prompts() == ["x"] * MAX_BATCH


@pytest.mark.parametrize(
    "fields, field",
    [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": 5}, "text"),
        ({"text": []}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, "2"]}, "input_ids.1"),
        ({"text": ["a"] * (MAX_BATCH + 1)}, "text"),
        ({"text": ["a"] * 9, "sampling_params": {"n": 8}}, "text"),
        ({"text": "a", "sampling_params": {"n": 9}}, "sampling_params.n"),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"max_tokens": 5}}, "sampling_params.max_tokens"),
        ({"text": "a", "sampling_params": {"frequency_penalty": 0.5}}, "sampling_params.frequency_penalty"),
        ({"text": "a", "sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty"),
        ({"text": "a", "sampling_params": {"min_new_tokens": 2}}, "sampling_params.min_new_tokens"),
        ({"text": "a", "sampling_params": {"skip_special_tokens": False}}, "sampling_params.skip_special_tokens"),
        ({"text": "a", "sampling_params": {"ebnf": "root ::= 'a'"}}, "sampling_params.ebnf"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"stop": ["x"] * 9}}, "sampling_params.stop"),
        ({"text": "a", "sampling_params": {"stop": ["x", ""]}}, "sampling_params.stop"),
        ({"text": "a", "sampling_params": {"stop_token_ids": list(range(17))}}, "sampling_params.stop_token_ids"),
        ({"text": "a", "sampling_params": {"regex": "[0-9"}}, "sampling_params.regex"),
        ({"text": "a", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
        ({"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "sampling_params.regex"),
        ({"text": "a", "sampling_params": [{"n": 1}]}, "sampling_params"),
        ({"text": "a", "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "a", "image_data": "cat.png"}, "image_data"),
        ({"text": "a", "lora_path": "adapter"}, "lora_path"),
        ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
        ({"text": ["a", "b"], "rid": ["r"]}, "rid"),
        ({"text": "a", "max_new_tokens": 4}, "max_new_tokens"),
    ],
)
def test_a_field_the_engine_cannot_honour_is_a_400_naming_it(fields, field):
    assert refusal(body(**fields)).param == field


def test_a_body_that_is_not_a_json_object_is_a_400():
    assert "not valid JSON" in refusal(b"{text").message and "JSON object" in refusal(b"[1, 2]").message


# ---- the reply, without a model -----------------------------------------------------------------------------------


def metrics(cached: int = 0) -> RequestMetrics:
    return RequestMetrics(1.0, 1.5, 3.0, prompt_tokens=4, output_tokens=2, cached_tokens=cached)  # arrival at 1.0 s


TEXTS = {10: "A", 11: "B", 12: "C", 13: "D", 20: " x", 21: " y", 2: "<|end|>"}


def reply_of(deltas: list[Delta], params: SamplingParams, **asked) -> Reply:
    reply = Reply("r", [10, 11, 12, 13], params, **asked)
    for d in deltas:
        reply.add(d)
    return reply


def test_a_reply_has_sglangs_shape_with_its_finish_reason():
    params = SamplingParams(max_new_tokens=2)
    deltas = [Delta(0, (20,), " x", 1.5), Delta(0, (21,), " y", 2.0, "length", metrics=metrics(cached=3))]
    out = reply_of(deltas, params, logprob_start=None).body(TEXTS.__getitem__, lambda ids: "")
    assert out["text"] == " x y"
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == ("r", 4, 2, 3)
    assert meta["e2e_latency"] == 2.0 and "input_token_logprobs" not in meta
    running = reply_of(deltas[:1], params, logprob_start=None).body(TEXTS.__getitem__, lambda ids: "")
    assert running["text"] == " x"  # a stream's bodies: the text so far
    assert running["meta_info"]["finish_reason"] is None and running["meta_info"]["cached_tokens"] == 0
    batch = replies_body([reply_of(deltas, params, logprob_start=None)] * 2, True, TEXTS.get, str)
    assert [b["text"] for b in batch] == [" x y", " x y"]


@pytest.mark.parametrize(
    "params, last, decoded, matched",
    [
        (SamplingParams(), 2, " x", 2),  # end-of-sequence: its id
        (SamplingParams(stop_token_ids=(21,)), 21, " x y", 21),
        (SamplingParams(stop=("y", " x")), 21, " x y", " x"),  # the stop string reached first
    ],
)
def test_stop_says_what_it_matched(params, last, decoded, matched):
    deltas = [Delta(0, (20,), "", 1.5), Delta(0, (last,), "", 2.0, "stop", metrics=metrics())]
    reply = reply_of(deltas, params, logprob_start=None)
    assert reply.finish_json(lambda ids: decoded) == {"type": "stop", "matched": matched}
    aborted = reply_of([Delta(0, (), "", 1.0, "abort", metrics=metrics())], params, logprob_start=None)
    assert aborted.finish_json(lambda ids: "")["type"] == "abort"


def test_logprobs_are_sglangs_triples_the_first_prompt_position_without_one():
    lp = TokenLogprob
    prompt = (lp(12, -1.5, ((12, -1.5), (10, -2.0))), lp(13, -0.25, ((13, -0.25), (11, -3.0))))
    first = Delta(0, (20,), " x", 1.5, logprobs=(lp(20, -0.5, ((20, -0.5), (21, -1.0))),), prompt_logprobs=prompt)
    last = Delta(0, (21,), " y", 2.0, "length", (lp(21, -0.75, ((20, -0.7), (21, -0.75))),), metrics())
    params = SamplingParams(max_new_tokens=2, logprobs=2, prompt_logprobs=2, prompt_logprobs_start=2)
    meta = reply_of([first, last], params, logprob_start=1, top=2, with_text=True).meta_info(TEXTS.get, str)
    assert meta["input_token_logprobs"] == [[None, 11, "B"], [-1.5, 12, "C"], [-0.25, 13, "D"]]
    assert meta["output_token_logprobs"] == [[-0.5, 20, " x"], [-0.75, 21, " y"]]
    assert meta["input_top_logprobs"] == [None, [[-1.5, 12, "C"], [-2.0, 10, "A"]], [[-0.25, 13, "D"], [-3.0, 11, "B"]]]
    assert meta["output_top_logprobs"][1] == [[-0.7, 20, " x"], [-0.75, 21, " y"]]
    bare = reply_of([first, last], params, logprob_start=3).meta_info(TEXTS.get, str)
    assert bare["input_token_logprobs"] == [[None, 13, None]] and "input_top_logprobs" not in bare


# ---- an SGLang program against the real model -----------------------------------------------------------------------

ENGINE = ("--kv-cache-memory", "128MiB", "--max-num-seqs", "8", "--max-waiting", "64", "--log-level", "warning")
SYSTEM = "You are a helpful assistant. You answer in a few words."
CITY_QUESTION = "Which city is the capital of France?"
CHOICES = ["Paris", "London", "Berlin"]
NUMBER = r"[0-9]{1,3}"
STOPS = [" ", "\n"]  # the answer ends at its first word
QUESTIONS = ["List three colours.", "Name three animals.", "Name three rivers."]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# a long shared prompt, forked into branches that differ only in their last few tokens
FACTS = "Facts about the planets. " + " ".join(f"Planet {i} orbits the sun at its own distance." for i in range(1, 16))


@pytest.fixture(scope="module")
def served(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    with pytest.MonkeyPatch.context() as env:
        if os.environ.get("OFFLOAD_KERNELS", "").lower() != "torch":  # the fixed paths, as the greedy tests take
            env.setenv("OFFLOAD_KERNELS", "native")
        served = start_server(smollm2_gguf, log, *ENGINE, "--served-model-name", "smollm2", "--api-key", API_KEY)
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def sgl(served: Served):
    """SGLang's frontend (the test extra), its default backend the server."""
    sgl = pytest.importorskip("sglang")
    sgl.set_default_backend(sgl.RuntimeEndpoint(served.url, api_key=API_KEY, chat_template_name="chatml"))
    return sgl


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    """The same GGUF in this process, to score the choices a select weighs."""
    return LLM(smollm2_gguf, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=4))


@pytest.fixture(scope="module")
def quiz(sgl):
    @sgl.function
    def quiz(s, question):
        s += sgl.system(SYSTEM)
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, stop=STOPS))
        s += sgl.user(CITY_QUESTION)
        s += sgl.assistant(sgl.select("city", choices=CHOICES))
        s += sgl.user("Give a number between 1 and 100.")
        s += sgl.assistant(sgl.gen("number", regex=NUMBER, max_tokens=4))
        forks = s.fork(2)
        for letter, f in zip("AB", forks, strict=True):
            f += sgl.user(f"Name a fruit that starts with the letter {letter}.")
            f += sgl.assistant(sgl.gen("fruit", max_tokens=4))
        s += sgl.user("Fruits: " + " and ".join(f["fruit"] for f in forks))

    return quiz


@pytest.fixture(scope="module")
def alone(quiz):
    """The program run once on its own, greedy."""
    state = quiz.run(question=QUESTIONS[0], temperature=0)
    assert state.error() is None
    return state


def prompt_logprobs(llm, ids: list[int], start: int) -> list[float]:
    """Each token's logprob from position `start` on, scored in this process."""
    logits = llm.score([ids])[0]  # [len(ids), vocab]
    return [float(logits[p - 1].log_softmax(-1)[ids[p]]) for p in range(start, len(ids))]


def mean_logprobs(llm, prefix: str, choices: list[str]) -> list[float]:
    """What SGLang's select weighs: each choice's mean token logprob after `prefix`, over the positions its scoring
    request returns (from two tokens before the choice; the first has no logprob, and the frontend skips zeros)."""
    start = len(llm.encode(prefix)) - 1
    values = [[v for v in prompt_logprobs(llm, llm.encode(prefix + c), start) if v] for c in choices]
    return [sum(v) / len(v) for v in values]


def check_program(state, llm) -> None:
    """What every run of the quiz must show: its select the in-process argmax, its gens held to their stop and regex."""
    text = state.text()
    marker = f"{CITY_QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    means = mean_logprobs(llm, text[: text.index(marker) + len(marker)], CHOICES)
    assert state["city"] == CHOICES[max(range(len(CHOICES)), key=means.__getitem__)]
    served_means = state.get_meta_info("city")["normalized_prompt_logprobs"]
    assert served_means == pytest.approx(means, abs=0.05)
    assert re.fullmatch(NUMBER, state["number"])
    assert state["answer"] and not any(stop in state["answer"] for stop in STOPS)
    assert state.get_meta_info("answer")["finish_reason"] in [{"type": "stop", "matched": stop} for stop in STOPS]
    fruits = text.rsplit("Fruits: ", 1)[1].removesuffix("<|im_end|>\n").split(" and ")
    assert len(fruits) == 2 and all(fruits)  # both branches' answers, joined back


@pytest.mark.slow
@pytest.mark.fixed_kernels
def test_a_program_runs_as_sglang_runs_it(alone, llm):
    check_program(alone, llm)


@pytest.mark.slow
@pytest.mark.fixed_kernels
def test_a_streamed_run_writes_the_same_program(quiz, alone):
    state = quiz.run(question=QUESTIONS[0], temperature=0, stream=True)
    pieces = list(state.text_iter())
    assert len(pieces) > 1 and "".join(pieces) == state.text() == alone.text()


@pytest.mark.slow
@pytest.mark.fixed_kernels
def test_run_batch_runs_each_program(quiz, llm):
    states = quiz.run_batch([{"question": q} for q in QUESTIONS], temperature=0)
    for state, question in zip(states, QUESTIONS, strict=True):
        assert state.error() is None and question in state.text()
        check_program(state, llm)


@pytest.mark.slow
def test_a_fork_prefills_its_shared_prompt_once(sgl, served, llm):
    cached: list[int] = []  # each branch's prompt tokens taken from the prefix cache

    @sgl.function
    def ideas(s):
        s += FACTS + "\n"
        forks = s.fork(8)
        for i, f in enumerate(forks):
            f += f"Idea {i}:" + sgl.gen("idea", max_tokens=2)
        cached.extend(f.get_meta_info("idea")["cached_tokens"] for f in forks if f["idea"] is not None)

    block = httpx.get(f"{served.url}/get_server_info", headers=AUTH, timeout=BOUND).json()["engine"]["block_size"]
    shared = len(llm.encode(FACTS + "\n"))
    longest = max(len(llm.encode(f"{FACTS}\nIdea {i}:")) for i in range(8))
    sgl.global_config.default_backend.flush_cache()
    before = served.metrics()
    assert ideas.run(temperature=0).text().startswith(FACTS)
    after = served.metrics()
    computed = after["offload_prefill_tokens_computed_total"] - before["offload_prefill_tokens_computed_total"]
    # the shared prompt once, then each branch's own tokens and the shared prompt's last partial block
    assert shared <= computed <= shared + 8 * (longest - shared + block)
    assert len(cached) == 8
    assert all(c >= shared // block * block for c in sorted(cached)[1:])  # the first may have computed it itself


def generate(served: Served, payload: dict, headers: dict = AUTH) -> httpx.Response:
    return httpx.post(f"{served.url}/generate", json=payload, headers=headers, timeout=BOUND)


@pytest.mark.slow
def test_the_info_routes_their_key_and_a_400_naming_the_field(served):
    assert httpx.get(f"{served.url}/get_model_info", timeout=BOUND).status_code == 401
    info = httpx.get(f"{served.url}/get_model_info", headers=AUTH, timeout=BOUND).json()
    assert info["model_path"] == "smollm2" and info["is_generation"] is True and Path(info["tokenizer_path"]).is_dir()
    for route in ("/get_server_info", "/server_info"):
        settings = httpx.get(f"{served.url}{route}", headers=AUTH, timeout=BOUND).json()
        assert settings["engine"]["max_num_seqs"] == settings["max_running_requests"] == 8
        assert settings["context_length"] > 0 and "api_key" not in settings["serve"]
    assert httpx.get(f"{served.url}/health_generate", timeout=BOUND).status_code == 200
    assert generate(served, {"text": "a"}, headers={}).status_code == 401
    reply = generate(served, {"text": "a", "sampling_params": {"frequency_penalty": 1.0}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "sampling_params.frequency_penalty"
    reply = generate(served, {"text": "ab", "return_logprob": True, "logprob_start_len": 50})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprob_start_len"
    reply = generate(served, {"input_ids": [10**9]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_ids"


@pytest.mark.slow
@pytest.mark.fixed_kernels
def test_prompt_logprobs_are_the_models_and_flush_cache_forgets_the_prefix(served, llm):
    prompt = FACTS[:200]
    asked = {"text": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 3}
    meta = generate(served, {**asked, "return_text_in_logprobs": True}).json()["meta_info"]
    ids = llm.encode(prompt)
    want = prompt_logprobs(llm, ids, 4)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[3:] and entries[0][0] is None
    assert [e[0] for e in entries[1:]] == pytest.approx(want, abs=0.05)
    assert [e[2] for e in entries] == [llm.token_text(t) for t in ids[3:]]
    assert meta["output_token_logprobs"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    again = generate(served, {"text": prompt, "sampling_params": {"max_new_tokens": 0}}).json()["meta_info"]
    assert again["cached_tokens"] >= len(ids) - 16  # its full blocks, from the request before
    assert httpx.post(f"{served.url}/flush_cache", headers=AUTH, timeout=BOUND).status_code == 200
    flushed = generate(served, {"text": prompt, "sampling_params": {"max_new_tokens": 0}}).json()["meta_info"]
    assert flushed["cached_tokens"] == 0


@pytest.mark.slow
@pytest.mark.fixed_kernels
def test_a_batch_with_n_and_a_stream(served):
    sampling = {"max_new_tokens": 6, "temperature": 0, "n": 2}
    replies = generate(served, {"text": ["The sky is", "Water is"], "sampling_params": sampling}).json()
    assert [r["meta_info"]["completion_tokens"] for r in replies] == [6] * 4
    assert replies[0]["text"] == replies[1]["text"] and replies[2]["text"] == replies[3]["text"]
    whole = generate(served, {"text": "The sky is", "sampling_params": {**sampling, "n": 1}}).json()
    assert whole["text"] == replies[0]["text"]
    payload = {"text": "The sky is", "sampling_params": {**sampling, "n": 1}, "stream": True}
    with httpx.stream("POST", f"{served.url}/generate", json=payload, headers=AUTH, timeout=BOUND) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts[:-1], texts[1:], strict=True)) and texts[-1] == whole["text"]
    assert [c["meta_info"]["finish_reason"] for c in chunks][-2:] == [None, {"type": "length", "length": 6}]
