"""`offload batch --ray`: one job sharded over Ray actors, each with its own engine and its own resumable part.

    summary = run_sharded(model_dir, config, Path("in.jsonl"), Path("out.jsonl"), workers=2, address=None)

The valid lines of the input are dealt to `workers` shards by a hash of their id, so a rerun with the same
worker count deals them the same way. Each shard is a JSONL file of its lines in OUT.parts/, and each worker runs
it with `run_job` into its own part (resumable, fingerprinted, like any job). When every worker is done, the
driver appends to OUT each part's results that OUT does not hold yet and only then removes OUT.parts/: a rerun
after an interruption anywhere (a worker, the merge) redoes what is missing and appends nothing twice. Ray is an
optional dependency (`pip install ray`); `address` joins an existing cluster, None starts a local one. Every node
must see the model directory and OUT's folder at the same paths (shared storage).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from offload.batch.job import JobSummary
from offload.batch.job_files import (
    Appender,
    BadLine,
    atomic_write,
    errors_path,
    fingerprint,
    meta_path,
    open_output,
    read_input,
    write_errors,
)
from offload.common.config import EngineConfig
from offload.common.errors import OffloadError

POLL_SECONDS = 0.5  # between progress updates while the workers run


def shard_of(request_id: str, workers: int) -> int:
    """The shard a request goes to: stable across runs and machines (not Python's salted hash)."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") % workers


def run_sharded(
    model_dir: Path,
    config: EngineConfig,
    input_path: Path,
    out: Path,
    workers: int,
    address: str | None = None,
    progress: bool = True,
) -> JobSummary:
    try:
        import ray
    except ImportError:
        raise OffloadError("--ray needs Ray: pip install 'ray>=2.9'") from None
    if workers < 1:
        raise OffloadError(f"--ray-workers must be at least 1, got {workers}")
    started = time.perf_counter()
    requests, bad = read_input(input_path, model_dir.name)
    done = open_output(out, fingerprint(input_path, model_dir))
    parts = out.with_name(out.name + ".parts")
    shards = _write_shards(input_path, requests, parts, workers)
    ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        worker = ray.remote(num_cpus=1)(_Worker)
        actors = [worker.remote(str(model_dir), config) for _ in range(workers)]
        futures = [
            a.run.remote(str(parts / f"{k}.in.jsonl"), str(parts / f"{k}.out.jsonl")) for k, a in enumerate(actors)
        ]
        summaries = _wait(ray, futures, parts, workers, len(requests), len(done), progress)
    finally:
        ray.shutdown()
    unrunnable = _part_errors(parts, shards)
    completed = _merge(out, parts, workers)
    write_errors(out, sorted(bad + unrunnable, key=lambda b: b.line))
    shutil.rmtree(parts)
    return JobSummary(
        input=str(input_path),
        output=str(out),
        requests=len(requests) - len(unrunnable),
        bad_lines=len(bad) + len(unrunnable),
        done_before=len(done),
        completed=completed,
        prompt_tokens=sum(s["prompt_tokens"] for s in summaries),
        generated_tokens=sum(s["generated_tokens"] for s in summaries),
        wall_seconds=time.perf_counter() - started,
        steps=sum(s["steps"] for s in summaries),
        preemptions=sum(s["preemptions"] for s in summaries),
        weight_bytes_read=sum(s["weight_bytes_read"] for s in summaries),
        read_stall_seconds=sum(s["read_stall_seconds"] for s in summaries),
    )


class _Worker:
    """One engine in a Ray worker process; runs shards into parts."""

    def __init__(self, model_dir: str, config: EngineConfig) -> None:
        from offload.api import LLM

        self.llm = LLM(model_dir, config)

    def run(self, shard: str, part: str) -> dict:
        from offload.batch.job import run_job

        return run_job(self.llm, Path(shard), Path(part), progress=False).to_json()


def _write_shards(input_path: Path, requests, parts: Path, workers: int) -> list[list[int]]:
    """OUT.parts/<k>.in.jsonl for each shard (unchanged if there from an earlier run); each shard's input line
    numbers, in order."""
    lines = input_path.read_bytes().splitlines()
    shards: list[list[int]] = [[] for _ in range(workers)]
    for r in requests:
        shards[shard_of(r.id, workers)].append(r.line)
    parts.mkdir(parents=True, exist_ok=True)
    layout = parts / "workers.json"
    if layout.exists() and json.loads(layout.read_text()) != {"workers": workers}:
        raise OffloadError(f"{parts}: an interrupted run used another --ray-workers; rerun with that, or remove it")
    for k, numbers in enumerate(shards):
        data = b"".join(lines[n - 1] + b"\n" for n in numbers)
        shard = parts / f"{k}.in.jsonl"
        if not shard.exists() or shard.read_bytes() != data:
            atomic_write(shard, data)
    atomic_write(layout, json.dumps({"workers": workers}).encode())
    return shards


def _wait(ray, futures, parts: Path, workers: int, total: int, initial: int, progress: bool) -> list[dict]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=initial, unit="req", file=sys.stderr, dynamic_ncols=True)
    pending = list(futures)
    try:
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            if bar is not None:
                written = sum(_count_lines(parts / f"{k}.out.jsonl") for k in range(workers))
                bar.update(max(0, initial + written - bar.n))
        return ray.get(futures)
    finally:
        if bar is not None:
            bar.close()


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _part_errors(parts: Path, shards: list[list[int]]) -> list[BadLine]:
    """The prompts the workers could not run, with their line numbers in the job's input."""
    bad = []
    for k, numbers in enumerate(shards):
        path = errors_path(parts / f"{k}.out.jsonl")
        if path.exists():
            for line in path.read_text().splitlines():
                e = json.loads(line)
                number = numbers[e["line"] - 1]
                error = e["error"].replace(f"prompt {e['line']} ", f"prompt {number} ", 1)  # the shard's numbering
                bad.append(BadLine(number, e["id"], error))
    return bad


def _merge(out: Path, parts: Path, workers: int) -> int:
    """Append each part's results that `out` lacks; the number appended."""
    have = open_output(out, json.loads(meta_path(out).read_text()))
    appender = Appender(out, fsync_seconds=float("inf"))
    added = 0
    try:
        for k in range(workers):
            part = parts / f"{k}.out.jsonl"
            for raw in part.read_bytes().splitlines() if part.exists() else []:
                record = json.loads(raw)
                rid = record.get("custom_id", record.get("id"))
                if rid not in have:
                    appender.write(record)
                    have.add(rid)
                    added += 1
    finally:
        appender.close()  # fsynced before the parts go
    return added
