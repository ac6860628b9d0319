"""A batch job's files: the input it reads, the output it appends to, and what makes a rerun resume.

Input, one JSON object per line, in either form:
- OpenAI's Batch format: {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
  "body": {...}}, answered with {"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error"};
- the plain form: {"id", "prompt" | "messages", and optionally "max_tokens", "temperature", "top_p", "top_k",
  "seed", "stop", "ignore_eos", "response_format"}, answered with {"id", "text", "finish_reason", "usage"}.
Chat lines of OpenAI's format may carry `response_format` and `tools` with `tool_choice`, as the endpoint takes them;
a completions line with `echo` is a bad line (a batch result holds the completion only).
A line that is not valid goes to OUT.errors.jsonl ({"line", "id", "error"}) and the job goes on; a duplicate id
or an unreadable input stops the job before any work.

Output: each result is appended as one line (one write) when its request finishes, flushed, and fsynced at
most every `fsync_seconds`. OUT.meta.json holds the fingerprint of the input and the model; a rerun of the
same command reads OUT, drops a torn last line, and skips the ids already there. An OUT whose fingerprint names
another input or model, or an OUT without one, is refused rather than appended to. A write that fails (a full
disk) is cut back off at once, so OUT holds whole lines only, and stops the job with OutputError.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from offload.common.config import SamplingParams
from offload.common.errors import OffloadError
from offload.common.outputs import Delta
from offload.openai import protocol
from offload.openai.protocol import ChatRequest, CompletionRequest, RequestError
from offload.openai.tool_calls import ToolUse
from offload.tiers.files import os_error_reason

FORMAT = 1  # of OUT.meta.json
PLAIN_FIELDS = {
    *("id", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"),
    "response_format",  # as OpenAI's: {"type": "json_schema", "json_schema": {"schema": {...}}}, or json_object
}
PLAIN_DEFAULT_TOKENS = 256  # new tokens of a plain request without max_tokens
UNBOUNDED = 1 << 30  # new tokens: the core stops a request at the context's end ("length")
URLS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One valid input line."""

    id: str
    line: int  # 1-based
    openai: bool  # OpenAI's Batch format (else the plain form)
    chat: bool
    prompt: str | list[int] | None  # completions
    messages: list[dict] | None  # chat
    params: tuple[SamplingParams, ...]  # one per choice (n)
    model: str | None  # what an OpenAI line named
    logprobs: bool
    tools: ToolUse | None = None  # what a chat line's reply may call

    @property
    def functions(self) -> list[dict] | None:
        return list(self.tools.functions) if self.tools is not None else None


@dataclass(frozen=True, slots=True)
class BadLine:
    line: int
    id: str | None
    error: str


def read_input(path: Path, model_name: str) -> tuple[list[JobRequest], list[BadLine]]:
    """Every line of `path`: the valid requests and the bad lines. OffloadError for an unreadable file or an id
    used twice (before any work, since which of the two the output would hold is unknowable)."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise OffloadError(f"{path}: cannot read the input ({exc.strerror})") from None
    requests: list[JobRequest] = []
    bad: list[BadLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            request = _parse_line(raw, number, model_name)
        except _Bad as exc:
            bad.append(BadLine(number, exc.id, exc.error))
            continue
        if request.id in seen:
            raise OffloadError(f"{path}: line {number}: id {request.id!r} is also on line {seen[request.id]}")
        seen[request.id] = number
        requests.append(request)
    return requests, bad


class _Bad(Exception):
    def __init__(self, error: str, id: str | None = None) -> None:
        self.error, self.id = error, id


def _parse_line(raw: bytes, number: int, model_name: str) -> JobRequest:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Bad(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _Bad("a line must be a JSON object")
    if "custom_id" in obj:
        return _openai_line(obj, number, model_name)
    return _plain_line(obj, number)


def _line_id(value: object, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Bad(f"{field} must be a non-empty string")
    return value


def _openai_line(obj: dict, number: int, model_name: str) -> JobRequest:
    rid = _line_id(obj.get("custom_id"), "custom_id")
    if obj.get("method", "POST") != "POST":
        raise _Bad(f"method {obj.get('method')!r}: only POST", rid)
    kind = URLS.get(obj.get("url"))
    if kind is None:
        raise _Bad(f"url {obj.get('url')!r}: one of {', '.join(URLS)}", rid)
    try:
        req = protocol.validate(obj.get("body"), kind)
    except RequestError as exc:
        raise _Bad(f"body: {exc.message}", rid) from None
    if req.model != model_name:
        raise _Bad(f"body.model {req.model!r}: this job runs {model_name!r}", rid)
    if req.stream:
        raise _Bad("body.stream: a batch request is answered whole", rid)
    if getattr(req, "echo", False):
        raise _Bad("body.echo: a batch job does not echo prompts; send the request to /v1/completions", rid)
    chat = kind is ChatRequest
    tools = None
    if chat:
        messages, prompt = req.conversation(), None
        logprobs = req.logprobs
        tools = req.tool_use()
    else:
        prompts = req.prompts()
        if len(prompts) != 1:
            raise _Bad("body.prompt: one prompt per batch line", rid)
        messages, prompt = None, prompts[0]
        logprobs = req.logprobs is not None
    budget = protocol.token_budget(req, UNBOUNDED)  # chat without a limit: until the context is full
    params = tuple(protocol.sampling_params(req, budget, k) for k in range(req.n))
    return JobRequest(rid, number, True, chat, prompt, messages, params, req.model, logprobs, tools)


def _plain_line(obj: dict, number: int) -> JobRequest:
    rid = _line_id(obj.get("id"), "id")
    unknown = sorted(set(obj) - PLAIN_FIELDS)
    if unknown:
        raise _Bad(f"unknown field {unknown[0]!r} (the plain form takes {', '.join(sorted(PLAIN_FIELDS))})", rid)
    if ("prompt" in obj) == ("messages" in obj):
        raise _Bad("give one of prompt or messages", rid)
    chat = "messages" in obj
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if chat and not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        raise _Bad("messages must be a non-empty list of {role, content} objects", rid)
    if not chat and not (isinstance(prompt, str) and prompt):
        raise _Bad("prompt must be a non-empty string", rid)
    stop = obj.get("stop") or ()
    try:
        constraint = {}
        if obj.get("response_format") is not None:
            holder = protocol.Sampling.model_validate({"model": "-", "response_format": obj["response_format"]})
            holder.check_constraint()
            constraint = holder.constraint()
        params = SamplingParams(
            max_new_tokens=obj.get("max_tokens", PLAIN_DEFAULT_TOKENS),
            temperature=float(obj.get("temperature", 0.0)),
            top_k=obj.get("top_k", 0),
            top_p=float(obj.get("top_p", 1.0)),
            seed=obj.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            ignore_eos=bool(obj.get("ignore_eos", False)),
            **constraint,
        )
    except RequestError as exc:
        raise _Bad(exc.message, rid) from None
    except ValidationError as exc:
        err = exc.errors()[0]
        raise _Bad(f"{'.'.join(map(str, err['loc']))}: {err['msg']}", rid) from None
    except (OffloadError, TypeError, ValueError) as exc:
        raise _Bad(str(exc), rid) from None
    return JobRequest(rid, number, False, chat, prompt, messages, (params,), None, False)


def result_record(r: JobRequest, prompt_tokens: int, outputs: list[list[Delta]], token_text) -> dict:
    """The output line of request `r`: its choices' deltas in the format of its input line."""
    if not r.openai:
        deltas = outputs[0]
        tokens = sum(len(d.token_ids) for d in deltas)
        return {
            "id": r.id,
            "text": "".join(d.text for d in deltas),
            "finish_reason": deltas[-1].finish_reason,
            "usage": protocol.usage(prompt_tokens, tokens),
        }
    head = {"id": protocol.new_id("chatcmpl" if r.chat else "cmpl"), "created": protocol.now(), "model": r.model}
    if r.chat:
        body = protocol.chat_body(head, outputs, prompt_tokens, r.logprobs, token_text, r.tools)
    else:
        body = protocol.completion_body(head, outputs, prompt_tokens, r.logprobs, token_text)
    response = {"status_code": 200, "request_id": protocol.new_id("req"), "body": body}
    return {"id": protocol.new_id("batch_req"), "custom_id": r.id, "response": response, "error": None}


# ---- the output and its fingerprint ---------------------------------------------------------------------


def fingerprint(input_path: Path, model_dir: Path) -> dict:
    """What an output belongs to: the input's bytes, and the model's config and weight files (names and sizes)."""
    digest = hashlib.sha256(input_path.read_bytes()).hexdigest()
    model = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.suffix in (".json", ".safetensors", ".model") and f.is_file():
            model.update(f"{f.name}:{f.stat().st_size}\n".encode())
            if f.suffix == ".json":
                model.update(f.read_bytes())
    return {"format": FORMAT, "input_sha256": digest, "model": str(model_dir), "model_sha256": model.hexdigest()}


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json")


def errors_path(out: Path) -> Path:
    return out.with_name(out.name.removesuffix(".jsonl") + ".errors.jsonl")


def atomic_write(path: Path, data: bytes) -> None:
    """`path` holding `data`, whole or not at all (OffloadError, and no temp file left, where it cannot be written)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OffloadError(f"{path}: {os_error_reason(exc)}") from None


def open_output(out: Path, print_: dict) -> set[str]:
    """Prepare `out` for appending: new (with its fingerprint written first), or resumed (its torn last line cut
    off). Returns the ids it already holds."""
    meta = meta_path(out)
    if not out.exists():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(meta, json.dumps(print_, indent=1).encode())
            out.touch()
        except OSError as exc:
            raise OffloadError(f"{out}: {os_error_reason(exc)}") from None
        return set()
    if not meta.exists():
        raise OffloadError(f"{out}: exists without {meta.name}: not this job's output; move it or pick another path")
    try:
        saved = json.loads(meta.read_text())
    except json.JSONDecodeError:
        raise OffloadError(f"{meta}: not valid JSON; move {out} away to start over") from None
    for key, what in (("input_sha256", "input"), ("model_sha256", "model"), ("format", "format")):
        if saved.get(key) != print_[key]:
            raise OffloadError(f"{out}: belongs to another {what} ({meta.name} differs); pick another output path")
    return _done_ids(out)


def _done_ids(out: Path) -> set[str]:
    """The ids of the whole, valid lines of `out`; whatever follows the first torn or unreadable line (a write cut
    short by a crash) is cut off."""
    data = out.read_bytes()
    *whole, _ = data.split(b"\n")  # the last piece is what follows the last newline: empty, or a torn line
    done: set[str] = set()
    good = 0  # bytes of whole, valid lines
    for raw in whole:
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            break
        rid = obj.get("custom_id", obj.get("id")) if isinstance(obj, dict) else None
        if not isinstance(rid, str):
            break
        done.add(rid)
        good += len(raw) + 1
    if good < len(data):
        with out.open("r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
    return done


class OutputError(OffloadError):
    """The output could not be written (a full disk): it holds whole lines only, and a rerun finishes the job."""


class Appender:
    """Appends whole lines to the output: one write each, flushed at once, fsynced at a bounded interval. A write
    that fails is cut back off (OutputError), so the output never keeps part of a line."""

    def __init__(self, out: Path, fsync_seconds: float) -> None:
        self.out = out
        self._fd = os.open(out, os.O_WRONLY | os.O_APPEND)
        self._size = os.fstat(self._fd).st_size  # bytes of whole lines
        self._every = fsync_seconds
        self._synced = time.monotonic()
        self.lines = 0  # written by this appender

    def write(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        try:
            written = os.write(self._fd, line)
            while written < len(line):  # a short write: the rest, so that the line stays whole
                written += os.write(self._fd, line[written:])
        except OSError as exc:
            os.ftruncate(self._fd, self._size)  # the part written, if any, goes: a shorter file needs no room
            raise OutputError(f"{self.out}: {os_error_reason(exc)}") from None
        self._size += len(line)
        self.lines += 1
        if time.monotonic() - self._synced >= self._every:
            self.sync()

    def sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise OutputError(f"{self.out}: {os_error_reason(exc)}") from None
        self._synced = time.monotonic()

    def close(self) -> None:
        try:
            self.sync()
        finally:
            os.close(self._fd)


def write_errors(out: Path, bad: list[BadLine]) -> None:
    path = errors_path(out)
    if bad:
        lines = "".join(json.dumps({"line": b.line, "id": b.id, "error": b.error}) + "\n" for b in bad)
        atomic_write(path, lines.encode())
    elif path.exists():
        path.unlink()


def rewrite_in_order(out: Path, ids: list[str]) -> None:
    """Rewrite the output in the input's order (atomically), once it holds every id; else leave it be."""
    records = {}
    for raw in out.read_bytes().splitlines():
        obj = json.loads(raw)
        records[obj.get("custom_id", obj.get("id"))] = raw
    if all(i in records for i in ids):
        atomic_write(out, b"".join(records[i] + b"\n" for i in ids))
