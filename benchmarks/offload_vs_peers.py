"""Our weight streaming vs Accelerate disk offload vs DeepSpeed ZeRO-Inference: one checkpoint, budget and workload.

    python benchmarks/offload_vs_peers.py [--work-dir ~/.cache/offload/bench] [--engines ours,accelerate,zero]
                                          [--layers 22] [--budget 600MB]

Builds (once, in the work dir) a random bf16 Llama checkpoint shaped like TinyLlama-1.1B, then runs 8 prompts
of 128 random token ids, 16 new tokens each, greedy, through every engine, each in its own subprocess so
that its storage reads (/proc/self/io read_bytes) and peak RSS are its own. The page cache is dropped before
every run, and engines that read through it get the checkpoint's pages evicted before every forward pass.
It also measures the raw O_DIRECT sequential bandwidth of the checkpoint files and, from a run of our engine
with every weight resident, the physical limit of the workload: per pass, max(streamed bytes / raw
bandwidth, that pass's compute time). Prints a table and the goals, and writes
benchmarks/results/offload_vs_peers.json with the machine it ran on. GB/s is 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_common import ensure_checkpoint, generate_exactly, machine, timestamp, write_report

RESULTS = Path(__file__).parent / "results" / "offload_vs_peers.json"
ENGINES = ("ours", "accelerate", "zero")
MiB = 1 << 20
SHAPE = {  # TinyLlama-1.1B's shape; the layer count comes from --layers
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
GOALS = {
    "ours_wall_vs_limit": 1.25,  # ours wall <= 1.25 x the physical limit
    "speedup_vs_accelerate": 4.0,  # tokens/s
    "speedup_vs_zero": 1.5,
    "overlap_efficiency": 0.8,
    "read_fraction_of_raw": 0.85,
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
    wall_seconds: float = 0.0  # the generate call
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


def evict(paths: Iterable[Path]) -> None:
    """Drop the files' pages from the page cache (written pages are synced first, or they would stay)."""
    from tiers.io.base import evict_page_cache

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


def peak_rss_bytes() -> int:
    """This process's own peak RSS. Not ru_maxrss: Linux carries that across fork and exec, so a worker would
    report its parent's peak (the parent builds the checkpoint in memory) whenever that is higher."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- raw bandwidth -----------------------------------------------------------------------------------------


def raw_bandwidth(files: list[Path], request: int = 64 * MiB, depth: int = 4, repeats: int = 3) -> dict:
    """O_DIRECT sequential reads of every file through our pread backend, cold; median and runs in GB/s."""
    from tiers.io.backends import make_backend
    from tiers.io.base import aligned_buffer

    rates = []
    for _ in range(repeats):
        drop_page_cache(files)
        backend = make_backend("pread")
        bufs = [aligned_buffer(request) for _ in range(depth)]
        start = time.perf_counter()
        done = 0
        for path in files:
            size = backend.file_size(path)
            in_flight = []
            for i, offset in enumerate(range(0, size, request)):
                if len(in_flight) == depth:
                    done += in_flight.pop(0).wait().numel()
                in_flight.append(backend.submit(path, offset, min(request, size - offset), bufs[i % depth]))
            done += sum(r.wait().numel() for r in in_flight)
        rates.append(done / (time.perf_counter() - start) / 1e9)
        direct = all(backend.is_direct(p) for p in files)
        backend.close()
    return {"median_gbps": statistics.median(rates), "runs_gbps": rates, "o_direct": direct, "bytes": done}


# ---- the engines (each runs in its own subprocess) ---------------------------------------------------------


def timed_calls(obj: object, name: str, times: list[float]) -> None:
    """Wrap obj.name so that each call's duration is appended to `times` (seconds)."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    setattr(obj, name, wrapper)


def run_ours(model_dir: Path, budget: int | None, workload: Workload, scratch: Path) -> EngineResult:
    """Our engine. budget None: every weight resident (the compute reference of the physical limit)."""
    import torch

    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams
    from offload.model.loader import load_spec
    from tiers.kv import KVCache

    spec, _ = load_spec(model_dir)
    block = 16
    blocks = workload.prompts * -(-workload.max_tokens // block)
    kv_bytes = blocks * KVCache.block_bytes(spec.num_layers, block, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    device_memory = None if budget is None else budget + kv_bytes
    config = EngineConfig(
        device_memory=device_memory,
        kv_cache_bytes=kv_bytes,
        io_backend="pread",
        dtype="bfloat16",
        block_size=block,
        max_num_seqs=workload.prompts,
        # every prompt in one prefill step: one pass over the weights, as each peer's generate() makes
        max_step_tokens=max(4096, workload.prompts * workload.prompt_tokens),
    )
    before = storage_read_bytes()
    start = time.perf_counter()
    llm = LLM(model_dir, config)
    load_seconds = time.perf_counter() - start
    pass_seconds: list[float] = []
    timed_calls(llm.engine, "step", pass_seconds)
    params = SamplingParams(max_new_tokens=workload.new_tokens, ignore_eos=True)
    prompts = workload.prompt_ids(spec.vocab_size)
    loaded = storage_read_bytes()
    out = llm.generate_ids(prompts, params)
    read = storage_read_bytes() - loaded
    stats, placement, tiers = llm.stats, llm.placement, llm.policy.layer_tiers
    return EngineResult(
        engine="ours" if budget is not None else "ours (all resident)",
        wall_seconds=stats.wall_seconds,
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
            "device_memory": device_memory,
            "kv_cache_bytes": kv_bytes,
            "kv_blocks": placement.kv_blocks,
            "device_peak_bytes": placement.device_peak,
            "resident_weight_bytes": placement.weight_bytes,
            "ring_slots": llm.policy.ring_slots,
            "engine_bytes_read": stats.bytes_read,
            "read_seconds": stats.read_seconds,
            "stall_seconds": stats.stall_seconds,
            "compute_seconds": stats.compute_seconds,
            "prefill_seconds": stats.prefill_seconds,
            "decode_seconds": stats.decode_seconds,
            "read_gbps": stats.read_gbps,
            "overlap_efficiency": stats.overlap_efficiency,
            "preemptions": stats.preemptions,
            "micro_batch_tokens": config.micro_batch_tokens,
            "layer_tiers": list(tiers),
        },
    )


def hf_generate(model, workload: Workload, vocab: int, evict_paths: list[Path]) -> EngineResult:
    """Greedy generate with a transformers model; evicts `evict_paths` before every forward pass and times each."""
    import torch

    pass_seconds: list[float] = []
    started: list[float] = []

    def pre_hook(module, args, kwargs):
        evict(evict_paths)
        started.append(time.perf_counter())

    def post_hook(module, args, kwargs, output):
        pass_seconds.append(time.perf_counter() - started[-1])

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    model.register_forward_hook(post_hook, with_kwargs=True)
    input_ids = torch.tensor(workload.prompt_ids(vocab))
    evict(evict_paths)
    before = storage_read_bytes()
    start = time.perf_counter()
    new = generate_exactly(model, input_ids, torch.ones_like(input_ids), workload.new_tokens)
    wall = time.perf_counter() - start
    return EngineResult(
        engine="",
        wall_seconds=wall,
        generated_tokens=new.numel(),
        passes=len(pass_seconds),
        pass_seconds=pass_seconds,
        storage_bytes_read=storage_read_bytes() - before,
        token_ids=new.tolist(),
    )


def run_accelerate(model_dir: Path, budget: int, workload: Workload, scratch: Path) -> EngineResult:
    """transformers + Accelerate big-model inference: layers on "cpu" up to the budget, the rest on "disk"."""
    import torch
    from transformers import AutoModelForCausalLM

    offload_dir = scratch / "accelerate_offload"
    offload_dir.mkdir(parents=True, exist_ok=True)
    for stale in files_under(offload_dir):
        stale.unlink()
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
    result.peak_rss_bytes = peak_rss_bytes()
    result.extra = {
        "device_map": {k: str(v) for k, v in device_map.items()},
        "offload_folder_files": len(files_under(offload_dir)),
        "offload_folder_bytes": sum(p.stat().st_size for p in files_under(offload_dir)),
    }
    return result


def zero_config(nvme_dir: Path, buffer_elements: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(nvme_dir),
                "pin_memory": False,
                "buffer_count": 5,
                "buffer_size": buffer_elements,
                "max_in_cpu": 0,
            },
            "stage3_param_persistence_threshold": 0,
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
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

    nvme_dir = scratch / "zero_nvme"
    nvme_dir.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(model_dir)
    ds_config = zero_config(nvme_dir, config.vocab_size * config.hidden_size)
    deepspeed.init_distributed(dist_backend="gloo")
    hf_ds = HfDeepSpeedConfig(ds_config)  # must be alive while from_pretrained runs: it partitions at load
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
    result.peak_rss_bytes = peak_rss_bytes()
    result.extra = {"nvme_files": len(files_under(nvme_dir)), "ds_config": ds_config}
    return result


WORKERS: dict[str, Callable[[Path, int | None, Workload, Path], EngineResult]] = {
    "ours": run_ours,
    "resident": run_ours,
    "accelerate": run_accelerate,
    "zero": run_zero,
}


def worker_main(args: argparse.Namespace) -> None:
    budget = None if args.worker == "resident" else args.budget_bytes
    try:
        result = WORKERS[args.worker](args.model, budget, Workload(prompts=args.prompts), args.work_dir)
    except Exception as exc:  # a peer that cannot run here is a result, not a crash of the benchmark
        traceback.print_exc()
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result = EngineResult(engine=args.worker, status=f"failed: {type(exc).__name__}: {reason}"[:300])
    args.result.write_text(json.dumps(asdict(result)))


def run_worker(name: str, model_dir: Path, args: argparse.Namespace, cache_paths: list[Path]) -> EngineResult:
    """Drop the page cache, run one engine in a fresh interpreter, read back its result."""
    out = args.work_dir / f"result-{name}.json"
    out.unlink(missing_ok=True)
    method = drop_page_cache(cache_paths)
    cmd = [sys.executable, __file__, "--worker", name, "--model", str(model_dir), "--result", str(out)]
    cmd += ["--work-dir", str(args.work_dir), "--budget", args.budget, "--prompts", str(args.prompts)]
    print(f"running {name} (page cache: {method}) ...", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(f"  {name} done in {time.perf_counter() - start:.0f} s", flush=True)
    if not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return EngineResult(engine=name, status=f"failed: {tail[0]}"[:300])
    result = EngineResult(**json.loads(out.read_text()))
    if result.status != "ok":
        (args.work_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    result.extra["page_cache"] = method
    return result


# ---- the report --------------------------------------------------------------------------------------------


def physical_limit(streamed_bytes: int, raw_gbps: float, compute_seconds: list[float]) -> float:
    """Seconds: every pass takes at least its reads at raw bandwidth and its compute with all weights resident."""
    io = streamed_bytes / (raw_gbps * 1e9)
    return sum(max(io, c) for c in compute_seconds)


def goals(results: dict[str, EngineResult], raw_gbps: float, limit: float | None) -> list[tuple[str, str, str]]:
    """(goal, measured, PASS / FAIL / n/a) for each goal."""
    ours = results.get("ours")
    ok = {k: r for k, r in results.items() if r.status == "ok"}
    rows = []

    def check(goal: str, value: float | None, target: float, higher: bool, fmt: str = "{:.2f}") -> None:
        if value is None:
            rows.append((goal, "-", "n/a"))
            return
        passed = value >= target if higher else value <= target
        rows.append((goal, fmt.format(value), "PASS" if passed else "FAIL"))

    have_ours = ours is not None and "ours" in ok
    ratio = ours.wall_seconds / limit if have_ours and limit else None
    check(f"ours wall <= {GOALS['ours_wall_vs_limit']}x physical limit", ratio, GOALS["ours_wall_vs_limit"], False)
    for peer, key in (("accelerate", "speedup_vs_accelerate"), ("zero", "speedup_vs_zero")):
        speedup = ours.tokens_per_second / ok[peer].tokens_per_second if have_ours and peer in ok else None
        check(f"tokens/s >= {GOALS[key]}x {peer}", speedup, GOALS[key], True)
    overlap = ours.extra["overlap_efficiency"] if have_ours else None
    check(f"overlap efficiency >= {GOALS['overlap_efficiency']}", overlap, GOALS["overlap_efficiency"], True)
    fraction = ours.extra["read_gbps"] / raw_gbps if have_ours else None
    target = GOALS["read_fraction_of_raw"]
    check(f"read bandwidth >= {target:.0%} of raw", fraction, target, True)
    return rows


def table(results: dict[str, EngineResult], raw: dict, limit: float | None) -> str:
    ours = results.get("ours")
    head = (
        f"{'engine':<20} {'wall s':>8} {'tok/s':>7} {'ours is':>8} {'layers res/str':>14} {'read GB':>8} "
        f"{'expect GB':>9} {'read GB/s':>9} {'overlap':>7} {'peak RSS MB':>11}"
    )
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        if r.status != "ok":
            lines.append(f"{name:<20} {r.status}")
            continue
        vs = ours.tokens_per_second / r.tokens_per_second if ours and ours.status == "ok" else float("nan")
        gbps = f"{r.extra['read_gbps']:.3f}" if "read_gbps" in r.extra else "-"
        overlap = f"{r.extra['overlap_efficiency']:.2f}" if "overlap_efficiency" in r.extra else "-"
        lines.append(
            f"{r.engine:<20} {r.wall_seconds:8.2f} {r.tokens_per_second:7.2f} {vs:7.2f}x "
            f"{f'{r.layers_resident}/{r.layers_streamed}':>14} {r.storage_bytes_read / 1e9:8.3f} "
            f"{r.expected_bytes / 1e9:9.3f} {gbps:>9} {overlap:>7} {r.peak_rss_bytes / 1e6:11.0f}"
        )
    runs = ", ".join(f"{x:.3f}" for x in raw["runs_gbps"])
    direct = "O_DIRECT" if raw["o_direct"] else "buffered: the filesystem refused O_DIRECT"
    lines.append(f"raw sequential read ({direct}): {raw['median_gbps']:.3f} GB/s median of {runs}")
    if limit and ours and ours.status == "ok":
        lines.append(
            f"physical limit: {limit:.2f} s over {ours.passes} passes; ours {ours.wall_seconds:.2f} s = "
            f"{ours.wall_seconds / limit:.2f}x the limit"
        )
    if ours and ours.status == "ok":
        x = ours.extra
        lines.append(
            f"ours: device budget {x['device_memory']} B (weights budget + KV cache of {x['kv_cache_bytes']} B), "
            f"device peak {x['device_peak_bytes']} B, {ours.streamed_bytes_per_pass} B streamed per pass, "
            f"stall {x['stall_seconds']:.2f} s, preemptions {x['preemptions']}"
        )
    return "\n".join(lines)


def token_agreement(results: dict[str, EngineResult]) -> dict[str, float]:
    """Fraction of generated tokens equal to ours, position by position (bf16 numerics differ; a sanity check)."""
    ours = results.get("ours")
    if not ours or ours.status != "ok":
        return {}
    flat = [t for seq in ours.token_ids for t in seq]
    out = {}
    for name, r in results.items():
        if name != "ours" and r.status == "ok":
            other = [t for seq in r.token_ids for t in seq]
            out[name] = sum(a == b for a, b in zip(flat, other, strict=False)) / max(len(flat), 1)
    return out


def main_run(args: argparse.Namespace) -> None:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"--engines: {bad[0]!r} is not one of {', '.join(ENGINES)}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = peers_checkpoint(args.work_dir, args.layers)
    checkpoint = sorted(model_dir.glob("*.safetensors"))
    cache_paths = files_under(model_dir, args.work_dir / "accelerate_offload")
    raw = raw_bandwidth(checkpoint)
    names = (["resident"] if "ours" in engines else []) + engines
    results = {n: run_worker(n, model_dir, args, cache_paths) for n in names}
    resident = results.pop("resident", None)
    ours = results.get("ours")
    limit = None
    if ours and resident and ours.status == resident.status == "ok":
        limit = physical_limit(ours.streamed_bytes_per_pass, raw["median_gbps"], resident.pass_seconds)
    shown = results | ({"ours (all resident)": resident} if resident else {})
    print()
    print(table(shown, raw, limit))
    print()
    goal_rows = goals(results, raw["median_gbps"], limit)
    for goal, value, verdict in goal_rows:
        print(f"{verdict:<5} {goal}: {value}")
    agreement = token_agreement(results)
    if agreement:
        print("greedy tokens equal to ours: " + ", ".join(f"{k} {v:.0%}" for k, v in agreement.items()))
    report = {
        "benchmark": "offload_vs_peers",
        "date": timestamp(),
        "machine": machine(args.work_dir),
        "checkpoint": {
            "dir": str(model_dir),
            "layers": args.layers,
            **SHAPE,
            "dtype": "bfloat16",
            "bytes": sum(p.stat().st_size for p in checkpoint),
        },
        "budget_bytes": args.budget_bytes,
        "workload": asdict(Workload(prompts=args.prompts)),
        "raw_read": raw,
        "physical_limit_seconds": limit,
        "results": {k: asdict(r) | {"tokens_per_second": r.tokens_per_second} for k, r in shown.items()},
        "goals": [{"goal": g, "measured": v, "verdict": x} for g, v, x in goal_rows],
        "token_agreement_with_ours": agreement,
    }
    write_report(args.out, report)


def main() -> None:
    from offload.common.sizes import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"))
    parser.add_argument("--engines", default=",".join(ENGINES), help="a subset of ours,accelerate,zero")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--budget", default="600MB", help="RAM for weights (the KV cache comes on top)")
    parser.add_argument("--prompts", type=int, default=8, help="requests in the batch")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work_dir = args.work_dir.expanduser()
    args.budget_bytes = parse_size(args.budget, "--budget")
    if args.worker:
        worker_main(args)
    else:
        main_run(args)


if __name__ == "__main__":
    main()
