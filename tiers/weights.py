"""Weight placement and the prefetch pipeline.

Every decoder layer lives in one tier (a `Policy`): "device" layers are read once and stay on the compute
device; "host" layers are read once into host RAM; "nvme" layers are streamed from the checkpoint files
on every pass through a bounded ring of device slots, read ahead of compute. The embedding and the head
stay on the device. The engine asks for layers in order with `acquire` and hands them back with
`release`; each release lets the ring start reading the next streamed layer, wrapping around to the
first ones of the next step, so memory never grows with model size or run length.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from offload.config import ModelSpec, Policy
from offload.errors import OffloadError
from offload.model.checkpoint import TORCH_DTYPES, Checkpoint
from offload.model.registry import Family, TensorSpec, Weights
from tiers.device import DeviceTier
from tiers.host import HostTier
from tiers.io.base import ReadBackend, ReadRequest
from tiers.layout import GroupLayout, TensorAt, plan_group


@dataclass(frozen=True, slots=True)
class WeightStats:
    resident_bytes: int  # bytes of weights held on the device for the whole run
    host_bytes: int  # bytes of weights held in host RAM for the whole run
    streamed_bytes_per_pass: int  # bytes read from storage for one pass over the layers
    bytes_read: int  # bytes read from the checkpoint so far (loading and streaming)
    read_seconds: float  # wall time with at least one read in flight
    stall_seconds: float  # time the engine waited in acquire() for a read


@dataclass(slots=True)
class _InFlight:
    layer: int
    slot: torch.Tensor
    requests: list[ReadRequest]


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Read plans of every weight group. With tied embeddings the head group holds only the final norm."""

    embed: GroupLayout
    head: GroupLayout
    layers: tuple[GroupLayout, ...]


def model_layout(checkpoint: Checkpoint, family: Family, spec: ModelSpec) -> ModelLayout:
    """The read plan of every weight group, after checking each tensor's shape and dtype."""
    head = family.head_tensors(spec)
    if spec.tie_word_embeddings:
        head = {"norm": head["norm"]}
    return ModelLayout(
        embed=_layout(checkpoint, family.embed_tensors(spec)),
        head=_layout(checkpoint, head),
        layers=tuple(_layout(checkpoint, family.layer_tensors(spec, i)) for i in range(spec.num_layers)),
    )


def group_cost(layout: GroupLayout, dtype: torch.dtype, tier: DeviceTier) -> int:
    """Bytes `tier` is charged for a group loaded in compute dtype `dtype`: on CPU its read buffer plus copies
    of tensors stored in another dtype; on CUDA the converted tensors alone (the read buffer is host staging)."""

    def as_dtype(t: TensorAt) -> int:
        return t.nbytes // TORCH_DTYPES[t.dtype][1] * dtype.itemsize

    if tier.device.type != "cpu":
        return sum(as_dtype(t) for t in layout.tensors)
    converted = sum(as_dtype(t) for t in layout.tensors if TORCH_DTYPES[t.dtype][0] != dtype)
    return tier.footprint(layout.slot_bytes) + converted


def _layout(checkpoint: Checkpoint, group: dict[str, TensorSpec]) -> GroupLayout:
    return plan_group({short: checkpoint.check(t.name, t.shape) for short, t in group.items()})


class WeightStore:
    def __init__(
        self,
        layout: ModelLayout,
        backend: ReadBackend,
        policy: Policy,
        device_tier: DeviceTier,
        host_tier: HostTier,
        dtype: torch.dtype,
    ) -> None:
        if len(policy.layer_tiers) != len(layout.layers):
            raise ValueError(f"policy places {len(policy.layer_tiers)} layers, the model has {len(layout.layers)}")
        self.backend, self.policy, self.dtype = backend, policy, dtype
        self.device_tier, self.host_tier = device_tier, host_tier
        self.device = device_tier.device
        self.stall_seconds = 0.0  # time spent waiting for reads, loading included
        self.layouts = layout.layers
        self.embed = self._load_resident(layout.embed, device_tier)
        self.head = self._load_resident(layout.head, device_tier)
        self.head.setdefault("lm_head", self.embed["embed"])  # tied embeddings
        self._resident: dict[int, Weights] = {}
        for layer, tier in enumerate(policy.layer_tiers):  # layer tiers: see the module docstring
            if tier == "device" or (tier == "host" and self.device.type == "cpu"):
                # on a CPU-only machine host RAM is what the compute reads: a host layer needs no copy
                self._resident[layer] = self._load_resident(self.layouts[layer], self._tier(tier))
            elif self.device.type != "cpu":
                raise OffloadError(
                    "streaming layers to a CUDA device is not supported yet: give every layer room "
                    "on the device (raise --device-memory)"
                )
        self._streamed = [i for i in range(len(self.layouts)) if i not in self._resident]
        slot_bytes = max((self.layouts[i].slot_bytes for i in self._streamed), default=0)
        self._free_slots: list[torch.Tensor] = []
        for _ in range(policy.ring_slots if self._streamed else 0):
            slot = self._read_buffer(device_tier, slot_bytes, "a ring slot for streamed layers")
            self._free_slots.append(slot)
        self._in_flight: deque[_InFlight] = deque()
        self._next = 0  # index into _streamed of the next layer to read
        self._acquired: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # layer -> (slot, converted)
        self._fill()

    # ---- loading ---------------------------------------------------------------------------------

    def _tier(self, name: str) -> DeviceTier | HostTier:
        return self.device_tier if name == "device" else self.host_tier

    def _read_buffer(self, tier: DeviceTier | HostTier, nbytes: int, what: str) -> torch.Tensor:
        buf = tier.allocate(nbytes)
        if buf is None:
            raise OffloadError(
                f"{tier.name} memory budget of {tier.capacity} bytes cannot hold {what} ({nbytes} bytes; "
                f"{tier.used} already in use)"
            )
        return buf

    def _load_resident(self, layout: GroupLayout, tier: DeviceTier | HostTier) -> Weights:
        """Read a group once and keep it; tensors stored in another dtype are converted (charged to `tier`)."""
        if tier.device.type == "cpu":
            buf = self._read_buffer(tier, layout.slot_bytes, "resident weights")
            self._wait([self.backend.submit(r.path, r.offset, r.nbytes, buf[r.slot_offset :]) for r in layout.runs])
            return self._convert(layout.views(buf), tier, keep=[])
        staging = self._read_buffer(self.host_tier, layout.slot_bytes, "a staging buffer")
        try:
            self._wait([self.backend.submit(r.path, r.offset, r.nbytes, staging[r.slot_offset :]) for r in layout.runs])
            out = {}
            for short, view in layout.views(staging).items():
                out[short] = view.to(device=tier.device, dtype=self.dtype)
                if not tier.adopt(out[short]):
                    raise OffloadError(f"{tier.name} memory budget of {tier.capacity} bytes cannot hold the weights")
            return out
        finally:
            self.host_tier.free(staging)

    def _convert(self, views: Weights, tier: DeviceTier | HostTier, keep: list[torch.Tensor]) -> Weights:
        """Views in the compute dtype; converted copies are charged to `tier` and listed in `keep`."""
        out = {}
        for short, view in views.items():
            if view.dtype == self.dtype:
                out[short] = view
                continue
            converted = view.to(self.dtype)
            if not tier.adopt(converted):
                raise OffloadError(
                    f"{tier.name} memory budget of {tier.capacity} bytes cannot hold {short} converted to "
                    f"{str(self.dtype).removeprefix('torch.')} ({converted.numel() * converted.element_size()} bytes)"
                )
            keep.append(converted)
            out[short] = converted
        return out

    def _wait(self, requests: list[ReadRequest]) -> None:
        start = time.perf_counter()
        for r in requests:
            r.wait()
        self.stall_seconds += time.perf_counter() - start

    # ---- the ring --------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Start reading the next streamed layers, in cyclic order, into every free slot."""
        while self._free_slots:
            layer = self._streamed[self._next]
            self._next = (self._next + 1) % len(self._streamed)
            slot = self._free_slots.pop()
            runs = self.layouts[layer].runs
            requests = [self.backend.submit(r.path, r.offset, r.nbytes, slot[r.slot_offset :]) for r in runs]
            self._in_flight.append(_InFlight(layer, slot, requests))

    def acquire(self, layer: int) -> Weights:
        """Layer `layer`'s weights on the device; waits only if its read is not done yet."""
        if layer in self._resident:
            return self._resident[layer]
        head = self._in_flight[0] if self._in_flight else None
        if head is None or head.layer != layer:
            self._restart_at(layer)
            head = self._in_flight[0]
        self._in_flight.popleft()
        self._wait(head.requests)
        converted: list[torch.Tensor] = []
        weights = self._convert(self.layouts[layer].views(head.slot), self.device_tier, converted)
        self._acquired[layer] = (head.slot, converted)
        return weights

    def release(self, layer: int) -> None:
        """The engine is done with `layer` for this step: its slot may be refilled."""
        if layer in self._resident:
            return
        slot, converted = self._acquired.pop(layer)
        for t in converted:
            self.device_tier.free(t)
        self._free_slots.append(slot)
        self._fill()

    def _restart_at(self, layer: int) -> None:
        """Out-of-order access (not the engine's layer order): drain the ring and read from `layer` on."""
        for f in self._in_flight:
            self._wait(f.requests)
            self._free_slots.append(f.slot)
        self._in_flight.clear()
        self._next = self._streamed.index(layer)
        self._fill()

    def close(self) -> None:
        """Wait for reads in flight (their buffers must outlive them)."""
        for f in self._in_flight:
            for r in f.requests:
                r.wait()
        self._in_flight.clear()

    @property
    def stats(self) -> WeightStats:
        def total(tier: str) -> int:
            return sum(self.layouts[i].tensor_bytes for i, t in enumerate(self.policy.layer_tiers) if t == tier)

        fixed = {t.data_ptr(): t.numel() * t.element_size() for t in (*self.embed.values(), *self.head.values())}
        return WeightStats(
            resident_bytes=total("device") + sum(fixed.values()),
            host_bytes=total("host"),
            streamed_bytes_per_pass=sum(self.layouts[i].read_bytes for i in self._streamed),
            bytes_read=self.backend.bytes_read,
            read_seconds=self.backend.read_seconds,
            stall_seconds=self.stall_seconds,
        )
