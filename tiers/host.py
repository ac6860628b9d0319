"""The host tier: CPU RAM under its own budget. Buffers are aligned for O_DIRECT reads and page-locked when
CUDA is present, so the copy engine can move them to the device asynchronously."""

from __future__ import annotations

import torch

from tiers.memory import MemoryTier


class HostTier(MemoryTier):
    def __init__(self, capacity: int | None) -> None:
        super().__init__("host", capacity, torch.device("cpu"), pin=True)
