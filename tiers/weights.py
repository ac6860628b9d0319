"""Weight placement and access. Today every tensor is resident on the compute device.

The engine speaks to weights through three verbs, `acquire(layer)`, `release(layer)` and the
`embed`/`head` groups, so that streaming placements slot in behind the same calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from offload.config import ModelSpec
from offload.model.checkpoint import Checkpoint
from offload.model.registry import Family, TensorSpec, Weights


@dataclass(frozen=True, slots=True)
class WeightStats:
    resident_bytes: int  # bytes of weights held on the compute device
    bytes_read: int  # bytes read from the checkpoint files
    load_seconds: float


class ResidentWeights:
    """Reads every tensor once, by extent, converts it to the compute dtype and keeps it on the device."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        family: Family,
        spec: ModelSpec,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.device, self.dtype = device, dtype
        start = time.perf_counter()
        groups = [family.embed_tensors(spec), family.head_tensors(spec)]
        groups += [family.layer_tensors(spec, i) for i in range(spec.num_layers)]
        for group in groups:  # verify every shape and dtype before reading any data
            for t in group.values():
                checkpoint.check(t.name, t.shape)
        loaded: dict[str, torch.Tensor] = {}  # checkpoint name -> tensor; tied weights load once
        self.embed = self._load(checkpoint, groups[0], loaded)
        self.head = self._load(checkpoint, groups[1], loaded)
        self._layers = [self._load(checkpoint, g, loaded) for g in groups[2:]]
        self.stats = WeightStats(
            resident_bytes=sum(t.numel() * t.element_size() for t in loaded.values()),
            bytes_read=checkpoint.reader.bytes_read,
            load_seconds=time.perf_counter() - start,
        )

    def _load(self, checkpoint: Checkpoint, group: dict[str, TensorSpec], loaded: dict[str, torch.Tensor]) -> Weights:
        out = {}
        for short, t in group.items():
            if t.name not in loaded:
                cpu = checkpoint.read(checkpoint.extent(t.name))
                loaded[t.name] = cpu.to(device=self.device, dtype=self.dtype)
            out[short] = loaded[t.name]
        return out

    def acquire(self, layer: int) -> Weights:
        return self._layers[layer]

    def release(self, layer: int) -> None:
        """Resident weights stay; nothing to give back."""
