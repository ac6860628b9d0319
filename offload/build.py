"""The engine built in one place: `build(model_dir, config, workload)` resolves the config for the workload, then
wires the tiers, the weights, the KV pool, the experts, the layer-major engine and the core, and returns them as
small frozen handles (`EngineParts`). `LLM` (offload/api.py) is a facade over them; the server and batch jobs drive
the same core through it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from offload.common.config import EngineConfig, Policy
from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.common.tier import Tier
from offload.convert.quantize import check_runnable
from offload.core import EngineCore
from offload.draft_core import draft_model
from offload.kernels import choice, native, timing
from offload.kernels.quant_linear import SCALES_SUFFIX
from offload.model.engine import Engine
from offload.model.expert_streaming import expert_caches, layer_experts, model_layouts, read_gates
from offload.model.loader import load_spec
from offload.model.speculation.drafters import make_drafter
from offload.planner.autoconfig import resolve
from offload.planner.cold_experts import cold_experts
from offload.planner.host_attention_prices import choose_host_attention
from offload.planner.profiles import saved_read_rates
from offload.planner.speculation import DEFAULT_K, engine_k
from offload.prompts import Prompts
from offload.scheduler.batcher import BatchLimits
from offload.scheduler.cost.predict import Prediction, Workload
from offload.tiers.device import DeviceTier
from offload.tiers.experts.expert_cache import ExpertCache
from offload.tiers.experts.expert_slots import DeviceExperts
from offload.tiers.host import HostTier
from offload.tiers.io.backends import BackendChoice, choose_backend, make_backend
from offload.tiers.io.base import ReadBackend
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.kv.blocks import BlockTables
from offload.tiers.kv.kv_cache import KVCache
from offload.tiers.kv.lower_tiers import KVTiers
from offload.tiers.kv.pool import kv_key, make_kv_pool
from offload.tiers.spill.spilling import SpillStats, spill_layers
from offload.tiers.weights.checkpoint import Checkpoint
from offload.tiers.weights.embedding import HEAD
from offload.tiers.weights.layout import ModelLayout
from offload.tiers.weights.placement import place_weights
from offload.tiers.weights.weight_store import WeightStore


@dataclass(frozen=True, slots=True)
class WeightParts:
    """The layers' weights: where they are placed and what reads them."""

    store: WeightStore
    policy: Policy
    io_backend: BackendChoice  # which backend reads the checkpoint, and why
    backend: ReadBackend
    embed_backend: ReadBackend | None  # reads a token table left in storage; None: the table is resident
    spill: SpillStats | None  # streamed layers converted once into offload_dir (None: no offload_dir)


@dataclass(frozen=True, slots=True)
class KVParts:
    """The paged KV cache: the device part, its tables, and the host and disk parts below it."""

    cache: KVCache
    tables: BlockTables
    host_tables: BlockTables | None  # the host part's tables (sequences admitted when the device part is full)
    tiers: KVTiers | None  # the parts below the device (None: the device part only)
    key: str  # what keys this model's blocks in the prefix cache and on disk


@dataclass(frozen=True, slots=True)
class ExpertParts:
    """A mixture's routed experts, streamed by (layer, expert)."""

    cache: ExpertCache
    slots: DeviceExperts | None  # on CUDA, the device slots filled from `cache` in pinned host RAM


@dataclass(frozen=True, slots=True)
class EngineParts:
    model_dir: Path
    spec: ModelSpec
    given: EngineConfig  # as the caller gave it
    config: EngineConfig  # resolved: as the engine runs
    prediction: Prediction | None  # the cost model's, where it chose the batch
    assumed: str | None  # the machine's budgets assumed where the caller gave none, and why (None: none assumed)
    device: torch.device
    dtype: torch.dtype
    device_tier: DeviceTier
    host_tier: HostTier
    weights: WeightParts
    kv: KVParts
    experts: ExpertParts | None
    engine: Engine
    core: EngineCore
    prompts: Prompts
    max_model_len: int
    k_why: str = ""  # why a speculating engine drafts config.num_speculative_tokens a step ("given", or the plan's)

    def close(self) -> None:
        """Let reads in flight land, write the KV blocks queued for disk, close the files."""
        self.core.close()  # the last step's computed blocks, not yet written through, go down first
        self.weights.store.close()
        if self.experts is not None:
            if self.experts.slots is not None:
                self.experts.slots.close()  # copies from the host cache's buffers land before those go
            self.experts.cache.close()
        self.weights.backend.close()
        if self.weights.embed_backend is not None:
            self.weights.embed_backend.close()
        if self.kv.tiers is not None:
            self.kv.tiers.close()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise OffloadError(f"device {name!r}: this machine has no CUDA device")
    return torch.device(name)


def eos_ids(model_dir: Path, spec: ModelSpec) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's, else config.json's."""
    path = model_dir / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    except json.JSONDecodeError as exc:
        raise OffloadError(f"{path}: not valid JSON ({exc})") from None
    if eos is not None:
        return tuple(eos) if isinstance(eos, list) else (eos,)
    return spec.eos_token_ids


def build(
    model_dir: Path, config: EngineConfig, workload: Workload | None = None, prompts: Prompts | None = None
) -> EngineParts:
    """The engine for `model_dir`, with `config` resolved for `workload` (None: the planner's default workload).
    `prompts`: the model's encoder, where the caller loaded it already (to measure its prompts), else loaded here."""
    given = config
    spec, family = load_spec(model_dir)
    draft, config = draft_model(model_dir, spec, config, build)  # a draft model: built first, charged to the budget
    device = resolve_device(config.device)
    check_runnable(model_dir, spec, device)  # a quantized checkpoint this device can multiply
    config, prediction, assumed = resolve(model_dir, config, workload)
    dtype = getattr(torch, spec.dtype if config.dtype == "auto" else config.dtype)
    device_tier = DeviceTier(config.device_memory, device)
    # the host budget less the KV host part; 0: no budget, so no layer in host RAM (see HostTier)
    host_tier = HostTier(config.host_layer_memory or None)
    kv = make_kv_cache(spec, config, dtype, device, device_tier)
    with BufferedReader() as reader:  # headers only; tensor data goes through the NVMe backend
        checkpoint = Checkpoint(model_dir, reader)
        layout, experts = model_layouts(checkpoint, family, spec, config.expert_cache_memory > 0)
        guess = experts is not None and config.expert_prefetch == "router"
        gates = read_gates(checkpoint, family, spec) if guess else {}  # the routers, copied to guess
    # what reads the checkpoint, and why: "auto" by the rates `offload probe` saved here, if it ran
    measured = saved_read_rates() if config.io_backend == "auto" else None
    locked_cache = config.expert_cache_memory if experts is not None and device.type == "cpu" else 0
    io_backend = choose_backend(config.io_backend, measured, locked_cache)
    backend = make_backend(io_backend.name)
    # routed experts stream through a cache of their own, taken from the device budget before layers are placed
    # (on CUDA: device slots, filled from a cache in pinned host RAM, where cold experts may run instead)
    budgets = config.expert_cache_memory, config.expert_host_memory
    expert_cache, slots = expert_caches(experts, backend, device_tier, host_tier, dtype, *budgets)
    cold = cold_experts(config.cold_experts, spec, dtype, device, slots.expert_bytes) if slots else None
    routed = layer_experts(expert_cache, spec, gates, dtype, config.expert_prefetch, slots, cold)

    shared = getattr(draft, "shared", {})  # a `self` draft's table and head, which the target holds as its own

    def place(layout: ModelLayout) -> Policy:
        """The layers placed in what the device budget leaves after the KV cache, the embedding and the head."""
        return place_weights(layout, dtype, device_tier, host_tier, config.ring_slots, table_held="embed" in shared)

    spill = None
    if config.offload_dir is not None:
        disk = config.disk_layer_memory  # the disk budget less the KV disk part
        layout, spill = spill_layers(layout, place, dtype, config.offload_dir, disk, io_backend.name)
    policy = place(layout)
    # a table left in storage reads its rows through a backend of its own, never queued behind layer reads
    embed_backend = make_backend(io_backend.name, threads=4) if policy.embed_tier == Tier.NVME else None
    store = WeightStore(
        layout,
        backend,
        policy,
        device_tier,
        host_tier,
        dtype,
        embed_backend=embed_backend,
        fuse=partial(family.fuse, spec),
        packable=family.packable,
        shared=shared,
    )
    key = kv_key(model_dir, spec, dtype, kv)
    tables, host_tables, kv_tiers = make_kv_pool(config, kv, key, spec)
    # a sequence's blocks are all in one part of the pool: the device's, or the host's
    kv_blocks = max(kv.num_blocks, host_tables.pool.num_blocks if host_tables else 0)
    max_model_len = min(spec.max_position, kv_blocks * config.block_size)
    host_kv = kv_tiers.host_kv if host_tables is not None else None
    where = None  # where host-resident micro-batches attend
    if host_kv is not None:
        where = choose_host_attention(config.host_kv_attention, spec, dtype, device, config.kv_dtype, config.block_size)
    engine = Engine(spec, family, store, kv, device, dtype, host_kv, routed, where)
    if device.type == "cpu" and dtype == torch.bfloat16:
        native.prepare()  # the CPU kernels built (once per machine) and loaded with the weights, not in a step
        timing.ensure(product_shapes(store))  # and timed against torch's paths (once per machine and shape)
    limits = BatchLimits(config.max_num_seqs, config.max_step_tokens, config.micro_batch_tokens, max_model_len)
    # loaded with the weights: no generate call pays for it (a first load imports for ~1 s)
    prompts = prompts if prompts is not None else Prompts.load(model_dir)
    decoder = (lambda: prompts) if prompts.tokenizer is not None else None
    k_why = ""  # why a speculating engine drafts as many tokens a step as it does
    if config.speculate is not None:  # the user's chain length, or the planner's for this placement
        dtype_name = spec.dtype if config.dtype == "auto" else config.dtype
        k, k_why = engine_k(model_dir, spec, dtype_name, config, policy, getattr(draft, "model_dir", None))
        config = dataclasses.replace(config, num_speculative_tokens=k)
    drafter = draft or make_drafter(config.speculate, config.speculative_topk)
    if drafter is not None:  # a verify step's rows round as a one-row step's (kernels/choice.py): a tree's nodes,
        # and the tokens of its last pass accepted off its main chain, computed again before them
        k = config.num_speculative_tokens
        choice.one_row_path_up_to(k * config.speculative_topk + k + 1)
    core = EngineCore(
        engine,
        tables,
        limits,
        eos_ids(model_dir, spec),
        store,
        decoder,
        kv_tiers,
        host_tables,
        drafter,
        config.num_speculative_tokens or DEFAULT_K,  # a drafter given the core later (tests) drafts the default
    )
    return EngineParts(
        model_dir=model_dir,
        spec=spec,
        given=given,
        config=config,
        prediction=prediction,
        assumed=assumed,
        device=device,
        dtype=dtype,
        device_tier=device_tier,
        host_tier=host_tier,
        weights=WeightParts(store, policy, io_backend, backend, embed_backend, spill),
        kv=KVParts(kv, tables, host_tables, kv_tiers, key),
        experts=None if expert_cache is None else ExpertParts(expert_cache, slots),
        engine=engine,
        core=core,
        prompts=prompts,
        max_model_len=max_model_len,
        k_why=k_why,
    )


def make_kv_cache(
    spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, device: torch.device, device_tier: DeviceTier
) -> KVCache:
    """The device part of the KV cache, charged to the device tier."""
    layers, block, heads, head_dim = spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim
    try:  # a format this model's shape or this torch cannot hold
        per_block = KVCache.block_bytes(
            layers, block, heads, head_dim, dtype, config.kv_dtype, config.kv_group_size, spec.kv_parts
        )
    except ValueError as exc:
        raise OffloadError(str(exc)) from None
    if config.kv_cache_bytes < per_block:
        raise OffloadError(
            f"kv cache memory of {config.kv_cache_bytes} bytes holds no block "
            f"(one block of {config.block_size} tokens needs {per_block} bytes)"
        )
    kv = KVCache(
        layers,
        config.kv_cache_bytes // per_block,
        block,
        heads,
        head_dim,
        dtype,
        device,
        config.kv_dtype,
        group_size=config.kv_group_size,
        parts=spec.kv_parts,
    )
    if not device_tier.adopt(kv.storage):
        raise OffloadError(
            f"--kv-cache-memory ({config.kv_cache_bytes} bytes) does not fit --device-memory "
            f"({config.device_memory} bytes)"
        )
    return kv


def product_shapes(store: WeightStore) -> set[tuple[str, int, int]]:
    """(kernel, out, in) of the matrices the model multiplies on the CPU, as kernels/timing.py times them: int4 codes
    of the cpu layout ("int4"), dense float matrices computed in bfloat16 ("bf16": resident ones packed for oneDNN
    are not), the LM head ("logits"). Resident layers as loaded (projections stacked), streamed ones as stored."""
    shapes = set()
    for w in store.resident.values():
        for name, t in w.items():
            if t.dim() != 2 or name.endswith(SCALES_SUFFIX) or t.is_mkldnn:
                continue
            if t.dtype == torch.uint8 and name + SCALES_SUFFIX in w:
                shapes.add(("int4", t.shape[0], t.shape[1] * 2))
            elif t.is_floating_point():
                shapes.add(("bf16", *t.shape))
    streamed = [i for i in range(len(store.layouts)) if i not in store.resident]
    for layout in (store.layouts[i] for i in streamed[:1]):  # every layer has the same matrices
        names = {t.short for t in layout.tensors}
        for t in layout.tensors:
            if len(t.shape) != 2 or t.short.endswith(SCALES_SUFFIX):
                continue
            if t.dtype == "U8" and t.short + SCALES_SUFFIX in names:
                shapes.add(("int4", t.shape[0], t.shape[1] * 2))
            elif t.dtype in ("BF16", "F16", "F32"):
                shapes.add(("bf16", *t.shape))
    head = store.head.get(HEAD)
    if head is not None and head.dim() == 2:
        shapes.add(("logits", *head.shape))
    return shapes
