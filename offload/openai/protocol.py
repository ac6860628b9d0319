"""OpenAI's wire format: the request bodies the engine accepts, checked strictly, and the objects it returns.

Both faces that speak it import it from here, below them: the HTTP server (offload/server/) and the batch jobs
(offload/batch/job_files.py, whose OpenAI Batch lines carry these bodies and get these responses).

Requests are validated in strict mode (a string is not a number, a number is not a string) and every failure
becomes a `RequestError` naming the field, which the server answers with OpenAI's error JSON and a batch job
writes to its errors file. Fields that OpenAI clients send and this engine has no use for are ignored; fields
that would change the answer and that the engine cannot honour (penalties, best_of other than n) are refused rather
than silently dropped. A completion's `echo` puts the prompt before it (offload/openai/echo.py).

`response_format` (json_schema, json_object) and `tools` with `tool_choice` become a grammar the reply is held to
(offload/model/structured.py, offload/openai/tool_calls.py); a schema or grammar that does not compile is a 400 naming
it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from offload.common.config import MAX_LOGPROBS, SamplingParams
from offload.common.outputs import Delta, TokenLogprob
from offload.model.structured import grammar_error
from offload.openai.bodies import RequestError, checked, decoded
from offload.openai.echo import Echo
from offload.openai.tool_calls import ToolUse

MAX_N = 8  # choices per request: each is a sequence of its own in the batch
MAX_STOPS = 4  # as OpenAI
COMPLETION_LOGPROBS = 5  # the most top logprobs the completions API allows
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    ignore_eos: bool = False  # an extension (as vLLM's): generate past end-of-sequence tokens
    top_k: int = Field(0, ge=0)  # an extension: 0 = no limit
    response_format: ResponseFormat | None = None

    def reply_schema(self) -> str | None:
        """The JSON schema (as JSON text) the response_format holds the reply to; None for free text."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return '{"type":"object"}'
        if fmt.json_schema is None:
            raise RequestError(400, "response_format.json_schema is required with type json_schema", "response_format")
        schema = fmt.json_schema.schema_
        return json.dumps({"type": "object"} if schema is None else schema)

    def constraint(self) -> dict:
        """The SamplingParams fields that hold the reply to its format: json_schema, or a tool-call grammar."""
        schema = self.reply_schema()
        return {} if schema is None else {"json_schema": schema}

    def check_constraint(self) -> None:
        """RequestError(400) naming the field if the reply's schema or grammar does not compile."""
        fields = self.constraint()
        error = grammar_error(SamplingParams(**fields)) if fields else None
        if error:
            field = "response_format.json_schema.schema" if "json_schema" in fields else "tools"
            raise RequestError(400, f"{field}: {error}", field)

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise RequestError(400, f"stop takes up to {MAX_STOPS} non-empty strings", "stop")
        return stops

    def refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise RequestError(400, f"{name} is not supported by this engine; leave it at 0", name)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt only (its logprobs), nothing generated
    logprobs: int | None = Field(None, ge=0, le=COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        if not p:
            raise RequestError(400, "prompt is empty", "prompt")
        return list(p)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    def text(self, index: int) -> str:
        if self.content is None:
            if self.role == "assistant" and self.tool_calls:
                return ""
            raise RequestError(400, "content is required", f"messages.{index}.content")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for k, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, "only text content parts are supported", f"messages.{index}.content.{k}")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def conversation(self) -> list[dict]:
        out = []
        for i, m in enumerate(self.messages):
            message = {"role": m.role, "content": m.text(i)}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    def tool_use(self) -> ToolUse | None:
        """What the reply may call; None without tools or with tool_choice "none"."""
        choice = self.tool_choice
        if self.tools is None:
            if choice not in (None, "none"):
                raise RequestError(400, "tool_choice needs tools", "tool_choice")
            return None
        names = [t.function.name for t in self.tools]
        for k, name in enumerate(names):
            if name in names[:k]:
                raise RequestError(400, f"two tools are named {name!r}", f"tools.{k}.function.name")
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise RequestError(400, f"tool_choice names {choice.function.name!r}, which no tool is", "tool_choice")
            choice = choice.function.name
        functions = tuple(t.function.model_dump(exclude_none=True) for t in self.tools)
        return ToolUse(functions, choice or "auto", self.parallel_tool_calls)

    def constraint(self) -> dict:
        tools = self.tool_use()
        if tools is None:
            return super().constraint()
        return {"grammar": tools.grammar(self.reply_schema())}


def parse(raw: bytes, model: type[Sampling]) -> Sampling:
    """The request body as `model`, or RequestError(400) naming the first bad field."""
    return validate(decoded(raw), model)


def validate(body: object, model: type[Sampling]) -> Sampling:
    """A decoded request body as `model`, or RequestError(400) naming the first bad field."""
    request = checked(body, model)
    request.refuse_unsupported()
    request.check_constraint()
    if request.max_tokens == 0 and not getattr(request, "echo", False):  # only a completion takes 0
        raise RequestError(400, "max_tokens 0 returns nothing without echo: give at least 1", "max_tokens")
    best_of = getattr(request, "best_of", None)
    if best_of not in (None, request.n):
        raise RequestError(400, "best_of is not supported by this engine (other than equal to n)", "best_of")
    return request


def token_budget(request: Sampling, context_left: int) -> int:
    """New tokens a request may generate: max_tokens (max_completion_tokens for chat); unset, OpenAI's default of
    16 for completions and what the context leaves for chat."""
    if isinstance(request, ChatRequest):
        return request.max_completion_tokens or request.max_tokens or context_left
    return COMPLETION_DEFAULT_TOKENS if request.max_tokens is None else request.max_tokens


def sampling_params(request: Sampling, max_new_tokens: int, seed_offset: int) -> SamplingParams:
    """The engine's parameters for choice `seed_offset` of a request (a seeded request's choices differ)."""
    if isinstance(request, ChatRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    echoed = logprobs if getattr(request, "echo", False) else None  # echo's prompt tokens have logprobs too
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=None if request.seed is None else request.seed + seed_offset,
        stop=request.stops(),
        ignore_eos=request.ignore_eos,
        top_k=request.top_k,
        logprobs=logprobs,
        prompt_logprobs=echoed,
        **request.constraint(),
    )


# ---- responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(deltas: list[Delta], token_text, offset: int) -> dict:
    """The completions API's logprobs object for these deltas; `offset`: characters of text before them."""
    entries: list[TokenLogprob] = [lp for d in deltas for lp in d.logprobs]
    tokens = [token_text(lp.token_id) for lp in entries]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in entries],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in entries],
        "text_offset": offsets,
    }


def chat_logprobs(deltas: list[Delta], token_text) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for lp in (lp for d in deltas for lp in d.logprobs):
        content.append({**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]})
    return {"content": content}


def _reason(deltas: list[Delta]) -> str:
    return deltas[-1].finish_reason if deltas else "abort"


def completion_body(
    head: dict, outputs: list[list[Delta]], prompt_tokens: int, logprobs: bool, token_text, echoes: list[Echo] = ()
) -> dict:
    """A whole /v1/completions response: one choice per output (a request's deltas), after its prompt in `echoes`."""
    choices = []
    for index, deltas in enumerate(outputs):
        lp = completion_logprobs(deltas, token_text, len(echoes[index].text) if echoes else 0) if logprobs else None
        text = "".join(d.text for d in deltas)
        if echoes:
            text, lp = echoes[index].before(text, lp, deltas[0] if deltas else None, token_text)
        choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": _reason(deltas)})
    used = sum(len(d.token_ids) for deltas in outputs for d in deltas)
    return {**head, "object": "text_completion", "choices": choices, "usage": usage(prompt_tokens, used)}


def chat_message(text: str, reason: str, tools: ToolUse | None) -> tuple[dict, str]:
    """A chat reply as OpenAI's message and finish_reason: with tools, its calls as `tool_calls`."""
    if tools is not None:
        content, calls = tools.parse(text)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, reason


def chat_body(
    head: dict, outputs: list[list[Delta]], prompt_tokens: int, logprobs: bool, token_text, tools: ToolUse | None = None
) -> dict:
    """A whole /v1/chat/completions response: one choice per output; `tools`: what the request let it call."""
    choices = []
    for index, deltas in enumerate(outputs):
        message, reason = chat_message("".join(d.text for d in deltas), _reason(deltas), tools)
        lp = chat_logprobs(deltas, token_text) if logprobs else None
        choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason})
    used = sum(len(d.token_ids) for deltas in outputs for d in deltas)
    return {**head, "object": "chat.completion", "choices": choices, "usage": usage(prompt_tokens, used)}
