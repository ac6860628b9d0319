"""Hardware profiles: what a machine's memories, links, disk and matrix units can do, for the cost model.

Sizes are bytes, bandwidths bytes/s, compute FLOP/s. A profile's JSON form (GB, GB/s, TFLOP/s, so a person can
read and edit it), the shipped cards and `offload probe`'s file are offload/planner/profiles.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "float16", "bfloat16", "int8")  # what a profile may give GEMM rates for
DEVICE_KINDS = ("cuda", "cpu")
GB = 1e9  # bytes
TFLOP = 1e12  # FLOP


@dataclass(frozen=True, slots=True)
class ComputeUnit:
    """One processor's dense matmul speed and its memory."""

    memory: int  # bytes
    memory_bandwidth: float  # bytes/s, sustained
    # dtype -> sustained dense GEMM FLOP/s for large products (a published peak derated, or measured)
    matmul_flops: dict[str, float]
    # dtype -> ((rows, FLOP/s), ...) measured by `offload probe` for [rows, k] x [k, n] products, rows ascending;
    # empty for published profiles (the cost model then uses matmul_flops and the memory roofline alone)
    matmul_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # the same for weights packed for the CPU's GEMM (kernels.linear.pack_weight), as the engine keeps resident
    # layers and the head where packing pays: 1.6x faster decode steps on an AMD EPYC; empty where it does not pay
    packed_matmul_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # the same through the engine's quantized kernels on CPU rows of that dtype, FLOPs counted as the dense
    # product's: int4 codes in groups of 32 in torch's CPU packing (kernels/quant_linear.py), and GGUF Q4_0 blocks
    # read in place (kernels/gguf_linear.py); empty where not measured (the cost model then scales the dense curve
    # by the bytes). At a few rows these kernels decode codes in registers, and that, not memory, can bound them.
    int4_matmul_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    gguf_matmul_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # GGUF blocks at a decode step's rows, where they take another kernel than a prompt's (AMX tiles:
    # kernels/gguf_linear.py's TILES_FROM_ROWS); empty elsewhere (a decode step's rows then cost gguf_matmul_curve's)
    gguf_decode_matmul_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # what `offload probe` measures of the rest of a layer through the engine's own code, dtype -> ((size, rate),
    # ...) with sizes ascending; empty for published profiles (the cost model then prices this work at the memory
    # bandwidth and the GEMM rate). On a CPU these run far below the memory roofline: a float32 RMS norm or a
    # 128-token causal attention is a chain of small kernels, not one streaming pass.
    # rows -> bytes/s: a layer's non-GEMM work (norms, rotary, SiLU * up, residual adds, KV write) at that many
    # rows, as the bytes the cost model counts for it (scheduler.cost.gemm_rates.elementwise_bytes) per second
    elementwise_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # prompt tokens -> FLOP/s: causal attention of whole prompts of that length, one call per sequence
    prefill_attention_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # context tokens -> bytes/s: one query per sequence over a paged K/V cache of that length (K and V bytes read)
    decode_attention_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # dtype -> seconds one decoder layer of a tiny model takes for one token: the least any layer costs (dispatch)
    layer_floor: dict[str, float] = field(default_factory=dict)
    # rows -> rows/s: the same tiny layer on that many rows (prompts of up to 128 tokens): the least a layer costs
    # at that many rows, however small its matrices; where a profile has it, it is used instead of layer_floor
    layer_floor_curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ServedStep:
    """What a step of the served engine costs beyond its layers, as `offload probe` measured it: the engine's own
    `offload serve` running a one-layer model, streamed to clients on the same machine. Seconds."""

    step: float  # each step: scheduling, batch preparation, the head, handing deltas to the event loop
    per_stream: float  # each sequence in the step: its sampling, its delta, its SSE chunk and the client reading it
    per_prompt_token: float  # each prompt token prefilled in the step, beyond the layers (embedding, batch, blocks)
    request: float  # each request once, before its first token: the HTTP request, its checks, joining the batch


# the probe's disk reads: large extents (disk_read) and small scattered requests (disk_read_small), bytes
LARGE_READ_BYTES = 64 << 20
SMALL_READ_BYTES = 512 << 10


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    device_kind: str  # "cuda" or "cpu" (on a CPU-only machine the device is a budgeted arena in host RAM)
    device: ComputeUnit
    host: ComputeUnit
    host_to_device: float  # bytes/s over the link; 0 when the device is the host (no copy is made)
    device_to_host: float  # bytes/s; 0 when the device is the host
    # bytes/s, O_DIRECT sequential reads of large extents (measured: through the fastest backend, the one
    # io_backend="auto" then takes)
    disk_read: float
    disk_write: float  # bytes/s
    source: str  # where the numbers come from: a spec sheet and its derating, or the probe's run
    # read backend ("pread", "aio") -> bytes/s, cold reads of the same file through each, as `offload probe`
    # measured them; empty for published profiles and older probes (io_backend="auto" then uses its default rule)
    disk_read_by_backend: dict[str, float] = field(default_factory=dict)
    # bytes/s, cold reads of SMALL_READ_BYTES at scattered offsets, 8 in flight: what expert streaming's misses read
    # at (a fine-grained mixture's experts are that small); None for published profiles and older probes (disk_read)
    disk_read_small: float | None = None
    price_per_hour: float | None = None  # USD an hour of this machine costs (rent, or a purchase spread), if stated
    not_run: str | None = None  # why this engine has not run on such a machine (a profile for planning only)
    # the served engine's own cost per step, stream and request on this machine; None for published profiles (a
    # latency prediction then prices the layers and head alone)
    served_step: ServedStep | None = None


# the optional measured curves: JSON field -> (the x of a point, the unit of its rate, that unit in base units)
CURVES = {
    "matmul_curve": ("rows", "TFLOP/s", TFLOP),
    "packed_matmul_curve": ("rows", "TFLOP/s", TFLOP),
    "int4_matmul_curve": ("rows", "TFLOP/s", TFLOP),
    "gguf_matmul_curve": ("rows", "TFLOP/s", TFLOP),
    "gguf_decode_matmul_curve": ("rows", "TFLOP/s", TFLOP),
    "elementwise_curve": ("rows", "GB/s", GB),
    "prefill_attention_curve": ("tokens", "TFLOP/s", TFLOP),
    "decode_attention_curve": ("tokens", "GB/s", GB),
    "layer_floor_curve": ("rows", "thousand rows/s", 1e3),
}
