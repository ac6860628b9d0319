"""Expert streaming: a mixture's routed experts leave their layers' groups for an ExpertCache (tiers/experts.py).

Each sparse layer's group keeps its dense part (attention, norms, router, shared expert), placed and streamed by
the WeightStore like a dense layer; every "expert{e}.*" tensor goes to the group of (layer, e), named by its bare
matrix name ("gate_proj", "down_proj.scales"), which the cache reads only when the router chooses that expert.
"""

from __future__ import annotations

import re

import torch

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.model.registry import Family, model_tensors
from tiers.checkpoint import Checkpoint, ModelTensors, TensorGroup
from tiers.experts import ExpertCache, Key, LayerExperts
from tiers.io.base import ReadBackend
from tiers.layout import GroupLayout, ModelLayout, group_layout, model_layout
from tiers.memory import MemoryTier

_EXPERT = re.compile(r"expert(\d+)\.(.+)")
PREFETCH_FACTOR = 2  # experts prefetched for the next sparse layer: experts_per_token times this


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
        key: group_layout({s: checkpoint.check(t.name, t.shape, t.dtype) for s, t in group.items()})
        for key, group in experts.items()
    }
    return model_layout(checkpoint, dense), layouts


def expert_cache(
    layouts: dict[Key, GroupLayout] | None, backend: ReadBackend, tier: MemoryTier, dtype: torch.dtype, budget: int
) -> ExpertCache | None:
    """The cache the experts stream through, its buffers taken from `tier` now (None: expert streaming is off)."""
    if layouts is None:
        return None
    if tier.device.type != "cpu":
        raise OffloadError(
            f"--expert-cache-memory on CUDA (the staged path) is not supported yet: experts would need pinned staging "
            f"and copies to {tier.device}; run without it (whole layers stream) or on the CPU"
        )
    return ExpertCache(layouts, backend, tier, budget, dtype)


def layer_experts(cache: ExpertCache | None, spec: ModelSpec) -> dict[int, LayerExperts]:
    """Each sparse layer's experts bound to the cache, each prefetching for the next sparse layer (the last for
    the first: the next step comes back to it). Empty when expert streaming is off."""
    sparse = [i for i in range(spec.num_layers) if spec.sparse(i)]
    if cache is None or not sparse:
        return {}
    ahead = min(spec.experts_per_token * PREFETCH_FACTOR, spec.num_experts)
    after = dict(zip(sparse, sparse[1:] + sparse[:1], strict=True))
    return {i: LayerExperts(cache, i, after[i], ahead) for i in sparse}
