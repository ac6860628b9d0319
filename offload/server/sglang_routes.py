"""SGLang's native HTTP API beside the OpenAI routes, over the same engine core: POST /generate (whole or streamed),
GET /get_model_info, GET /get_server_info (also /server_info), POST /flush_cache and GET /health_generate.

SGLang's frontend language (`sgl.RuntimeEndpoint(url)`: gen, select, fork, run_batch, streaming) runs against them.
The wire format is offload/sglang/. The routes take the same key (`Server.authorize`; /health_generate, like
SGLang's /health routes, takes none), refuse the same way (503 while loading or draining, 429 when the queue is full,
400 naming the field) and abort a request whose client disconnects, as the OpenAI routes do.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import Response

from offload.common.config import SamplingParams
from offload.openai.protocol import RequestError
from offload.server.front import Draining, RequestStream
from offload.server.sse import collect, merged, sse, unless_gone
from offload.sglang.sglang_reply import Reply, replies_body
from offload.sglang.sglang_request import GenerateRequest, parse


def add_sglang_routes(app: FastAPI, server) -> None:
    """Register SGLang's routes on `app`, served by `server` (offload/server/app.py's Server)."""

    def decode(ids: list[int]) -> str:
        return server.llm.prompts.decode(ids)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        server.authorize(request)
        req = parse(await request.body())
        front = server.ready()
        replies = _replies(server, req)
        streams = server.submit(front, [(r.prompt_ids, r.params) for r in replies])
        if req.stream:
            return sse(_chunks(replies, streams, req.is_batch(), server.token_text, decode))
        outputs = await unless_gone(request, collect(streams))
        for reply, deltas in zip(replies, outputs, strict=True):
            for delta in deltas:
                reply.add(delta)
        return replies_body(replies, req.is_batch(), server.token_text, decode)

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> dict:
        server.authorize(request)
        server.ready()
        return {
            "model_path": server.settings.model_name,
            "tokenizer_path": str(server.llm.model_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
        }

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info(request: Request) -> dict:
        server.authorize(request)
        server.ready()
        return _server_info(server)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        server.authorize(request)
        front = server.ready()
        try:
            await front.call(server.llm.reset_prefix_cache)
        except Draining as exc:
            raise RequestError(503, str(exc), kind="service_unavailable") from None
        return Response("Cache flushed.\n", media_type="text/plain")

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        if server.status != "ok":
            return Response(status_code=503)
        if server.front.snapshot.running:  # the engine is stepping requests: it is generating
            return Response(status_code=200)
        try:  # token 0 is in every vocabulary
            streams = server.submit(server.front, [([0], SamplingParams(max_new_tokens=1))])
            await unless_gone(request, collect(streams))
        except RequestError:
            return Response(status_code=503)
        return Response(status_code=200)


def _replies(server, req: GenerateRequest) -> list[Reply]:
    """One Reply per engine request: each prompt encoded once, n of them per prompt (prompt-major, as SGLang)."""
    field = req.input_field()
    ids_given = req.reply_ids()
    top, with_text = req.top_logprobs_num or 0, req.return_text_in_logprobs
    replies: list[Reply] = []
    for i, prompt in enumerate(req.prompts()):
        ids = server.encode(prompt, i, field)
        params = req.engine_params(len(ids), server.llm.max_model_len - len(ids), i)
        start = req.logprob_start(len(ids), i) if req.return_logprob else None
        for _ in range(req.sampling().n):
            rid = ids_given[len(replies)] if ids_given else uuid.uuid4().hex
            replies.append(Reply(rid, ids, params, start, top, with_text))
    return replies


async def _chunks(
    replies: list[Reply], streams: list[RequestStream], batch: bool, token_text, decode
) -> AsyncIterator[dict]:
    """A streamed reply's bodies: each output's whole text and meta_info so far, after each step that added to it;
    a batch's carry the output's `index`."""
    async for index, delta in merged(streams):
        reply = replies[index]
        reply.add(delta)
        if not (delta.text or delta.finish_reason or delta.logprobs or delta.prompt_logprobs):
            continue  # a token whose text is held back (a partial character or a possible stop string)
        body = reply.body(token_text, decode)
        yield {**body, "index": index} if batch else body


def _server_info(server) -> dict:
    """What the engine runs with: its resolved settings, the server's (the key left out), the context window."""
    llm = server.llm
    settings = {k: v for k, v in dataclasses.asdict(server.settings).items() if k != "api_key"}
    return jsonable_encoder(
        {
            "model_path": server.settings.model_name,
            "tokenizer_path": str(llm.model_dir),
            "context_length": llm.max_model_len,
            "max_running_requests": llm.config.max_num_seqs,
            "engine": dataclasses.asdict(llm.config),
            "serve": settings,
            "version": metadata.version("offload"),
        }
    )
