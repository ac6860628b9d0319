"""Device slots for routed experts: the staged path's second level of expert caching (a CUDA device).

On the staged path the ExpertCache (tiers/experts/expert_cache.py) holds experts as read, in pinned host RAM; the
experts a step computes on the device are copied from there into `slots` buffers taken once from the device tier under
--expert-cache-memory, each holding one expert packed in the compute dtype (tiers/weights/slot.py; tensors stored in
another dtype are converted on the device after their copy, through one scratch buffer). An expert stays in its
slot across steps until evicted, so the experts a router favours are copied once, not once a step.

Order is kept by events, never by host waits: a copy into a slot runs after the event recorded when the slot's
last expert was released (the compute that read it has finished), and compute waits on an expert's copy event
only when the expert is first looked up. Eviction follows the host cache's order (ExpertCache.rank: selected least
often, then the layer that comes back last), among the experts the current fetch does not use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from offload.common.errors import OffloadError
from offload.tiers.copy import CopyEngine, Event
from offload.tiers.memory import MemoryTier
from offload.tiers.weights.layout import GroupLayout, Weights
from offload.tiers.weights.slot import SlotLayout, slot_layout

Key = tuple[int, int]  # (layer, expert)


class DeviceExperts:
    """Experts copied to the device, `slots` at a time (see the module docstring). `budget`: bytes of `tier` for
    the slots and the conversion scratch, all taken here."""

    def __init__(
        self, layouts: dict[Key, GroupLayout], copier: CopyEngine, tier: MemoryTier, budget: int, dtype: torch.dtype
    ) -> None:
        self.copier, self.tier, self.budget = copier, tier, budget
        self.packed: dict[Key, SlotLayout] = {k: slot_layout(g, dtype) for k, g in layouts.items()}
        slot_bytes = max(p.nbytes for p in self.packed.values())
        scratch = max(p.convert_bytes for p in self.packed.values())
        self.slot_cost = tier.footprint(slot_bytes)  # bytes
        self.expert_bytes = max(p.copy_bytes for p in self.packed.values())  # the most one expert's copy moves
        self.slots = (budget - (tier.footprint(scratch) if scratch else 0)) // self.slot_cost
        if self.slots <= 0:
            raise OffloadError(
                f"--expert-cache-memory of {budget} bytes holds no expert on {tier.device} (one expert takes "
                f"{self.slot_cost} bytes{f', plus {tier.footprint(scratch)} of conversion scratch' if scratch else ''})"
            )
        self._bufs = [_take(tier, slot_bytes) for _ in range(self.slots)]
        self._scratch = _take(tier, scratch) if scratch else None
        self._free = list(range(self.slots - 1, -1, -1))  # slot indices; pop() takes the lowest
        self._held: dict[Key, int] = {}  # expert -> its slot
        self._after: list[Event | None] = [None] * self.slots  # slot -> the compute to finish before overwriting it
        self._pending: dict[Key, Event] = {}  # copies compute has not been told to wait for yet
        self._in_use: set[Key] = set()  # the current fetch's experts on the device

    def holds(self, key: Key) -> bool:
        return key in self._held

    def cached(self) -> list[Key]:
        return sorted(self._held)

    def begin(self) -> None:
        """A new fetch: the slots the last one used are released after the compute issued so far."""
        if self._in_use:
            event = self.copier.record()
            for key in self._in_use:
                self._after[self._held[key]] = event
        self._in_use = set()

    def use(self, key: Key) -> None:
        """Keep a held expert for the current fetch: no copy of this fetch evicts it."""
        self._in_use.add(key)

    def copy_in(self, key: Key, raw: torch.Tensor, rank: Callable[[Key], tuple]) -> Event:
        """Copy an expert from `raw` (its host buffer as read) into a slot, evicting the held expert lowest by
        `rank` that the current fetch does not use when none is free; the copy's event (the host buffer must
        stay unchanged until it completes)."""
        slot = self._slot(rank)
        packed = self.packed[key]
        event = self.copier.copy(packed.copies(raw, self._bufs[slot], self._scratch), self._after[slot])
        self._held[key] = slot
        self._pending[key] = event
        self._in_use.add(key)
        return event

    def weights(self, key: Key) -> Weights:
        """A held expert's weights on the device, usable by compute issued from now on."""
        event = self._pending.pop(key, None)
        if event is not None:
            self.copier.wait(event)
        return self.packed[key].views(self._bufs[self._held[key]])

    def copy_bytes(self, key: Key) -> int:
        return self.packed[key].copy_bytes

    def close(self) -> None:
        """Wait for copies in flight (their host buffers must outlive them)."""
        self.copier.synchronize()

    def _slot(self, rank: Callable[[Key], tuple]) -> int:
        if self._free:
            return self._free.pop()
        candidates = [k for k in self._held if k not in self._in_use]
        if not candidates:
            raise OffloadError(f"all {self.slots} device slots for experts are in use by one fetch")
        victim = min(candidates, key=rank)
        self._pending.pop(victim, None)
        return self._held.pop(victim)


def _take(tier: MemoryTier, nbytes: int) -> torch.Tensor:
    buf = tier.allocate(nbytes)
    if buf is None:
        raise OffloadError(
            f"--{tier.name}-memory budget of {tier.capacity} bytes cannot hold the device slots for experts "
            f"({tier.footprint(nbytes)} bytes a buffer; {tier.used} already in use): lower --expert-cache-memory or "
            f"raise --{tier.name}-memory"
        )
    return buf
