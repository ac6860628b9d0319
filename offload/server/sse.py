"""Server-sent events: a request's choices as OpenAI's stream chunks, ending with `data: [DONE]`.

Each choice's deltas come from its RequestStream; several choices (n > 1) are merged as they arrive, and a reader
that fell behind the engine sends what has arrived in one chunk. Closing the stream (the client gone) aborts
whatever has not finished. A reply that is not streamed takes its choices whole: `collect`, under `unless_gone`,
which aborts them when the client disconnects first.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from offload.common.errors import OffloadError
from offload.common.outputs import Delta
from offload.openai import protocol
from offload.openai.echo import Echo
from offload.openai.protocol import RequestError
from offload.openai.tool_calls import CallStream, ToolUse
from offload.server.front import RequestStream


def join_deltas(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one request as one (what a reader that fell behind sends in one chunk)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return Delta(
        last.request_id,
        tuple(t for d in deltas for t in d.token_ids),
        "".join(d.text for d in deltas),
        last.time,
        last.finish_reason,
        tuple(lp for d in deltas for lp in d.logprobs),
        last.metrics,
        tuple(lp for d in deltas for lp in d.prompt_logprobs),  # the first delta's only
    )


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream as they come; closing the iterator aborts what is unfinished."""
    if len(streams) == 1:  # the common case, without a task and a queue between the stream and its reader
        try:
            async for delta in streams[0]:
                yield 0, join_deltas([delta, *streams[0].ready()])
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                remaining -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for s in streams:
            s.close()


DISCONNECT_POLL = 0.5  # seconds between checks that a non-streaming request's client is still there


async def _drain_one(stream: RequestStream) -> list[Delta]:
    try:
        return [d async for d in stream]
    finally:
        stream.close()


async def collect(streams: list[RequestStream]) -> list[list[Delta]]:
    """Every choice's deltas; an error in one aborts the others. Cancelled (the client gone): all abort."""
    tasks = [asyncio.ensure_future(_drain_one(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except OffloadError as exc:
        raise RequestError(500, str(exc), kind="server_error") from None
    finally:
        for task in tasks:
            task.cancel()
        for s in streams:
            s.close()


async def unless_gone(request: Request, work):
    """Await `work`; if the client disconnects first, cancel it (which aborts its requests) and answer 499."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise RequestError(499, "the client closed the connection", kind="client_closed")
    finally:
        task.cancel()


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except OffloadError as exc:  # headers are sent: the error goes in the stream, as OpenAI does
            yield f"data: {json.dumps(RequestError(500, str(exc), kind='server_error').body())}\n\n".encode()
        finally:
            await chunks.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def completion_chunks(
    server, req, head, streams, prompt_tokens: int, echoes: list[Echo] = ()
) -> AsyncIterator[dict]:
    """With `echoes` (a request with echo), each choice's first chunk starts with its prompt."""
    include_usage = req.include_usage()
    offsets = [len(e.text) for e in echoes] if echoes else [0] * len(streams)
    pending = list(echoes) if echoes else [None] * len(streams)  # prompts not yet sent
    generated = [0] * len(streams)
    async for index, delta in merged(streams):
        echo = pending[index]
        if not delta.text and delta.finish_reason is None and req.logprobs is None and echo is None:
            continue  # a token whose text is held back (a partial character or a possible stop string)
        logprobs = None
        if req.logprobs is not None:
            logprobs = protocol.completion_logprobs([delta], server.token_text, offsets[index])
        offsets[index] += len(delta.text)
        generated[index] += len(delta.token_ids)
        text = delta.text
        if echo is not None:
            text, logprobs = echo.before(text, logprobs, delta, server.token_text)
            pending[index] = None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        yield {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
    if include_usage:
        yield {**head, "choices": [], "usage": protocol.usage(prompt_tokens, sum(generated))}


async def chat_chunks(server, req, head, streams, prompt_len, tools: ToolUse | None = None) -> AsyncIterator[dict]:
    """With `tools`, content that may open a call block is held back, and each call goes out once the reply has
    ended: a delta with its id and name, then one with its arguments, as OpenAI's stream shapes them."""
    include_usage = req.include_usage()
    extra = {"usage": None} if include_usage else {}
    calls = [CallStream(tools) for _ in streams] if tools is not None else None

    def chunk(index: int, delta: dict, reason: str | None = None, logprobs=None) -> dict:
        return {
            **head,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}],
            **extra,
        }

    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""})
    generated = 0
    async for index, delta in merged(streams):
        generated += len(delta.token_ids)
        text, reason = delta.text, delta.finish_reason
        if calls is not None:
            text = calls[index].push(text)
            if reason is not None:
                rest, made, reason = calls[index].finish(reason)
                text += rest
                for k, call in enumerate(made):
                    fn = call["function"]
                    named = {
                        "index": k,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                    yield chunk(index, {"tool_calls": [named]})
                    yield chunk(index, {"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]})
        if not text and reason is None and not req.logprobs:
            continue
        content = {"content": text} if text else {}
        logprobs = protocol.chat_logprobs([delta], server.token_text) if req.logprobs else None
        yield chunk(index, content, reason, logprobs)
    if include_usage:
        yield {**head, "choices": [], "usage": protocol.usage(prompt_len, generated)}
