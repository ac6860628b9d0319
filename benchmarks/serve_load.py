"""The server under load: `offload serve` in its own process on loopback, driven by the official openai client.

    python benchmarks/serve_load.py [--model DIR] [--clients 32] [--rounds 2] [--max-tokens 32]
                                    [--ratio-clients 16] [--ratio-tokens 128] [--repeats 3] [--skip-streamed]
                                    [--work-dir ~/.cache/offload/bench] [--layers 22] [--budget 600MB]
                                    [--quick] [--out benchmarks/results/serve_load.json]

load      The demo model (or --model), served with the engine's default settings. --clients clients each send
          --rounds requests in turn: prompts of mixed lengths (DEMO_PROMPTS and their concatenations), completions and
          chat, streamed and whole, and a third of the streams closed after a few chunks; greedy, --max-tokens each.
          Four bad requests go in among them. Every request not cancelled must be answered exactly once, with the text
          and token count that LLM.generate (LLM.chat for chat) gives in this process with the same EngineConfig;
          afterwards /metrics must show no KV block in use and no request running; each bad request must get a 4xx.
          Reported, client-side: time to first token (request start to the first non-empty chunk) and the gaps between
          non-empty chunks, p50 and p99 over the streamed requests; completion tokens (usage; cancelled requests have
          none) over the phase's wall time.
ratio     The same server: --ratio-clients streaming clients on as many distinct prompts against one LLM.generate
          call on the same prompts in this process, each side's tokens actually generated over its wall time, for
          --repeats rounds. Goal: the median served rate >= 0.8x the median in-process rate. The clients run in this
          process, on the same cores as the server, as a load generator on one machine does.
streamed  offload_vs_peers.py's random bf16 checkpoint of TinyLlama-1.1B's shape, served with the settings its runs
          of our engine use (--budget of device memory for weights, the KV cache on top, reads through pread), so
          that most layers stream from disk on every step. Token-id prompts of one length: one client alone, then 8
          at once, the checkpoint's pages evicted before each, for --repeats rounds. Goal: the 8 finish within 1.3x
          the time of the one (medians), judged only when every request generated all its tokens. Slow on a CPU
          (every step reads about 2 GB): --skip-streamed leaves it out.

Every phase is bounded in time; the server gets SIGTERM at the end of its phase (and SIGKILL if it has not exited
DRAIN_BOUND seconds later). Prints a table (phase, metric, value, goal, verdict) and writes the settings, every
measurement, the goals and the machine to --out. --quick shrinks everything (8 clients, few tokens, one round, no
streamed phase) for the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_common import machine, timestamp, write_report
from peer_engines import SHAPE, Workload, evict, ours_config, peers_checkpoint

RESULTS = Path(__file__).parent / "results" / "serve_load.json"
FULL = {"clients": 32, "rounds": 2, "max_tokens": 32, "ratio_clients": 16, "ratio_tokens": 128, "repeats": 3}
QUICK = {"clients": 8, "rounds": 2, "max_tokens": 8, "ratio_clients": 8, "ratio_tokens": 16, "repeats": 1}
CANCEL_AFTER = 3  # non-empty chunks a cancelled stream reads before closing
GOAL_RATIO = 0.8  # served tokens/s over in-process tokens/s, medians
GOAL_SLOWDOWN = 1.3  # STREAMED_CLIENTS at once over one alone, wall time, medians
STREAMED = Workload(prompts=8, prompt_tokens=16, new_tokens=8)  # the streamed phase: 8 clients, short, few tokens
START_BOUND = {"demo": 120.0, "streamed": 600.0}  # seconds until /health says ok (the first start imports torch)
REQUEST_BOUND = {"demo": 120.0, "streamed": 600.0}  # seconds one request may take
SETTLE_BOUND = 30.0  # seconds for /metrics to show an idle engine after the load
DRAIN_BOUND = 45.0  # seconds after SIGTERM: the server's drain timeout (30 s) and its exit


# ---- the server process --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Server:
    """A running `offload serve`: where it listens, what it serves, where its output goes."""

    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    model: str  # the name clients pass
    max_model_len: int  # tokens: the context window
    exit_status: int | None = None  # set once stopped: 0 after a clean drain, negative when killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_config(flags: list[str]):
    """The EngineConfig `offload serve` builds from `flags` (the CLI's own mapping). The flags must fix the batch
    and KV cache where they give a budget: a config the cost model plans would not be the one compared against."""
    from offload.cli import build_parser, engine_config, needs_plan

    args = build_parser().parse_args(["serve", *flags])
    config = engine_config(args)
    if needs_plan(args, config):
        raise SystemExit(f"serve flags {flags}: give --max-num-seqs and --kv-cache-memory with a budget")
    return config


def serve_flags(config) -> list[str]:
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
    import httpx

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
    command = [sys.executable, "-m", "offload", "serve", "--model", str(model_dir), "--port", url.rsplit(":", 1)[1]]
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--log-level", "warning", *flags], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = None
    try:
        server = wait_ready(process, url, log, bound)
        yield server
    finally:
        status = stop(process)
        if server is not None:
            server.exit_status = status


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


async def send(client, model: str, prompt: str | list[int], job: Job, max_tokens: int, bound: float) -> Answer:
    """Send `job` greedily and time it. A failure (an API or connection error, the bound) is an Answer with its
    error, never an exception: the other clients go on."""
    import httpx
    import openai

    start = time.perf_counter()
    try:
        return await asyncio.wait_for(_request(client, model, prompt, job, max_tokens, start), bound)
    except (openai.APIError, httpx.HTTPError, asyncio.TimeoutError) as exc:
        return Answer(job, start, time.perf_counter(), error=f"{type(exc).__name__}: {exc}"[:300])


async def _request(client, model: str, prompt: str | list[int], job: Job, max_tokens: int, start: float) -> Answer:
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


def openai_client(server: Server, bound: float):
    """An AsyncOpenAI client of `server` that never retries (a retry would send a request twice)."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=bound)


async def at_once(server: Server, prompts: list, jobs: list[Job], max_tokens: int, bound: float):
    """Every job from its own client at the same moment: (answers, wall seconds from the first send to the last
    answer)."""
    async with openai_client(server, bound) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(send(client, server.model, prompts[j.prompt], j, max_tokens, bound) for j in jobs)
        )
        return list(answers), time.perf_counter() - start


# ---- the load phase ------------------------------------------------------------------------------------------


def prompt_pool() -> list[str]:
    """Prompts of mixed lengths: DEMO_PROMPTS, every ordered pair of them, all of them, and all of them four times."""
    from offload.demo import DEMO_PROMPTS

    pairs = [f"{a}. {b}" for a in DEMO_PROMPTS for b in DEMO_PROMPTS if a != b]
    everything = ". ".join(DEMO_PROMPTS)
    return [*DEMO_PROMPTS, *pairs, everything, ". ".join([everything] * 4)]


def client_jobs(clients: int, rounds: int, prompts: int) -> list[list[Job]]:
    """Each client's jobs in order: both APIs, streamed and whole, a cancelled stream in every third, the prompts
    spread over all of them."""
    kinds = [
        ("completions", False, None),
        ("completions", True, None),
        ("completions", True, CANCEL_AFTER),
        ("chat", False, None),
        ("chat", True, None),
        ("chat", True, CANCEL_AFTER),
    ]
    jobs = [Job(*kinds[k % len(kinds)][:2], k % prompts, kinds[k % len(kinds)][2]) for k in range(clients * rounds)]
    return [jobs[c::clients] for c in range(clients)]


def bad_requests(model: str, context: int) -> dict[str, tuple[str, bytes]]:
    """What the server must refuse with a 4xx: name -> (route, body)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}]}
    return {
        "malformed JSON": ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '),
        "unknown model": ("/v1/completions", json.dumps({"model": f"{model}-unknown", "prompt": "Hello"}).encode()),
        "max_tokens as a string": ("/v1/chat/completions", json.dumps(chat | {"max_tokens": "8"}).encode()),
        "prompt longer than the context": (
            "/v1/completions",
            json.dumps({"model": model, "prompt": [3] * context}).encode(),
        ),
    }


async def refusals(server: Server) -> dict[str, int]:
    """Each bad request's HTTP status."""
    import httpx

    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_BOUND["demo"]) as http:
        bad = bad_requests(server.model, server.max_model_len)
        answers = await asyncio.gather(
            *(http.post(route, content=body, headers=headers) for route, body in bad.values())
        )
    return {name: r.status_code for name, r in zip(bad, answers, strict=True)}


async def settle(server: Server) -> dict[str, float]:
    """GET /metrics until no request runs and no KV block is in use, or SETTLE_BOUND passes: the last values of the
    engine's gauges and totals."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + SETTLE_BOUND
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            text = (await http.get(f"{server.url}/metrics")).text
            values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
            idle = values["offload_kv_blocks_used"] == 0 and values["offload_requests_running"] == 0
            if idle or time.monotonic() > deadline:
                return values
            await asyncio.sleep(0.1)


async def load(server: Server, pool: list[str], args: argparse.Namespace):
    """The load phase: (answers, bad requests' statuses, wall seconds, /metrics once settled)."""
    bound = REQUEST_BOUND["demo"]

    async def one_client(jobs: list[Job]) -> list[Answer]:
        return [await send(client, server.model, pool[j.prompt], j, args.max_tokens, bound) for j in jobs]

    async with openai_client(server, bound) as client:
        start = time.perf_counter()
        per_client, statuses = await asyncio.gather(
            asyncio.gather(*(one_client(js) for js in client_jobs(args.clients, args.rounds, len(pool)))),
            refusals(server),
        )
        wall = time.perf_counter() - start
    return [a for answers in per_client for a in answers], statuses, wall, await settle(server)


@dataclass(frozen=True, slots=True)
class Tally:
    """How the load phase's requests ended. Each request counts once: failed, cancelled, lost, duplicated,
    mismatched or answered, checked in that order."""

    requests: int
    answered: int  # exactly once, with the in-process text and token count
    cancelled: int  # closed by the client before the end
    failed: int  # an HTTP or connection error, or the time bound
    lost: int  # no error, yet no finish_reason
    duplicated: int  # two finish_reasons, or a response id another request got too
    mismatched: int  # text or token count unlike the in-process ones


def tally(answers: list[Answer], expected: dict[tuple[str, int], object]) -> Tally:
    """Check every answer; `expected`: the in-process Completion per (api, prompt index)."""
    ids = Counter(a.response_id for a in answers if a.response_id is not None)
    counts = Counter()
    for a in answers:
        want = expected[(a.job.api, a.job.prompt)]
        if a.error is not None:
            counts["failed"] += 1
        elif a.cancelled:
            counts["cancelled"] += 1
        elif a.finishes == 0:
            counts["lost"] += 1
        elif a.finishes > 1 or ids[a.response_id] > 1:
            counts["duplicated"] += 1
        elif a.text != want.text or a.completion_tokens != len(want.token_ids):
            counts["mismatched"] += 1
        else:
            counts["answered"] += 1
    fields = ("answered", "cancelled", "failed", "lost", "duplicated", "mismatched")
    return Tally(len(answers), *(counts[f] for f in fields))


@dataclass(frozen=True, slots=True)
class Latency:
    """Client-side speed of the load phase, in seconds; p50 and p99 by nearest rank over the streamed requests."""

    first_token_p50: float
    first_token_p99: float
    inter_chunk_p50: float
    inter_chunk_p99: float
    completion_tokens: int  # from usage, over the requests not cancelled
    wall_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.wall_seconds


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) by nearest rank: always a value that was measured."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def latency(answers: list[Answer], wall: float) -> Latency:
    firsts = [a.first_token for a in answers if a.first_token is not None]
    gaps = [g for a in answers for g in a.gaps]
    tokens = sum(a.completion_tokens or 0 for a in answers)
    if not firsts or not gaps:
        raise RuntimeError("no streamed request produced two chunks: nothing to time (raise --max-tokens)")
    return Latency(
        percentile(firsts, 0.5), percentile(firsts, 0.99), percentile(gaps, 0.5), percentile(gaps, 0.99), tokens, wall
    )


# ---- the ratio and streamed phases ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rates:
    """Tokens/s of each round on the same prompts: served (streaming clients over HTTP) and in-process
    (one LLM.generate call); each side's tokens actually generated over its wall time."""

    served: list[float]
    in_process: list[float]
    served_tokens: list[int]
    in_process_tokens: list[int]
    failed: int  # served requests that failed in any round (their rounds are not timed)

    @property
    def ratio(self) -> float:
        return statistics.median(self.served) / statistics.median(self.in_process)


def ratio_phase(server: Server, llm, prompts: list[str], args: argparse.Namespace) -> Rates:
    from offload.common.config import SamplingParams

    params = SamplingParams(max_new_tokens=args.ratio_tokens, temperature=0.0)
    jobs = [Job("completions", i, True) for i in range(len(prompts))]
    served, local, served_tokens, local_tokens, failed = [], [], [], [], 0
    for _ in range(args.repeats):
        llm.generate(prompts, params)
        local.append(llm.stats.generated_tokens / llm.stats.wall_seconds)
        local_tokens.append(llm.stats.generated_tokens)
        answers, wall = asyncio.run(at_once(server, prompts, jobs, args.ratio_tokens, REQUEST_BOUND["demo"]))
        failed += sum(a.error is not None or a.completion_tokens is None for a in answers)
        if all(a.completion_tokens is not None for a in answers):
            served_tokens.append(sum(a.completion_tokens for a in answers))
            served.append(served_tokens[-1] / wall)
    if not served:
        raise RuntimeError(f"every round of the ratio phase had failed requests ({failed})")
    return Rates(served, local, served_tokens, local_tokens, failed)


@dataclass(frozen=True, slots=True)
class Streamed:
    """Wall seconds of each round on the streamed checkpoint: one client alone, then `clients` at once; and the
    completion tokens (usage) of every request."""

    clients: int
    max_tokens: int
    single_seconds: list[float]
    concurrent_seconds: list[float]
    single_tokens: list[int]  # one request per round
    concurrent_tokens: list[list[int]]  # per round, per request
    flags: list[str]

    @property
    def slowdown(self) -> float:
        return statistics.median(self.concurrent_seconds) / statistics.median(self.single_seconds)

    @property
    def complete(self) -> bool:
        """Every request generated max_tokens tokens (eos or a failure ended none early)."""
        counts = [*self.single_tokens, *(t for round_ in self.concurrent_tokens for t in round_)]
        return all(t == self.max_tokens for t in counts)


def streamed_phase(args: argparse.Namespace, scratch: Path) -> Streamed:
    """Serve the peers' checkpoint under their weight budget and time one client, then STREAMED.prompts at once."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = peers_checkpoint(args.work_dir, args.layers)
    flags = serve_flags(ours_config(model_dir, args.budget_bytes, STREAMED))
    prompts = STREAMED.prompt_ids(SHAPE["vocab_size"])
    jobs = [Job("completions", i, False) for i in range(STREAMED.prompts)]
    files, bound = sorted(model_dir.glob("*.safetensors")), REQUEST_BOUND["streamed"]
    times: dict[int, list[float]] = {1: [], len(jobs): []}
    tokens: dict[int, list[list[int | None]]] = {1: [], len(jobs): []}
    with serving(model_dir, flags, scratch / "streamed.log", START_BOUND["streamed"]) as server:
        asyncio.run(at_once(server, prompts, jobs[:1], 1, bound))  # warm-up: one prefill step
        for r in range(args.repeats):
            for n in times:
                evict(files)
                print(f"streamed round {r + 1} of {args.repeats}: {n} client(s) ...", flush=True)
                answers, wall = asyncio.run(at_once(server, prompts, jobs[:n], STREAMED.new_tokens, bound))
                times[n].append(wall)
                tokens[n].append([a.completion_tokens for a in answers])
    n = len(jobs)
    return Streamed(n, STREAMED.new_tokens, times[1], times[n], [t[0] for t in tokens[1]], tokens[n], flags)


# ---- the report ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table; goal "" and passed None: a measurement with nothing to judge."""

    phase: str
    metric: str
    value: str
    goal: str = ""
    passed: bool | None = None

    @property
    def verdict(self) -> str:
        if self.passed is None:
            return "n/a" if self.goal else ""
        return "PASS" if self.passed else "FAIL"


def load_rows(t: Tally, lat: Latency, statuses: dict[str, int], after: dict[str, float], exit_status) -> list[Row]:
    refused = sum(400 <= s < 500 for s in statuses.values())
    kv, running = after["offload_kv_blocks_used"], after["offload_requests_running"]
    return [
        Row("load", "requests (answered, cancelled)", f"{t.requests} ({t.answered}, {t.cancelled})"),
        Row(
            "load",
            "lost / duplicated / failed",
            f"{t.lost} / {t.duplicated} / {t.failed}",
            "0",
            t.lost + t.duplicated + t.failed == 0,
        ),
        Row("load", "text unlike in-process", str(t.mismatched), "0", t.mismatched == 0),
        Row("load", "bad requests refused 4xx", f"{refused} of {len(statuses)}", "all", refused == len(statuses)),
        Row("load", "KV blocks / requests running after", f"{kv:.0f} / {running:.0f}", "0 / 0", kv == running == 0),
        Row(
            "load",
            "time to first token p50 / p99",
            f"{lat.first_token_p50 * 1e3:.1f} / {lat.first_token_p99 * 1e3:.1f} ms",
        ),
        Row(
            "load",
            "inter-chunk latency p50 / p99",
            f"{lat.inter_chunk_p50 * 1e3:.1f} / {lat.inter_chunk_p99 * 1e3:.1f} ms",
        ),
        Row("load", "aggregate tokens/s", f"{lat.tokens_per_second:.1f}"),
        Row("load", "server exit after SIGTERM", str(exit_status), "0", exit_status == 0),
    ]


def ratio_rows(rates: Rates, clients: int) -> list[Row]:
    return [
        Row("ratio", f"served tokens/s, {clients} streams (median)", f"{statistics.median(rates.served):.1f}"),
        Row("ratio", "in-process tokens/s (median)", f"{statistics.median(rates.in_process):.1f}"),
        Row("ratio", "served / in-process", f"{rates.ratio:.2f}", f">= {GOAL_RATIO}", rates.ratio >= GOAL_RATIO),
    ]


def streamed_rows(s: Streamed) -> list[Row]:
    goal = f"<= {GOAL_SLOWDOWN}"
    return [
        Row("streamed", "one client s (median)", f"{statistics.median(s.single_seconds):.2f}"),
        Row("streamed", f"{s.clients} clients s (median)", f"{statistics.median(s.concurrent_seconds):.2f}"),
        Row(
            "streamed",
            f"{s.clients} clients / one",
            f"{s.slowdown:.2f}",
            goal,
            s.slowdown <= GOAL_SLOWDOWN if s.complete else None,
        ),
    ]


def table(rows: list[Row]) -> str:
    head = f"{'phase':<9} {'metric':<40} {'value':>22} {'goal':>7}  verdict"
    lines = [head, "-" * len(head)]
    lines += [f"{r.phase:<9} {r.metric:<40} {r.value:>22} {r.goal:>7}  {r.verdict}" for r in rows]
    return "\n".join(lines)


# ---- running it ----------------------------------------------------------------------------------------------


def demo_phases(args: argparse.Namespace, scratch: Path) -> dict:
    """The load and ratio phases on one server with the engine's default settings, and the same settings in this
    process: what each request must be answered, and the in-process side of the ratio."""
    from offload.api import LLM
    from offload.common.config import SamplingParams

    pool = prompt_pool()
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0)
    llm = LLM(args.model, served_config([]))
    completions = llm.generate(pool, params)
    chats = llm.chat([[{"role": "user", "content": p}] for p in pool], params)
    expected = {("completions", i): c for i, c in enumerate(completions)}
    expected |= {("chat", i): c for i, c in enumerate(chats)}
    with serving(args.model, [], scratch / "demo.log", START_BOUND["demo"]) as server:
        answers, statuses, wall, after = asyncio.run(load(server, pool, args))
        rates = ratio_phase(server, llm, pool[: args.ratio_clients], args)
    llm.close()
    t, lat = tally(answers, expected), latency(answers, wall)
    return {
        "tally": t,
        "latency": lat,
        "bad_requests": statuses,
        "after": after,
        "server_exit_status": server.exit_status,
        "rates": rates,
        "failures": sorted({a.error for a in answers if a.error is not None}),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
        demo = demo_phases(args, Path(tmp))
        streamed = None if args.skip_streamed else streamed_phase(args, Path(tmp))
    rows = load_rows(demo["tally"], demo["latency"], demo["bad_requests"], demo["after"], demo["server_exit_status"])
    rows += ratio_rows(demo["rates"], args.ratio_clients)
    rows += streamed_rows(streamed) if streamed is not None else []
    print()
    print(table(rows))
    for failure in demo["failures"]:
        print(f"  failed: {failure}")
    report = {
        "benchmark": "serve_load",
        "date": timestamp(),
        "machine": machine(args.work_dir),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "budget_bytes")}
        | {"model": str(args.model), "work_dir": str(args.work_dir), "cancel_after": CANCEL_AFTER},
        "load": {
            "tally": asdict(demo["tally"]),
            "latency": asdict(demo["latency"]) | {"tokens_per_second": demo["latency"].tokens_per_second},
            "bad_requests": demo["bad_requests"],
            "metrics_after": demo["after"],
            "server_exit_status": demo["server_exit_status"],
            "failures": demo["failures"],
        },
        "ratio": asdict(demo["rates"]) | {"ratio": demo["rates"].ratio},
        "streamed": None if streamed is None else asdict(streamed) | {"slowdown": streamed.slowdown},
        "goals": [asdict(r) | {"verdict": r.verdict} for r in rows if r.goal],
    }
    write_report(args.out, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from offload.common.sizes import parse_size
    from offload.demo import ensure_demo_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model for the load and ratio phases (default: the demo model)")
    parser.add_argument("--clients", type=int, help=f"concurrent clients in the load phase ({FULL['clients']})")
    parser.add_argument("--rounds", type=int, help=f"requests each load client sends in turn ({FULL['rounds']})")
    parser.add_argument("--max-tokens", type=int, help=f"max_tokens of the load phase ({FULL['max_tokens']})")
    parser.add_argument("--ratio-clients", type=int, help=f"streams of the ratio phase ({FULL['ratio_clients']})")
    parser.add_argument("--ratio-tokens", type=int, help=f"max_tokens of the ratio phase ({FULL['ratio_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"rounds of the ratio and streamed phases ({FULL['repeats']})")
    parser.add_argument("--skip-streamed", action="store_true", help="leave out the streamed checkpoint (slow)")
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"), help="the peers' checkpoint")
    parser.add_argument("--layers", type=int, default=22, help="decoder layers of the streamed checkpoint")
    parser.add_argument("--budget", default="600MB", help="device memory for the streamed checkpoint's weights")
    parser.add_argument("--quick", action="store_true", help="8 clients, few tokens, one round, no streamed phase")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.skip_streamed = args.skip_streamed or args.quick
    args.model = args.model.expanduser() if args.model is not None else ensure_demo_model()
    args.work_dir = args.work_dir.expanduser()
    args.budget_bytes = parse_size(args.budget, "--budget")
    pool = len(prompt_pool())
    if not 1 <= args.ratio_clients <= pool:
        raise SystemExit(f"--ratio-clients must be 1..{pool} (distinct prompts), got {args.ratio_clients}")
    if min(args.clients, args.rounds, args.max_tokens, args.ratio_tokens, args.repeats) < 1:
        raise SystemExit("--clients, --rounds, --max-tokens, --ratio-tokens and --repeats must be at least 1")
    return args


if __name__ == "__main__":
    main()
