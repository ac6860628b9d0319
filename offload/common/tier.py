"""The tiers, named once: where bytes live (a layer's weights, the token embedding, KV blocks)."""

from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    """Where bytes live. A str, so it equals, hashes and serializes as its name ("device" == Tier.DEVICE): flags,
    JSON and the cost model's dicts read the same with either."""

    DEVICE = "device"  # the compute device's memory (GPU HBM; on a CPU-only machine, a budgeted RAM arena)
    HOST = "host"  # host RAM
    NVME = "nvme"  # storage: the checkpoint, spill files, the KV disk part

    def __str__(self) -> str:
        return self.value
