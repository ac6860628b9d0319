"""Frozen configuration: where layers live (Policy), the engine's settings and a request's sampling parameters.

The model's own shape is offload/common/model_config.py's ModelSpec."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from offload.common.dtypes import DTYPES, KV_DTYPES
from offload.common.errors import OffloadError

TIERS = ("device", "host", "nvme")
EMBED_TIERS = ("device", "nvme")  # where a token embedding may live (Policy.embed_tier)
EMBED_READ_BUFFER = 2 << 20  # bytes; a stored embedding reads its rows through a buffer this big (tiers/embedding.py)
READ_BACKENDS = ("pread", "aio")  # the NVMe read backends (tiers/io/backends.py)
IO_BACKENDS = ("auto", *READ_BACKENDS)  # what io_backend may say; "auto" resolves to a read backend
EXPERT_PREFETCH = ("router", "frequency")  # how the next sparse layer's experts are chosen for prefetch
COLD_EXPERTS = ("auto", "device", "cpu")  # on CUDA, where a chosen expert not in the device slots runs
HOST_KV_ATTENTION = ("auto", "cpu", "device")  # on CUDA, where a micro-batch whose KV is in host RAM attends
KV_GROUP_SIZES = (32, 64)  # values along head_dim sharing one scale in a quantized KV cache (kernels/kv_quant.py)


def embed_read_buffer(row_bytes: int) -> int:
    """Bytes of a stored embedding's read buffer, for rows of `row_bytes`: EMBED_READ_BUFFER, or two rows' aligned
    spans where a row is bigger (an unaligned row of 4096-byte blocks spans one block more than it fills)."""
    return max(EMBED_READ_BUFFER, 2 * (-(-row_bytes // 4096) + 1) * 4096)


@dataclass(frozen=True, slots=True)
class Policy:
    """Where each decoder layer's weights live. Placement is data; tiers/weights.py moves bytes to match it."""

    layer_tiers: tuple[str, ...]  # per layer: "device" (resident), "host" (RAM copy), "nvme" (streamed)
    ring_slots: int = 0  # device buffers that streamed layers pass through; 0 when nothing streams
    # where the token embedding lives: "device" (resident), or "nvme" (left in storage, each step reading its
    # tokens' rows: tiers/embedding.py), which frees its bytes for layers when some layer streams anyway
    embed_tier: str = "device"

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_tiers if t not in TIERS]
        if bad:
            raise OffloadError(f"policy: tier {bad[0]!r} is not one of {', '.join(TIERS)}")
        if self.embed_tier not in EMBED_TIERS:
            raise OffloadError(f"policy: embedding tier {self.embed_tier!r} is not one of {', '.join(EMBED_TIERS)}")
        if "nvme" in self.layer_tiers and self.ring_slots < 2:
            raise OffloadError(f"policy: streamed layers need at least 2 ring slots, got {self.ring_slots}")

    @classmethod
    def from_counts(cls, device: int, host: int, nvme: int, ring_slots: int = 0) -> Policy:
        """`device` resident layers, then `host` in host RAM, then `nvme` streamed: the order `fill` places them."""
        return cls(("device",) * device + ("host",) * host + ("nvme",) * nvme, ring_slots)

    @classmethod
    def fill(cls, layer_bytes: Sequence[float], device_room: float, host_room: float, ring_slots: int) -> Policy:
        """Layers in order: on the device while it has room, then in host RAM, then streamed from NVMe through a
        ring of `ring_slots` device buffers (0 when nothing streams). Rooms and layer_bytes in the same unit."""
        tiers = []
        for nbytes in layer_bytes:
            if nbytes <= device_room:
                tiers.append("device")
                device_room -= nbytes
            elif nbytes <= host_room:
                tiers.append("host")
                host_room -= nbytes
            else:
                tiers.append("nvme")
        return cls(tuple(tiers), ring_slots if "nvme" in tiers else 0)

    @property
    def counts(self) -> tuple[int, int, int]:
        """Layers per tier: (device, host, nvme)."""
        return self.layer_tiers.count("device"), self.layer_tiers.count("host"), self.layer_tiers.count("nvme")

    def off_device(self, host_copied: bool) -> tuple[int, int]:
        """What ranks two placements of the same model, fewer first: layers streamed from disk, then, where host
        layers are copied to the device every pass (`host_copied`: on CUDA), layers in host RAM."""
        _, host, nvme = self.counts
        return nvme, host if host_copied else 0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs: compute dtype and device, KV cache geometry, batch limits."""

    dtype: str = "auto"  # "auto" = the checkpoint's dtype
    device: str = "auto"  # "auto" = cuda when available, else cpu
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64  # sequences in one step
    # tokens computed in one step: one per decoding sequence, the rest prefill chunks (a longer prompt is
    # prefilled over several steps, interleaved with decoding); bounds a step's activations and caps the
    # running sequences (each may decode in the same step)
    max_step_tokens: int = 4096
    micro_batch_tokens: int = 2048  # tokens per micro-batch inside a step
    device_memory: int | None = None  # bytes for weights + KV cache on the compute device; None = no budget
    host_memory: int = 0  # bytes of host RAM that may hold layers read once (not streamed)
    # NVMe reads: "pread" (O_DIRECT thread pool), "aio" (DeepSpeed AsyncIO), or "auto": the faster of the two as
    # `offload probe` measured them on this machine, else aio only on CUDA (offload/api.py resolves it)
    io_backend: str = "auto"
    # device buffers for streamed layers: one computing, the rest reading ahead. Two suffice when reads are the
    # bottleneck (a read is always in flight) and leave room for one more resident layer, which reads never touch
    ring_slots: int = 2
    # a folder for the engine's spill files: streamed layers stored in another dtype are converted once and
    # streamed from there (tiers/spill.py); None = stream and convert from the checkpoint every pass
    offload_dir: str | None = None
    disk_memory: int | None = None  # bytes the spill files in offload_dir may take; None = no budget
    # bytes the whole process may hold resident (its libraries included); None = no cap. The cost model turns it into
    # the device budget when it plans the batch (offload/planner/autoconfig.py); exclusive with device_memory
    memory: int | None = None
    # the KV cache's format: "auto" (the compute dtype), a float dtype, or int8 / int4 / fp8, quantized on write per
    # group along head_dim and dequantized on read; every tier stores the quantized bytes
    kv_dtype: str = "auto"
    kv_group_size: int = 32  # int8 / int4 / fp8 KV: values along head_dim per scale (and int4's zero), 32 or 64
    # full KV blocks keyed by the tokens before and in them, shared by every sequence with that prefix; a request
    # computes only what no cached block holds
    prefix_cache: bool = True
    kv_host_memory: int = 0  # host RAM for KV blocks demoted from the device part (kept for reuse); 0 = none
    # local disk, in offload_dir, for KV blocks demoted from host RAM; they persist, so later runs start warm; 0 = none
    kv_disk_memory: int = 0
    # read the cached blocks waiting requests will take from the disk part while a step computes, not at admission
    kv_prefetch: bool = True
    # bytes of the device budget for a mixture's routed experts, cached by (layer, expert) and read when the router
    # chooses them (tiers/experts.py); the rest of each sparse layer is placed like a dense layer. 0 = off: whole
    # layers are placed and streamed
    expert_cache_memory: int = 0
    # how the next sparse layer's experts are prefetched while a layer computes: "router" (those its router chooses
    # for the current hidden state; offload/model/expert_streaming.py) or "frequency" (those selected most often)
    expert_prefetch: str = "router"
    # on CUDA, pinned host RAM (charged to the host tier) keeping experts as read, which the device slots are filled
    # from; 0 = as many experts as the device slots hold. Ignored on a CPU device, where experts are read in place
    expert_host_memory: int = 0
    # on CUDA, where a chosen expert that is not in the device slots runs: "device" copies it there from host RAM,
    # "cpu" runs it on the CPU where it is (its tokens' rows move, not its weights), "auto" prices both by the cost
    # model for the rows it has in the step
    cold_experts: str = "auto"
    # on CUDA, where a micro-batch of sequences whose KV lives in the host part attends: "cpu" (where the KV is, the
    # query moved), "device" (its blocks copied to the device each layer), "auto" (priced per micro-batch and step)
    host_kv_attention: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise OffloadError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise OffloadError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.io_backend not in IO_BACKENDS:
            raise OffloadError(f"io_backend must be one of {', '.join(IO_BACKENDS)}, got {self.io_backend!r}")
        if self.ring_slots < 2:
            raise OffloadError(f"ring_slots must be at least 2, got {self.ring_slots!r}")
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, (str, os.PathLike)) or not str(self.offload_dir).strip():
                raise OffloadError(f"offload_dir must be a folder path, got {self.offload_dir!r}")
            object.__setattr__(self, "offload_dir", os.fspath(self.offload_dir))
        if self.expert_prefetch not in EXPERT_PREFETCH:
            raise OffloadError(
                f"expert_prefetch must be one of {', '.join(EXPERT_PREFETCH)}, got {self.expert_prefetch!r}"
            )
        if self.cold_experts not in COLD_EXPERTS:
            raise OffloadError(f"cold_experts must be one of {', '.join(COLD_EXPERTS)}, got {self.cold_experts!r}")
        if self.host_kv_attention not in HOST_KV_ATTENTION:
            raise OffloadError(
                f"host_kv_attention must be one of {', '.join(HOST_KV_ATTENTION)}, got {self.host_kv_attention!r}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise OffloadError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_group_size not in KV_GROUP_SIZES:
            sizes = " or ".join(map(str, KV_GROUP_SIZES))
            raise OffloadError(f"kv_group_size must be {sizes}, got {self.kv_group_size!r}")
        if self.kv_disk_memory and self.offload_dir is None:
            raise OffloadError(f"kv_disk_memory ({self.kv_disk_memory!r}) keeps KV blocks on disk: needs offload_dir")
        if self.disk_memory is not None and self.offload_dir is None:
            raise OffloadError(f"disk_memory ({self.disk_memory!r}) budgets the spill files: it needs offload_dir")
        for name, value in (
            ("device_memory", self.device_memory),
            ("host_memory", self.host_memory),
            ("disk_memory", self.disk_memory),
            ("memory", self.memory),
            ("kv_host_memory", self.kv_host_memory),
            ("kv_disk_memory", self.kv_disk_memory),
            ("expert_cache_memory", self.expert_cache_memory),
            ("expert_host_memory", self.expert_host_memory),
        ):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise OffloadError(f"{name} must be a non-negative number of bytes, got {value!r}")
        if self.memory is not None and self.device_memory is not None:
            raise OffloadError(
                f"memory ({self.memory!r}, a cap on the whole process) and device_memory ({self.device_memory!r}) "
                "are exclusive: the device budget is derived from the cap"
            )
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_step_tokens", "micro_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise OffloadError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_max_memory(cls, max_memory: dict, **fields) -> EngineConfig:
        """Budgets given as Accelerate's max_memory: {0: "2GiB", "cpu": "8GiB", "disk": "50GB"}; other fields as
        keywords. "disk" needs offload_dir (it bounds the spill files written there)."""
        from offload.common.sizes import parse_max_memory

        tiers = parse_max_memory(max_memory)
        names = {"device": "device_memory", "host": "host_memory", "disk": "disk_memory"}
        return cls(**fields, **{names[t]: b for t, b in tiers.items()})


MAX_LOGPROBS = 20  # top alternatives a request may ask for with each token


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # report each sampled token's logprob and this many top alternatives

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise OffloadError(f"max_new_tokens must be at least 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise OffloadError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise OffloadError(f"top_k must be >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise OffloadError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise OffloadError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise OffloadError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
