"""Bounds on what one request may send the HTTP server, checked before the work the request would cost.

The body cap. `BodyLimit`, pure ASGI middleware, answers 413 to a body larger than the cap: at once where its
Content-Length says so (the body is never read), else as soon as the bytes received pass the cap (a chunked body:
reading stops there, and the rest is never buffered). The cap is --max-request-size where given; else, once the
model is loaded, it is derived from the context window:

    MAX_PROMPTS x window x token_json_bytes + BODY_SLACK

the largest list of prompts a request may carry, each a full context window of tokens, every token in the most
verbose JSON it can take (its text with every character escaped as \\uXXXX, as JSON's ensure_ascii writes it, or
its id with a separator), plus BODY_SLACK bytes for every other field. Before the model is loaded (when every
generation route answers 503) the cap is LOADING_BODY_BYTES. The Batch API's upload (POST /v1/files, which the
multipart parser spools to disk) takes the larger of UPLOAD_BYTES, OpenAI's limit on a batch input file, and the cap.

The character bound. A text longer than window x token_chars x fold characters cannot fit the window, so it is
refused with the engine's 400 for a prompt too long, without tokenizing it: token_chars is the most characters one
token of the vocabulary decodes to (plus one, for a decoder that strips a leading space), fold the most characters
the tokenizer's normalizer may fold into one (4 for NFC and NFKC, 1 where it never shortens text). A tokenizer that
may drop text (a normalizer or pre-tokenizer that strips or removes characters, a vocabulary without byte fallback,
special tokens that swallow the spaces beside them) has no character bound. A conversation counts the characters of
its messages other than the assistant's (a chat template may leave out parts of earlier assistant turns, such as
their reasoning), each stripped of surrounding whitespace (a template may trim it).

The list bounds: MAX_PROMPTS prompts in a request, MAX_MESSAGES messages, MAX_TOOLS tools (OpenAI's limits for the
last two); a token-id prompt is bounded by the window (the engine's own check, made without tokenizing).

For routes of other faces: `prompt_bounds(llm)` (computed once per model), `check_count`, `check_text`.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from offload.openai.protocol import RequestError

MAX_PROMPTS = 64  # prompts in one request (each with up to `n` choices, each a sequence in the batch)
MAX_MESSAGES = 2048  # messages in one conversation (OpenAI's limit)
MAX_TOOLS = 128  # tools a request may offer (OpenAI's limit)
BODY_SLACK = 1 << 20  # bytes: every field of a request but its prompts (sampling fields, schemas, tool definitions)
LOADING_BODY_BYTES = 1 << 20  # bytes: the cap before the model is loaded
UPLOAD_BYTES = 200 << 20  # bytes: a Batch API input file (OpenAI's limit)
UPLOAD_PATH = "/v1/files"
ID_JSON_BYTES = 9  # bytes: a token id of up to 7 digits and ", "
COMPOSED = 4  # the most characters (a base and its marks, a Hangul syllable's jamo) NFC composes into one


@dataclass(frozen=True, slots=True)
class PromptBounds:
    """What a model's context window and tokenizer bound a request to."""

    window: int  # tokens: the context window
    token_chars: int  # the most characters one token decodes to, plus one; 0: no tokenizer
    token_json_bytes: int  # the most bytes one token takes in a request's JSON (escaped text, or an id)
    fold: int | None  # the most characters the tokenizer folds into one; None: it may drop text

    @property
    def max_chars(self) -> int | None:
        """Characters a text may have and still fit the window; None: no bound."""
        if self.fold is None or not self.token_chars:
            return None
        return self.window * self.token_chars * self.fold

    @property
    def body_bytes(self) -> int:
        """The derived body cap (see the module docstring)."""
        return MAX_PROMPTS * self.window * self.token_json_bytes * (self.fold or 1) + BODY_SLACK

    def check_text(self, chars: int, what: str, field: str) -> None:
        """RequestError(400) if a text of `chars` characters (`what`: "prompt 3") cannot fit the window."""
        limit = self.max_chars
        if limit is not None and chars > limit:
            raise RequestError(
                400,
                f"{what} has {chars} characters; the context window is {self.window} tokens of at most "
                f"{self.token_chars - 1} characters each, so it cannot fit",
                field,
            )


_bounds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # an LLM -> its PromptBounds


def prompt_bounds(llm) -> PromptBounds:
    """The bounds of a loaded LLM (offload/api.py), computed on first use (one decode of every token) and kept."""
    found = _bounds.get(llm)
    if found is None:
        found = _bounds[llm] = measure(llm.max_model_len, llm.prompts.tokenizer, llm.token_text)
    return found


def measure(window: int, tokenizer, token_text: Callable[[int], str]) -> PromptBounds:
    """The bounds of a window and a tokenizer (None: the model takes token ids only); `token_text(id)`: one token's
    text, special tokens included."""
    if tokenizer is None:
        return PromptBounds(window, 0, ID_JSON_BYTES, None)
    longest, escaped = 0, ID_JSON_BYTES
    for i in range(len(tokenizer)):
        text = token_text(i)
        longest = max(longest, len(text))
        escaped = max(escaped, len(json.dumps(text)) - 2 + 1)  # quotes off; one for a stripped leading space
    return PromptBounds(window, longest + 1, escaped, fold(tokenizer))


def fold(tokenizer) -> int | None:
    """How many characters of text the tokenizer may turn into one before it splits it into tokens: 1 where it never
    shortens text, None where it may drop text (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer: nothing to read its rules from
    spec = json.loads(backend.to_str())
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return None
    pre = spec.get("pre_tokenizer")
    if not _keeps_text(pre) or not _covers_every_byte(spec.get("model") or {}, pre):
        return None
    return _normalizer_fold(spec.get("normalizer"))


_NEVER_SHORTEN = ("Prepend", "NFD", "NFKD", "Lowercase")
_KEEPING_PRE = ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def _normalizer_fold(n: dict | None) -> int | None:
    if n is None or n["type"] in _NEVER_SHORTEN:
        return 1
    if n["type"] in ("NFC", "NFKC"):
        return COMPOSED
    if n["type"] == "Replace":
        pattern, content = n.get("pattern", {}).get("String"), n.get("content", "")
        return math.ceil(len(pattern) / len(content)) if pattern and content else None
    if n["type"] == "Sequence":
        folds = [_normalizer_fold(m) for m in n["normalizers"]]
        return None if None in folds else math.prod(folds)
    return None


def _pieces(p: dict | None) -> list[dict]:
    """A pre-tokenizer's parts, a Sequence's flattened."""
    if p is None:
        return []
    return [q for part in p["pretokenizers"] for q in _pieces(part)] if p["type"] == "Sequence" else [p]


def _keeps_text(pre: dict | None) -> bool:
    """Whether a pre-tokenizer passes every character on (splitting text, never removing any)."""
    return all(
        p["type"] in _KEEPING_PRE or (p["type"] in ("Split", "Punctuation") and p.get("behavior") != "Removed")
        for p in _pieces(pre)
    )


def _covers_every_byte(model: dict, pre: dict | None) -> bool:
    """Whether the vocabulary spells any text without an unknown token swallowing a run of it."""
    byte_level = any(p["type"] == "ByteLevel" for p in _pieces(pre))
    return model.get("type") in ("BPE", "Unigram") and (byte_level or bool(model.get("byte_fallback")))


# ---- request checks ------------------------------------------------------------------------------------------


def check_count(items: Sequence | None, limit: int, field: str) -> None:
    """RequestError(400) naming `field` if the list `items` holds more than `limit` entries."""
    if items is not None and len(items) > limit:
        raise RequestError(400, f"{field} has {len(items)} entries; at most {limit} are accepted", field)


def check_lists(request) -> None:
    """The list bounds of an OpenAI request (a protocol.CompletionRequest or ChatRequest)."""
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        check_count(prompt, MAX_PROMPTS, "prompt")
    check_count(getattr(request, "messages", None), MAX_MESSAGES, "messages")
    check_count(getattr(request, "tools", None), MAX_TOOLS, "tools")


def check_text(llm, text: str, what: str, field: str) -> None:
    """RequestError(400) if `text` (`what`: "prompt 3") is too long for the model's window, by its characters."""
    prompt_bounds(llm).check_text(len(text), what, field)


def conversation_chars(conversation: list[dict]) -> int:
    """The characters of a conversation a chat template keeps in any case (see the module docstring)."""
    return sum(
        len(m["content"].strip())
        for m in conversation
        if m.get("role") != "assistant" and isinstance(m.get("content"), str)
    )


# ---- the body cap --------------------------------------------------------------------------------------------


def body_cap(server, method: str, path: str) -> int:
    """Bytes a request body to `path` may have on `server` (offload/server/app.py's Server)."""
    cap = server.settings.max_body_bytes
    if cap is None:
        cap = LOADING_BODY_BYTES if server.llm is None else prompt_bounds(server.llm).body_bytes
    return max(cap, UPLOAD_BYTES) if method == "POST" and path == UPLOAD_PATH else cap


def too_large(cap: int) -> RequestError:
    return RequestError(
        413,
        f"the request body is larger than {cap} bytes, this server's limit (--max-request-size raises it)",
        code="request_too_large",
    )


class _Overflow(Exception):
    """The body received passed the cap: the app's reading stops here."""


class BodyLimit:
    """Pure ASGI middleware: 413 (the server's error JSON) for a body over `cap(method, path)` bytes, decided by its
    Content-Length before it is read, or by the bytes received as they arrive. Past the cap nothing is read; what the
    app answered to a body it could not finish reading is replaced by the 413."""

    def __init__(self, app, cap: Callable[[str, str], int]) -> None:
        self.app, self.cap = app, cap

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.cap(scope["method"], scope["path"])
        declared = _content_length(scope["headers"])
        if declared is not None and declared > cap:
            await _answer(send, too_large(cap))
            return
        received, over, started = 0, False, False

        async def counted() -> dict:
            nonlocal received, over
            if over:
                raise _Overflow
            message = await receive()
            received += len(message.get("body", b""))
            if received > cap:
                over = True
                raise _Overflow
            return message

        async def guarded(message: dict) -> None:
            nonlocal started
            if over:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over and not started:
            await _answer(send, too_large(cap))


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _answer(send, error: RequestError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
