"""A real `offload serve` process on loopback, started and stopped by the tests (imported by them: a module of
its own, since tests/conftest.py holds the name conftest), and `eventually`, the tests' one way to wait for a state.

Every wait here and in the tests that import it is for a state (the server answers, a batch ended, the blocks are
free), polled, with a bound that only a broken server reaches: on a loaded machine (a compiler on both cores)
the server runs many times slower than alone, and a state reached early ends its wait at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from offload.planner.served_step import free_port

API_KEY = "test-key"
SERVER_FLAGS = ("--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--max-waiting", "4", "--log-level", "warning")
BOUND = 600.0  # seconds: the longest any wait for a state lasts, and the client's timeout for one answer
POLL = 0.05  # seconds between looks at a state

T = TypeVar("T")


def eventually(check: Callable[[], T], what: str, bound: float = BOUND, poll: float = POLL) -> T:
    """The first truthy value `check()` returns, polled every `poll` seconds; the test fails, saying it never
    saw `what`, if none came within `bound` seconds."""
    deadline = time.monotonic() + bound
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"not within {bound} s: {what}")
        time.sleep(poll)
    return value


@dataclass
class Served:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path

    def stop(self, timeout: float = BOUND) -> int:
        """SIGTERM, then wait; killed (and the test failed) if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            pytest.fail(f"the server did not exit {timeout} s after SIGTERM; log: {self.log.read_text()[-2000:]}")

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {name{labels}: value}, comments left out."""
        text = httpx.get(f"{self.url}/metrics", timeout=BOUND).text
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}


def start_server(model_dir: Path, log: Path, *flags: str) -> Served:
    """`offload serve` on a free port, once /health says it is ready (the first start imports torch and
    transformers)."""
    port = free_port()
    command = [sys.executable, "-m", "offload", "serve", "--model", str(model_dir), "--port", str(port), *flags]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    served = Served(process, f"http://127.0.0.1:{port}", log)

    def ready() -> bool:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            return httpx.get(f"{served.url}/health", timeout=10).status_code == 200  # a slow answer: asked again
        except httpx.HTTPError:
            return False

    try:
        eventually(ready, "the server answers /health with 200", poll=0.2)
    except BaseException:
        served.stop()
        print(log.read_text()[-2000:], file=sys.stderr)
        raise
    return served
