"""The rings non-resident layers pass through on their way to the compute device, a bounded set of buffers each.

Both read layers ahead of the engine in cyclic order (the last layers of a step, then the first of the next), so
memory never grows with model size or run length, and neither ever reads a layer the engine did not place off
the device. `DirectRing` (CPU device): NVMe reads land straight in device slots, which are host RAM.
`StagedRing` (CUDA, or any device when asked): NVMe -> pinned host staging slot -> device slot via the copy
engine; "host" layers skip the disk and are only copied. The buffers NVMe reads land in (device slots, staging
slots) are tiers/weights/landing.py's: page-locked by the read backend where it reads into those faster.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import torch

from offload.common.errors import OffloadError
from offload.common.tier import Tier
from offload.tiers.copy import DONE, CopyEngine, Event
from offload.tiers.io.base import ReadBackend, ReadRequest
from offload.tiers.memory import MemoryTier, take
from offload.tiers.weights.landing import LandingBuffers
from offload.tiers.weights.layout import GroupLayout, Weights
from offload.tiers.weights.slot import SlotLayout, slot_layout


def read(backend: ReadBackend, layout: GroupLayout, buf: torch.Tensor) -> list[ReadRequest]:
    """Start reading a group's runs into `buf` (a host buffer of at least layout.slot_bytes)."""
    return [backend.submit(r.path, r.offset, r.nbytes, buf[r.slot_offset :]) for r in layout.runs]


class Ring(ABC):
    """Hands out layers in the engine's order. Invariant: every acquire is followed by a release of that layer
    before the same layer is acquired again; acquiring out of order is allowed and restarts the read-ahead.

    Subclasses say where a drained read's buffer goes back (`_give_back`), how reading resumes after a restart
    (`_read_ahead`) and what closing gives back (`_close_buffers`); a ring that copies extends `settle` and
    `_restart_at` to wait for and drop its copies."""

    def __init__(self, order: list[int]) -> None:
        self.order = order  # the layers through the ring, in the engine's order
        self.stall_seconds = 0.0  # host time spent waiting for reads (and, staged, for a staging slot's copy)
        self.h2d_bytes = 0  # bytes copied host -> device (copies issued)
        self._reading: deque[_Reading] = deque()  # the next layers in order, reads started (a host layer's: none)
        self._next = 0  # index into order of the next layer to read
        self._closed = False

    @abstractmethod
    def acquire(self, layer: int) -> Weights:
        """Layer `layer`'s weights, usable by compute issued from now on."""

    @abstractmethod
    def release(self, layer: int) -> None:
        """The compute issued so far is the last to read `layer`: its slot may be refilled after it."""

    def settle(self) -> None:
        """Wait for reads and copies in flight, so byte counts are final; the ring stays usable."""
        for r in self._reading:
            for req in r.requests:
                req.wait()

    def close(self) -> None:
        """Wait for every read and copy in flight, then give the ring's buffers back (weights acquired from it are
        not to be used afterwards). Closing again does nothing; a read that failed is raised once all have ended."""
        if self._closed:
            return
        self._closed = True
        failed: OffloadError | None = None
        for r in self._reading:
            for req in r.requests:
                try:
                    req.wait()
                except OffloadError as exc:  # that read has ended all the same: nothing lands in its buffer later
                    failed = failed or exc
        self._reading.clear()
        self._close_buffers()
        if failed is not None:
            raise failed

    @abstractmethod
    def _close_buffers(self) -> None:
        """Every read has landed: wait for copies in flight, and give back the buffers the ring allocated."""

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("the weight ring is closed: its buffers are gone")

    def _wait(self, requests: list[ReadRequest]) -> None:
        start = time.perf_counter()
        for r in requests:
            r.wait()
        self.stall_seconds += time.perf_counter() - start

    def _restart_at(self, layer: int) -> None:
        """Out-of-order access (not the engine's layer order): drain the ring and read from `layer` on."""
        for r in self._reading:
            self._wait(r.requests)  # a buffer is given back only once nothing is landing in it
            self._give_back(r)
        self._reading.clear()
        self._next = self.order.index(layer)
        self._read_ahead()

    @abstractmethod
    def _give_back(self, drained: _Reading) -> None:
        """A queued layer is dropped, its reads all landed: its buffer may take another read."""

    @abstractmethod
    def _read_ahead(self) -> None:
        """Queue layers from order[_next] on, at least one when the queue is empty."""


@dataclass(slots=True)
class _Reading:
    layer: int
    buf: torch.Tensor  # a staging slot (staged) or a device slot (direct), or a host layer's own buffer
    requests: list[ReadRequest]  # empty for a host layer


class DirectRing(Ring):
    """`slots` device slots on a CPU device; each takes the NVMe reads of the next streamed layer once released.
    Tensors stored in another dtype are converted at acquire into copies charged to the device tier."""

    def __init__(
        self,
        layouts: dict[int, GroupLayout],
        backend: ReadBackend,
        device_tier: MemoryTier,
        dtype: torch.dtype,
        slots: int,
    ) -> None:
        super().__init__(sorted(layouts))  # the streamed layers
        self.layouts, self.backend, self.device_tier, self.dtype = layouts, backend, device_tier, dtype
        slot_bytes = max((g.slot_bytes for g in layouts.values()), default=0)
        count = slots if self.order else 0
        self._landing = LandingBuffers(device_tier, backend, slot_bytes, count, "a ring slot for streamed layers")
        self._free = list(self._landing.buffers)
        self._acquired: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # layer -> (slot, converted)
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Start reading the next streamed layers, in cyclic order, into every free slot."""
        while self._free:
            layer = self.order[self._next]
            self._next = (self._next + 1) % len(self.order)
            slot = self._free.pop()
            self._reading.append(_Reading(layer, slot, read(self.backend, self.layouts[layer], slot)))

    def acquire(self, layer: int) -> Weights:
        self._check_open()
        if not self._reading or self._reading[0].layer != layer:
            self._restart_at(layer)
        head = self._reading.popleft()
        self._wait(head.requests)
        converted: list[torch.Tensor] = []
        weights = convert(self.layouts[layer].views(head.buf), self.dtype, self.device_tier, converted)
        self._acquired[layer] = (head.buf, converted)
        return weights

    def release(self, layer: int) -> None:
        slot, converted = self._acquired.pop(layer)
        for t in converted:
            self.device_tier.free(t)
        if not self._closed:  # a closed ring's slots are given back already
            self._free.append(slot)
            self._read_ahead()

    def _give_back(self, drained: _Reading) -> None:
        self._free.append(drained.buf)

    def _close_buffers(self) -> None:
        self._free.clear()
        self._landing.close()


def convert(views: Weights, dtype: torch.dtype, tier: MemoryTier, keep: list[torch.Tensor]) -> Weights:
    """Views in compute dtype `dtype` (integer tensors, quantized weights, as stored); converted copies are charged
    to `tier` and listed in `keep`."""
    out = {}
    for short, view in views.items():
        if view.dtype == dtype or not view.dtype.is_floating_point:
            out[short] = view
            continue
        converted = view.to(dtype)
        if not tier.adopt(converted):
            raise OffloadError(
                f"--{tier.name}-memory budget of {tier.capacity} bytes cannot hold {short} converted to "
                f"{str(dtype).removeprefix('torch.')} ({converted.numel() * converted.element_size()} bytes)"
            )
        keep.append(converted)
        out[short] = converted
    return out


@dataclass(slots=True)
class _Copied:
    layer: int
    slot: torch.Tensor  # the device slot the copy fills
    event: Event  # completes when the copy has landed


class StagedRing(Ring):
    """Layers reach the device through host RAM; every buffer is allocated once, here.

    Host RAM (the host tier): "host" layers are read once into pinned buffers of their own; "nvme" layers are
    read, `slots` layers ahead, into `slots` pinned staging slots. Device (the device tier): `slots` device slots,
    each holding one layer packed in the compute dtype (tiers/weights/slot.py), and one scratch buffer when some tensor
    is stored in another dtype (converted on the device, on the copy stream, after its copy).

    Order, kept by events and never by a host wait on a copy: a layer's copy into a device slot waits on the
    event `release` recorded for the slot's previous layer, so it never overwrites weights that queued compute
    still reads; `acquire` makes the compute stream wait on the copy's event; a staging slot takes its next
    read only once its copy's event has completed. Copies are issued in layer order: a host layer's as soon as
    a device slot is free, a streamed layer's when `acquire` needs it and its reads have landed (the host runs
    ahead of the device, so the copy still overlaps the compute queued for the layers before it).
    """

    def __init__(
        self,
        layouts: dict[int, GroupLayout],
        tiers: dict[int, str],
        backend: ReadBackend,
        copier: CopyEngine,
        device_tier: MemoryTier,
        host_tier: MemoryTier,
        dtype: torch.dtype,
        slots: int,
    ) -> None:
        super().__init__(sorted(layouts))
        self.layouts, self.backend, self.copier = layouts, backend, copier
        self.slots = slots
        self.packed: dict[int, SlotLayout] = {i: slot_layout(g, dtype) for i, g in layouts.items()}
        self._host: dict[int, torch.Tensor] = {}  # host layer -> its bytes as read, pinned
        for i in self.order:
            if tiers[i] == Tier.HOST:
                self._host[i] = take(host_tier, layouts[i].slot_bytes, f"layer {i} in host RAM")
                self._wait(read(backend, layouts[i], self._host[i]))
        streamed = [layouts[i].slot_bytes for i in self.order if tiers[i] == Tier.NVME]
        count = slots if streamed else 0
        what = "a staging buffer for streamed layers"
        self._landing = LandingBuffers(host_tier, backend, max(streamed, default=0), count, what)
        self._staging: deque[tuple[torch.Tensor, Event]] = deque((buf, DONE) for buf in self._landing.buffers)
        slot_bytes = max((p.nbytes for p in self.packed.values()), default=0)
        # device slot -> the event after which it may be overwritten (None: never used)
        self._slots: deque[tuple[torch.Tensor, Event | None]] = deque(
            (take(device_tier, slot_bytes, "a ring slot for layers off the device"), None)
            for _ in self.order[:1] * slots
        )
        scratch = max((p.convert_bytes for p in self.packed.values()), default=0)
        self._scratch = take(device_tier, scratch, "a buffer for dtype conversion") if scratch else None
        self._copied: deque[_Copied] = deque()  # the layers before those of _reading, copies issued
        self._acquired: dict[int, torch.Tensor] = {}  # layer -> its device slot
        self._advance()

    def acquire(self, layer: int) -> Weights:
        self._check_open()
        self._advance()  # staging slots whose copies landed since the last call take reads before any wait
        if not self._copied or self._copied[0].layer != layer:
            self._bring(layer)
        entry = self._copied.popleft()
        self.copier.wait(entry.event)
        self._acquired[layer] = entry.slot
        self._advance()
        return self.packed[layer].views(entry.slot)

    def release(self, layer: int) -> None:
        self._slots.append((self._acquired.pop(layer), self.copier.record()))
        self._advance()

    def settle(self) -> None:
        super().settle()
        self.copier.synchronize()

    def _close_buffers(self) -> None:
        self.copier.synchronize()  # copies out of the staging slots have landed
        self._staging.clear()
        self._landing.close()

    def _bring(self, layer: int) -> None:
        """Copy `layer` next: it is the next one due (waiting for its reads), or the ring restarts at it."""
        due = self._reading[0].layer if self._reading else self.order[self._next]
        if self._copied or due != layer:
            self._restart_at(layer)
        elif not self._reading:
            self._enqueue(block=True)  # succeeds: with nothing queued every staging slot is in _staging
        if not self._copy_next(block=True):
            raise OffloadError(f"layer {layer}: all {self.slots} ring slots are acquired; release one first")

    def _advance(self) -> None:
        """Start all that needs no host wait: reads into staging slots whose copies have landed, and copies of
        queued layers already in host RAM into free device slots."""
        while (len(self._reading) < self.slots and self._enqueue(block=False)) or self._copy_next(block=False):
            pass

    def _enqueue(self, block: bool) -> bool:
        """Queue the next layer in cyclic order, starting its reads if it streams. False, queueing nothing, when
        no staging slot is free, or the oldest one's copy is still in flight and `block` is False."""
        layer = self.order[self._next]
        if layer in self._host:
            self._reading.append(_Reading(layer, self._host[layer], []))
        else:
            if not self._staging:
                return False
            buf, event = self._staging[0]
            if not event.query():
                if not block:
                    return False
                start = time.perf_counter()
                event.synchronize()
                self.stall_seconds += time.perf_counter() - start
            self._staging.popleft()
            self._reading.append(_Reading(layer, buf, read(self.backend, self.layouts[layer], buf)))
        self._next = (self._next + 1) % len(self.order)
        return True

    def _copy_next(self, block: bool) -> bool:
        """Copy the first queued layer into a free device slot; only with `block` does it wait for the layer's reads.
        False, copying nothing, when nothing is queued, no device slot is free, or reads are pending without `block`."""
        if not self._reading or not self._slots or (self._reading[0].requests and not block):
            return False
        head = self._reading.popleft()
        self._wait(head.requests)
        slot, after = self._slots.popleft()
        packed = self.packed[head.layer]
        event = self.copier.copy(packed.copies(head.buf, slot, self._scratch), after)
        self.h2d_bytes += packed.copy_bytes
        if head.layer not in self._host:  # a staging slot: free for the next read once this copy has landed
            self._staging.append((head.buf, event))
        self._copied.append(_Copied(head.layer, slot, event))
        return True

    def _give_back(self, drained: _Reading) -> None:
        if drained.layer not in self._host:
            self._staging.append((drained.buf, DONE))  # taken once its last copy had landed; nothing copied since

    def _read_ahead(self) -> None:
        self._enqueue(block=True)  # one layer, waiting for a staging slot if need be; _advance queues the rest

    def _restart_at(self, layer: int) -> None:
        for c in self._copied:  # copied ahead, never acquired: each slot is free again once its copy has landed
            self._slots.append((c.slot, c.event))
        self._copied.clear()
        super()._restart_at(layer)
