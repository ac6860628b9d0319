"""The server under load: `offload serve` in its own process on loopback, driven by the official openai client.

    python benchmarks/serve_load.py [--model DIR] [--clients 32] [--rounds 2] [--max-tokens 32]
                                    [--ratio-clients 16] [--ratio-tokens 128] [--repeats 3] [--skip-streamed]
                                    [--work-dir ~/.cache/offload/bench] [--layers 22] [--budget 600MB]
                                    [--rate R] [--arrival poisson|burst] [--rate-requests 40]
                                    [--quick] [--out benchmarks/results/serve_load.json]

load      The demo model (or --model), served with the engine's default settings. --clients clients each send
          --rounds requests in turn: prompts of mixed lengths (DEMO_PROMPTS and their concatenations), completions and
          chat, streamed and whole, a third of them streams closed after a few chunks; greedy, --max-tokens each.
          Four bad requests go in among them. Every request not cancelled must be answered exactly once, with the text
          and token count that LLM.generate (LLM.chat for chat) gives in this process with the same EngineConfig;
          afterwards /metrics must show no KV block in use and no request running; each bad request must get a 4xx.
          Reported, client-side: time to first token (request start to the first non-empty chunk) and the gaps between
          non-empty chunks, p50 and p99 over the streamed requests; completion tokens (usage; cancelled requests have
          none) over the phase's wall time.
ratio     The same server: --ratio-clients streaming clients on as many distinct prompts against one LLM.generate
          call on the same prompts in this process, each side's tokens actually generated over its wall time, for
          --repeats rounds. Goal: the median served rate >= 0.8x the median in-process rate. The clients run in this
          process, on the same cores as the server, as a load generator on one machine does; the goal is judged with
          minimal SSE clients (httpx, one json.loads per chunk), and the rate to openai clients, which validate
          every chunk into typed objects and so take CPU from the server on a machine of two cores, is reported
          beside it.
rate      With --rate: the same server, --rate-requests streamed completions arriving at R requests/s, Poisson (a
          fixed seed) or in bursts of 8 (the arrivals `offload plan --qps` simulates), each a token-id prompt of its
          own of --rate-prompt-tokens tokens and --rate-tokens new tokens (eos ignored), sent by served.py's at_rate.
          Reported, client-side, over the requests after the first quarter: time to first token p50 and p90, the
          median stream's decode tokens/s, and the completion rate (benchmarks/plan_vs_measured.py sets the rates
          from the planner and compares).
streamed  offload_vs_peers.py's random bf16 checkpoint of TinyLlama-1.1B's shape, served with the settings its runs
          of our engine use (--budget of device memory for weights, the KV cache on top, reads through pread), so
          that most layers stream from disk on every step. Token-id prompts of one length: one client alone, then 8
          at once, the checkpoint's pages evicted before each, for --repeats rounds. Goal: the 8 finish within 1.3x
          the time of the one (medians), judged only when every request generated all its tokens. Slow on a CPU
          (every step reads about 2 GB): --skip-streamed leaves it out.

Every phase is bounded in time; the server gets SIGTERM at the end of its phase (and SIGKILL if it has not exited
served.py's DRAIN_BOUND seconds later). Prints a table (phase, metric, value, goal, verdict) and writes the settings,
every measurement, the goals and the machine to --out. --quick shrinks everything (8 clients, few tokens, one round,
no streamed phase) for the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from bench_common import machine, timestamp, write_report
from peer_engines import SHAPE, Workload, evict, ours_config, peers_checkpoint
from served import (
    Answer,
    Job,
    Server,
    at_once,
    at_rate,
    lean_at_once,
    openai_client,
    rate_stats,
    scrape,
    send,
    serve_flags,
    served_config,
    serving,
)

if TYPE_CHECKING:
    from offload.api import LLM, Completion

RESULTS = Path(__file__).parent / "results" / "serve_load.json"
FULL = {"clients": 32, "rounds": 2, "max_tokens": 32, "ratio_clients": 16, "ratio_tokens": 128, "repeats": 3}
FULL |= {"rate_requests": 40, "rate_prompt_tokens": 128, "rate_tokens": 32}
QUICK = {"clients": 8, "rounds": 2, "max_tokens": 16, "ratio_clients": 8, "ratio_tokens": 16, "repeats": 1}
QUICK |= {"rate_requests": 8, "rate_prompt_tokens": 16, "rate_tokens": 8}
CANCEL_AFTER = 3  # non-empty chunks a cancelled stream reads before closing
GOAL_RATIO = 0.8  # served tokens/s over in-process tokens/s, medians
GOAL_SLOWDOWN = 1.3  # STREAMED.prompts clients at once over one alone, wall time, medians
STREAMED = Workload(prompts=8, prompt_tokens=16, new_tokens=8)  # the streamed phase: 8 clients, short, few tokens
START_BOUND = {"demo": 120.0, "streamed": 600.0}  # seconds until /health says ok (the first start imports torch)
REQUEST_BOUND = {"demo": 120.0, "streamed": 600.0}  # seconds one request may take
SETTLE_BOUND = 30.0  # seconds for /metrics to show an idle engine after the load
DISK_READ = 'offload_weight_bytes_read_total{tier="nvme"}'  # the /metrics sample of weight bytes read from disk


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
    jobs = []
    for k in range(clients * rounds):
        api, stream, cancel_after = kinds[k % len(kinds)]
        jobs.append(Job(api, k % prompts, stream, cancel_after))
    return [jobs[c::clients] for c in range(clients)]


def bad_requests(model: str, context: int) -> dict[str, tuple[str, bytes]]:
    """What the server must refuse with a 4xx: name -> (route, body). `context`: the context window in tokens."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": "8"}
    too_long = {"model": model, "prompt": [3] * context}  # token ids: a prompt must leave room for one new token
    return {
        "malformed JSON": ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '),
        "unknown model": ("/v1/completions", json.dumps({"model": f"{model}-unknown", "prompt": "Hello"}).encode()),
        "max_tokens as a string": ("/v1/chat/completions", json.dumps(chat).encode()),
        "prompt longer than the context": ("/v1/completions", json.dumps(too_long).encode()),
    }


async def refusals(server: Server) -> dict[str, int]:
    """Each bad request's HTTP status (0: no answer at all)."""
    bad = bad_requests(server.model, server.max_model_len)

    async def status(route: str, body: bytes) -> int:
        try:
            return (await http.post(route, content=body, headers={"Content-Type": "application/json"})).status_code
        except httpx.HTTPError:
            return 0

    async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_BOUND["demo"]) as http:
        statuses = await asyncio.gather(*(status(route, body) for route, body in bad.values()))
    return dict(zip(bad, statuses, strict=True))


def settle(server: Server) -> dict[str, float]:
    """Scrape /metrics until no request runs and no KV block is in use, or SETTLE_BOUND passes; the last scrape."""
    deadline = time.monotonic() + SETTLE_BOUND
    while True:
        values = scrape(server)
        idle = values["offload_kv_blocks_used"] == 0 and values["offload_requests_running"] == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


async def load(server: Server, pool: list[str], args: argparse.Namespace) -> tuple[list[Answer], dict[str, int], float]:
    """The load phase: (answers, bad requests' statuses, wall seconds)."""
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
    return [a for answers in per_client for a in answers], statuses, wall


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


def tally(answers: list[Answer], expected: dict[tuple[str, int], Completion]) -> Tally:
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
    tokens_per_second: float  # completion_tokens / wall_seconds


@dataclass(frozen=True, slots=True)
class LoadResult:
    """The load phase: how its requests ended, how fast, and the server's state after it."""

    tally: Tally
    latency: Latency
    bad_requests: dict[str, int]  # name -> HTTP status
    metrics_after: dict[str, float]  # /metrics once settled
    server_exit_status: int | None  # after SIGTERM at the end of the demo model's phases
    failures: list[str]  # the distinct errors of failed requests


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
    ttft = percentile(firsts, 0.5), percentile(firsts, 0.99)
    return Latency(*ttft, percentile(gaps, 0.5), percentile(gaps, 0.99), tokens, wall, tokens / wall)


# ---- the ratio and streamed phases ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rates:
    """Tokens/s of each round on the same prompts: served to minimal SSE clients, served to openai clients, and
    in-process (one LLM.generate call); each side's tokens actually generated over its wall time."""

    served: list[float]  # minimal SSE clients: what the goal judges
    served_openai: list[float]  # the official openai client, which parses every chunk on the same cores
    in_process: list[float]
    served_tokens: list[int]
    in_process_tokens: list[int]
    failed: int  # served requests that failed in any round (their rounds are not timed)

    @property
    def ratio(self) -> float:
        return statistics.median(self.served) / statistics.median(self.in_process)

    @property
    def openai_ratio(self) -> float:
        return statistics.median(self.served_openai) / statistics.median(self.in_process)


def ratio_phase(server: Server, llm: LLM, prompts: list[str], args: argparse.Namespace) -> Rates:
    """Each round: one LLM.generate call on `prompts` in this process, then the same prompts streamed from the server
    at once to minimal SSE clients, then to openai clients, all greedy with --ratio-tokens."""
    from offload.common.config import SamplingParams

    params = SamplingParams(max_new_tokens=args.ratio_tokens, temperature=0.0)
    jobs = [Job("completions", i, True) for i in range(len(prompts))]
    served, served_openai, local, served_tokens, local_tokens, failed = [], [], [], [], [], 0
    bound = REQUEST_BOUND["demo"]
    for r in range(args.repeats):
        llm.generate(prompts, params)
        local.append(llm.last_run.generated_tokens / llm.last_run.wall_seconds)
        local_tokens.append(llm.last_run.generated_tokens)
        tokens, wall = asyncio.run(lean_at_once(server, prompts, args.ratio_tokens, bound))
        answers, openai_wall = asyncio.run(at_once(server, prompts, jobs, args.ratio_tokens, bound))
        unanswered = sum(t is None for t in tokens) + sum(a.completion_tokens is None for a in answers)
        if unanswered:
            failed += unanswered
            said = f"{unanswered} requests failed (not timed)"
        else:
            served_tokens.append(sum(tokens))
            served.append(served_tokens[-1] / wall)
            served_openai.append(sum(a.completion_tokens for a in answers) / openai_wall)
            said = f"{served[-1]:.1f} tokens/s (openai client {served_openai[-1]:.1f})"
        print(f"ratio round {r + 1} of {args.repeats}: in-process {local[-1]:.1f} tokens/s, served {said}", flush=True)
    if not served:
        raise RuntimeError(f"every round of the ratio phase had failed requests ({failed})")
    return Rates(served, served_openai, local, served_tokens, local_tokens, failed)


@dataclass(frozen=True, slots=True)
class TimedRun:
    """One timed run of the streamed phase: `clients` requests sent at once."""

    clients: int
    seconds: float  # the first send to the last answer
    tokens: list[int | None]  # each request's completion tokens (usage; None: it failed)
    bytes_read: int  # weight bytes the server read from disk meanwhile (its /metrics)


@dataclass(frozen=True, slots=True)
class Streamed:
    """The streamed phase's runs, round by round: one client alone, then `clients` at once."""

    clients: int
    max_tokens: int
    single: list[TimedRun]
    concurrent: list[TimedRun]
    flags: list[str]  # how the server was started

    @property
    def slowdown(self) -> float:
        """The concurrent runs' median wall time over the single ones'."""
        return statistics.median(r.seconds for r in self.concurrent) / statistics.median(r.seconds for r in self.single)

    @property
    def complete(self) -> bool:
        """Every request generated max_tokens tokens (eos or a failure ended none early)."""
        return all(t == self.max_tokens for r in self.single + self.concurrent for t in r.tokens)


def timed_run(server: Server, prompts: list[list[int]], jobs: list[Job], bound: float) -> TimedRun:
    before = scrape(server)[DISK_READ]
    answers, wall = asyncio.run(at_once(server, prompts, jobs, STREAMED.new_tokens, bound))
    read = scrape(server)[DISK_READ] - before
    return TimedRun(len(jobs), wall, [a.completion_tokens for a in answers], int(read))


def streamed_phase(args: argparse.Namespace, scratch: Path) -> Streamed:
    """Serve the peers' checkpoint under their weight budget and time one client, then STREAMED.prompts at once."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = peers_checkpoint(args.work_dir, args.layers)
    flags = serve_flags(ours_config(model_dir, args.budget_bytes, STREAMED))
    prompts = STREAMED.prompt_ids(SHAPE["vocab_size"])
    jobs = [Job("completions", i, False) for i in range(STREAMED.prompts)]
    files, bound = sorted(model_dir.glob("*.safetensors")), REQUEST_BOUND["streamed"]
    runs: dict[int, list[TimedRun]] = {1: [], len(jobs): []}
    with serving(model_dir, flags, scratch / "streamed.log", START_BOUND["streamed"]) as server:
        asyncio.run(at_once(server, prompts, jobs[:1], 1, bound))  # warm-up: one prefill step
        for r in range(args.repeats):
            for n, done in runs.items():
                evict(files)
                print(f"streamed round {r + 1} of {args.repeats}: {n} client(s) ...", flush=True)
                done.append(timed_run(server, prompts, jobs[:n], bound))
    return Streamed(len(jobs), STREAMED.new_tokens, runs[1], runs[len(jobs)], flags)


# ---- the report ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RateResult:
    """The rate phase: requests/s offered, how they arrived, and served.py's rate_stats of what the clients saw."""

    rate: float
    arrival: str
    requests: int
    stats: dict[str, float]


def rate_phase(server: Server, args: argparse.Namespace) -> RateResult:
    import random

    from offload.scheduler.cost.queueing import arrival_times

    rng = random.Random(0)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(5, vocab) for _ in range(args.rate_prompt_tokens)] for _ in range(args.rate_requests)]
    arrivals = arrival_times(args.rate, args.rate_requests, args.arrival, seed=1)
    seen = at_rate(server, prompts, args.rate_tokens, arrivals, REQUEST_BOUND["demo"])
    return RateResult(args.rate, args.arrival, args.rate_requests, rate_stats(seen))


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


def load_rows(r: LoadResult) -> list[Row]:
    t, lat = r.tally, r.latency
    unanswered = t.lost + t.duplicated + t.failed
    bad, refused = len(r.bad_requests), sum(400 <= status < 500 for status in r.bad_requests.values())
    kv, running = r.metrics_after["offload_kv_blocks_used"], r.metrics_after["offload_requests_running"]
    ttft = f"{lat.first_token_p50 * 1e3:.1f} / {lat.first_token_p99 * 1e3:.1f} ms"
    itl = f"{lat.inter_chunk_p50 * 1e3:.1f} / {lat.inter_chunk_p99 * 1e3:.1f} ms"
    return [
        Row("load", "requests (answered, cancelled)", f"{t.requests} ({t.answered}, {t.cancelled})"),
        Row("load", "lost / duplicated / failed", f"{t.lost} / {t.duplicated} / {t.failed}", "0", unanswered == 0),
        Row("load", "text unlike in-process", str(t.mismatched), "0", t.mismatched == 0),
        Row("load", "bad requests refused 4xx", f"{refused} of {len(r.bad_requests)}", "all", refused == bad),
        Row("load", "KV blocks / requests running after", f"{kv:.0f} / {running:.0f}", "0 / 0", kv == running == 0),
        Row("load", "time to first token p50 / p99", ttft),
        Row("load", "inter-chunk latency p50 / p99", itl),
        Row("load", "aggregate tokens/s", f"{lat.tokens_per_second:.1f}"),
        Row("load", "server exit after SIGTERM", str(r.server_exit_status), "0", r.server_exit_status == 0),
    ]


def ratio_rows(rates: Rates, clients: int) -> list[Row]:
    return [
        Row("ratio", f"served tokens/s, {clients} SSE streams (median)", f"{statistics.median(rates.served):.1f}"),
        Row("ratio", f"same, {clients} openai clients (median)", f"{statistics.median(rates.served_openai):.1f}"),
        Row("ratio", "in-process tokens/s (median)", f"{statistics.median(rates.in_process):.1f}"),
        Row("ratio", "served / in-process", f"{rates.ratio:.2f}", f">= {GOAL_RATIO}", rates.ratio >= GOAL_RATIO),
        Row("ratio", "served to openai clients / in-process", f"{rates.openai_ratio:.2f}"),
    ]


def rate_rows(r: RateResult) -> list[Row]:
    st, offered = r.stats, f"{r.rate:g}/s {r.arrival}"
    return [
        Row(
            "rate",
            f"time to first token p50 / p90 at {offered}",
            f"{st['ttft_p50'] * 1e3:.1f} / {st['ttft_p90'] * 1e3:.1f} ms",
        ),
        Row("rate", "stream decode tokens/s (median stream)", f"{st['stream_tps_p50']:.1f}"),
        Row("rate", "requests completed/s", f"{st['completion_rate']:.2f}"),
    ]


def streamed_rows(s: Streamed) -> list[Row]:
    single = statistics.median(r.seconds for r in s.single)
    concurrent = statistics.median(r.seconds for r in s.concurrent)
    read = [statistics.median(r.bytes_read for r in runs) / 1e9 for runs in (s.single, s.concurrent)]
    judged = s.slowdown <= GOAL_SLOWDOWN if s.complete else None
    return [
        Row("streamed", "one client s (median)", f"{single:.2f}"),
        Row("streamed", f"{s.clients} clients s (median)", f"{concurrent:.2f}"),
        Row("streamed", f"weights read from disk, one / {s.clients}", f"{read[0]:.1f} / {read[1]:.1f} GB"),
        Row("streamed", f"{s.clients} clients / one", f"{s.slowdown:.2f}", f"<= {GOAL_SLOWDOWN}", judged),
    ]


def table(rows: list[Row]) -> str:
    head = f"{'phase':<9} {'metric':<40} {'value':>22} {'goal':>7}  verdict"
    lines = [head, "-" * len(head)]
    lines += [f"{r.phase:<9} {r.metric:<40} {r.value:>22} {r.goal:>7}  {r.verdict}" for r in rows]
    return "\n".join(lines)


# ---- running it ----------------------------------------------------------------------------------------------


def demo_phases(args: argparse.Namespace, scratch: Path) -> tuple[LoadResult, Rates, RateResult | None]:
    """The load, ratio and (with --rate) rate phases on one server with the engine's default settings, and the same
    settings in this process: what each request must be answered, and the in-process side of the ratio."""
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
        answers, statuses, wall = asyncio.run(load(server, pool, args))
        after = settle(server)
        rates = ratio_phase(server, llm, pool[: args.ratio_clients], args)
        at = rate_phase(server, args) if args.rate is not None else None
    llm.close()
    failures = sorted({a.error for a in answers if a.error is not None})
    result = LoadResult(tally(answers, expected), latency(answers, wall), statuses, after, server.exit_status, failures)
    return result, rates, at


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
        loaded, rates, at = demo_phases(args, Path(tmp))
        streamed = None if args.skip_streamed else streamed_phase(args, Path(tmp))
    rows = load_rows(loaded) + ratio_rows(rates, args.ratio_clients) + (rate_rows(at) if at is not None else [])
    rows += streamed_rows(streamed) if streamed is not None else []
    print()
    print(table(rows))
    for failure in loaded.failures:
        print(f"  failed: {failure}")
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "budget_bytes")}
    report = {
        "benchmark": "serve_load",
        "date": timestamp(),
        "machine": machine(args.work_dir),
        "settings": settings | {"model": str(args.model), "work_dir": str(args.work_dir), "cancel_after": CANCEL_AFTER},
        "load": asdict(loaded),
        "ratio": asdict(rates) | {"ratio": rates.ratio, "openai_ratio": rates.openai_ratio},
        "rate": None if at is None else asdict(at),
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
    parser.add_argument("--rate", type=float, help="requests/s of the rate phase (default: no rate phase)")
    parser.add_argument("--arrival", choices=("poisson", "burst"), default="poisson", help="how they arrive")
    parser.add_argument("--rate-requests", type=int, help=f"requests of the rate phase ({FULL['rate_requests']})")
    parser.add_argument("--rate-prompt-tokens", type=int, help=f"prompt tokens each ({FULL['rate_prompt_tokens']})")
    parser.add_argument("--rate-tokens", type=int, help=f"new tokens each ({FULL['rate_tokens']})")
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
    if args.rate is not None and not (args.rate > 0 and min(args.rate_requests, args.rate_prompt_tokens) >= 1):
        raise SystemExit("--rate, --rate-requests and --rate-prompt-tokens must be positive")
    if args.rate_tokens < 2:
        raise SystemExit("--rate-tokens must be at least 2 (a stream's rate needs a token after its first)")
    return args


if __name__ == "__main__":
    main()
