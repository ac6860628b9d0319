"""Expert streaming: a mixture's routed experts leave their layers' groups for an ExpertCache
(tiers/experts/expert_cache.py).

Each sparse layer's group keeps its dense part (attention, norms, router, shared expert), placed and streamed by
the WeightStore like a dense layer; every "expert{e}.*" tensor goes to the group of (layer, e), named by its bare
matrix name ("gate_proj", "down_proj.scales"), which the cache reads only when the router chooses that expert.

Prefetch starts reads for the next sparse layer while this one computes (EngineConfig.expert_prefetch):
"router" (the default) guesses its experts with a copy of that layer's router and input norm (`Gate`, a few KiB to
a few MiB, resident on the device): when a layer fetches its experts it runs the next layer's router on its own
residual stream (the next layer's input, less one attention and one MLP output) and starts reading each token's
first choice there as a guess (tiers/experts/expert_cache.py). "frequency" prefetches the next layer's experts selected
most often instead. The last sparse layer's next is the first one at the next step, whose hidden state does not exist
yet: it always prefetches by frequency. How often the guesses are right, and what each kind is worth, is measured
by benchmarks/moe.py (docs/benchmarks.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.kernels.rms_norm import fused_rms_norm
from offload.model.registry import Family, model_tensors
from offload.tiers.copy import make_copy_engine
from offload.tiers.experts.expert_cache import ExpertCache, Key, slot_cost
from offload.tiers.experts.expert_slots import DeviceExperts
from offload.tiers.io.base import ReadBackend
from offload.tiers.memory import MemoryTier
from offload.tiers.weights.checkpoint import Checkpoint, ModelTensors, TensorGroup
from offload.tiers.weights.layout import GroupLayout, ModelLayout, Weights, group_layout, model_layout

_EXPERT = re.compile(r"expert(\d+)\.(.+)")
PREFETCH_FACTOR = 2  # experts prefetched by frequency for the first sparse layer: experts_per_token times this


def split_experts(tensors: ModelTensors) -> tuple[ModelTensors, dict[Key, TensorGroup]]:
    """The model's groups without their routed experts, and each expert's group keyed (layer, expert)."""
    layers: list[TensorGroup] = []
    experts: dict[Key, TensorGroup] = {}
    for i, group in enumerate(tensors.layers):
        dense: TensorGroup = {}
        for short, t in group.items():
            if m := _EXPERT.fullmatch(short):
                experts.setdefault((i, int(m[1])), {})[m[2]] = t
            else:
                dense[short] = t
        layers.append(dense)
    return ModelTensors(tensors.embed, tensors.head, tuple(layers)), experts


def model_layouts(
    checkpoint: Checkpoint, family: Family, spec: ModelSpec, split: bool
) -> tuple[ModelLayout, dict[Key, GroupLayout] | None]:
    """The model's read plans; with `split` (expert streaming), sparse layers without their experts and each
    expert's own plan, else every layer whole and None."""
    tensors = model_tensors(family, spec)
    if not split:
        return model_layout(checkpoint, tensors), None
    if not spec.num_experts:
        raise OffloadError(f"--expert-cache-memory streams a mixture's experts; {spec.architecture} has none")
    dense, experts = split_experts(tensors)
    layouts = {
        key: group_layout({s: checkpoint.check(t.name, t.shape, t.dtype, t.row) for s, t in group.items()})
        for key, group in experts.items()
    }
    return model_layout(checkpoint, dense), layouts


def expert_caches(
    layouts: dict[Key, GroupLayout] | None,
    backend: ReadBackend,
    device_tier: MemoryTier,
    host_tier: MemoryTier,
    dtype: torch.dtype,
    budget: int,
    host_budget: int = 0,
    staged: bool | None = None,
) -> tuple[ExpertCache | None, DeviceExperts | None]:
    """The caches the experts stream through, their buffers taken now (None, None: expert streaming is off).

    Direct path (a CPU device): one ExpertCache of `budget` bytes of the device tier. Staged path (a CUDA device;
    `staged` forces it on the CPU, as tests do): device slots of `budget` bytes of the device tier, and an
    ExpertCache in pinned host RAM of `host_budget` bytes of the host tier (0: as many experts as the device
    slots, the least that lets every slot be filled from it in one fetch)."""
    if layouts is None:
        return None, None
    if not (staged if staged is not None else device_tier.device.type != "cpu"):
        return ExpertCache(layouts, backend, device_tier, budget, dtype), None
    slots = DeviceExperts(layouts, make_copy_engine(device_tier.device), device_tier, budget, dtype)
    host_budget = host_budget or slots.slots * slot_cost(layouts, host_tier, dtype)
    return ExpertCache(layouts, backend, host_tier, host_budget, dtype, "--expert-host-memory"), slots


def read_gates(checkpoint: Checkpoint, family: Family, spec: ModelSpec) -> dict[int, tuple[torch.Tensor, ...]]:
    """Each sparse layer's (router input norm [hidden], router [experts, hidden]), as stored, on the CPU; all but
    the first sparse layer's, which no layer guesses for (the last prefetches it by frequency)."""
    tensors = model_tensors(family, spec).layers
    sparse = [i for i in range(spec.num_layers) if spec.sparse(i)]
    return {
        i: tuple(checkpoint.read(checkpoint.check(t.name, t.shape)) for t in (group["post_norm"], group["router"]))
        for i, group in enumerate(tensors)
        if i in sparse[1:]
    }


@dataclass(frozen=True, slots=True)
class Gate:
    """A sparse layer's router and the norm before it, copied to the device: rows 0..experts-1 the router, the
    last row the norm's weight."""

    rows: torch.Tensor  # [experts + 1, hidden]

    def choose(self, hidden: torch.Tensor, eps: float) -> list[int]:
        """The experts this router puts first for the tokens of the residual stream `hidden` [tokens, hidden],
        those first for more tokens first (ties: lower number). A token's first choice is the likeliest to hold
        one layer on (87% vs 65% for its second on the MoE benchmark's checkpoint)."""
        x = fused_rms_norm(hidden, self.rows[-1], eps)[0]
        chosen = torch.argmax(x @ self.rows[:-1].T, dim=-1)
        experts, counts = torch.unique(chosen, return_counts=True)
        return [e for _, e in sorted(zip((-counts).tolist(), experts.tolist(), strict=True))]


@dataclass(frozen=True, slots=True)
class ColdExperts:
    """Where a chosen expert that is not in the device slots runs on the staged path (a CUDA device): "device"
    copies it there from the host cache; "cpu" runs it on the CPU from the host cache, moving its tokens' rows and
    not its weights (Fiddler's choice for cold experts); "auto" prices both for the expert's rows by the cost
    model (scheduler/cost/moe_cost.py) each time a step chooses it."""

    mode: str  # "auto", "device" or "cpu" (COLD_EXPERTS)
    cpu_seconds: Callable[[int], float] | None = None  # rows -> one expert on the CPU, its rows moved both ways
    device_seconds: Callable[[int], float] | None = None  # rows -> one expert's copy to the device and its compute

    def on_cpu(self, rows: int) -> bool:
        if self.mode == "auto":
            return self.cpu_seconds(rows) < self.device_seconds(rows)
        return self.mode == "cpu"


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """One sparse layer's experts, as the model family fetches them (registry.ExpertSource); a micro-batch's last
    fetch of the layer (the one given `hidden`) starts reading the experts `gate` (the next sparse layer's) guesses
    for it, or, without a gate, the `ahead` experts of `next_layer` selected most often. With `slots` (the staged
    path) the experts a fetch runs on the device are copied from `cache` (in host RAM) into the device slots, and
    `cold` says which of those not there already run on the CPU instead."""

    cache: ExpertCache
    layer: int
    next_layer: int
    gate: Gate | None
    eps: float  # the norms' epsilon
    ahead: int  # experts prefetched by frequency when there is no gate; 0: none
    slots: DeviceExperts | None = None
    cold: ColdExperts = ColdExperts("device")

    @property
    def capacity(self) -> int:
        return self.cache.slots if self.slots is None else min(self.cache.slots, self.slots.slots)

    def fetch(
        self, experts: list[int], hidden: torch.Tensor | None = None, rows: list[int] | None = None
    ) -> Mapping[int, Weights]:
        if self.slots is None:
            self.cache.start(self.layer, experts)
            self._prefetch(hidden)
            return self.cache.land(self.layer, experts)
        self.slots.begin()
        held = [e for e in experts if self.slots.holds((self.layer, e))]
        for e in held:
            self.slots.use((self.layer, e))
        rest = [e for e in experts if e not in held]
        self.cache.start(self.layer, rest, on_device=held)
        self._prefetch(hidden)
        counts = dict(zip(experts, rows or [1] * len(experts), strict=True))
        cpu = {e for e in rest if self.cold.on_cpu(counts[e])}
        self.cache.count("cpu_runs", len(cpu))
        landing = _StagedLanding(self, held, list(self.cache.land(self.layer, rest)), cpu)
        for e in rest:  # copies of the experts already in host RAM start now, behind the compute queued before
            if e not in cpu and self.cache.landed(self.layer, e):
                landing.copy(e)
        return landing

    def _prefetch(self, hidden: torch.Tensor | None) -> None:
        if hidden is not None and self.gate is not None:
            self.cache.prefetch(self.next_layer, self.gate.choose(hidden, self.eps), guess=True)
        elif hidden is not None and self.ahead:
            self.cache.prefetch(self.next_layer, self.cache.predict(self.next_layer, self.ahead))


class _StagedLanding(Mapping[int, Weights]):
    """A staged fetch's experts, iterated in the order to run them: those on the device, then those in host RAM
    (copied to the device before those run on the CPU, so the copies overlap the CPU's work), then the rest in the
    order their reads started. An expert bound for the device is copied when first looked up, if not before."""

    def __init__(self, source: RoutedExperts, held: list[int], landing: list[int], cpu: set[int]) -> None:
        self._source, self._cpu = source, cpu
        self._on_device = set(held)
        cache, layer = source.cache, source.layer
        rest = sorted(enumerate(landing), key=lambda p: (not cache.landed(layer, p[1]), p[1] in cpu, p[0]))
        self._order = held + [e for _, e in rest]

    def copy(self, expert: int) -> None:
        source = self._source
        key = (source.layer, expert)
        event = source.slots.copy_in(key, source.cache.raw(*key), source.cache.rank)
        source.cache.copied(*key, event, source.slots.copy_bytes(key))
        self._on_device.add(expert)

    def __getitem__(self, expert: int) -> Weights:
        if expert not in self._order:
            raise KeyError(expert)
        if expert in self._cpu:
            return self._source.cache.weights(self._source.layer, expert)
        if expert not in self._on_device:
            self.copy(expert)
        return self._source.slots.weights((self._source.layer, expert))

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


def layer_experts(
    cache: ExpertCache | None,
    spec: ModelSpec,
    gates: dict[int, tuple[torch.Tensor, ...]],
    dtype: torch.dtype,
    prefetch: str = "router",
    slots: DeviceExperts | None = None,
    cold: ColdExperts | None = None,
) -> dict[int, RoutedExperts]:
    """Each sparse layer's experts bound to the cache (and, staged, to the device `slots`, with `cold` choosing
    where the experts not there run), each prefetching the next sparse layer's by `prefetch` ("router": with a
    copy of its gate, from `gates` (read_gates), copied now to the compute device outside the caches' budgets),
    the last by frequency (the next step comes back to the first). Empty when expert streaming is off."""
    sparse = [i for i in range(spec.num_layers) if spec.sparse(i)]
    if cache is None or not sparse:
        return {}
    after = dict(zip(sparse, sparse[1:] + sparse[:1], strict=True))
    ahead = min(spec.experts_per_token * PREFETCH_FACTOR, spec.num_experts)
    tier = cache.tier if slots is None else slots.tier  # where the hidden state the gates read lives
    out = {}
    for i in sparse:
        nxt = after[i]
        gate = _gate(tier, gates[nxt], dtype) if prefetch == "router" and nxt > i else None
        out[i] = RoutedExperts(cache, i, nxt, gate, spec.rms_norm_eps, ahead, slots, cold or ColdExperts("device"))
    return out


def _gate(tier: MemoryTier, norm_router: tuple[torch.Tensor, ...], dtype: torch.dtype) -> Gate:
    norm, router = norm_router
    shape = (router.shape[0] + 1, router.shape[1])
    nbytes = shape[0] * shape[1] * dtype.itemsize
    buf = tier.allocate(nbytes)
    if buf is None:
        raise OffloadError(
            f"--{tier.name}-memory budget of {tier.capacity} bytes cannot hold the routers' copies for expert "
            f"prefetch ({nbytes} bytes a layer; {tier.used} already in use): raise --{tier.name}-memory"
        )
    rows = buf[:nbytes].view(dtype).view(shape)
    rows[:-1].copy_(router)
    rows[-1].copy_(norm)
    return Gate(rows)
