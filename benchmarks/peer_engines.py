"""The engines offload_vs_peers.py and same_memory.py compare, each run in its own subprocess: ours (under a weight
budget, or under a cap on the whole process), transformers with Accelerate's disk offload, and DeepSpeed
ZeRO-Inference; the workload, the result record and the page-cache tools they share.

Every engine is timed by the same clock: the harness's perf_counter around the generate call, with the harness's
own page-cache eviction (done for the peers before every forward pass, so that they read from storage as ours
does with O_DIRECT) left out of every engine's time.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bench_common import ensure_checkpoint, generate_exactly

if TYPE_CHECKING:
    from offload.common.config import EngineConfig

SHAPE = {  # TinyLlama-1.1B's shape; the layer count comes from --layers
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: int = 8
    prompt_tokens: int = 128
    new_tokens: int = 16
    seed: int = 0

    def prompt_ids(self, vocab: int) -> list[list[int]]:
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(3, vocab, (self.prompts, self.prompt_tokens), generator=gen).tolist()

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence holds at most: its prompt and every new token."""
        return self.prompt_tokens + self.new_tokens


@dataclass(slots=True)
class EngineResult:
    """What one engine did in its subprocess. status is "ok" or "failed: <reason>"."""

    engine: str
    status: str = "ok"
    # the generate call on the harness's clock, the harness's own page-cache eviction (peers only) left out
    wall_seconds: float = 0.0
    generated_tokens: int = 0
    passes: int = 0  # forward passes over the layers
    pass_seconds: list[float] = field(default_factory=list)
    storage_bytes_read: int = 0  # /proc/self/io read_bytes during generate
    load_bytes_read: int = 0  # /proc/self/io read_bytes while loading
    load_seconds: float = 0.0
    streamed_bytes_per_pass: int = 0  # weight bytes the engine must read from storage on every pass
    layers_resident: int = 0  # decoder layers held in RAM for the whole run
    layers_streamed: int = 0  # decoder layers read from storage on every pass
    peak_rss_bytes: int = 0
    baseline_rss_bytes: int = 0  # RSS with the engine's libraries imported, before it loads any weight
    token_ids: list[list[int]] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # engine-specific facts

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.wall_seconds, 1e-9)

    @property
    def expected_bytes(self) -> int:
        return self.streamed_bytes_per_pass * self.passes


# ---- the checkpoint and the page cache ---------------------------------------------------------------------


def peers_checkpoint(work_dir: Path, layers: int) -> Path:
    """The random-weight bf16 Llama of TinyLlama-1.1B's shape with `layers` decoder layers, built once in work_dir."""
    return ensure_checkpoint(work_dir / f"llama-{layers}L-bf16", SHAPE | {"num_hidden_layers": layers})


def files_under(*dirs: Path) -> list[Path]:
    return [p for d in dirs if d.exists() for p in sorted(d.rglob("*")) if p.is_file()]


def fresh_copy(model_dir: Path, dest: Path) -> Path:
    """A copy of the checkpoint written now, synced to storage, in place of any earlier one at `dest`.

    Some storage serves recently written files faster than old ones (a virtual disk backed by a host file the host
    still caches). ZeRO-Inference reads swap files it writes at startup, so it always gets that; an engine given a
    copy written just before its run gets the same, and every engine reads files equally fresh."""
    import shutil

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for src in files_under(model_dir):
        target = dest / src.relative_to(model_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())
    return dest


def evict(paths: Iterable[Path]) -> None:
    """Drop the files' pages from the page cache (written pages are synced first, or they would stay)."""
    from offload.tiers.io.base import evict_page_cache

    for path in paths:
        evict_page_cache(path)


def drop_page_cache(paths: list[Path]) -> str:
    """Empty the page cache; where that is not permitted, evict `paths`. Returns which was done."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        evict(paths)
        return "fadvise"


def storage_read_bytes() -> int:
    """Bytes this process (all its threads) has had read from storage, page-cache hits excluded."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def rss_bytes() -> int:
    """This process's resident set now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/self/status has no VmRSS")


def peak_rss_bytes() -> int:
    """This process's own peak RSS. Not ru_maxrss: Linux carries that across fork and exec, so a worker would
    report its parent's peak (the parent builds the checkpoint in memory) whenever that is higher."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_isolated(name: str, label: str, cmd: list[str], out: Path, log: Path, method: str) -> EngineResult:
    """Run `cmd` (a worker writing an EngineResult as JSON to `out`) in a fresh interpreter and read the result back;
    a worker that wrote none is a failed result, its output kept in `log`. `method`: how the page cache was dropped."""
    out.unlink(missing_ok=True)
    print(f"running {label} (page cache: {method}) ...", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(f"  {label} done in {time.perf_counter() - start:.0f} s", flush=True)
    if not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        print(f"  {label} failed: {tail[0]}", flush=True)
        log.write_text(proc.stdout + proc.stderr)
        return EngineResult(engine=name, status=f"failed: {tail[0]}"[:300])
    result = EngineResult(**json.loads(out.read_text()))
    result.engine = name
    result.extra["page_cache"] = method
    return result


# ---- the engines -----------------------------------------------------------------------------------------


def timed_calls(obj: object, name: str, times: list[float]) -> None:
    """Wrap obj.name so that each call's duration is appended to `times` (seconds)."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)


def ours_config(model_dir: Path, budget: int | None, workload: Workload) -> EngineConfig:
    """Our engine's settings for `workload` under a weight budget of `budget` bytes (None: every weight resident):
    a bf16 KV cache that holds every sequence at its longest, on top of the budget; the whole batch at once."""
    import torch

    from offload.common.config import EngineConfig
    from offload.model.loader import load_spec
    from offload.tiers.kv.kv_cache import KVCache

    spec, _ = load_spec(model_dir)
    block = 16
    blocks = workload.prompts * -(-workload.max_tokens // block)
    geometry = (spec.num_layers, block, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    kv_bytes = blocks * KVCache.block_bytes(*geometry, parts=spec.kv_parts)
    return EngineConfig(
        device_memory=None if budget is None else budget + kv_bytes,
        kv_cache_bytes=kv_bytes,
        io_backend="pread",
        dtype="bfloat16",
        block_size=block,
        max_num_seqs=workload.prompts,
        # every prompt in one prefill step: one pass over the weights, as each peer's generate() makes
        max_step_tokens=max(4096, workload.prompts * workload.prompt_tokens),
    )


def run_ours(model_dir: Path, budget: int | None, workload: Workload, scratch: Path) -> EngineResult:
    """Our engine. budget None: every weight resident (the compute reference of the physical limit)."""
    config = ours_config(model_dir, budget, workload)  # imports the engine's libraries, reads config.json only
    baseline = rss_bytes()
    result = generate_ours(model_dir, config, workload)
    result.engine = "ours" if budget is not None else "ours (all resident)"
    result.baseline_rss_bytes = baseline
    return result


def run_ours_capped(model_dir: Path, cap: int, workload: Workload, scratch: Path) -> EngineResult:
    """Our engine under a cap on the whole process's memory: an EngineConfig with only `memory=cap` (and the dtype,
    block and reads run_ours uses), planned by the cost model for `workload.prompts` candidate requests, then one
    batch of the size it chose: that many requests, one round, as the peers run theirs."""
    from offload.common.config import EngineConfig
    from offload.planner.autoconfig import autoconfigure, describe

    baseline = rss_bytes()
    capped = EngineConfig(memory=cap, io_backend="pread", dtype="bfloat16", block_size=16)
    lengths = [workload.prompt_tokens] * workload.prompts
    config, prediction = autoconfigure(model_dir, capped, lengths, workload.new_tokens)
    batch = replace(workload, prompts=config.max_num_seqs)
    result = generate_ours(model_dir, config, batch)
    result.engine = "ours-capped"
    result.baseline_rss_bytes = baseline
    result.extra |= {
        "memory": cap,
        "batch": config.max_num_seqs,
        "candidate_requests": workload.prompts,
        "plan": describe(prediction),
        "predicted_tokens_per_second": prediction.tokens_per_second,
        "predicted_device_bytes": prediction.memory["device"],
    }
    return result


def generate_ours(model_dir: Path, config: EngineConfig, workload: Workload) -> EngineResult:
    """Load our engine with `config`, generate `workload` greedily, and measure it (the engine name and baseline RSS
    are the caller's to fill in)."""
    from offload.api import LLM
    from offload.common.config import SamplingParams

    before = storage_read_bytes()
    start = time.perf_counter()
    llm = LLM(model_dir, config)
    load_seconds = time.perf_counter() - start
    pass_seconds: list[float] = []
    timed_calls(llm.parts.engine, "step", pass_seconds)
    params = SamplingParams(max_new_tokens=workload.new_tokens, ignore_eos=True)
    prompts = workload.prompt_ids(llm.spec.vocab_size)
    loaded = storage_read_bytes()
    start = time.perf_counter()
    out = llm.generate_ids(prompts, params)
    wall = time.perf_counter() - start
    read = storage_read_bytes() - loaded
    stats, placement = llm.last_run, llm.placement
    tiers = placement.layer_tiers
    return EngineResult(
        engine="",
        wall_seconds=wall,
        generated_tokens=stats.generated_tokens,
        passes=stats.steps,
        pass_seconds=pass_seconds,
        storage_bytes_read=read,
        load_bytes_read=loaded - before,
        load_seconds=load_seconds,
        streamed_bytes_per_pass=placement.streamed_bytes_per_pass,
        layers_resident=sum(t != "nvme" for t in tiers),
        layers_streamed=sum(t == "nvme" for t in tiers),
        peak_rss_bytes=peak_rss_bytes(),
        token_ids=[list(c.token_ids) for c in out],
        extra={
            "device_memory": llm.config.device_memory,
            "kv_cache_bytes": llm.config.kv_cache_bytes,
            "kv_blocks": placement.kv_blocks,
            "device_peak_bytes": placement.device_peak,
            "resident_weight_bytes": placement.weight_bytes,
            "ring_slots": placement.ring_slots,
            "engine_bytes_read": stats.bytes_read,
            "read_seconds": stats.read_seconds,
            "stall_seconds": stats.stall_seconds,
            "engine_wall_seconds": stats.wall_seconds,  # RunStats' own clock around the same call
            "compute_seconds": stats.compute_seconds,
            "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds,
            "read_gbps": stats.read_gbps,
            "overlap_efficiency": stats.overlap_efficiency,
            "preemptions": stats.preemptions,
            "micro_batch_tokens": llm.config.micro_batch_tokens,
            "layer_tiers": list(tiers),
            "embedding": placement.embed_tier,  # "nvme": left on disk, its rows read as tokens need them
            "embed_rows_read": llm.stats().weights.embed_rows_read,
            "experts": asdict(stats.experts) if stats.experts is not None else None,
        },
    )


def hf_generate(model, workload: Workload, vocab: int, evict_paths: list[Path]) -> EngineResult:
    """Greedy generate with a transformers model; evicts `evict_paths` before every forward pass (so every pass
    reads its offloaded weights from storage, as ours does with O_DIRECT) and times each pass. The eviction's own
    time is taken out of the wall time: the harness's work is charged to no engine."""
    import torch

    pass_seconds: list[float] = []
    started: list[float] = []
    evicting: list[float] = []  # seconds each eviction took

    def pre_hook(module, args, kwargs):
        begin = time.perf_counter()
        evict(evict_paths)
        started.append(time.perf_counter())
        evicting.append(started[-1] - begin)

    def post_hook(module, args, kwargs, output):
        pass_seconds.append(time.perf_counter() - started[-1])

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True)
    input_ids = torch.tensor(workload.prompt_ids(vocab))
    evict(evict_paths)
    before = storage_read_bytes()
    start = time.perf_counter()
    new = generate_exactly(model, input_ids, torch.ones_like(input_ids), workload.new_tokens)
    wall = time.perf_counter() - start - sum(evicting)
    return EngineResult(
        engine="",
        wall_seconds=wall,
        generated_tokens=new.numel(),
        passes=len(pass_seconds),
        pass_seconds=pass_seconds,
        storage_bytes_read=storage_read_bytes() - before,
        token_ids=new.tolist(),
        extra={"eviction_seconds": sum(evicting)},
    )


def run_accelerate(model_dir: Path, budget: int, workload: Workload, scratch: Path) -> EngineResult:
    """transformers + Accelerate big-model inference: layers on "cpu" up to the budget, the rest on "disk"."""
    import torch
    from transformers import AutoModelForCausalLM

    offload_dir = scratch / "accelerate_offload"
    offload_dir.mkdir(parents=True, exist_ok=True)
    for stale in files_under(offload_dir):
        stale.unlink()
    baseline = rss_bytes()
    before = storage_read_bytes()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        device_map="auto",
        max_memory={"cpu": budget},
        offload_folder=str(offload_dir),
        dtype=torch.bfloat16,
    )
    model.eval()
    load_seconds = time.perf_counter() - start
    load_read = storage_read_bytes() - before
    device_map = dict(getattr(model, "hf_device_map", {}))  # absent when all fits on "cpu"
    offloaded = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "meta")
    result = hf_generate(model, workload, model.config.vocab_size, files_under(model_dir, offload_dir))
    layer_devices = [v for k, v in device_map.items() if ".layers." in k] or ["cpu"] * model.config.num_hidden_layers
    result.engine = "accelerate"
    result.load_seconds, result.load_bytes_read = load_seconds, load_read
    result.streamed_bytes_per_pass = offloaded
    result.layers_resident = sum(d == "cpu" for d in layer_devices)
    result.layers_streamed = sum(d == "disk" for d in layer_devices)
    result.peak_rss_bytes, result.baseline_rss_bytes = peak_rss_bytes(), baseline
    result.extra |= {
        "device_map": {k: str(v) for k, v in device_map.items()},
        "offload_folder_files": len(files_under(offload_dir)),
        "offload_folder_bytes": sum(p.stat().st_size for p in files_under(offload_dir)),
    }
    return result


def zero_config(nvme_dir: Path, hidden: int, largest_param: int, budget_bytes: int) -> dict:
    """DeepSpeed's published ZeRO-Inference configuration (DeepSpeedExamples, inference/huggingface/zero_inference,
    run_model.py with --disk-offload) for this model: parameter persistence threshold of the hidden size, prefetch
    bucket and live parameters of 2 x hidden^2, parameters offloaded to NVMe through aio with its queue settings.
    Two choices scale it to this machine, named in the report: the swap buffers hold the largest parameter (the
    example's 2 G elements are sized for OPT-30B and up; 5 such buffers would be 20 GB here), and buffers are
    pinned only where CUDA can pin them. `max_in_cpu` carries the weight budget, but DeepSpeed reads it only in
    its optimizer's parameter groups: an inference engine (no optimizer) keeps no more weights in RAM for it."""
    import torch

    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": 2 * hidden * hidden,
            "stage3_param_persistence_threshold": hidden,
            "stage3_max_live_parameters": 2 * hidden * hidden,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(nvme_dir),
                "pin_memory": torch.cuda.is_available(),
                "buffer_count": 5,
                "buffer_size": largest_param,
                "max_in_cpu": budget_bytes // 2,  # bf16 elements
            },
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,  # the example's thread_count, under its current name
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }


def run_zero(model_dir: Path, budget: int, workload: Workload, scratch: Path) -> EngineResult:
    """DeepSpeed ZeRO-Inference: ZeRO-3 with every parameter offloaded to NVMe, CPU accelerator, gloo, 1 rank."""
    for key, value in {
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        os.environ.setdefault(key, value)
    import deepspeed
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from offload.tiers.io.aio import aio_unavailable

    if why := aio_unavailable():  # builds the op where ours finds it ($TORCH_EXTENSIONS_DIR), so DeepSpeed loads it
        raise RuntimeError(f"ZeRO-Inference offloads to NVMe through DeepSpeed's aio op: {why}")

    nvme_dir = scratch / "zero_nvme"
    nvme_dir.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(model_dir)
    ds_config = zero_config(nvme_dir, config.hidden_size, config.vocab_size * config.hidden_size, budget)
    deepspeed.init_distributed(dist_backend="gloo")
    hf_ds = HfDeepSpeedConfig(ds_config)  # must be alive while from_pretrained runs: it partitions at load
    baseline = rss_bytes()
    before = storage_read_bytes()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
    engine.module.eval()
    load_seconds = time.perf_counter() - start
    load_read = storage_read_bytes() - before
    params = sum(p.ds_numel * 2 for p in engine.module.parameters())
    result = hf_generate(engine.module, workload, config.vocab_size, files_under(model_dir))
    del hf_ds
    result.engine = "zero"
    result.load_seconds, result.load_bytes_read = load_seconds, load_read
    result.streamed_bytes_per_pass = params
    result.layers_streamed = config.num_hidden_layers
    result.peak_rss_bytes, result.baseline_rss_bytes = peak_rss_bytes(), baseline
    result.extra |= {"nvme_files": len(files_under(nvme_dir)), "ds_config": ds_config}
    return result


WORKERS: dict[str, Callable[[Path, int | None, Workload, Path], EngineResult]] = {
    "ours": run_ours,
    "resident": run_ours,
    "ours-capped": run_ours_capped,  # benchmarks/same_memory.py: the budget is the cap on the whole process
    "accelerate": run_accelerate,
    "zero": run_zero,
}
