"""`offload batch --ray`: a job sharded over a local Ray cluster of 2 workers gives the same output as one engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_batch import BOUND, comparable, records, write_input

from offload.batch.ray_shards import shard_of


def test_shards_are_stable_and_cover_every_worker():
    assert [shard_of(f"r{i}", 2) for i in range(8)] == [shard_of(f"r{i}", 2) for i in range(8)]
    assert {shard_of(f"r{i}", 3) for i in range(60)} == {0, 1, 2}
    assert shard_of("r0", 1) == 0


def _batch(model, src, out, *extra: str) -> subprocess.CompletedProcess:
    """The job in a process of its own, run in the output's folder (as test_batch's `_batch`, for the same reason);
    the bound is generous: Ray starts its cluster and two engines, slowly on a loaded machine."""
    command = [sys.executable, "-m", "offload", "batch", "--model", str(model), "--input", str(src)]
    command += ["--output", str(out), "--no-progress", "--kv-cache-memory", "4MiB", "--block-size", "4", *extra]
    return subprocess.run(command, capture_output=True, timeout=BOUND, cwd=out.parent)


def test_two_ray_workers_give_what_one_engine_gives(tiny_llama, tmp_path):
    pytest.importorskip("ray")
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert _batch(tiny_llama, src, one).returncode == 0
    done = _batch(tiny_llama, src, two, "--ray", "--ray-workers", "2", "--ordered")
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    got = records(two)
    assert {k: comparable(v) for k, v in got.items()} == {k: comparable(v) for k, v in records(one).items()}
    assert list(got) == [f"r{i}" for i in range(24)] + ["chat-1", "cmpl-1"]  # --ordered
    errors = [json.loads(line)["line"] for line in (tmp_path / "two.errors.jsonl").read_text().splitlines()]
    assert errors == [27, 28, 29, 30]
    assert not (tmp_path / "two.jsonl.parts").exists()  # merged, then removed
    again = _batch(tiny_llama, src, two, "--ray", "--ray-workers", "2")  # a rerun of a finished job adds nothing
    assert again.returncode == 0 and len(records(two)) == 26
