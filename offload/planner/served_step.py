"""What a step of the served engine costs beyond its layers: `offload probe`'s measurement of `offload serve` itself.

The cost model prices a step's layers and head. A served step does more: the engine schedules and prepares the
batch, samples each sequence, hands the deltas to the event loop, which writes each stream's SSE chunk, which its
client reads; each request is parsed and checked before it joins the batch. For a large model that is noise; for a
small one it is most of a step (on a 2-core AMD EPYC VM a 4-layer model's served step took 4.6 ms at 8 streams
against 3.2 ms for the same step run offline). A latency prediction at a request rate needs it.

The probe measures it on the engine's own server: a one-layer model of the probe's tiny layer shape (random
weights, written to a temporary folder) is served by `offload serve` in a process of its own, and clients on this
machine stream completions from it, one at a time and then 8 at once, each a 16-token prompt and `tokens` new
tokens. A stream's step is the time between its chunks (after its first); a lone request's first token takes
one step and the request's own cost; lone requests with 512-token prompts take longer by their prompt tokens' cost.
Less the layer itself (rates.measure_layer_floor at the same rows), what remains at one stream and at 8 gives a
step's cost and each stream's, the longer prompts' extra wait a prompt token's, and the first token's wait less one
step (and its 16 prompt tokens) a request's. Clients on the same machine load its cores as a benchmark's clients
do; remote clients cost the server less, so on a served machine this errs on the slow side.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

from offload.common.errors import OffloadError
from offload.common.hardware import ServedStep
from offload.planner.measured_rates import measure_layer_floor, tiny_model_config

STREAMS = 8  # the larger number of concurrent streams measured (the smaller is one)
PROMPT = 16  # tokens of each prompt (random ids)
LONG_PROMPT = 512  # tokens of the prompts that measure a prompt token's cost (long: a difference of two medians)
READY_BOUND = 180.0  # seconds for the server to load and answer /health
REQUEST_BOUND = 120.0  # seconds for one streamed completion
T = TypeVar("T")
ROUNDS = 5  # each measurement is taken this many times, the median kept


def measure_served_step(dtype: str, tokens: int = 64, min_seconds: float = 0.2) -> ServedStep:
    """The served engine's cost per step, per stream, per prompt token and per request on this machine (seconds),
    computing in `dtype`, each stream `tokens` long. Raises OffloadError when the server does not come up or a
    request fails."""
    if tokens < 4:
        raise OffloadError(f"served-tokens: must be at least 4, got {tokens}")
    rng = random.Random(0)

    def prompt(length: int = PROMPT) -> list[int]:  # a new one each time: the prefix cache would skip its prefill
        return [rng.randrange(4, 256) for _ in range(length)]

    with tempfile.TemporaryDirectory(prefix="offload-probe-serve-") as tmp:
        folder = Path(tmp)
        _write_tiny_model(folder / "model", dtype)
        with _served(folder, dtype) as port:
            _stream(port, prompt(), 8)  # warm-up: the first steps pay for lazy imports and allocations
            one = [_stream(port, prompt(), tokens) for _ in range(ROUNDS)]
            long = [_stream(port, prompt(LONG_PROMPT), 4) for _ in range(ROUNDS)]
            many = [_concurrent(port, [prompt() for _ in range(STREAMS)], tokens) for _ in range(ROUNDS)]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def layer(seqs: int, new: int) -> float:
        return measure_layer_floor(device, dtype, min_seconds, seqs, new)

    step_1 = _median_step(one)
    step_n = statistics.median(_median_step(rs) for rs in many)
    extra_1, extra_n = max(step_1 - layer(1, 1), 0.0), max(step_n - layer(STREAMS, 1), 0.0)
    per_stream = max(extra_n - extra_1, 0.0) / (STREAMS - 1)
    first, first_long = (statistics.median(r["first"] for r in rs) for rs in (one, long))
    longer = layer(1, LONG_PROMPT) - layer(1, PROMPT)  # what the layer itself adds to the longer prefill
    per_token = max(first_long - first - longer, 0.0) / (LONG_PROMPT - PROMPT)
    return ServedStep(
        step=max(extra_1 - per_stream, 0.0),
        per_stream=per_stream,
        per_prompt_token=per_token,
        request=max(first - step_1 - PROMPT * per_token, 0.0),
    )


def _median_step(streams: list[dict]) -> float:
    steps = [r["step"] for r in streams if r["step"] is not None]
    if not steps:
        raise OffloadError("the probe's `offload serve` sent each stream's tokens in one chunk: no step to time")
    return statistics.median(steps)


def _write_tiny_model(folder: Path, dtype: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = tiny_model_config(dtype, layers=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    model.to(getattr(torch, dtype)).save_pretrained(folder)


@contextlib.contextmanager
def _served(folder: Path, dtype: str):
    """`offload serve` of folder/model on a free loopback port, in its own process group; its port while ready."""
    port = free_port()
    log = folder / "serve.log"
    command = [sys.executable, "-m", "offload", "serve", "--model", str(folder / "model"), "--port", str(port)]
    command += ["--log-level", "warning", "--dtype", dtype, "--max-num-seqs", str(STREAMS)]
    # the batch and KV cache given (nothing to plan) and a read backend named: the server never reads the saved
    # profile, which this probe is about to replace
    command += ["--kv-cache-memory", "8MiB", "--served-model-name", "probe", "--io-backend", "pread"]
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
    try:
        deadline = time.monotonic() + READY_BOUND
        while not _healthy(port):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise OffloadError(f"the probe's `offload serve` did not come up: {tail[0]}")
            time.sleep(0.2)
        yield port
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Run in a child before its program starts: SIGTERM it when the process that started it dies (Linux's
    PR_SET_PDEATHSIG), so that a probe killed outright (the OOM killer, SIGKILL) leaves no server behind. Elsewhere
    nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    """A TCP port on loopback nobody listens on now (the OS's choice for a bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    with contextlib.suppress(OSError, http.client.HTTPException):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        finally:
            conn.close()
    return False


def stream_completion(
    port: int, model: str, prompt: list[int], tokens: int, bound: float = REQUEST_BOUND
) -> tuple[float, list[tuple[float, int]]]:
    """A streamed completion of token-id `prompt` from the server on loopback `port`: `tokens` new tokens, greedy,
    eos ignored, read with a plain http.client connection (the lightest client there is). Returns (when it was sent,
    [(when, tokens) of each chunk with tokens]) in time.perf_counter() seconds; a slow reader may get several tokens
    in one chunk, and `logprobs: 0` makes every token come in a chunk that says so, whatever its text (a checkpoint
    without a tokenizer has none). An answer that is not 200, or not `tokens` tokens, raises OffloadError."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "logprobs": 0}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=bound)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise OffloadError(f"`offload serve` on port {port} answered {response.status}: {response.read()[:200]!r}")
        seen = []
        for line in response:
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and (got := len((choices[0].get("logprobs") or {}).get("tokens") or ())):
                    seen.append((time.perf_counter(), got))
    finally:
        conn.close()
    if sum(n for _, n in seen) != tokens:
        raise OffloadError(f"`offload serve` on port {port} streamed {sum(n for _, n in seen)} tokens, not {tokens}")
    return sent, seen


def in_threads(calls: list[Callable[[], T]]) -> list[T]:
    """Each call run in a thread of its own, all at once; their results in order. The first exception is raised
    once every thread has finished."""
    results: list = [None] * len(calls)

    def one(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # raised below, in the caller's thread
            results[i] = _Failed(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, _Failed):
            raise r.exc
    return results


class _Failed(NamedTuple):
    exc: BaseException


def _stream(port: int, prompt: list[int], tokens: int) -> dict:
    """One streamed completion: {"first": seconds from sending to its first token, "step": seconds a later token
    took, on average (None when they all came in the first chunk)}."""
    sent, seen = stream_completion(port, "probe", prompt, tokens)
    (first, n_first), (last, _) = seen[0], seen[-1]
    return {"first": first - sent, "step": (last - first) / (tokens - n_first) if tokens > n_first else None}


def _concurrent(port: int, prompts: list[list[int]], tokens: int) -> list[dict]:
    """A completion of each prompt, all sent at once, each from a thread of its own."""
    start = threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> Callable[[], dict]:
        return lambda: (start.wait(), _stream(port, prompt, tokens))[1]

    return in_threads([one(p) for p in prompts])
