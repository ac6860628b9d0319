"""A served model for the benchmarks: `offload serve` in its own process on loopback, and requests to it through
the official openai client, timed as the client sees them.

    with serving(model_dir, flags, log, bound=120.0) as server:      # ready: /health said ok
        answers, wall = asyncio.run(at_once(server, prompts, jobs, max_tokens=32, bound=60.0))
    server.exit_status                                               # 0: it drained and exited on SIGTERM

A request that fails (an API or connection error, its time bound) comes back as an Answer with its error, so that
one client's failure never stops the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai

from offload.planner.served_step import free_port

if TYPE_CHECKING:
    from offload.common.config import EngineConfig

DRAIN_BOUND = 45.0  # seconds after SIGTERM: the server's drain timeout (30 s) and its exit


# ---- the server process --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Server:
    """A running `offload serve`: its process, where it listens, what it serves."""

    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    model: str  # the name clients pass
    max_model_len: int  # tokens: the context window
    exit_status: int | None = None  # set once stopped: 0 after a clean drain, negative when killed


def served_config(flags: list[str]) -> EngineConfig:
    """The EngineConfig `offload serve` builds from `flags` (the CLI's own mapping). The flags must fix the batch
    and KV cache where they give a budget: a config the cost model plans would not be the one compared against."""
    from offload.cli import build_parser, engine_config
    from offload.planner.autoconfig import needs_plan

    args = build_parser().parse_args(["serve", *flags])
    config = engine_config(args)
    if needs_plan(config):
        raise SystemExit(f"serve flags {flags}: give --max-num-seqs and --kv-cache-memory with a budget")
    return config


def serve_flags(config: EngineConfig) -> list[str]:
    """`offload serve` flags for the fields ours_config sets; served_config must give `config` back."""
    flags = [
        *("--dtype", config.dtype, "--block-size", str(config.block_size)),
        *("--kv-cache-memory", str(config.kv_cache_bytes), "--device-memory", str(config.device_memory)),
        *("--max-num-seqs", str(config.max_num_seqs), "--max-step-tokens", str(config.max_step_tokens)),
        *("--io-backend", config.io_backend),
    ]
    if served_config(flags) != config:
        raise SystemExit(f"serve flags {flags} do not give {config}")
    return flags


def wait_ready(process: subprocess.Popen, url: str, log: Path, bound: float) -> Server:
    """Poll /health until it says ok, then read the model's name and context from /v1/models."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                entry = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
                return Server(process, url, entry["id"], entry["max_model_len"])
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready within {bound:.0f} s:\n{log.read_text()[-2000:]}")


def stop(process: subprocess.Popen) -> int:
    """SIGTERM to the server's process group (it drains), SIGKILL if it has not exited DRAIN_BOUND s later."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    try:
        return process.wait(DRAIN_BOUND)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


@contextlib.contextmanager
def serving(model_dir: Path, flags: list[str], log: Path, bound: float) -> Iterator[Server]:
    """`offload serve --model model_dir *flags` on a free loopback port, in its own process group, ready to answer;
    stopped on leaving, its exit status then set on the Server."""
    url = f"http://127.0.0.1:{free_port()}"
    model = str(Path(model_dir).resolve())
    command = [sys.executable, "-m", "offload", "serve", "--model", model, "--port", url.rsplit(":", 1)[1]]
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--log-level", "warning", *flags],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = None
    try:
        server = wait_ready(process, url, log, bound)
        yield server
    finally:
        status = stop(process)
        if server is not None:
            server.exit_status = status


def scrape(server: Server) -> dict[str, float]:
    """GET /metrics: each sample's value by its name and labels as the text format writes them (histogram buckets
    left out)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples if "_bucket{" not in name}


# ---- requests, as a client sees them -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One request: which API, which prompt, streamed or not; cancel_after: close the stream after that many
    non-empty chunks (None: read it to the end)."""

    api: str  # "completions" or "chat"
    prompt: int  # index into the phase's prompts
    stream: bool
    cancel_after: int | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """What the client saw of one request; times in time.perf_counter() seconds."""

    job: Job
    start: float
    end: float
    text: str = ""
    completion_tokens: int | None = None  # from usage; None when cancelled or failed
    finishes: int = 0  # choices that came with a finish_reason: 1 for a request answered once
    response_id: str | None = None
    chunk_times: tuple[float, ...] = ()  # each non-empty chunk's arrival (streams only)
    cancelled: bool = False  # closed by the client before its finish_reason came
    error: str | None = None  # an HTTP or connection error, or the time bound

    @property
    def first_token(self) -> float | None:
        """Seconds from the request's start to its first non-empty chunk (streams only)."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive non-empty chunks."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]


async def send(
    client: openai.AsyncOpenAI, model: str, prompt: str | list[int], job: Job, max_tokens: int, bound: float
) -> Answer:
    """Send `job` greedily and time it. A failure (an API or connection error, the bound) is an Answer with its
    error, never an exception: the other clients go on."""
    start = time.perf_counter()
    try:
        return await asyncio.wait_for(_request(client, model, prompt, job, max_tokens, start), bound)
    except (openai.APIError, httpx.HTTPError, asyncio.TimeoutError) as exc:
        return Answer(job, start, time.perf_counter(), error=f"{type(exc).__name__}: {exc}"[:300])


async def _request(
    client: openai.AsyncOpenAI, model: str, prompt: str | list[int], job: Job, max_tokens: int, start: float
) -> Answer:
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if job.stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if job.api == "chat":
        response = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        response = await client.completions.create(prompt=prompt, **common)
    if job.stream:
        return await _read_stream(response, job, start)
    choice = response.choices[0]
    text = choice.message.content if job.api == "chat" else choice.text
    finishes = sum(c.finish_reason is not None for c in response.choices)
    return Answer(job, start, time.perf_counter(), text or "", response.usage.completion_tokens, finishes, response.id)


async def _read_stream(stream, job: Job, start: float) -> Answer:
    """Read a stream to its end (the usage chunk included), or close it after job.cancel_after non-empty chunks."""
    parts: list[str] = []
    times: list[float] = []
    finishes, tokens, rid = 0, None, None
    try:
        async for chunk in stream:
            rid = rid or chunk.id
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                piece = choice.delta.content if job.api == "chat" else choice.text
                if piece:
                    parts.append(piece)
                    times.append(time.perf_counter())
                finishes += choice.finish_reason is not None
            if job.cancel_after is not None and len(times) >= job.cancel_after and not finishes:
                return Answer(job, start, time.perf_counter(), "".join(parts), None, 0, rid, tuple(times), True)
    finally:
        await stream.close()
    return Answer(job, start, time.perf_counter(), "".join(parts), tokens, finishes, rid, tuple(times))


def openai_client(server: Server, bound: float) -> openai.AsyncOpenAI:
    """An AsyncOpenAI client of `server` that never retries (a retry would send a request twice)."""
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=bound)


async def at_once(
    server: Server, prompts: list[str] | list[list[int]], jobs: list[Job], max_tokens: int, bound: float
) -> tuple[list[Answer], float]:
    """Every job sent at the same moment, each on its own connection: (answers, seconds from the first send to the
    last answer)."""
    async with openai_client(server, bound) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(send(client, server.model, prompts[j.prompt], j, max_tokens, bound) for j in jobs)
        )
        return list(answers), time.perf_counter() - start


async def lean_stream(http: httpx.AsyncClient, server: Server, prompt: str, max_tokens: int) -> int | None:
    """A streamed completion read by a minimal SSE client (httpx; each `data:` line decoded with json): its
    completion tokens from the usage chunk, None if it failed. The openai client validates every chunk into
    typed objects, which on a machine of two cores takes CPU from the server it measures."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    tokens = None
    try:
        async with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
    except httpx.HTTPError:
        return None
    return tokens


async def lean_at_once(server: Server, prompts: list[str], max_tokens: int, bound: float) -> tuple[list, float]:
    """Every prompt streamed at the same moment by lean_stream: (completion tokens or None each, wall seconds)."""
    async with httpx.AsyncClient(timeout=bound, limits=httpx.Limits(max_connections=len(prompts))) as http:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(lean_stream(http, server, p, max_tokens) for p in prompts))
        return list(tokens), time.perf_counter() - start


# ---- requests at a rate ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timed:
    """One streamed completion sent at its arrival time; seconds from the run's start."""

    sent: float
    first: float  # the first chunk with a token
    last: float  # the last chunk with a token
    tokens: int  # tokens streamed


def at_rate(server: Server, prompts: list[list[int]], max_tokens: int, arrivals: list[float], bound: float) -> list:
    """Each token-id prompt sent as a streamed completion at its arrival time (seconds from now), greedy, eos
    ignored, `max_tokens` new tokens; a Timed each, in order. Each request has a thread of its own with a plain
    http.client connection (offload.planner.served_step's stream_completion, which `offload probe` measures the
    server with): on a machine of two cores the clients' CPU is taken from the server they measure, and an asyncio
    client with one json.loads per chunk took more of it. A failed request raises, after the others finish."""
    from offload.planner.served_step import in_threads, stream_completion

    port = int(server.url.rsplit(":", 1)[1])
    start = time.perf_counter()

    def one(prompt: list[int], at: float):
        def call() -> Timed:
            time.sleep(max(0.0, start + at - time.perf_counter()))
            sent, seen = stream_completion(port, server.model, prompt, max_tokens, bound)
            return Timed(sent - start, seen[0][0] - start, seen[-1][0] - start, sum(n for _, n in seen))

        return call

    return in_threads([one(p, at) for p, at in zip(prompts, arrivals, strict=True)])


def rate_stats(seen: list[Timed]) -> dict[str, float]:
    """p50 and p90 time to first token and the median stream's decode tokens/s (its tokens after the first over the
    time from its first chunk to its last) over the requests after the first quarter (the queue warms up); and the
    completion rate from the fifth to the fifth-last completion (while the queue is full, at a rate above capacity,
    the largest rate the server sustains)."""
    kept = seen[len(seen) // 4 :]
    ttft = sorted(s.first - s.sent for s in kept)
    streams = [(s.tokens - 1) / (s.last - s.first) for s in kept if s.last > s.first]
    done = sorted(s.last for s in seen)
    a, b = len(done) // 5, len(done) - len(done) // 5 - 1
    return {
        "ttft_p50": statistics.median(ttft),
        "ttft_p90": ttft[min(int(0.9 * len(ttft)), len(ttft) - 1)],
        "stream_tps_p50": statistics.median(streams) if streams else float("nan"),
        "completion_rate": (b - a) / (done[b] - done[a]) if b > a else float("nan"),
    }
