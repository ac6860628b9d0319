"""Huge requests against `offload serve`: how fast they are refused and what they cost the server's memory.

    python benchmarks/request_limits.py [--model DIR] [--huge-mb 50] [--at-once 16] [--work-dir DIR]
                                        [--out benchmarks/results/request_limits.json]

The demo model (or --model) is served twice on loopback. With the default body cap (derived from the context window,
offload/server/limits.py), one client sends in turn: a /v1/completions body of --huge-mb MB declared by its
Content-Length, the headers of that body alone (a raw socket that sends no byte of the body: the 413 must come
without it), the same body chunked (no length), and a prompt of 2 million characters (under the demo's cap, over its
character bound); then --at-once clients send huge bodies all at once (half declared, half chunked), after which
/health and a normal completion must still answer. With --max-request-size raised above the huge body, the huge
prompt passes the cap and meets the character bound alone (parsed, never tokenized).

Each case is timed as its client sees it (sending the body included) while a thread samples the server's RSS every
10 ms: the peak over the case and what stays after it, against the RSS before it. Goals: a refusal in under a
second (each case sent alone) and the RSS peak less than 100 MB above where it started (each case under the cap; the
raised cap's case shows what parsing the huge body costs without it). Prints a table and writes the cases, the
derived cap, the goals and the machine to --out.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil
from bench_common import machine, timestamp, write_report
from served import Server, serving

FLAGS = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "4"]
REFUSED_SECONDS = 1.0  # goal: a refusal, client-side
RSS_GROWTH = 100 << 20  # goal: bytes the server's RSS may rise over a case
BOUND = 600.0  # seconds: the client's bound on one answer
LONG_TEXT = 2_000_000  # characters: under the demo's body cap, over its character bound


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    statuses: list[int]  # each request's HTTP status
    want: list[int]
    seconds: float  # client-side wall time of the case (the slowest request of a case at once)
    rss_before: int  # bytes
    rss_peak: int
    rss_after: int
    goals: tuple[str, ...]  # of "seconds" and "rss": the goals this case is judged by

    @property
    def verdict(self) -> str:
        missed = self.statuses != self.want
        missed |= "seconds" in self.goals and self.seconds >= REFUSED_SECONDS
        missed |= "rss" in self.goals and self.rss_peak - self.rss_before >= RSS_GROWTH
        return "MISSED" if missed else "ok"


class RssPeak:
    """The highest RSS of a process, sampled every 10 ms in a thread while the block runs."""

    def __init__(self, pid: int) -> None:
        self.process, self.peak = psutil.Process(pid), 0
        self._done = threading.Event()

    def rss(self) -> int:
        return self.process.memory_info().rss

    def __enter__(self) -> RssPeak:
        self.before = self.peak = self.rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        time.sleep(0.2)  # what a refused body left behind, once the allocator returned what it frees
        self.after = self.rss()
        self.peak = max(self.peak, self.after)


def body(model: str, prompt_chars: int) -> bytes:
    return json.dumps({"model": model, "prompt": "a" * prompt_chars, "max_tokens": 4}).encode()


def chunked(data: bytes):
    return (data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20))


def post(server: Server, content) -> int:
    if isinstance(content, Headers):
        return content.send(server)
    return httpx.post(f"{server.url}/v1/completions", content=content, timeout=BOUND).status_code


@dataclass(frozen=True, slots=True)
class Headers:
    """A request's headers alone, declaring a body of `length` bytes that never follows, on a raw socket."""

    length: int

    def send(self, server: Server) -> int:
        host, port = server.url.removeprefix("http://").split(":")
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {self.length}\r\n\r\n"
        )
        with socket.create_connection((host, int(port)), timeout=BOUND) as conn:
            conn.sendall(head.encode())
            return int(conn.recv(4096).split(b" ", 2)[1])  # HTTP/1.1 413 ...


def case(server: Server, name: str, contents: list, want: list[int], goals: tuple[str, ...]) -> Case:
    with RssPeak(server.process.pid) as rss:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(contents)) as pool:
            statuses = list(pool.map(lambda c: post(server, c), contents))
        seconds = time.perf_counter() - start
    print(f"  {name}: {statuses[0]}... in {seconds:.3f} s", flush=True)
    return Case(name, statuses, want, seconds, rss.before, rss.peak, rss.after, goals)


def answers(server: Server) -> bool:
    health = httpx.get(f"{server.url}/health", timeout=BOUND).status_code
    return health == 200 and post(server, body(server.model, 20)) == 200


def capped_cases(server: Server, huge_mb: int, at_once: int) -> tuple[list[Case], bool]:
    huge = body(server.model, huge_mb * 1_000_000)
    long_text = body(server.model, LONG_TEXT)
    answers(server)  # warm: the bounds computed, the first request's allocations made
    alone = ("seconds", "rss")
    cases = [
        case(server, f"{huge_mb} MB, Content-Length", [huge], [413], alone),
        case(server, f"{huge_mb} MB declared, headers only", [Headers(len(huge))], [413], alone),
        case(server, f"{huge_mb} MB, chunked", [chunked(huge)], [413], alone),
        case(server, f"{LONG_TEXT // 1_000_000}M characters, under the cap", [long_text], [400], alone),
        case(
            server,
            f"{at_once} x {huge_mb} MB at once",
            [huge if i % 2 else chunked(huge) for i in range(at_once)],
            [413] * at_once,
            ("rss",),
        ),
    ]
    return cases, answers(server)


def derived_bounds(model_dir: Path, window: int) -> dict:
    """The server's bounds for this model, as offload/server/limits.py derives them."""
    from offload.prompts import Prompts
    from offload.server.limits import measure

    prompts = Prompts.load(model_dir)
    bounds = measure(window, prompts.tokenizer, lambda i: prompts.decode([i], skip_special_tokens=False))
    return asdict(bounds) | {"max_chars": bounds.max_chars, "body_bytes": bounds.body_bytes}


def table(cases: list[Case]) -> str:
    head = f"{'case':<42} {'status':>6} {'seconds':>8} {'RSS peak +MB':>12} {'RSS after +MB':>13} {'verdict':>7}"
    lines = [head, "-" * len(head)]
    for c in cases:
        status = str(c.statuses[0]) if len(set(c.statuses)) == 1 else "mixed"
        lines.append(
            f"{c.name:<42} {status:>6} {c.seconds:8.3f} {(c.rss_peak - c.rss_before) / 1e6:12.1f} "
            f"{(c.rss_after - c.rss_before) / 1e6:13.1f} {c.verdict:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="request_limits-") as tmp:
        with serving(args.model, FLAGS, Path(tmp) / "capped.log", bound=BOUND) as server:
            bounds = derived_bounds(args.model, server.max_model_len)
            print(f"derived body cap: {bounds['body_bytes']} bytes, character bound: {bounds['max_chars']}")
            cases, still_answers = capped_cases(server, args.huge_mb, args.at_once)
        raised = ["--max-request-size", f"{2 * args.huge_mb}MB"]
        with serving(args.model, FLAGS + raised, Path(tmp) / "raised.log", bound=BOUND) as server:
            answers(server)
            huge = body(server.model, args.huge_mb * 1_000_000)
            cases.append(case(server, f"{args.huge_mb} MB, cap raised: character bound", [huge], [400], ("seconds",)))
    print()
    print(table(cases))
    print(f"after {args.at_once} at once: /health and a normal completion answered: {still_answers}")
    report = {
        "benchmark": "request_limits",
        "date": timestamp(),
        "machine": machine(args.work_dir),
        "settings": {"model": str(args.model), "huge_mb": args.huge_mb, "at_once": args.at_once, "flags": FLAGS},
        "bounds": bounds,
        "cases": [asdict(c) | {"verdict": c.verdict} for c in cases],
        "answers_after_at_once": still_answers,
        "goals": {"refused_seconds": REFUSED_SECONDS, "rss_growth_bytes": RSS_GROWTH},
    }
    write_report(args.out, report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from offload.demo import ensure_demo_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="the served model (default: the demo model)")
    parser.add_argument("--huge-mb", type=int, default=50, help="MB of the huge body (default: 50)")
    parser.add_argument("--at-once", type=int, default=16, help="huge requests sent at once (default: 16)")
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"), help="recorded storage")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "request_limits.json")
    args = parser.parse_args(argv)
    args.model = args.model or ensure_demo_model()
    args.work_dir = args.work_dir.expanduser()
    return args


if __name__ == "__main__":
    main()
