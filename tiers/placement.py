"""Choose each layer's tier from the budgets: resident layers first, then host RAM, the rest streamed."""

from __future__ import annotations

from offload.config import Policy
from offload.errors import OffloadError
from tiers.budget import format_size


def plan_policy(
    layer_bytes: list[int], slot_bytes: int, device_free: int | None, host_free: int, ring_slots: int
) -> Policy:
    """The placement for layers costing `layer_bytes` each (what they take resident) in the room left.

    device_free: device bytes left after the embedding, head and KV cache (None: no budget, all resident);
    slot_bytes: what one ring slot costs (the largest streamed layer); host_free: host bytes for layers.
    """
    n = len(layer_bytes)
    if device_free is None or sum(layer_bytes) <= device_free:
        return Policy(("device",) * n)
    tiers = _fill(layer_bytes, device_free, host_free)
    if "nvme" not in tiers:  # device and host RAM hold everything: nothing streams, no ring needed
        return Policy(tiers)
    room = device_free - ring_slots * slot_bytes
    if room < 0:
        raise OffloadError(
            f"--device-memory is too small: after the embedding, head and KV cache {format_size(max(device_free, 0))} "
            f"is left, and streaming needs {ring_slots} layer buffers of {format_size(slot_bytes)} "
            f"({format_size(ring_slots * slot_bytes)})"
        )
    tiers = _fill(layer_bytes, room, host_free)
    return Policy(tiers, ring_slots=ring_slots if "nvme" in tiers else 0)


def _fill(layer_bytes: list[int], device_room: int, host_room: int) -> tuple[str, ...]:
    """Layers in order: on the device while it has room, then in host RAM, then streamed from NVMe."""
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
    return tuple(tiers)
