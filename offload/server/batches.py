"""OpenAI's Batch API on the server: uploaded JSONL files, batches that run them in the background.

    POST /v1/files (multipart: file, purpose=batch)      GET /v1/files/{id}, GET /v1/files/{id}/content
    POST /v1/batches {input_file_id, endpoint, completion_window}
    GET /v1/batches/{id}, GET /v1/batches, POST /v1/batches/{id}/cancel

Files and batch objects live under one folder (--batch-dir): files/<id>.jsonl with files/<id>.json, and
batches/<id>.json, each JSON rewritten atomically on every change. A batch runs through the same formats, output
and fingerprint as `offload batch` (offload/batch/job_files.py): its output file is appended as requests finish and
resumes after a restart, which restarts every batch not yet ended. Its requests go to the core through the front
at priority class 1, behind every interactive request, with at most `window` of them in the core at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import aiofiles
from fastapi import File, Form, Request, UploadFile
from fastapi.responses import Response

from offload.batch.job_files import (
    Appender,
    BadLine,
    JobRequest,
    atomic_write,
    errors_path,
    fingerprint,
    open_output,
    read_input,
    result_record,
    write_errors,
)
from offload.common.outputs import Delta
from offload.openai.protocol import RequestError
from offload.server.front import AsyncFront, Draining

BACKGROUND = 1  # the priority class of batch requests: behind interactive ones (0)
ENDED = ("completed", "failed", "cancelled", "expired")
UPLOAD_CHUNK = 1 << 20  # bytes read from an upload at a time
SAVE_SECONDS = 1.0  # most time between saves of a running batch's request counts
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request of a batch, tokenized: what the front gets."""

    request: JobRequest
    ids: list[int]


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "files").mkdir(parents=True, exist_ok=True)
        (root / "batches").mkdir(parents=True, exist_ok=True)

    # ---- files ----------------------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.root / "files" / f"{file_id}.jsonl"

    def file(self, file_id: str) -> dict:
        meta = self.root / "files" / f"{file_id}.json"
        if "/" in file_id or not meta.exists():
            raise RequestError(404, f"no file {file_id!r}", "file_id", code="not_found")
        return json.loads(meta.read_text())

    async def save_upload(self, upload, purpose: str) -> dict:
        """Write an uploaded file (a starlette UploadFile) asynchronously, then its metadata."""
        if purpose != "batch":
            raise RequestError(400, f"purpose {purpose!r}: only 'batch'", "purpose")
        file_id = _new_id("file")
        path = self.file_path(file_id)
        size = 0
        async with aiofiles.open(path, "wb") as f:
            while chunk := await upload.read(UPLOAD_CHUNK):
                size += len(chunk)
                await f.write(chunk)
        return self.register(file_id, upload.filename or path.name, purpose, size)

    def register(self, file_id: str, filename: str, purpose: str, size: int) -> dict:
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
        }
        atomic_write(self.root / "files" / f"{file_id}.json", json.dumps(meta).encode())
        return meta

    # ---- batches --------------------------------------------------------------------------------------------

    def batch(self, batch_id: str) -> dict:
        path = self.root / "batches" / f"{batch_id}.json"
        if "/" in batch_id or not path.exists():
            raise RequestError(404, f"no batch {batch_id!r}", "batch_id", code="not_found")
        return json.loads(path.read_text())

    def batches(self) -> list[dict]:
        found = [json.loads(p.read_text()) for p in (self.root / "batches").glob("*.json")]
        return sorted(found, key=lambda b: b["created_at"], reverse=True)

    def save(self, batch: dict) -> None:
        atomic_write(self.root / "batches" / f"{batch['id']}.json", json.dumps(batch).encode())

    def create(self, body: dict, endpoints: tuple[str, ...] = ENDPOINTS) -> dict:
        input_id = body.get("input_file_id")
        if not isinstance(input_id, str):
            raise RequestError(400, "input_file_id must be a string", "input_file_id")
        self.file(input_id)
        if body.get("endpoint") not in endpoints:
            raise RequestError(400, f"endpoint must be one of {', '.join(endpoints)}", "endpoint")
        if body.get("completion_window", "24h") != "24h":
            raise RequestError(400, "completion_window must be '24h'", "completion_window")
        batch = {
            "id": _new_id("batch"),
            "object": "batch",
            "endpoint": body["endpoint"],
            "errors": None,
            "input_file_id": input_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": _new_id("file"),
            "error_file_id": None,
            "created_at": int(time.time()),
            "in_progress_at": None,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "expires_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.get("metadata"),
        }
        self.save(batch)
        return batch


class BatchRunner:
    """Runs the store's batches on a front, one asyncio task each."""

    def __init__(self, store: BatchStore, front: AsyncFront, server, window: int) -> None:
        self.store, self.front, self.server, self.window = store, front, server, window
        self.tasks: dict[str, asyncio.Task] = {}
        self._saved = 0.0  # time.monotonic() of the last save of a batch's progress

    def resume_all(self) -> None:
        """Restart every batch a previous server left unfinished (its output resumes where it stopped)."""
        for batch in self.store.batches():
            if batch["status"] == "cancelling":
                self._end(batch, "cancelled")
            elif batch["status"] not in ENDED:
                self.start(batch)

    def start(self, batch: dict) -> None:
        self.tasks[batch["id"]] = asyncio.ensure_future(self._run(batch["id"]))

    def cancel(self, batch_id: str) -> dict:
        batch = self.store.batch(batch_id)
        if batch["status"] in ENDED:
            return batch
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        self.store.save(batch)
        task = self.tasks.get(batch_id)
        if task is not None:
            task.cancel()
        return batch

    async def _run(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        try:
            await self._work(batch)
        except asyncio.CancelledError:
            if self.store.batch(batch_id)["status"] == "cancelling":
                self._end(self.store.batch(batch_id), "cancelled")
            raise
        except Draining:
            return  # the server is stopping: the batch stays in progress and resumes after a restart
        except Exception as exc:  # a file gone, a disk full: the batch fails, the server goes on
            batch = self.store.batch(batch_id)
            batch["errors"] = {"object": "list", "data": [{"code": "failed", "message": str(exc)}]}
            self._end(batch, "failed")
        finally:
            self.tasks.pop(batch_id, None)

    async def _work(self, batch: dict) -> None:
        source = self.store.file_path(batch["input_file_id"])
        out = self.store.file_path(batch["output_file_id"])
        requests, invalid = read_input(source, self.server.settings.model_name)
        done = open_output(out, fingerprint(source, self.server.llm.model_dir))
        chat = batch["endpoint"] == "/v1/chat/completions"
        wrong = {r.id for r in requests if r.chat != chat or not r.openai}
        bad = invalid + [
            BadLine(r.line, r.id, f"not an OpenAI batch line for {batch['endpoint']}")
            for r in requests
            if r.id in wrong
        ]
        prompts, refused = self._encode([r for r in requests if r.id not in wrong and r.id not in done])
        bad = sorted(bad + refused, key=lambda b: b.line)
        write_errors(out, bad)
        batch["status"], batch["in_progress_at"] = "in_progress", batch["in_progress_at"] or int(time.time())
        total = len(requests) + len(invalid)
        batch["request_counts"] = {"total": total, "completed": len(done), "failed": len(bad)}
        self.store.save(batch)
        appender = Appender(out, fsync_seconds=1.0)
        gate = asyncio.Semaphore(self.window)
        try:
            await asyncio.gather(*(self._one(p, gate, appender, batch) for p in prompts))
        finally:
            appender.close()
        batch["status"], batch["finalizing_at"] = "finalizing", int(time.time())
        self.store.save(batch)
        name = f"{batch['id']}_output.jsonl"
        self.store.register(batch["output_file_id"], name, "batch_output", out.stat().st_size)
        if bad:
            error_id = batch["error_file_id"] or _new_id("file")
            errors_path(out).replace(self.store.file_path(error_id))
            size = self.store.file_path(error_id).stat().st_size
            self.store.register(error_id, f"{batch['id']}_errors.jsonl", "batch_output", size)
            batch["error_file_id"] = error_id
        self._end(batch, "completed")

    def stop(self) -> None:
        """Stop every running batch without ending it (the server is shutting down): each resumes on restart."""
        for task in list(self.tasks.values()):
            task.cancel()

    def _encode(self, requests: list[JobRequest]) -> tuple[list[Prompt], list[BadLine]]:
        prompts, bad = [], []
        for r in requests:
            try:
                if r.chat:
                    ids = self.server.encode_chat(r.messages, r.functions)
                else:
                    ids = self.server.encode(r.prompt, r.line, "prompt")
            except RequestError as exc:
                bad.append(BadLine(r.line, r.id, exc.message))
                continue
            prompts.append(Prompt(r, ids))
        return prompts, bad

    async def _one(self, p: Prompt, gate: asyncio.Semaphore, appender: Appender, batch: dict) -> None:
        async with gate:
            streams = [self.front.submit(p.ids, params, priority=BACKGROUND) for params in p.request.params]
            outputs: list[list[Delta]] = []
            try:
                for stream in streams:
                    outputs.append([d async for d in stream])
            finally:
                for s in streams:
                    s.close()
        appender.write(result_record(p.request, len(p.ids), outputs, self.server.token_text))
        batch["request_counts"]["completed"] += 1
        if time.monotonic() - self._saved >= SAVE_SECONDS:  # the counts are progress: saved now and then
            self.store.save(batch)
            self._saved = time.monotonic()

    def _end(self, batch: dict, status: str) -> None:
        batch["status"] = status
        batch[{"completed": "completed_at", "failed": "failed_at", "cancelled": "cancelled_at"}[status]] = int(
            time.time()
        )
        self.store.save(batch)


def add_batch_routes(app, server) -> None:
    """The Batch API's routes on `app`; `server.batches` (a BatchRunner) exists once the model is loaded."""

    def runner(request: Request) -> BatchRunner:
        server.authorize(request)
        server.ready()
        return server.batches

    @app.post("/v1/files")
    async def upload(request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]) -> dict:
        return await runner(request).store.save_upload(file, purpose)

    @app.get("/v1/files/{file_id}")
    async def file_meta(request: Request, file_id: str) -> dict:
        return runner(request).store.file(file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> Response:
        store = runner(request).store
        store.file(file_id)
        async with aiofiles.open(store.file_path(file_id), "rb") as f:
            return Response(await f.read(), media_type="application/jsonl")

    @app.post("/v1/batches")
    async def create(request: Request) -> dict:
        batches = runner(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # bytes that are not UTF-8 are not JSON either
            raise RequestError(400, f"the request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        batch = batches.store.create(body, ENDPOINTS)
        batches.start(batch)
        return batch

    @app.get("/v1/batches")
    async def listing(request: Request) -> dict:
        return {"object": "list", "data": runner(request).store.batches(), "has_more": False}

    @app.get("/v1/batches/{batch_id}")
    async def retrieve(request: Request, batch_id: str) -> dict:
        return runner(request).store.batch(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> dict:
        return runner(request).cancel(batch_id)
