"""The search over policies: place each candidate's layers under the budgets, predict it with the cost model,
and rank the predictions by throughput. `offload plan` prints what `search` returns; the engine asks it for its
batch when the user does not fix one.

Plain numbers in, plain numbers out, like the cost model it drives.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from offload.common.config import BLOCK_SIZE, KV_GROUP_SIZE, RING_SLOTS, Policy
from offload.common.hardware import HardwareProfile
from offload.common.model_config import ModelSpec
from offload.common.tier import Tier
from offload.scheduler.cost.moe_cost import average_routed_params
from offload.scheduler.cost.predict import (
    Budgets,
    Candidate,
    Context,
    Prediction,
    Workload,
    capacity,
    make_context,
    predict,
    tier_memory,
)

KV_TIERS = (Tier.DEVICE, Tier.HOST)  # where a candidate's KV cache may live
WHOLE_MACHINE = Budgets()  # no budget: every tier as big as the hardware profile says (frozen, safe to share)
# expert_cache for place_layers: what the device budget leaves once every layer's dense part is resident (at least
# one token's experts)
AUTO_EXPERT_CACHE = -1


def place_layers(
    shape: ModelSpec,
    hw: HardwareProfile,
    workload: Workload,
    batch: int,
    micro_batches: int,
    kv_tier: str = Tier.DEVICE,
    weight_bits: int = 16,
    kv_bits: int = 16,
    *,
    dtype: str | None = None,
    budgets: Budgets = WHOLE_MACHINE,
    ring_slots: int = RING_SLOTS,
    block_size: int = BLOCK_SIZE,
    kv_group: int = KV_GROUP_SIZE,
    expert_cache: int = 0,
) -> Candidate:
    """The candidate with as many layers on the device as fit beside the KV cache and activations, then as
    many in host RAM, the rest streamed from disk (every layer costs the same, so these counts are optimal), those
    off the device spread through the model as Policy.fill places them.
    Its policy's ring is `ring_slots` when some layer passes through the device ring, else 0.

    expert_cache: bytes of the device budget for a mixture's expert cache (the layers placed are then their dense
    parts), AUTO_EXPERT_CACHE for what the budget leaves once every dense part is resident, 0 for none."""
    ctx = make_context(shape, hw, dtype, block_size, kv_group)
    n = shape.num_layers
    cap = capacity(ctx.hw, budgets)
    if expert_cache == AUTO_EXPERT_CACHE:
        bare = Candidate(batch, micro_batches, Policy(()), kv_tier, weight_bits, kv_bits)
        expert_cache = _auto_expert_cache(ctx, bare, workload, cap[Tier.DEVICE])

    def candidate(policy: Policy) -> Candidate:
        return Candidate(batch, micro_batches, policy, kv_tier, weight_bits, kv_bits, expert_cache)

    w = ctx.placed_bytes(candidate(Policy(())))

    def fill(device_room: float, host_room: float) -> Policy:
        # in whole layers of w bytes: floor division is exact where subtracting float bytes layer by layer is not
        return Policy.fill([1] * n, int(device_room // w), int(host_room // w), ring_slots)

    def place(embed_tier: str) -> Policy | None:
        fixed = tier_memory(ctx, candidate(Policy((), embed_tier=embed_tier)), workload)  # the expert cache included
        device_room = cap[Tier.DEVICE] - fixed[Tier.DEVICE]
        host_room = cap[Tier.HOST] - fixed[Tier.HOST]
        if n * w <= device_room:
            return Policy.from_counts(n, 0, 0)
        # on a CPU machine host layers are read in place; on CUDA they pass through the device ring like disk layers
        if ctx.on_cpu:
            policy = fill(device_room, host_room)
            if Tier.NVME not in policy.layer_tiers:
                return policy
        device_room -= ring_slots * w  # something passes through the ring of device slots
        if device_room < 0:
            return None  # does not fit
        policy = fill(device_room, host_room)
        if Tier.NVME in policy.layer_tiers and not ctx.on_cpu:  # disk reads land in pinned staging buffers on the way
            policy = fill(device_room, host_room - ring_slots * w)
        return Policy(policy.layer_tiers, ring_slots)

    resident = place(Tier.DEVICE)
    stored = None
    if ctx.embed_storable and (resident is None or resident.counts[0] < n):
        stored = place(Tier.NVME)
    chosen = Policy.choose_embedding(resident, stored, host_copied=not ctx.on_cpu)  # as the engine places it
    # None: does not fit, and `predict` reports by how much
    return candidate(chosen or Policy.from_counts(0, 0, n, ring_slots))


def _auto_expert_cache(ctx: Context, bare: Candidate, workload: Workload, device_cap: int) -> int:
    """Bytes of device budget left for the expert cache once every layer's dense part is resident beside the
    KV cache and activations of `bare` (no layer placed, no cache), less one expert; at least one token's experts.
    The expert kept free holds what the engine charges and this count does not (each buffer's alignment, a GGUF
    file's float norms and routers priced here at its blocks' bits): filled to the byte, the 26 GB Mixtral-shape
    file's plan left its engine 24 MB short of its last dense part, which then streamed."""
    s = ctx.shape
    dense = ctx.weight_bytes(s.params.layer - average_routed_params(s), bare.weight_bits) * s.num_layers
    one = ctx.expert_bytes(bare.weight_bits)
    room = device_cap - tier_memory(ctx, bare, workload)[Tier.DEVICE] - dense - one
    return int(max(room, s.experts_per_token * one))


def search(
    shape: ModelSpec,
    hw: HardwareProfile,
    workload: Workload,
    *,
    dtype: str | None = None,
    budgets: Budgets = WHOLE_MACHINE,
    batches: Iterable[int] | None = None,
    micro_batches: Iterable[int] = (1, 2, 4, 8, 16, 32),
    kv_tiers: Iterable[str] = KV_TIERS,
    quantized: bool = False,
    ring_slots: int = RING_SLOTS,
    block_size: int = BLOCK_SIZE,
    kv_group: int = KV_GROUP_SIZE,
    kv_bits: Iterable[int] | None = None,
    weight_bits: Iterable[int] | None = None,
    expert_caches: Iterable[int] | None = None,
) -> list[Prediction]:
    """Every candidate's prediction, best first: those that fit by throughput, then the rest by overflow.

    quantized: also 8- and 4-bit weights and KV cache, besides the compute dtype's own width.
    kv_bits: the KV cache widths to consider instead (the engine's --kv-dtype, when it is fixed).
    weight_bits: the weight widths to consider instead (a checkpoint's, when it is quantized).
    expert_caches: a mixture's expert cache sizes to consider (place_layers' expert_cache); None: experts with
    their layers (0) and streamed through what the budget leaves beside resident dense parts (AUTO_EXPERT_CACHE).
    """
    full = 8 * make_context(shape, hw, dtype, block_size).dtype_bytes
    widths = (full, 8, 4) if quantized else (full,)
    kv_bits = tuple(kv_bits) if kv_bits is not None else widths
    weight_bits = tuple(weight_bits) if weight_bits is not None else widths
    if batches is None:
        top = workload.requests or 4096
        batches = sorted({1 << i for i in range(13) if 1 << i <= top} | ({top} if workload.requests else set()))
    kw = dict(dtype=dtype, budgets=budgets, block_size=block_size, kv_group=kv_group)
    if expert_caches is None:
        expert_caches = (0, AUTO_EXPERT_CACHE) if shape.num_experts else (0,)
    expert_caches = tuple(expert_caches)
    place = functools.partial(place_layers, shape, hw, workload, ring_slots=ring_slots, **kw)
    out = []
    for batch in batches:
        for mb in micro_batches:
            if mb > batch:
                continue
            for kv_tier in kv_tiers:
                if kv_tier == Tier.HOST and hw.device_kind == "cpu":
                    continue  # host RAM is the device's own memory: no different from "device"
                for wb in weight_bits:
                    for kb in kv_bits:
                        for cache in expert_caches:
                            cand = place(batch, mb, kv_tier, wb, kb, expert_cache=cache)
                            out.append(predict(shape, hw, workload, cand, **kw))  # the ring is the candidate's
    return rank(out)


def rank(predictions: list[Prediction]) -> list[Prediction]:
    fits = sorted((p for p in predictions if p.fits), key=lambda p: (-p.tokens_per_second, p.memory[Tier.DEVICE]))
    rest = sorted((p for p in predictions if not p.fits), key=lambda p: sum(p.overflow.values()))
    return fits + rest


def best(predictions: list[Prediction], runnable_only: bool = False) -> Prediction | None:
    """The fastest prediction that fits (and that this engine can run, when asked)."""
    for p in predictions:
        if p.fits and (not runnable_only or not p.unsupported):
            return p
    return None
