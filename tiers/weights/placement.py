"""Choose each layer's tier from the budgets: as many layers resident as fit, then in host RAM, the rest streamed, those
off the device spread through the model (Policy.fill); and whether the token embedding stays in storage."""

from __future__ import annotations

import functools

import torch

from offload.common.config import Policy
from offload.common.errors import OffloadError
from offload.common.sizes import format_size
from offload.common.tier import Tier
from offload.tiers.device import DeviceTier
from offload.tiers.host import HostTier
from offload.tiers.weights.checkpoint import TORCH_DTYPES, held_dtype
from offload.tiers.weights.embedding import read_buffer_bytes, storable
from offload.tiers.weights.layout import GroupLayout, ModelLayout, TensorAt, load_buffer_bytes
from offload.tiers.weights.slot import slot_layout


def place_by_bytes(
    layer_bytes: list[int], slot_bytes: int, device_free: int | None, host_free: int, ring_slots: int
) -> Policy:
    """The placement for layers costing `layer_bytes` each (what they take resident) in the room left.

    device_free: device bytes left after the embedding, head and KV cache (None: no budget, all resident);
    slot_bytes: what one ring slot costs (the largest streamed layer); host_free: host bytes for layers.
    """
    n = len(layer_bytes)
    if device_free is None or sum(layer_bytes) <= device_free:
        return Policy((Tier.DEVICE,) * n)
    policy = Policy.fill(layer_bytes, device_free, host_free, ring_slots)
    if not policy.ring_slots:  # device and host RAM hold everything: nothing streams, no ring needed
        return policy
    room = device_free - ring_slots * slot_bytes
    if room < 0:
        raise OffloadError(
            f"--device-memory is too small: after the embedding, head and KV cache {format_size(max(device_free, 0))} "
            f"is left, and streaming needs {ring_slots} layer buffers of {format_size(slot_bytes)} "
            f"({format_size(ring_slots * slot_bytes)})"
        )
    return Policy.fill(layer_bytes, room, host_free, ring_slots)


def group_cost(layout: GroupLayout, dtype: torch.dtype, tier: DeviceTier, staged: bool | None = None) -> int:
    """Bytes `tier` is charged for a group loaded in compute dtype `dtype`. Direct path: its read buffer (the slot,
    or the piece a wholly converted group is read through: tiers/weights/layout.py's load_buffer_bytes) plus copies of
    tensors stored in another dtype. Staged path (default: when the device is not the CPU): its tensors
    packed in `dtype` (the read buffer is host staging)."""
    if staged if staged is not None else tier.device.type != "cpu":
        return tier.footprint(slot_layout(layout, dtype).nbytes)

    def as_dtype(t: TensorAt) -> int:
        return t.nbytes // TORCH_DTYPES[t.dtype][1] * dtype.itemsize

    converted = sum(as_dtype(t) for t in layout.tensors if held_dtype(t.dtype, dtype) != TORCH_DTYPES[t.dtype][0])
    return tier.footprint(load_buffer_bytes(layout, dtype)) + converted


def place_weights(
    layout: ModelLayout,
    dtype: torch.dtype,
    device_tier: DeviceTier,
    host_tier: HostTier,
    ring_slots: int,
    staged: bool | None = None,
    table_held: bool = False,
) -> Policy:
    """Place the layers in what the tiers have left (the KV cache is already on the device), costed exactly as
    WeightStore will charge them. Host RAM holds layers only under a host budget (see HostTier).

    Staged path (default: when the device is not the CPU): host layers are copied to the device every pass, so
    any layer off the device needs the device ring (and, when tensors change dtype, one conversion scratch
    buffer); host RAM holds the ring's staging slots first whenever some layer still streams from disk.

    The token embedding is left in storage (tiers/weights/embedding.py) by Policy.choose_embedding's rule, as the cost
    model places it: its bytes buy resident layers, and a step reads only its tokens' rows. With `table_held` the
    table is resident whatever the rule: the process holds it anyway (a `self` draft's, shared)."""
    staged = device_tier.device.type != "cpu" if staged is None else staged
    cost = functools.partial(group_cost, dtype=dtype, tier=device_tier, staged=staged)
    free = device_tier.num_free
    host_free = host_tier.num_free or 0  # bytes; no host budget: no layer is kept in host RAM
    place = functools.partial(_place, layout, dtype, device_tier, host_tier, ring_slots, staged)
    resident = stored = None
    failure: OffloadError | None = None  # why the embedding cannot stay resident, if it cannot
    may_store = free is not None and storable(layout.embed, layout.head) and not table_held
    try:
        resident = place(None if free is None else free - cost(layout.embed) - cost(layout.head), host_free)
    except OffloadError as exc:
        if not may_store:
            raise
        failure = exc
    if may_store and (resident is None or resident.counts[0] < len(layout.layers)):
        buffer = read_buffer_bytes(layout.embed)
        room, host_room = free - cost(layout.head), host_free
        if not staged:  # the rows are read into the device's own memory
            room -= device_tier.footprint(buffer)
        elif host_tier.capacity is not None:  # the rows are read into host RAM, then copied
            host_room -= host_tier.footprint(buffer)
        if host_room >= 0:
            try:
                stored = place(room, host_room)
            except OffloadError:  # it does not fit this way either: the resident placement (or its error) stands
                stored = None
    chosen = Policy.choose_embedding(resident, stored, host_copied=staged)
    if chosen is None:
        assert failure is not None
        raise failure
    return chosen


def _place(
    layout: ModelLayout,
    dtype: torch.dtype,
    device_tier: DeviceTier,
    host_tier: HostTier,
    ring_slots: int,
    staged: bool,
    free: int | None,
    host_free: int,
) -> Policy:
    """place_weights' layers, given the device bytes `free` beside the embedding and head and the host bytes
    `host_free` for layers."""
    cost = functools.partial(group_cost, dtype=dtype, tier=device_tier, staged=staged)
    layer_costs = [cost(g) for g in layout.layers]
    if not staged:
        return place_by_bytes(layer_costs, max(layer_costs), free, host_free, ring_slots)
    policy = place_by_bytes(layer_costs, max(layer_costs), free, 0, ring_slots)  # as if every layer off it streamed
    scratch = max(slot_layout(g, dtype).convert_bytes for g in layout.layers)
    if policy.ring_slots and scratch:
        policy = place_by_bytes(layer_costs, max(layer_costs), free - device_tier.footprint(scratch), 0, ring_slots)
    off = [i for i, t in enumerate(policy.layer_tiers) if t != Tier.DEVICE]
    host_cost = {i: host_tier.footprint(layout.layers[i].slot_bytes) for i in off}  # bytes, kept as read
    room = host_free
    if sum(host_cost.values()) > host_free:  # some layers will stream: their staging slots come first
        staging = ring_slots * max(host_cost.values())
        if host_tier.capacity is not None and staging > host_free:
            raise OffloadError(
                f"--host-memory is too small: {format_size(host_free)} of host RAM is left for weights, and "
                f"streaming from disk stages layers in {ring_slots} pinned buffers of "
                f"{format_size(max(host_cost.values()))} ({format_size(staging)})"
            )
        room -= staging
    tiers = list(policy.layer_tiers)
    for i in off:
        if host_cost[i] <= room:
            tiers[i] = Tier.HOST
            room -= host_cost[i]
    return Policy(tuple(tiers), ring_slots=policy.ring_slots)
