"""The buffers a ring's NVMe reads land in, charged to a memory tier, page-locked by the read backend where it reads
into those faster.

DeepSpeed's aio op reads memory it has not page-locked through a bounce buffer it locks and copies from per read;
into buffers it locked itself it reads directly. torch pins CPU memory only where CUDA is present, so on a CPU
device (and for staging slots that torch does not pin) the ring asks the backend for locked buffers, and takes
the tier's own where the backend has none to give (the pread pool, or locked memory short of RLIMIT_MEMLOCK).
"""

from __future__ import annotations

import torch

from offload.tiers.io.base import ReadBackend, aligned_span
from offload.tiers.memory import MemoryTier, take


class LandingBuffers:
    """`count` buffers of at least `nbytes` each from `tier` (`buffers`): all page-locked by `backend`, or none.

    Locked only for a CPU tier whose buffers torch does not pin, and only where the backend gives every one of them;
    otherwise those it gave go back and the tier's own serve (the backend's `lock_note` says why).
    Invariant: until `close()`, `tier` is charged exactly the bytes of `buffers`; `close()`, once the last read into
    them has been waited for, gives each back to the tier and each locked one to the backend; closing again does
    nothing. The backend must outlive it: the locked memory is freed by no one else.
    """

    def __init__(self, tier: MemoryTier, backend: ReadBackend, nbytes: int, count: int, what: str) -> None:
        self.tier, self.backend = tier, backend
        lockable = count > 0 and tier.device.type == "cpu" and not tier.pins
        locked = self._lock(nbytes, count) if lockable else None
        self.locked = locked is not None  # whether `buffers` are the backend's
        self.buffers: list[torch.Tensor] = locked or [take(tier, nbytes, what) for _ in range(count)]

    def _lock(self, nbytes: int, count: int) -> list[torch.Tensor] | None:
        """`count` locked buffers from the backend, each charged to the tier; None, holding none, when the backend
        or the budget cannot give them all (the budget's refusal is then take()'s to say)."""
        size = aligned_span(0, nbytes).length  # bytes; a locked buffer starts on a page and needs no padding
        got: list[torch.Tensor] = []
        for _ in range(count):
            buf = self.backend.locked_buffer(nbytes) if self.tier.can_allocate(size) else None
            if buf is None or not self.tier.adopt(buf):
                if buf is not None:
                    self.backend.free_locked(buf)
                for taken in got:
                    self._give_back(taken, locked=True)
                return None
            got.append(buf)
        return got

    def close(self) -> None:
        """Give every buffer back; nothing may read into them any more."""
        buffers, self.buffers = self.buffers, []
        for buf in buffers:
            self._give_back(buf, self.locked)

    def _give_back(self, buf: torch.Tensor, locked: bool) -> None:
        self.tier.free(buf)
        if locked:
            self.backend.free_locked(buf)
