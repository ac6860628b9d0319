"""Offline batch jobs: `offload batch --input IN.jsonl --output OUT.jsonl`, every result exactly once, resumable.

    summary = run_job(llm, Path("in.jsonl"), Path("out.jsonl"))

The job hands the engine core every pending request at once, longest new-token budget first (the long ones
start early, the short ones fill the places they leave), and appends each result as its request finishes
(offload/batch/job_files.py: the formats, the fingerprint, the torn-line repair). An interrupted job rerun with the same
command skips what its output already holds; `ordered` rewrites the finished output in the input's order. An
output that cannot be written (a full disk) stops the job with one line saying how many results it keeps.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from offload.api import LLM
from offload.batch.job_files import (
    Appender,
    BadLine,
    JobRequest,
    OutputError,
    fingerprint,
    open_output,
    read_input,
    result_record,
    rewrite_in_order,
    write_errors,
)
from offload.common.errors import OffloadError
from offload.common.outputs import Delta


@dataclass(frozen=True, slots=True)
class JobSummary:
    input: str
    output: str
    requests: int  # requests the model can run (valid lines with prompts that fit)
    bad_lines: int  # in the errors file: invalid lines, and prompts the model cannot take
    done_before: int  # already in the output when this run started
    completed: int  # finished by this run
    prompt_tokens: int  # of this run's requests
    generated_tokens: int
    wall_seconds: float
    steps: int
    preemptions: int
    weight_bytes_read: int
    read_stall_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.wall_seconds, 1e-9)

    def to_json(self) -> dict:
        return asdict(self) | {"tokens_per_second": self.tokens_per_second}


@dataclass(slots=True, eq=False)
class _Pending:
    request: JobRequest
    prompt_ids: list[int]
    outputs: list[list[Delta]]  # per choice
    open_choices: int


def run_job(
    llm: LLM, input_path: Path, out: Path, ordered: bool = False, fsync_seconds: float = 1.0, progress: bool = True
) -> JobSummary:
    started = time.perf_counter()
    requests, bad = read_input(input_path, llm.model_dir.name)
    done = open_output(out, fingerprint(input_path, llm.model_dir))
    pending, unrunnable = _encode(llm, [r for r in requests if r.id not in done])
    bad = sorted(bad + unrunnable, key=lambda b: b.line)
    write_errors(out, bad)
    runnable = len(requests) - len(unrunnable)
    before = llm.core.counters()
    bar = _progress(runnable, len(done), progress)
    appender = Appender(out, fsync_seconds)
    completed = 0
    try:
        try:
            completed = _drive(llm, pending, appender, bar)
        finally:
            if bar is not None:
                bar.close()
            appender.close()
    except OutputError as exc:
        kept = len(done) + appender.lines
        raise OffloadError(f"{exc}; {kept} of {runnable} results are kept; rerun the same command to finish") from None
    if ordered:
        refused = {b.id for b in unrunnable}
        rewrite_in_order(out, [r.id for r in requests if r.id not in refused])
    ran = llm.core.counters() - before
    return JobSummary(
        input=str(input_path),
        output=str(out),
        requests=runnable,
        bad_lines=len(bad),
        done_before=len(done),
        completed=completed,
        prompt_tokens=ran.prompt_tokens,
        generated_tokens=ran.generated_tokens,
        wall_seconds=time.perf_counter() - started,
        steps=ran.steps,
        preemptions=ran.preemptions,
        weight_bytes_read=ran.bytes_read,
        read_stall_seconds=ran.stall_seconds,
    )


def _encode(llm: LLM, requests: list[JobRequest]) -> tuple[list[_Pending], list[BadLine]]:
    """Tokenized requests, and those whose prompt the model cannot take (too long, empty, no chat template)."""
    pending, bad = [], []
    for r in requests:
        try:
            ids = llm.encode_chat(r.messages, r.line, r.functions) if r.chat else _encode_prompt(llm, r)
        except OffloadError as exc:
            bad.append(BadLine(r.line, r.id, str(exc)))
            continue
        pending.append(_Pending(r, ids, [[] for _ in r.params], len(r.params)))
    return pending, bad


def _encode_prompt(llm: LLM, r: JobRequest) -> list[int]:
    if isinstance(r.prompt, str):
        return llm.encode(r.prompt, r.line)
    return llm.core.check_prompt(list(r.prompt), r.line)


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="req", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


def _drive(llm: LLM, pending: list[_Pending], appender: Appender, bar) -> int:
    """Run every pending request through the core, writing each result as it finishes; the number written.
    Interrupted (Ctrl-C, an error), the requests still in the core are aborted, so the LLM stays usable."""
    core = llm.core
    by_rid: dict[int, tuple[_Pending, int]] = {}
    order = sorted(pending, key=lambda p: -max(q.max_new_tokens for q in p.request.params))
    completed = 0
    tokens = 0
    start = time.perf_counter()
    try:
        for p in order:
            for k, params in enumerate(p.request.params):
                by_rid[core.add_request(p.prompt_ids, params, stream_text=False)] = (p, k)
        while by_rid:
            for delta in core.step():
                if delta.request_id not in by_rid:
                    continue
                p, k = by_rid[delta.request_id]
                p.outputs[k].append(delta)
                tokens += len(delta.token_ids)
                if delta.finish_reason is None:
                    continue
                del by_rid[delta.request_id]
                p.open_choices -= 1
                if p.open_choices == 0:
                    appender.write(result_record(p.request, len(p.prompt_ids), p.outputs, llm.token_text))
                    completed += 1
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tokens/s", refresh=False)
    finally:
        if by_rid:  # interrupted: nothing of the job stays in the core
            core.abort_all()
    return completed
