"""The bounds on what a request may send: the body cap (middleware driven on a tiny ASGI app), the character bound
and the list bounds (on their own), and a real `offload serve` refusing huge bodies without growing."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from serving import BOUND, SERVER_FLAGS, Served, start_server
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from offload.openai.protocol import ChatRequest, CompletionRequest, RequestError
from offload.server import limits
from offload.server.app import Server
from offload.server.limits import (
    LOADING_BODY_BYTES,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_TOOLS,
    UPLOAD_BYTES,
    BodyLimit,
)
from offload.server.settings import ServeSettings

# ---- the middleware, on a tiny app ---------------------------------------------------------------------------


class Reader:
    """An ASGI app that reads the whole body (as a route does), counting what it pulled, and answers its length;
    `swallow`: it answers 400 itself when reading fails (as FastAPI's form parser does)."""

    def __init__(self, swallow: bool = False) -> None:
        self.pulled, self.swallow = 0, swallow

    async def __call__(self, scope, receive, send) -> None:
        size, more = 0, True
        try:
            while more:
                message = await receive()
                self.pulled += 1
                size += len(message.get("body", b""))
                more = message.get("more_body", False)
        except Exception:
            if not self.swallow:
                raise
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b"bad form"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(size).encode()})


def drive(app, chunks: list[bytes], length: int | None, path: str = "/v1/completions") -> tuple[int, bytes, int]:
    """One POST through `app`: (status, body, chunks the client had to hand over)."""
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    given, sent = 0, []

    async def receive() -> dict:
        nonlocal given
        given += 1
        return {"type": "http.request", "body": chunks[given - 1], "more_body": given < len(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    return sent[0]["status"], sent[1]["body"], given


def capped(app, cap: int) -> BodyLimit:
    return BodyLimit(app, lambda method, path: cap)


def test_a_declared_length_over_the_cap_is_refused_before_a_byte_is_read():
    reader = Reader()
    status, body, given = drive(capped(reader, 1000), [b"x" * 1001], 1001)
    assert (status, given, reader.pulled) == (413, 0, 0)
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "1000 bytes" in error["message"] and "--max-request-size" in error["message"]
    assert "\n" not in error["message"]


def test_a_chunked_body_is_cut_off_where_it_passes_the_cap():
    reader = Reader()
    chunks = [b"x" * 400] * 10  # 4000 bytes, no Content-Length
    status, body, given = drive(capped(reader, 1000), chunks, None)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert given == 3  # the third chunk passed 1000 bytes: the other seven were never asked for


def test_what_an_app_answers_to_a_body_cut_off_is_replaced_by_the_413():
    status, _, given = drive(capped(Reader(swallow=True), 1000), [b"x" * 600] * 4, None)
    assert (status, given) == (413, 2)


@pytest.mark.parametrize("length", [None, 1000])
def test_a_body_within_the_cap_reaches_the_app_whole(length):
    status, body, given = drive(capped(Reader(), 1000), [b"x" * 500, b"y" * 500], length)
    assert (status, body, given) == (200, b"1000", 2)


def test_the_cap_before_and_after_loading_and_the_uploads_own():
    server = Server(lambda: None, ServeSettings(model_name="m"))
    assert limits.body_cap(server, "POST", "/v1/completions") == LOADING_BODY_BYTES
    server.llm = FakeLLM()
    # 100 tokens of the longest (one more byte each for a stripped leading space), and the slack
    derived = MAX_PROMPTS * 100 * (len("0123456789") + 1) + limits.BODY_SLACK
    assert limits.body_cap(server, "POST", "/v1/completions") == derived
    assert limits.body_cap(server, "POST", "/v1/files") == UPLOAD_BYTES
    assert limits.body_cap(server, "GET", "/v1/files") == derived
    server.settings = ServeSettings(model_name="m", max_body_bytes=300 << 20)
    assert limits.body_cap(server, "POST", "/v1/chat/completions") == 300 << 20
    assert limits.body_cap(server, "POST", "/v1/files") == 300 << 20


# ---- the character bound -------------------------------------------------------------------------------------


VOCAB = ["a", "0123456789", "b"]


class FakeTokenizer:
    backend_tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=[]))
    backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    has_chat_template = True

    def __len__(self) -> int:
        return len(VOCAB)


class FakeLLM:
    """What the server reaches of an LLM: a window of 100 tokens of at most 10 characters; tokenizing fails."""

    max_model_len = 100

    def __init__(self) -> None:
        self.prompts = self
        self.tokenizer = FakeTokenizer()
        self.has_chat_template = True

    def token_text(self, token_id: int) -> str:
        return VOCAB[token_id]

    def encode(self, prompt, index, tools=None):
        raise AssertionError("tokenized")

    def encode_chat(self, conversation, index, tools=None):
        raise AssertionError("tokenized")


def test_a_text_too_long_for_the_window_is_refused_without_tokenizing():
    server = Server(lambda: None, ServeSettings(model_name="m"))
    server.llm = FakeLLM()  # bound: 100 tokens x (10 characters + 1 for a stripped leading space)
    with pytest.raises(RequestError) as refused:
        server.encode("x" * 1101, 3, "prompt")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert refused.value.message == (
        "prompt 3 has 1101 characters; the context window is 100 tokens of at most 10 characters each, so it cannot fit"
    )
    with pytest.raises(AssertionError, match="tokenized"):  # at the bound: tokenized (and refused by tokens, if so)
        server.encode("x" * 1100, 3, "prompt")
    talk = [
        {"role": "assistant", "content": "a" * 5000},  # a template may drop earlier assistant turns
        {"role": "user", "content": " " * 5000 + "u" * 1101},  # and trim the whitespace around a message
    ]
    with pytest.raises(RequestError, match="the conversation has 1101 characters") as refused:
        server.encode_chat(talk)
    assert refused.value.param == "messages"
    with pytest.raises(AssertionError, match="tokenized"):
        server.encode_chat(talk[:1])


def test_bounds_from_a_tokenizer_count_its_longest_token_and_its_most_escaped_one():
    texts = ["a", "hello", "\n\n\n", "é", "😀😀"]

    class Vocab:
        backend_tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(texts)}, merges=[]))

        def __len__(self):
            return len(texts)

    Vocab.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    bounds = limits.measure(256, Vocab(), texts.__getitem__)
    assert bounds.token_chars == 5 + 1  # "hello", and one for a stripped leading space
    assert bounds.token_json_bytes == len("\\ud83d\\ude00" * 2) + 1
    assert bounds.max_chars == 256 * 6 and bounds.fold == 1
    assert limits.measure(256, None, texts.__getitem__).max_chars is None  # token ids only


def tokenizer_with(model, normalizer=None, pre=None, added: AddedToken | None = None):
    """A fast tokenizer (as transformers holds one) of these parts."""
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre is not None:
        tok.pre_tokenizer = pre
    if added is not None:
        tok.add_special_tokens([added])
    return type("Fast", (), {"backend_tokenizer": tok})()


def bpe(byte_fallback: bool = False):
    return models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", byte_fallback=byte_fallback)


@pytest.mark.parametrize(
    ("tokenizer", "fold"),
    [
        (tokenizer_with(bpe(), pre=pre_tokenizers.ByteLevel()), 1),
        (tokenizer_with(bpe(True), normalizers.Sequence([normalizers.Prepend("▁"), normalizers.NFC()])), 4),
        (tokenizer_with(bpe(True), normalizers.Replace("  ", "_")), 2),
        (tokenizer_with(bpe(True), normalizers.Strip()), None),  # strips text
        (tokenizer_with(bpe(True), pre=pre_tokenizers.WhitespaceSplit()), None),  # drops the spaces
        (tokenizer_with(bpe()), None),  # an unknown run becomes one <unk>
        (tokenizer_with(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), None),
        (tokenizer_with(bpe(True), added=AddedToken("<m>", lstrip=True)), None),
        (object(), None),  # a slow tokenizer
    ],
)
def test_the_fold_of_a_tokenizer(tokenizer, fold):
    assert limits.fold(tokenizer) == fold


# ---- the list bounds -----------------------------------------------------------------------------------------


def refusal(request) -> RequestError | None:
    try:
        limits.check_lists(request)
    except RequestError as exc:
        return exc
    return None


def test_lists_are_bounded_and_the_refusal_names_the_field():
    def completion(prompt):
        return CompletionRequest(model="m", prompt=prompt)

    assert refusal(completion(["p"] * MAX_PROMPTS)) is None
    assert refusal(completion([[1, 2]] * MAX_PROMPTS)) is None
    assert refusal(completion(list(range(5 * MAX_PROMPTS)))) is None  # one token-id prompt (the window bounds it)
    for prompt in (["p"] * (MAX_PROMPTS + 1), [[1]] * (MAX_PROMPTS + 1)):
        exc = refusal(completion(prompt))
        assert exc.status == 400 and exc.param == "prompt" and f"at most {MAX_PROMPTS}" in exc.message
    message = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": "f"}}
    assert refusal(ChatRequest(model="m", messages=[message] * MAX_MESSAGES, tools=[tool] * MAX_TOOLS)) is None
    assert refusal(ChatRequest(model="m", messages=[message] * (MAX_MESSAGES + 1))).param == "messages"
    assert refusal(ChatRequest(model="m", messages=[message], tools=[tool] * (MAX_TOOLS + 1))).param == "tools"


# ---- a real server -------------------------------------------------------------------------------------------

MODEL = "demo-llama-v1"


@pytest.fixture(scope="module")
def served(demo_model: Path, tmp_path_factory: pytest.TempPathFactory):
    server = start_server(demo_model, tmp_path_factory.mktemp("limits") / "server.log", *SERVER_FLAGS)
    yield server
    assert server.stop() == 0


def post(served: Served, body) -> httpx.Response:
    """POST /v1/completions; `body` bytes are sent with a Content-Length, an iterator of bytes chunked."""
    return httpx.post(f"{served.url}/v1/completions", content=body, timeout=BOUND)


def completion_body(prompt: str) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()


def rss(served: Served) -> int:
    return psutil.Process(served.process.pid).memory_info().rss


def answers_normally(served: Served) -> bool:
    health = httpx.get(f"{served.url}/health", timeout=BOUND)
    normal = post(served, completion_body("The cat sat on the"))
    return health.status_code == 200 and normal.status_code == 200 and normal.json()["choices"][0]["text"] != ""


@pytest.mark.slow
def test_huge_bodies_are_refused_without_the_server_growing(served):
    assert answers_normally(served)  # warm: the bounds are computed, the first request's allocations made
    huge = completion_body("a" * 50_000_000)
    before = rss(served)
    refused = post(served, huge)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    chunked = post(served, iter([huge[i : i + (1 << 20)] for i in range(0, len(huge), 1 << 20)]))
    assert chunked.status_code == 413
    long_text = post(served, completion_body("a" * 2_000_000))  # under the demo's cap of a few MB
    assert long_text.status_code == 400
    assert "2000000 characters" in long_text.json()["error"]["message"]  # refused by length, never tokenized
    assert long_text.json()["error"]["param"] == "prompt"
    assert rss(served) - before < 100 << 20


@pytest.mark.slow
def test_sixteen_huge_requests_at_once_leave_the_server_answering(served):
    huge, long_text = completion_body("a" * 50_000_000), completion_body("a" * 2_000_000)
    bodies = [huge if i % 2 else long_text for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda body: post(served, body).status_code, bodies))
    assert codes == [400 if i % 2 == 0 else 413 for i in range(16)]
    assert answers_normally(served)
