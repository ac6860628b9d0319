"""Offline batch jobs: both input forms, bad lines, exactly-once output across interruptions and a full output disk,
the fingerprint."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload.api import LLM
from offload.batch.job import run_job
from offload.batch.job_files import meta_path
from offload.cli import main
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError

PROMPTS = [f"request {i}: " + "tokens " * (i % 5) for i in range(24)]
BOUND = 600.0  # seconds a job gets to reach a state (end, or write its next lines): generous, for a loaded machine


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, EngineConfig(kv_cache_bytes=1 << 22, block_size=4))


def write_input(path: Path, model: str) -> Path:
    lines = [json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": 4 + 2 * i}) for i, p in enumerate(PROMPTS)]
    lines.append(
        json.dumps(
            {
                "custom_id": "chat-1",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                    "temperature": 0,
                },
            }
        )
    )
    lines.append(
        json.dumps(
            {
                "custom_id": "cmpl-1",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": model, "prompt": "abc", "max_tokens": 6, "n": 2, "temperature": 0},
            }
        )
    )
    lines += [
        "{torn",
        json.dumps({"id": "bad-1", "prompt": "x", "temperature": -1}),
        json.dumps(
            {
                "custom_id": "bad-2",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "other", "prompt": "x"},
            }
        ),
        json.dumps({"id": "bad-3", "prompt": "x", "colour": "red"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def records(path: Path) -> dict[str, dict]:
    out = {}
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        key = obj.get("custom_id", obj.get("id"))
        assert key not in out, f"{key} twice"
        out[key] = obj
    return out


def comparable(rec: dict) -> dict:
    """A record without the ids and times OpenAI's format draws fresh each run."""
    if "custom_id" not in rec:
        return rec
    body = dict(rec["response"]["body"])
    body.pop("id"), body.pop("created")
    return {"custom_id": rec["custom_id"], "body": body}


def test_a_job_answers_every_valid_line_once_and_lists_the_bad_ones(llm, tiny_llama, tmp_path):
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    out = tmp_path / "out.jsonl"
    summary = run_job(llm, src, out, progress=False)
    got = records(out)
    assert set(got) == {f"r{i}" for i in range(24)} | {"chat-1", "cmpl-1"}
    assert summary.requests == 26 and summary.completed == 26 and summary.bad_lines == 4
    want = llm.generate(PROMPTS, [SamplingParams(max_new_tokens=4 + 2 * i) for i in range(24)])
    for i, c in enumerate(want):
        assert got[f"r{i}"]["text"] == c.text and got[f"r{i}"]["finish_reason"] == c.finish_reason
        assert got[f"r{i}"]["usage"]["completion_tokens"] == len(c.token_ids)
    body = got["cmpl-1"]["response"]["body"]
    assert got["cmpl-1"]["response"]["status_code"] == 200 and len(body["choices"]) == 2
    assert body["choices"][0]["text"] == body["choices"][1]["text"] == llm.generate("abc", SamplingParams(6))[0].text
    assert got["chat-1"]["response"]["body"]["object"] == "chat.completion"
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["id"]) for e in errors] == [(27, None), (28, "bad-1"), (29, "bad-2"), (30, "bad-3")]
    assert "temperature must be >= 0" in errors[1]["error"] and "this job runs" in errors[2]["error"]
    assert "unknown field 'colour'" in errors[3]["error"]


def test_a_torn_last_line_is_redone_and_nothing_is_twice(llm, tiny_llama, tmp_path):
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    whole = tmp_path / "whole.jsonl"
    run_job(llm, src, whole, progress=False)
    out = tmp_path / "out.jsonl"
    run_job(llm, src, out, progress=False)
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:10]) + lines[10][: len(lines[10]) // 2])  # a crash mid-write
    summary = run_job(llm, src, out, progress=False)
    assert summary.done_before == 10 and summary.completed == 16
    assert {k: comparable(v) for k, v in records(out).items()} == {k: comparable(v) for k, v in records(whole).items()}


def test_ordered_output_follows_the_input(llm, tiny_llama, tmp_path):
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    out = tmp_path / "out.jsonl"
    run_job(llm, src, out, ordered=True, progress=False)
    assert list(records(out)) == [f"r{i}" for i in range(24)] + ["chat-1", "cmpl-1"]


def test_refused_before_any_work(llm, tiny_llama, tmp_path):
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    dup = tmp_path / "dup.jsonl"
    dup.write_text(src.read_text() + json.dumps({"id": "r3", "prompt": "again"}) + "\n")
    with pytest.raises(OffloadError, match="line 31: id 'r3' is also on line 4"):
        run_job(llm, dup, tmp_path / "dup-out.jsonl", progress=False)
    assert not (tmp_path / "dup-out.jsonl").exists()
    out = tmp_path / "out.jsonl"
    run_job(llm, src, out, progress=False)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "x", "prompt": "other input"}) + "\n")
    before = out.read_bytes()
    with pytest.raises(OffloadError, match="belongs to another input"):
        run_job(llm, other, out, progress=False)
    meta_path(out).unlink()
    with pytest.raises(OffloadError, match="exists without out.jsonl.meta.json"):
        run_job(llm, src, out, progress=False)
    assert out.read_bytes() == before
    with pytest.raises(OffloadError, match="cannot read the input"):
        run_job(llm, tmp_path / "missing.jsonl", tmp_path / "o.jsonl", progress=False)


def _batch(model: Path, src: Path, out: Path) -> subprocess.Popen:
    """`offload batch` in a process of its own."""
    command = [sys.executable, "-m", "offload", "batch", "--model", str(model), "--input", str(src)]
    command += ["--output", str(out), "--no-progress", "--kv-cache-memory", "4MiB", "--block-size", "4"]
    command += ["--fsync-interval", "0"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _wait_for_lines(job: subprocess.Popen, out: Path, count: int) -> None:
    """Return once `out` holds `count` lines or the job has ended, whichever comes first."""
    deadline = time.monotonic() + BOUND
    while _lines(out) < count and job.poll() is None:
        if time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"the job wrote {_lines(out)} of {count} lines in {BOUND} s")
        time.sleep(0.002)


@pytest.mark.parametrize("seed", [1, 2])
def test_kill_9_at_a_random_point_then_rerun_gives_every_result_once(tiny_llama, tmp_path, seed):
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    whole = tmp_path / "whole.jsonl"
    assert _batch(tiny_llama, src, whole).wait(BOUND) == 0
    out = tmp_path / "out.jsonl"
    target = random.Random(seed).randrange(1, 24)  # results written before the kill
    job = _batch(tiny_llama, src, out)
    _wait_for_lines(job, out, target)
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    assert _lines(out) < 26, "the job finished before the kill: nothing was tested"
    rerun = _batch(tiny_llama, src, out)
    assert rerun.wait(BOUND) == 0, rerun.stderr.read().decode()[-2000:]
    assert {k: comparable(v) for k, v in records(out).items()} == {k: comparable(v) for k, v in records(whole).items()}


def test_sigterm_stops_the_job_cleanly_and_it_resumes(tiny_llama, tmp_path):
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    out = tmp_path / "out.jsonl"
    job = _batch(tiny_llama, src, out)
    _wait_for_lines(job, out, 3)
    job.send_signal(signal.SIGTERM)
    code = job.wait(BOUND)
    if code == 0:
        pytest.skip("the job finished before SIGTERM arrived")
    assert code == 130 and b"rerun the same command to resume" in job.stderr.read()
    assert _batch(tiny_llama, src, out).wait(BOUND) == 0
    assert len(records(out)) == 26


def test_the_next_job_starts_warm_from_the_disk_tier(tiny_llama, tmp_path):
    shared = "You answer in one word. " * 6
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": shared + f"q{i}", "max_tokens": 3}) + "\n" for i in range(6))
    )
    config = EngineConfig(
        kv_cache_bytes=1 << 22, block_size=4, offload_dir=str(tmp_path / "kv"), kv_disk_memory=8 << 20
    )
    with LLM(tiny_llama, config) as first:
        run_job(first, src, tmp_path / "first.jsonl", progress=False)
    with LLM(tiny_llama, config) as second:  # a new engine: its device cache is empty
        summary = run_job(second, src, tmp_path / "second.jsonl", progress=False)
        counters = second.core.counters()
    assert summary.completed == 6
    assert counters.prefix_hit_tokens > 0.8 * counters.prefix_lookup_tokens and counters.kv_bytes_up > 0
    assert {k: comparable(v) for k, v in records(tmp_path / "second.jsonl").items()} == {
        k: comparable(v) for k, v in records(tmp_path / "first.jsonl").items()
    }


def fill_output(monkeypatch, out: Path, room: int) -> None:
    """The disk under `out` takes `room` more bytes, the last write short, then fails every write with ENOSPC."""
    real, left = os.write, [room]

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") != str(out):
            return real(fd, data)
        n = min(len(data), left[0])
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        left[0] -= n
        return real(fd, memoryview(data)[:n])

    monkeypatch.setattr(os, "write", write)


def whole_lines(out: Path) -> int:
    """The lines of `out`, each a whole JSON record (asserted)."""
    data = out.read_bytes()
    assert data.endswith(b"\n")
    return len([json.loads(line) for line in data.splitlines()])


def test_a_full_output_disk_stops_with_one_line_keeping_whole_lines_and_the_rerun_finishes(
    llm, tiny_llama, tmp_path, monkeypatch
):
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    whole = tmp_path / "whole.jsonl"
    run_job(llm, src, whole, progress=False)
    out = tmp_path / "out.jsonl"
    fill_output(monkeypatch, out, len(whole.read_bytes()) // 3)
    with pytest.raises(OffloadError) as info:
        run_job(llm, src, out, progress=False)
    monkeypatch.undo()
    stop = r": no space left on device; (\d+) of 26 results are kept; rerun the same command to finish"
    kept = re.fullmatch(re.escape(str(out)) + stop, str(info.value))
    assert kept is not None, str(info.value)
    assert 0 < whole_lines(out) == int(kept[1]) < 26
    summary = run_job(llm, src, out, progress=False)
    assert summary.done_before == int(kept[1]) and summary.completed == 26 - int(kept[1])
    assert {k: comparable(v) for k, v in records(out).items()} == {k: comparable(v) for k, v in records(whole).items()}


def test_the_command_says_a_full_output_disk_in_one_line_and_exits_2(tiny_llama, tmp_path, monkeypatch, capsys):
    src = write_input(tmp_path / "in.jsonl", tiny_llama.name)
    out = tmp_path / "out.jsonl"
    fill_output(monkeypatch, out, 2000)
    args = ["batch", "--model", str(tiny_llama), "--input", str(src), "--output", str(out), "--no-progress"]
    args += ["--kv-cache-memory", "4MiB", "--block-size", "4"]
    assert main(args) == 2
    err = capsys.readouterr().err
    kept = whole_lines(out)
    assert "Traceback" not in err and err.splitlines()[-1] == (
        f"error: {out}: no space left on device; {kept} of 26 results are kept; rerun the same command to finish"
    )
    monkeypatch.undo()
    assert main(args) == 0 and len(records(out)) == 26
