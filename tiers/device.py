"""The device tier: the compute device's memory (GPU HBM; on a CPU-only machine, a budgeted RAM arena)."""

from __future__ import annotations

import torch

from offload.common.tier import Tier
from offload.tiers.memory import MemoryTier


class DeviceTier(MemoryTier):
    def __init__(self, capacity: int | None, device: torch.device) -> None:
        super().__init__(Tier.DEVICE, capacity, device)
