"""`offload probe`: measure this machine into a HardwareProfile, through the engine's own I/O and compute paths
(the compute rates are offload.planner.measured_rates).

- disk: a test file written with O_DIRECT and fsync, dropped from the page cache, then read back cold through each
  backend (offload.tiers.io: the pread pool, and aio where its op is built, which the probe never waits to do) in
  large extents, several in flight, into the buffers the engine's ring reads into (on a CPU-only machine
  page-locked by the aio op where RLIMIT_MEMLOCK allows); io_backend="auto" takes the faster; the file is removed.
- memory bandwidth: a large tensor copy, counted as bytes read + bytes written per second.
- matmul: [rows, k] x [k, n] through offload.kernels.linear per dtype, the median of a few runs after a warm-up;
  every row count goes into matmul_curve, the largest one's rate is matmul_flops. On a CPU also bfloat16 rows, up to
  a few, through the kernels (int4; GGUF Q4_0, a decode step's on AMX tiles too): int4_, gguf_(decode_)matmul_curve.
- the rest of a layer of hidden size k, through the engine's own functions: its non-GEMM work at each row count
  (RMS norms, rotary, KV write, SiLU * up, residual adds; elementwise_curve), causal attention of whole prompts of
  a few lengths (prefill_attention_curve) and one decode query per sequence over paged caches of a few lengths
  (decode_attention_curve). On a CPU these run far below the memory roofline, and a cost model that priced them
  there predicted long prefills too fast. And the engine's Llama layer for one token of a tiny model
  (layer_floor), and on each row count as prompts of up to 128 tokens (layer_floor_curve): what a layer costs
  however small, where dispatch, not bytes, sets the time.
- on CUDA the same on the GPU, plus pinned host-to-device and device-to-host copies; on a CPU-only machine the
  device is the host's RAM (device_kind "cpu", links 0).
- serving: what a step of `offload serve` costs beyond its layers, per step, per stream and per request, measured
  on the engine's own server (offload/planner/served_step.py), for latency predictions at a request rate.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.common.errors import OffloadError
from offload.common.hardware import CURVES, ComputeUnit, HardwareProfile
from offload.common.paths import cache_dir
from offload.common.sizes import format_size, parse_size
from offload.kernels import timing
from offload.planner.disk import SMALL_DEPTH, SMALL_READ, SMALL_SPAN, measure_disk
from offload.planner.measured_rates import (
    MIN_REPEATS,
    layer_shape,
    measure_attention,
    measure_copy,
    measure_elementwise,
    measure_layer_floor,
    measure_layer_floor_curve,
    measure_links,
    measure_matmul,
    measure_quantized_matmul,
)
from offload.planner.profile_text import format_profile
from offload.planner.profiles import load_profile, local_profile_path, save_profile
from offload.planner.served_step import STREAMS, measure_served_step
from offload.tiers.io.base import ALIGN

MiB = 1 << 20
PROBE_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZED_ROWS = 64  # quantized products measured below it (codes decoded in registers; above, kernels/choice.py's)


@dataclass(frozen=True, slots=True)
class ProbeSizes:
    """How much the probe moves and multiplies; the defaults take under a minute on two cores."""

    disk_bytes: int = 1 << 30  # test file, rounded up to ALIGN
    extent_bytes: int = 64 * MiB  # bytes per write and per read request
    depth: int = 4  # read requests in flight
    copy_bytes: int = 512 * MiB  # size of the tensor copied to measure memory bandwidth
    link_bytes: int = 256 * MiB  # size of each host<->device copy (CUDA only)
    k: int = 4096  # inner dimension of the measured products
    n: int = 4096  # output features of the measured products
    rows: tuple[int, ...] = (1, 8, 32, 128, 512, 2048)  # ascending
    head_dim: int = 128  # attention: k // head_dim query heads, a quarter as many K/V heads
    attention_tokens: tuple[int, ...] = (16, 128, 512, 2048)  # prompt and cache lengths measured, ascending
    decode_seqs: int = 32  # sequences of each measured decode step
    # bytes of weight copies each product cycles through: more than the caches hold, so small-row rates include
    # streaming the weight from memory, as in the engine, instead of a cache-resident repeat
    weight_pool_bytes: int = 1 << 30
    min_seconds: float = 0.2  # each rate is timed over at least this long (and at least MIN_REPEATS runs)
    # tokens each stream of the served-engine measurement runs (offload/planner/served_step.py); 0: not measured
    served_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("disk_bytes", "extent_bytes", "depth", "copy_bytes", "link_bytes", "k", "n"):
            if getattr(self, name) < 1:
                raise OffloadError(f"{name.replace('_', '-')}: must be positive, got {getattr(self, name)}")
        for name in ("weight_pool_bytes", "min_seconds"):
            if getattr(self, name) < 0:
                raise OffloadError(f"{name.replace('_', '-')}: must not be negative, got {getattr(self, name)}")
        if self.extent_bytes % ALIGN:
            raise OffloadError(f"extent-bytes: must be a multiple of {ALIGN}, got {self.extent_bytes}")
        for name in ("rows", "attention_tokens"):
            sizes = getattr(self, name)
            if not sizes or sizes[0] < 1 or list(sizes) != sorted(set(sizes)):
                raise OffloadError(f"{name.replace('_', '-')}: must be positive and ascending, got {sizes}")
        if self.head_dim < 1 or self.k % (4 * self.head_dim):
            raise OffloadError(f"k: must be a multiple of 4 x head-dim ({4 * self.head_dim}), got {self.k}")
        if self.decode_seqs < 1:
            raise OffloadError(f"decode-seqs: must be positive, got {self.decode_seqs}")
        if self.served_tokens and self.served_tokens < 4:
            raise OffloadError(f"served-tokens: must be 0 (not measured) or at least 4, got {self.served_tokens}")

    @classmethod
    def quick(cls) -> ProbeSizes:
        """Sizes for `--quick`: about 20 s on two cores (about 10 of them serving the one-layer model)."""
        return cls(
            256 * MiB,
            copy_bytes=256 * MiB,
            link_bytes=64 * MiB,
            k=2048,
            n=2048,
            weight_pool_bytes=512 * MiB,
            min_seconds=0.05,
            head_dim=64,
            attention_tokens=(16, 128, 512),
        )

    def within(self, ram: int) -> ProbeSizes:
        """These sizes with the buffers they allocate (the copied tensor twice, the weight pool, the disk test's
        reads in flight) each at most an eighth of `ram` bytes, so that a probe on a small machine is not killed
        for memory; a smaller copy or pool measures the same rates less surely."""
        eighth = max(ram // 8, 16 * MiB)
        extent = max(min(self.extent_bytes, eighth // self.depth) // ALIGN * ALIGN, ALIGN)
        return dataclasses.replace(
            self,
            copy_bytes=min(self.copy_bytes, eighth // 2),
            weight_pool_bytes=min(self.weight_pool_bytes, eighth),
            extent_bytes=extent,
        )


def probe(
    directory: str | Path, sizes: ProbeSizes | None = None, log: Callable[[str], None] | None = None
) -> HardwareProfile:
    """Measure this machine; `directory` is on the drive whose bandwidth to measure. `log` hears each stage."""
    sizes = sizes or ProbeSizes()
    say = log or (lambda _: None)
    directory = Path(directory).expanduser()
    say(f"disk: writing and reading {format_size(sizes.disk_bytes)} in {directory}")
    disk = measure_disk(directory, sizes.disk_bytes, sizes.extent_bytes, sizes.depth)
    cpu = torch.device("cpu")
    say("host: memory bandwidth")
    host_bandwidth = measure_copy(cpu, sizes.copy_bytes, sizes.min_seconds)
    host = _compute_unit(cpu, _total_ram(), host_bandwidth, sizes, PROBE_DTYPES, say)
    layer = layer_shape(sizes.k, sizes.head_dim)
    what = [
        f"disk: a {format_size(sizes.disk_bytes)} file in {directory} written with O_DIRECT + fsync, read back cold "
        f"through {' and '.join(disk.by_backend)} in {format_size(sizes.extent_bytes)} requests, "
        f"{sizes.depth} in flight, the fastest's rate as read_gbps{f' ({disk.missing})' if disk.missing else ''}"
        + ("" if disk.direct else " (buffered: the filesystem refused O_DIRECT; pages evicted first)")
        + f"; small_read_gbps: {format_size(SMALL_READ)} reads of its first {format_size(SMALL_SPAN)} shuffled, "
        f"{SMALL_DEPTH} in flight",
        f"memory: a {format_size(sizes.copy_bytes)} tensor copy, bytes read + written per second",
        f"matmul: offload.kernels.linear on [rows, {sizes.k}] x [{sizes.k}, {sizes.n}], median of >= {MIN_REPEATS} "
        f"runs after a warm-up, weights cycled through {format_size(sizes.weight_pool_bytes)} of copies, matmul_tflops "
        f"at {sizes.rows[-1]} rows, {torch.get_num_threads()} torch threads",
        f"rest of a layer: hidden {sizes.k}, {layer.heads} heads of {sizes.head_dim} ({layer.kv_heads} K/V heads), "
        f"MLP {layer.intermediate}; prompts of {sizes.rows[-1]} tokens in all, {sizes.decode_seqs} decode sequences",
    ]
    names = [_cpu_model()]
    if torch.cuda.is_available():
        gpu = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(gpu)
        names.insert(0, props.name)
        say(f"device: {props.name} memory bandwidth")
        device_bandwidth = measure_copy(gpu, sizes.copy_bytes, sizes.min_seconds)
        dtypes = tuple(d for d in PROBE_DTYPES if d != "bfloat16" or torch.cuda.is_bf16_supported())
        device = _compute_unit(gpu, props.total_memory, device_bandwidth, sizes, dtypes, say)
        say("links: pinned host<->device copies")
        host_to_device, device_to_host = measure_links(gpu, sizes.link_bytes, sizes.min_seconds)
        kind = "cuda"
        what.append(f"links: pinned copies of {format_size(sizes.link_bytes)} each way")
    else:
        device, kind, host_to_device, device_to_host = host, "cpu", 0.0, 0.0
    served = None
    if sizes.served_tokens:
        dtype = "bfloat16" if "bfloat16" in device.matmul_flops else "float32"
        say(f"serving: `offload serve` of a one-layer model, {dtype}, streamed to 1 and {STREAMS} clients at once")
        try:
            served = measure_served_step(dtype, sizes.served_tokens, sizes.min_seconds)
            what.append(
                f"serving: offload serve of a one-layer model in {dtype} streaming {sizes.served_tokens} tokens to 1 "
                f"and {STREAMS} clients on this machine, less the layer"
            )
        except OffloadError as exc:  # the rest of the profile stands; latency predictions then leave this out
            say(f"serving: not measured ({exc})")
    return HardwareProfile(
        name=f"local ({', '.join(names)})",
        device_kind=kind,
        device=device,
        host=host,
        host_to_device=host_to_device,
        device_to_host=device_to_host,
        disk_read=disk.read,
        disk_write=disk.write,
        source=f"offload probe {time.strftime('%Y-%m-%d %H:%M %Z')}; " + "; ".join(what),
        disk_read_by_backend=disk.by_backend,
        disk_read_small=disk.small_read,
        served_step=served,
    )


def run_probe(out: str | None, directory: str | None, disk_bytes: str | None, quick: bool) -> Path:
    """`offload probe`: measure, print the table, save the profile to `out` (default: the cache); returns the path."""
    cache = cache_dir()
    if directory is None:
        directory = cache
        cache.mkdir(parents=True, exist_ok=True)
    sizes = ProbeSizes.quick() if quick else ProbeSizes()
    if disk_bytes is not None:
        if (size := parse_size(disk_bytes, "--disk-bytes")) == 0:
            raise OffloadError("--disk-bytes: must be positive")
        sizes = dataclasses.replace(sizes, disk_bytes=size)
    path = Path(out).expanduser() if out is not None else local_profile_path()
    try:  # fail before a minute of measuring, not after
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OffloadError(f"{path}: cannot write the profile ({exc.strerror})") from None
    if not os.access(path.parent, os.W_OK):
        raise OffloadError(f"{path}: cannot write the profile (its directory is not writable)")
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say("cpu kernels: each native kernel timed against torch's path again (kept for the engine; the GEMMs take them)")
    timing.retime()
    profile = probe(directory, sizes, log=say)
    save_profile(profile, path)
    print(f"saved {path}\n")
    print(format_profile(profile))
    return path


def remeasure(
    profile: HardwareProfile,
    dtypes: tuple[str, ...] = ("bfloat16",),
    sizes: ProbeSizes | None = None,
    disk_dir: str | Path | None = None,
    served: bool = False,
    disk_reads: int = 1,
) -> HardwareProfile:
    """`profile` with this machine's memory bandwidth and `dtypes` GEMM rates measured again now (quick sizes,
    a few seconds), its disk too when `disk_dir` is given (the median of `disk_reads` tests, by read rate), and the
    served engine's step costs when `served` (in the first of `dtypes`, about 10 s); the rest kept. For a benchmark
    that predicts each of its points: a shared VM's compute speed drifts by up to 2x within an hour (its virtual
    disk's by a third), and a profile measured at the start then judges the cost model by the drift. CPU-only
    profiles: on CUDA the device, not the host, would need measuring."""
    if profile.device_kind != "cpu":
        raise OffloadError(f"remeasure measures CPU-only profiles; {profile.name!r} is {profile.device_kind}")
    sizes = sizes or ProbeSizes.quick()
    cpu = torch.device("cpu")
    bandwidth = measure_copy(cpu, sizes.copy_bytes, sizes.min_seconds)
    fresh = _compute_unit(cpu, profile.host.memory, bandwidth, sizes, dtypes, lambda _: None)
    old = profile.host
    unit = dataclasses.replace(
        fresh,
        matmul_flops={**old.matmul_flops, **fresh.matmul_flops},
        **{key: {**getattr(old, key), **getattr(fresh, key)} for key in (*CURVES, "layer_floor")},
    )
    profile = dataclasses.replace(profile, device=unit, host=unit)
    if disk_dir is not None:
        tests = (measure_disk(disk_dir, sizes.disk_bytes, sizes.extent_bytes, sizes.depth) for _ in range(disk_reads))
        disk = sorted(tests, key=lambda d: d.read)[disk_reads // 2]
        profile = dataclasses.replace(
            profile,
            disk_read=disk.read,
            disk_write=disk.write,
            disk_read_by_backend=disk.by_backend,
            disk_read_small=disk.small_read,
        )
    if served:
        step = measure_served_step(dtypes[0], sizes.served_tokens or ProbeSizes.served_tokens, sizes.min_seconds)
        profile = dataclasses.replace(profile, served_step=step)
    return profile


def local_profile() -> HardwareProfile:
    """This machine's profile: the one `offload probe` saved, else a quick probe now (saved for next time)."""
    path = local_profile_path()
    if path.exists():
        profile = load_profile(path)
        if not profile.device.layer_floor:
            print(
                f"note: {path} comes from an older `offload probe` without the rest-of-layer rates (attention, "
                "elementwise work, the layer floor): predictions price that work at memory speed and the GEMM rate; "
                "run `offload probe` again to measure them",
                file=sys.stderr,
            )
        elif not profile.device.layer_floor_curve or profile.served_step is None:
            print(
                f"note: {path} comes from an older `offload probe` without the layer floor by rows or the served "
                "engine's own step costs: predictions leave them out; run `offload probe` again to measure them",
                file=sys.stderr,
            )
        return profile
    print(f"no hardware profile at {path}: measuring this machine (offload probe --quick) ...", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    _probe_in_a_child(path)
    return load_profile(path)


_QUICK_PROBE = """
import sys
from pathlib import Path
from offload.common.paths import cache_dir
from offload.planner.machine_budget import machine_memory
from offload.planner.probe import ProbeSizes, probe
from offload.planner.profiles import save_profile
sizes = ProbeSizes.quick().within(machine_memory().available)
save_profile(probe(cache_dir(), sizes, log=lambda line: print(line, flush=True)), Path(sys.argv[1]))
"""


def _probe_in_a_child(path: Path) -> None:
    """The quick probe, run in a process of its own, its lines relayed to stderr: the gigabyte and more its tests
    allocate goes with that process, not counted against the budget this one is about to plan (a no-flag run plans
    for the RAM left beside what it holds)."""
    import subprocess

    command = [sys.executable, "-c", _QUICK_PROBE, str(path)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        for line in child.stdout:
            print(line, end="", file=sys.stderr, flush=True)
    if child.returncode != 0 or not path.exists():
        raise OffloadError(f"the quick probe of this machine failed (exit {child.returncode}); run `offload probe`")


def _compute_unit(
    device: torch.device,
    memory: int,
    bandwidth: float,
    sizes: ProbeSizes,
    dtypes: tuple[str, ...],
    say: Callable[[str], None],
) -> ComputeUnit:
    from offload.kernels.gguf_linear import tiles_run
    from offload.kernels.linear import packing_pays

    curves, packed, elementwise, prefill, decode, floor, floor_curve = {}, {}, {}, {}, {}, {}, {}
    quantized: dict[str, dict] = {"int4": {}, "gguf": {}} | ({"gguf_decode": {}} if tiles_run() else {})
    for dtype in dtypes:
        say(f"{'host' if device.type == 'cpu' else 'device'}: {dtype} matmul, elementwise work and attention")
        curves[dtype] = measure_matmul(
            device, dtype, sizes.rows, sizes.k, sizes.n, sizes.min_seconds, sizes.weight_pool_bytes
        )
        if device.type == "cpu" and packing_pays(getattr(torch, dtype)):  # the engine packs resident layers
            packed[dtype] = measure_matmul(
                device, dtype, sizes.rows, sizes.k, sizes.n, sizes.min_seconds, sizes.weight_pool_bytes, packed=True
            )
        if device.type == "cpu" and dtype == "bfloat16":  # the rows the quantized kernels decode codes for
            few = tuple(r for r in sizes.rows if r < QUANTIZED_ROWS) or sizes.rows[:1]
            inter = layer_shape(sizes.k, sizes.head_dim).intermediate  # an MLP's two shapes
            for kind, curve in quantized.items():
                curve[dtype] = measure_quantized_matmul(
                    kind, few, sizes.k, inter, sizes.min_seconds, sizes.weight_pool_bytes
                )
        elementwise[dtype] = measure_elementwise(device, dtype, sizes.rows, sizes.k, sizes.head_dim, sizes.min_seconds)
        prefill[dtype], decode[dtype] = measure_attention(
            device,
            dtype,
            sizes.attention_tokens,
            sizes.k,
            sizes.head_dim,
            sizes.rows[-1],
            sizes.decode_seqs,
            sizes.min_seconds,
        )
        floor[dtype] = measure_layer_floor(device, dtype, sizes.min_seconds)
        floor_curve[dtype] = measure_layer_floor_curve(device, dtype, sizes.rows, sizes.min_seconds)
    return ComputeUnit(
        memory=memory,
        memory_bandwidth=bandwidth,
        matmul_flops={dtype: curve[-1][1] for dtype, curve in curves.items()},
        matmul_curve=curves,
        packed_matmul_curve=packed,
        **{f"{kind}_matmul_curve": curve for kind, curve in quantized.items()},  # int4_, gguf_, gguf_decode_
        elementwise_curve=elementwise,
        prefill_attention_curve=prefill,
        decode_attention_curve=decode,
        layer_floor=floor,
        layer_floor_curve=floor_curve,
    )


def _total_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
