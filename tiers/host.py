"""The host tier: CPU RAM under its own budget. Buffers are aligned for O_DIRECT reads and page-locked when
CUDA is present, so the copy engine can move them to the device asynchronously."""

from __future__ import annotations

import torch

from offload.common.tier import Tier
from offload.tiers.memory import MemoryTier


class HostTier(MemoryTier):
    """Host RAM for weights under the --host-memory budget: layers placed in host RAM and, on the staged path
    (tiers/weights/weight_store.py), the pinned staging buffers disk reads land in on their way to the device, all
    charged here against one budget. capacity None (--host-memory 0, the default: no budget given) keeps no layer in
    host RAM, and staging then takes what it needs: a bounded amount (`ring_slots` buffers of the largest
    streamed layer, and one of the largest resident group while loading), counted in `used` and `peak`."""

    def __init__(self, capacity: int | None) -> None:
        super().__init__(Tier.HOST, capacity, torch.device("cpu"), pin=True)
