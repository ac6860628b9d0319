"""Frozen configuration: where layers live (Policy), the engine's settings and a request's sampling parameters.

The model's own shape is offload/common/model_config.py's ModelSpec.

Over 400 lines: every knob of the engine and of sampling is declared here and nowhere else (its flag, help, default
and checks), so that the CLI, the docs and the API cannot drift."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from offload.common.dtypes import DTYPES, KV_DTYPES
from offload.common.errors import OffloadError
from offload.common.knobs import knob
from offload.common.tier import Tier

EMBED_TIERS = (Tier.DEVICE, Tier.NVME)  # where a token embedding may live (Policy.embed_tier): never host RAM
# bytes; a stored embedding reads its rows through a buffer this big (tiers/weights/embedding.py)
EMBED_READ_BUFFER = 2 << 20
READ_BACKENDS = ("pread", "aio")  # the NVMe read backends (tiers/io/backends.py)
IO_BACKENDS = ("auto", *READ_BACKENDS)  # what io_backend may say; "auto" resolves to a read backend
EXPERT_PREFETCH = ("router", "frequency")  # how the next sparse layer's experts are chosen for prefetch
COLD_EXPERTS = ("auto", "device", "cpu")  # on CUDA, where a chosen expert not in the device slots runs
HOST_KV_ATTENTION = ("auto", "cpu", "device")  # on CUDA, where a micro-batch whose KV is in host RAM attends
KV_GROUP_SIZES = (32, 64)  # values along head_dim sharing one scale in a quantized KV cache (kernels/kv_quant.py)
KV_GROUP_SIZE = 32  # the default of those
RING_SLOTS = 2  # device buffers streamed layers pass through, unless configured: the engine's and the planner's
BLOCK_SIZE = 16  # tokens per KV block, unless configured
DEFAULT_KV_CACHE = 1 << 30  # bytes of KV cache where neither the user nor the cost model sizes it
SPECULATE = (None, "ngram", "self")  # speculative decoding's drafters by name (or a draft model's path); None: off
MAX_DRAFT = 64  # tokens a drafter may propose per sequence and step
MAX_TOPK = 8  # candidates a drafter may offer at each drafted position
DEFAULT_MAX_NUM_SEQS = 64  # sequences per step where neither the user nor the cost model sizes the batch


def _is_path(value: object) -> bool:
    """Whether `value` names an existing file or directory (a draft model, for `speculate`)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        return False
    return os.path.exists(os.path.expanduser(os.fspath(value)))


def embed_read_buffer(row_bytes: int) -> int:
    """Bytes of a stored embedding's read buffer, for rows of `row_bytes`: EMBED_READ_BUFFER, or two rows' aligned
    spans where a row is bigger (an unaligned row of 4096-byte blocks spans one block more than it fills)."""
    return max(EMBED_READ_BUFFER, 2 * (-(-row_bytes // 4096) + 1) * 4096)


def spread(tiers: list[str], layer_bytes: Sequence[float], rooms: dict[str, float]) -> list[str]:
    """As many layers on each tier as `tiers` has, the streamed ones, then those in host RAM, at evenly spaced places
    through the model. A step computes its layers in order, and a layer is read into one of a few ring slots while
    the layers before it compute: streamed layers all at the end (the fill order) left a step's reads waiting on
    the ring after the resident layers had long finished (56 layers of Llama-70B's shape, 14 streamed, on the
    2-core Xeon: a decode step took 4.4 s where reading the streamed ones takes 3.8). Where layers differ in size
    and the spread would not fit the `rooms` (tier -> bytes), the fill order stays."""
    out, free = [Tier.DEVICE] * len(tiers), list(range(len(tiers)))
    for tier in (Tier.NVME, Tier.HOST):
        count = tiers.count(tier)
        picked = {free[int((k + 0.5) * len(free) / count)] for k in range(count)}
        for i in picked:
            out[i] = tier
        free = [i for i in free if i not in picked]
    held = {t: sum(b for b, at in zip(layer_bytes, out, strict=True) if at == t) for t in rooms}
    return out if all(held[t] <= room for t, room in rooms.items()) else tiers


@dataclass(frozen=True, slots=True)
class Policy:
    """Where each decoder layer's weights live. Placement is data; tiers/weights/weight_store.py moves bytes to match
    it."""

    layer_tiers: tuple[str, ...]  # per layer a Tier: DEVICE (resident), HOST (RAM copy), NVME (streamed)
    ring_slots: int = 0  # device buffers that streamed layers pass through; 0 when nothing streams
    # where the token embedding lives: Tier.DEVICE (resident), or Tier.NVME (left in storage, each step reading its
    # tokens' rows: tiers/weights/embedding.py), which frees its bytes for layers when some layer streams anyway
    embed_tier: str = Tier.DEVICE

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_tiers if t not in tuple(Tier)]
        if bad:
            raise OffloadError(f"policy: tier {bad[0]!r} is not one of {', '.join(Tier)}")
        if self.embed_tier not in EMBED_TIERS:
            raise OffloadError(f"policy: embedding tier {self.embed_tier!r} is not one of {', '.join(EMBED_TIERS)}")
        if Tier.NVME in self.layer_tiers and self.ring_slots < 2:
            raise OffloadError(f"policy: streamed layers need at least 2 ring slots, got {self.ring_slots}")

    @classmethod
    def from_counts(cls, device: int, host: int, nvme: int, ring_slots: int = 0) -> Policy:
        """`device` resident layers, `host` in host RAM and `nvme` streamed, at the places `fill` gives them."""
        ordered = [Tier.DEVICE] * device + [Tier.HOST] * host + [Tier.NVME] * nvme
        return cls(tuple(spread(ordered, [1] * len(ordered), {Tier.DEVICE: device, Tier.HOST: host})), ring_slots)

    @classmethod
    def fill(cls, layer_bytes: Sequence[float], device_room: float, host_room: float, ring_slots: int) -> Policy:
        """Layers in order: on the device while it has room, then in host RAM, then streamed from NVMe through a
        ring of `ring_slots` device buffers (0 when nothing streams); then those off the device spread through the
        model (`spread`). Rooms and layer_bytes in the same unit."""
        tiers, rooms = [], {Tier.DEVICE: device_room, Tier.HOST: host_room}
        for nbytes in layer_bytes:
            if nbytes <= device_room:
                tiers.append(Tier.DEVICE)
                device_room -= nbytes
            elif nbytes <= host_room:
                tiers.append(Tier.HOST)
                host_room -= nbytes
            else:
                tiers.append(Tier.NVME)
        return cls(tuple(spread(tiers, layer_bytes, rooms)), ring_slots if Tier.NVME in tiers else 0)

    @property
    def counts(self) -> tuple[int, int, int]:
        """Layers per tier: (device, host, nvme)."""
        device, host, nvme = (self.layer_tiers.count(t) for t in Tier)
        return device, host, nvme

    def off_device(self, host_copied: bool) -> tuple[int, int]:
        """What ranks two placements of the same model, fewer first: layers streamed from disk, then, where host
        layers are copied to the device every pass (`host_copied`: on CUDA), layers in host RAM."""
        _, host, nvme = self.counts
        return nvme, host if host_copied else 0

    @staticmethod
    def choose_embedding(resident: Policy | None, stored: Policy | None, host_copied: bool) -> Policy | None:
        """Where the token embedding lives, given the layers placed beside it resident (`resident`) and with it left
        in storage (`stored`), None where a placement does not fit: `stored`, as embed_tier NVME, where it puts fewer
        layers off the device (off_device), else `resident`. Placing `stored` pays only where `resident` is None or
        leaves some layer off the device; otherwise it cannot win."""
        if stored is not None and (
            resident is None or stored.off_device(host_copied) < resident.off_device(host_copied)
        ):
            return replace(stored, embed_tier=Tier.NVME)
        return resident


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs: budgets, KV cache, experts, batch limits, I/O and compute. Every field is a knob (its flag,
    help and default are declared here and nowhere else). A budget of None means "the planner decides":
    offload/planner/autoconfig.py's `resolve` turns a config and a workload into one the engine runs."""

    # ---- budgets
    memory: int | None = knob(
        None,
        "budgets",
        "cap on the process's resident memory, on a CPU device",
        doc="Instead of --device-memory: the cost model sizes the batch, the KV cache and the device budget to what "
        "the process does not hold yet. Without it (and without --device-memory), a model that does not fit is "
        "planned for the RAM available, less a sixteenth of the machine's (at least 256 MiB) for the system.",
        size=True,
        default_text="RAM available",
    )
    device_memory: int | None = knob(
        None,
        "budgets",
        "weights + KV cache on the compute device; the rest streams",
        doc="With no --max-num-seqs and no --kv-cache-memory, the cost model picks the batch and KV cache for the "
        "workload within it. Without it, a model that does not fit is planned on CUDA for the device memory free "
        "less 512 MiB (and, without --host-memory, the RAM available for layers), on a CPU as --memory says.",
        size=True,
        default_text="the free memory",
    )
    host_memory: int | None = knob(
        None,
        "budgets",
        "host RAM the engine keeps: layers read once instead of streamed, and the KV and expert host parts",
        doc="--kv-host-memory and --expert-host-memory are taken out of it; layers get the rest.",
        size=True,
        default_text="none",
    )
    offload_dir: str | None = knob(
        None,
        "budgets",
        "folder on fast local disk for spill files and the KV disk part",
        doc="Streamed layers stored in another dtype than the compute dtype are converted once and streamed from "
        "there (checksummed, reused by later runs); --kv-disk-memory keeps KV blocks there.",
        metavar="DIR",
        default_text="none",
    )
    disk_memory: int | None = knob(
        None,
        "budgets",
        "disk the engine fills in --offload-dir: converted layers, and the KV disk part",
        doc="--kv-disk-memory is taken out of it; converted layers get the rest.",
        size=True,
        default_text="no budget",
    )
    # ---- KV cache
    kv_cache_bytes: int | None = knob(
        None,
        "kv",
        "the KV cache on the device",
        doc="With a device budget and no --max-num-seqs, or with --memory, sized by the cost model for the batch it "
        "picks.",
        flag="--kv-cache-memory",
        size=True,
        default_text=f"{DEFAULT_KV_CACHE >> 30}GiB, or the planner's",
    )
    block_size: int = knob(BLOCK_SIZE, "kv", "tokens per KV block", metavar="TOKENS")
    kv_dtype: str = knob(
        "auto",
        "kv",
        "KV cache format",
        doc="auto: the compute dtype. int8 / int4 / fp8 are quantized on write per group along head_dim and "
        "dequantized on read; every tier stores the quantized bytes.",
        choices=KV_DTYPES,
        metavar="FORMAT",
    )
    kv_group_size: int = knob(
        KV_GROUP_SIZE,
        "kv",
        "values along head_dim per scale in a quantized KV cache",
        doc="64 stores fewer scales, 32 keeps the error lower.",
        choices=KV_GROUP_SIZES,
    )
    prefix_cache: bool = knob(
        True,
        "kv",
        "reuse the KV blocks of prefixes seen before",
        doc="Full blocks are keyed by the tokens before and in them and shared by every sequence with that prefix; "
        "--no-prefix-cache computes every prompt in full.",
    )
    kv_host_memory: int | None = knob(
        None,
        "kv",
        "part of --host-memory for KV blocks demoted from the device, kept for reuse",
        doc="Without --host-memory, the host RAM the KV cache alone keeps.",
        size=True,
        default_text="none",
    )
    kv_disk_memory: int | None = knob(
        None,
        "kv",
        "part of --disk-memory for KV blocks demoted from host RAM, in --offload-dir",
        doc="They persist, so later runs start warm.",
        size=True,
        default_text="none",
    )
    kv_prefetch: bool = knob(
        True,
        "kv",
        "read waiting requests' cached disk blocks while a step computes",
        doc="--no-kv-prefetch reads them only when a request is admitted.",
    )
    host_kv_attention: str = knob(
        "auto",
        "kv",
        "on CUDA, where sequences with KV in host RAM attend",
        doc="cpu: where the KV is, the query moved; device: over their blocks copied to the GPU each layer; auto: "
        "whichever the cost model prices faster for each micro-batch (prompt chunks on the GPU, decode on the CPU "
        "where no profile is saved).",
        choices=HOST_KV_ATTENTION,
        metavar="WHERE",
    )
    # ---- experts
    expert_cache_memory: int | None = knob(
        None,
        "experts",
        "part of the device budget for a mixture's routed experts",
        doc="Experts are read only when the router chooses them and cached by (layer, expert); the rest of each "
        "sparse layer is placed like a dense layer. Default: where the cost model plans the batch (a budget given, "
        "or a model bigger than the machine), its choice between none and what the budget leaves once every "
        "layer's dense part is resident; else off, whole layers are placed and streamed. 0: off.",
        size=True,
        default_text="the plan's",
    )
    expert_host_memory: int | None = knob(
        None,
        "experts",
        "on CUDA, part of --host-memory keeping experts as read, pinned",
        doc="The device's expert slots are filled from it. Default: as many experts as those slots hold. Ignored on "
        "a CPU device, where experts are read in place.",
        size=True,
        default_text="the device slots' worth",
    )
    expert_prefetch: str = knob(
        "router",
        "experts",
        "how the next sparse layer's experts are prefetched",
        doc="router: those its router chooses for the current hidden state (a copy of each router stays resident); "
        "frequency: those selected most often.",
        choices=EXPERT_PREFETCH,
        metavar="HOW",
    )
    cold_experts: str = knob(
        "auto",
        "experts",
        "on CUDA, where a chosen expert off the device runs",
        doc="device: copied there from host RAM; cpu: on the CPU where it is, its tokens' rows moved instead of its "
        "weights; auto: whichever the cost model prices faster for its rows.",
        choices=COLD_EXPERTS,
        metavar="WHERE",
    )
    # ---- scheduler
    max_num_seqs: int | None = knob(
        None,
        "scheduler",
        "sequences per step",
        doc="With a device budget and no --kv-cache-memory, or with --memory, the batch with the highest throughput "
        "the cost model predicts for the workload on this machine.",
        metavar="N",
        default_text=f"{DEFAULT_MAX_NUM_SEQS}, or the planner's",
    )
    max_step_tokens: int = knob(
        4096,
        "scheduler",
        "tokens computed per step (decode tokens + prefill chunks)",
        doc="One per decoding sequence, the rest prefill chunks: a longer prompt is prefilled over several steps, "
        "interleaved with decoding.",
        metavar="N",
    )
    micro_batch_tokens: int = knob(2048, "scheduler", "tokens per micro-batch inside a step", metavar="N")
    speculate: str | None = knob(
        None,
        "scheduler",
        "speculative decoding: ngram, self (its own int4 copy drafts) or PATH (a draft model)",
        doc="ngram drafts from tokens seen earlier in the sequence; PATH is a draft model's directory or GGUF file "
        "with the same tokenizer. A decoding sequence's drafted tokens are verified in the same weight pass as its "
        "next token; greedy output stays the target's own, sampled output keeps the target's distribution "
        "(rejection sampling). "
        "A draft model (self: converted once into the cache folder, or the model itself where it is int4) runs "
        "resident on the CPU, its bytes charged to the memory budget. Requests held to a grammar do not speculate.",
        metavar="METHOD",
        default_text="none",
    )
    num_speculative_tokens: int | None = knob(
        None,
        "scheduler",
        "tokens a drafter proposes per sequence and step",
        doc="By default the chain length the cost model prices fastest for the engine's placement, by this machine's "
        "saved profile (offload probe) and the acceptance runs of the model measured (4 without a profile).",
        metavar="K",
        default_text="the planner's",
    )
    speculative_topk: int = knob(
        1,
        "scheduler",
        "candidates drafted at each position (a tree above 1)",
        doc="Above 1 a draft is a tree: the drafter's likeliest continuation, and at each of its positions the next "
        "N - 1 likeliest tokens (a draft model's runners-up, as leaves; ngram: what followed other earlier "
        "occurrences, each a continuation of its own). The same weight pass verifies them all, up to K x N drafted "
        "rows a sequence: where weights stream they cost little; where they are resident, compute.",
        metavar="N",
    )
    # ---- I/O
    io_backend: str = knob(
        "auto",
        "io",
        "NVMe reads: pread (O_DIRECT thread pool), aio (DeepSpeed AsyncIO)",
        doc="auto: the faster of the two as `offload probe` measured them here (pread where a CPU device holds an "
        "expert cache, which aio would page-lock at load), else aio only on CUDA.",
        choices=IO_BACKENDS,
    )
    ring_slots: int = knob(
        RING_SLOTS,
        "io",
        "device buffers streamed layers pass through",
        doc="One computing, the rest reading ahead. Two suffice when reads are the bottleneck and leave room for one "
        "more resident layer.",
        metavar="N",
    )
    # ---- compute
    dtype: str = knob(
        "auto", "compute", "compute dtype", doc="auto: the checkpoint's.", choices=("auto", *DTYPES), metavar="DTYPE"
    )
    device: str = knob("auto", "compute", "auto (cuda when available), cpu or cuda[:N]", metavar="DEVICE")

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise OffloadError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise OffloadError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.io_backend not in IO_BACKENDS:
            raise OffloadError(f"io_backend must be one of {', '.join(IO_BACKENDS)}, got {self.io_backend!r}")
        if self.speculate not in SPECULATE and not _is_path(self.speculate):
            raise OffloadError(
                f"speculate must be ngram, self or a draft model's directory or GGUF file, got {self.speculate!r}"
            )
        if isinstance(self.speculate, os.PathLike):
            object.__setattr__(self, "speculate", os.fspath(self.speculate))
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or not 1 <= k <= MAX_DRAFT):
            raise OffloadError(f"num_speculative_tokens must be in 1..{MAX_DRAFT}, got {self.num_speculative_tokens!r}")
        if not isinstance(self.speculative_topk, int) or not 1 <= self.speculative_topk <= MAX_TOPK:
            raise OffloadError(f"speculative_topk must be in 1..{MAX_TOPK}, got {self.speculative_topk!r}")
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
            ("kv_cache_bytes", self.kv_cache_bytes),
            ("kv_host_memory", self.kv_host_memory),
            ("kv_disk_memory", self.kv_disk_memory),
            ("expert_cache_memory", self.expert_cache_memory),
            ("expert_host_memory", self.expert_host_memory),
        ):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise OffloadError(f"{name} must be a non-negative number of bytes, got {value!r}")
        for part, total, whole in (
            ("kv_host_memory", "host_memory", self.host_memory),
            ("kv_disk_memory", "disk_memory", self.disk_memory),
        ):
            value = getattr(self, part)
            if whole and value and value > whole:  # a total of 0 or None: no budget, so the part stands alone
                raise OffloadError(f"{part} ({value!r}) is part of {total} ({whole!r}): it cannot be larger")
        if self.memory is not None and self.device_memory is not None:
            raise OffloadError(
                f"memory ({self.memory!r}, a cap on the whole process) and device_memory ({self.device_memory!r}) "
                "are exclusive: the device budget is derived from the cap"
            )
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_step_tokens", "micro_batch_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise OffloadError(f"{name} must be a positive integer, got {value!r}")
        if self.memory is not None and (self.max_num_seqs is not None or self.kv_cache_bytes is not None):
            raise OffloadError(
                "memory sizes the batch and the KV cache itself: leave max_num_seqs (--max-num-seqs) and "
                "kv_cache_bytes (--kv-cache-memory) unset"
            )

    @property
    def host_layer_memory(self) -> int | None:
        """What the host budget leaves for layers (and, on CUDA, the expert host cache): host_memory less the KV
        host part; None as host_memory's."""
        return None if self.host_memory is None else max(self.host_memory - (self.kv_host_memory or 0), 0)

    @property
    def host_total(self) -> int:
        """Host RAM the engine keeps beside the device tier: host_memory, or without it the KV host part alone."""
        return self.host_memory or self.kv_host_memory or 0

    @property
    def disk_layer_memory(self) -> int | None:
        """What the disk budget leaves for converted layers: disk_memory less the KV disk part; None: no budget."""
        return None if self.disk_memory is None else max(self.disk_memory - (self.kv_disk_memory or 0), 0)

    @classmethod
    def from_max_memory(cls, max_memory: dict, **fields) -> EngineConfig:
        """Budgets given as Accelerate's max_memory: {0: "2GiB", "cpu": "8GiB", "disk": "50GB"}; other fields as
        keywords. "disk" needs offload_dir (it bounds the spill files written there)."""
        from offload.common.sizes import parse_max_memory

        # parse_max_memory's keys ("device", "host", "disk") name the budgets: device_memory, host_memory, disk_memory
        return cls(**fields, **{f"{t}_memory": b for t, b in parse_max_memory(max_memory).items()})


MAX_LOGPROBS = 20  # top alternatives a request may ask for with each token


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 means greedy."""

    max_new_tokens: int = knob(64, "sampling", "tokens to generate at most", metavar="N")
    temperature: float = knob(0.0, "sampling", "0 = greedy", metavar="T")
    top_k: int = knob(0, "sampling", "sample among the K most likely (0 = no limit)", metavar="K")
    top_p: float = knob(1.0, "sampling", "sample within top-p probability mass", metavar="P")
    seed: int | None = knob(None, "sampling", "seed for reproducible sampling", metavar="N", default_text="none")
    stop: tuple[str, ...] = knob((), "sampling", "stop string; repeatable", repeat=True)
    ignore_eos: bool = knob(False, "sampling", "keep generating past end-of-sequence tokens")
    # report each sampled token's logprob and this many top alternatives (the API and endpoint ask; no flag)
    logprobs: int | None = None
    # each prompt token's logprob with this many top alternatives, from position prompt_logprobs_start on (the
    # endpoints' echo and logprob_start_len ask; no flag): computed in the scheduled steps, never taken from the
    # prefix cache; on the request's first delta
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    stop_token_ids: tuple[int, ...] = knob(
        (), "sampling", "token id that ends the reply, as end-of-sequence does; repeatable", repeat=True, metavar="ID"
    )
    min_p: float = knob(0.0, "sampling", "sample among tokens at least P times as likely as the top one", metavar="P")
    # constrained decoding (offload/model/structured.py): at most one of a JSON schema (a dict or JSON text, kept as
    # compact JSON text), a regular expression, or a Lark grammar in llguidance's dialect
    json_schema: str | None = knob(
        None, "sampling", "hold the reply to this JSON schema (JSON text)", metavar="SCHEMA", default_text="none"
    )
    regex: str | None = knob(
        None, "sampling", "hold the reply to this regular expression", metavar="RE", default_text="none"
    )
    grammar: str | None = knob(
        None,
        "sampling",
        "hold the reply to this Lark grammar (llguidance's dialect)",
        metavar="LARK",
        default_text="none",
    )

    def __post_init__(self) -> None:
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        given = [f for f in ("json_schema", "regex", "grammar") if getattr(self, f) is not None]
        if len(given) > 1:
            raise OffloadError(f"give at most one of json_schema, regex and grammar, got {' and '.join(given)}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise OffloadError(f"max_new_tokens must be at least 0 (0: the prompt only), got {self.max_new_tokens!r}")
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise OffloadError(f"{name} must be in 0..{MAX_LOGPROBS}, got {value!r}")
        if self.prompt_logprobs_start < 0:
            raise OffloadError(f"prompt_logprobs_start must be >= 0, got {self.prompt_logprobs_start!r}")
        if not 0.0 <= self.min_p <= 1.0:  # also rejects NaN
            raise OffloadError(f"min_p must be in [0, 1], got {self.min_p!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.grammar is not None


def _schema_text(schema: object) -> str:
    """A JSON schema given as a dict or as JSON text, as compact JSON text (hashable, as a frozen field must be)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise OffloadError(f"json_schema is not valid JSON ({exc})") from None
    if not isinstance(schema, dict | bool):
        raise OffloadError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))
