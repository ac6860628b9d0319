"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

The model loads in a background thread once the app starts, so /health answers 503 ("loading") until the
weights are placed, then 200; while the server drains it answers 503 ("draining") and so do new requests.
Every refusal is OpenAI's error JSON with the field it concerns; nothing a request sends can crash the server or
touch another request's output.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from offload.common.errors import OffloadError
from offload.openai import protocol
from offload.openai.echo import Echo
from offload.openai.protocol import ChatRequest, CompletionRequest, RequestError
from offload.server import limits
from offload.server.batches import BatchRunner, BatchStore, add_batch_routes
from offload.server.front import AsyncFront, Draining, QueueFull, RequestStream
from offload.server.metrics import Metrics
from offload.server.settings import ServeSettings
from offload.server.sglang_routes import add_sglang_routes
from offload.server.sse import chat_chunks, collect, completion_chunks, sse, unless_gone


class Server:
    """What the routes share: the loaded model, its front, the metrics. `load` builds the LLM (any thread)."""

    def __init__(self, load: Callable[[], object], settings: ServeSettings, on_ready=None, on_load_error=None) -> None:
        """on_ready(server) and on_load_error(exception) run on the event loop once loading ends."""
        self.load, self.settings = load, settings
        self.on_ready, self.on_load_error = on_ready, on_load_error
        self.llm = None
        self.front: AsyncFront | None = None
        self.metrics = Metrics()
        self.load_error: BaseException | None = None
        self.batches: BatchRunner | None = None  # the Batch API's runner, once loaded (with a batch_dir)

    @property
    def status(self) -> str:
        if self.load_error is not None:
            return "failed"
        if self.front is None:
            return "loading"
        return "draining" if self.front.draining else "ok"

    def start_loading(self) -> None:
        loop = asyncio.get_running_loop()

        def work() -> None:
            try:
                llm = self.load()
            except BaseException as exc:  # reported on the loop; the server then exits with it
                loop.call_soon_threadsafe(self._failed, exc)
                return
            loop.call_soon_threadsafe(self._loaded, llm)

        threading.Thread(target=work, name="offload-load", daemon=True).start()

    def _loaded(self, llm) -> None:
        self.llm = llm
        front = AsyncFront(llm.core, self.settings.max_waiting)
        front.observer = self.metrics.observe
        front.start()
        self.front = self.metrics.front = front
        if self.settings.batch_dir is not None:
            store = BatchStore(self.settings.batch_dir)
            self.batches = BatchRunner(store, front, self, window=2 * llm.config.max_num_seqs)
            self.batches.resume_all()
        if self.on_ready is not None:
            self.on_ready(self)

    def _failed(self, exc: BaseException) -> None:
        self.load_error = exc
        if self.on_load_error is not None:
            self.on_load_error(exc)

    async def drain(self) -> int:
        """Stop taking requests, let running ones finish (bounded by drain_timeout); how many were cut short."""
        if self.front is None:
            return 0
        if self.batches is not None:
            self.batches.stop()  # background work resumes after a restart; interactive requests get the drain
        return await self.front.drain(self.settings.drain_timeout)

    # ---- request checks -----------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.llm.token_text(token_id)

    def echo(self, prompt: str | list[int], ids: list[int]) -> Echo:
        """A prompt as a completion's `echo` returns it: the string sent, or the token ids sent, decoded."""
        if isinstance(prompt, str) or self.llm.prompts.tokenizer is None:
            return Echo(prompt if isinstance(prompt, str) else "", tuple(ids))
        return Echo(self.llm.prompts.decode(ids, skip_special_tokens=False), tuple(ids))

    def ready(self) -> AsyncFront:
        if self.front is None:
            raise RequestError(503, "the model is still loading", kind="service_unavailable")
        if self.front.draining:
            raise RequestError(503, "the server is shutting down", kind="service_unavailable")
        return self.front

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise RequestError(
                401,
                "missing or wrong API key (Authorization: Bearer ...)",
                kind="authentication_error",
                code="invalid_api_key",
            )

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise RequestError(
                400,
                f"model {name!r} is not served here; this server serves {self.settings.model_name!r}",
                "model",
                code="model_not_found",
            )

    def encode(self, prompt: str | list[int], index: int, field: str) -> list[int]:
        if isinstance(prompt, str):  # a text too long for the window is refused by its length, untokenized
            limits.check_text(self.llm, prompt, f"prompt {index}", field)
        try:
            return self.llm.encode(prompt, index)  # the engine's one tokenizer, shared with its decoding
        except OffloadError as exc:
            raise RequestError(400, str(exc), field) from None

    def encode_chat(self, conversation: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not self.llm.prompts.has_chat_template:
            raise RequestError(400, "this model has no chat template: use /v1/completions", "messages")
        chars = limits.conversation_chars(conversation)
        limits.prompt_bounds(self.llm).check_text(chars, "the conversation", "messages")
        try:
            return self.llm.encode_chat(conversation, 0, tools)
        except OffloadError as exc:
            raise RequestError(400, str(exc).replace("prompt 0", "the conversation"), "messages") from None

    async def accept(self, request: Request, kind: type[protocol.Sampling]) -> tuple[protocol.Sampling, AsyncFront]:
        """The checks every generation request passes, in order: the key, the body, the model, readiness."""
        self.authorize(request)
        req = protocol.parse(await request.body(), kind)
        limits.check_lists(req)
        self.check_model(req.model)
        return req, self.ready()

    def submit(self, front: AsyncFront, jobs: list[tuple[list[int], object]]) -> list[RequestStream]:
        """Submit every choice, or none: a refusal part way closes (aborts) those already submitted."""
        streams: list[RequestStream] = []
        try:
            for ids, params in jobs:
                streams.append(front.submit(ids, params))
        except QueueFull as exc:
            for s in streams:
                s.close()
            raise RequestError(429, str(exc), kind="rate_limit_error", code="queue_full") from None
        except Draining as exc:
            for s in streams:
                s.close()
            raise RequestError(503, str(exc), kind="service_unavailable") from None
        return streams


def create_app(server: Server) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start_loading()
        yield
        if server.front is not None and not server.front.draining:
            server.front.close()

    app = FastAPI(title="offload", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(limits.BodyLimit, cap=lambda method, path: limits.body_cap(server, method, path))

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"][1:]) or None  # loc starts with body, query, ...
        return await refused(request, RequestError(400, f"{field or 'request'}: {err['msg']}", field))

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    if server.settings.batch_dir is not None:
        add_batch_routes(app, server)
    add_sglang_routes(app, server)  # SGLang's native API: /generate and its companions

    @app.get("/health")
    async def health() -> JSONResponse:
        status = server.status
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.authorize(request)
        entry = {"id": server.settings.model_name, "object": "model", "created": protocol.now(), "owned_by": "offload"}
        if server.llm is not None:
            entry["max_model_len"] = server.llm.max_model_len
        return {"object": "list", "data": [entry]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, front = await server.accept(request, CompletionRequest)
        sent = req.prompts()
        prompts = [server.encode(p, i, "prompt") for i, p in enumerate(sent)]
        echoes = []  # with echo: each choice's prompt, to come before it
        if req.echo:
            echoes = [server.echo(p, ids) for p, ids in zip(sent, prompts, strict=True) for _ in range(req.n)]
        jobs = [
            (ids, protocol.sampling_params(req, protocol.token_budget(req, server.llm.max_model_len - len(ids)), k))
            for ids in prompts
            for k in range(req.n)
        ]
        streams = server.submit(front, jobs)
        rid, created = protocol.new_id("cmpl"), protocol.now()
        head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
        if req.stream:
            return sse(completion_chunks(server, req, head, streams, sum(len(p) for p in prompts), echoes))
        outputs = await unless_gone(request, collect(streams))
        prompt_tokens = sum(len(p) for p in prompts)
        logprobs = req.logprobs is not None
        return protocol.completion_body(head, outputs, prompt_tokens, logprobs, server.token_text, echoes)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req, front = await server.accept(request, ChatRequest)
        tools = req.tool_use()
        ids = server.encode_chat(req.conversation(), list(tools.functions) if tools else None)
        budget = protocol.token_budget(req, server.llm.max_model_len - len(ids))
        streams = server.submit(front, [(ids, protocol.sampling_params(req, budget, k)) for k in range(req.n)])
        rid, created = protocol.new_id("chatcmpl"), protocol.now()
        if req.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model}
            return sse(chat_chunks(server, req, head, streams, len(ids), tools))
        outputs = await unless_gone(request, collect(streams))
        head = {"id": rid, "created": created, "model": req.model}
        return protocol.chat_body(head, outputs, len(ids), req.logprobs, server.token_text, tools)

    return app
