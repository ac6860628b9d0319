"""A real `offload serve` process on loopback, started and stopped by the tests (imported by them: a module of
its own, since tests/conftest.py holds the name conftest)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
SERVER_FLAGS = ("--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--max-waiting", "4", "--log-level", "warning")
START_TIMEOUT = 120.0  # seconds: the first start imports torch and transformers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: Path

    def stop(self, timeout: float = 30.0) -> int:
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
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}


def start_server(model_dir: Path, log: Path, *flags: str) -> Served:
    port = free_port()
    command = [sys.executable, "-m", "offload", "serve", "--model", str(model_dir), "--port", str(port), *flags]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    served = Served(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{served.url}/health", timeout=2).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    served.stop()
    pytest.fail(f"the server was not ready within {START_TIMEOUT} s: {log.read_text()[-2000:]}")
