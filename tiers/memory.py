"""A budgeted memory tier: hands out byte buffers and never lets their total exceed the budget."""

from __future__ import annotations

import torch

from offload.common.errors import OffloadError
from offload.tiers.io.base import ALIGN, aligned_buffer, aligned_span


class MemoryTier:
    """Byte buffers on one kind of memory under a hard budget; "does not fit" is None, not an exception.

    Invariant: `used` == the sum of the sizes of live buffers <= `capacity`; `peak` is the highest `used` seen.
    """

    def __init__(self, name: str, capacity: int | None, device: torch.device, pin: bool = False) -> None:
        self.name = name
        self.pin = pin  # page-lock CPU buffers (when CUDA is present) so copies to the device run asynchronously
        self.capacity = capacity  # bytes; None = no budget
        self.device = device
        self.used = 0  # bytes
        self.peak = 0  # bytes
        self._live: dict[int, int] = {}  # _key(buffer) -> bytes charged

    @property
    def pins(self) -> bool:
        """Whether its buffers come page-locked by torch: CPU buffers asked pinned, where CUDA is there to pin them."""
        return self.pin and self.device.type == "cpu" and torch.cuda.is_available()

    @property
    def num_free(self) -> int | None:
        return None if self.capacity is None else self.capacity - self.used

    def can_allocate(self, nbytes: int) -> bool:
        return self.capacity is None or self.used + nbytes <= self.capacity

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of at least `nbytes`, or None when the budget cannot hold it."""
        nbytes = self.footprint(nbytes)
        if not self.can_allocate(nbytes):
            return None
        buf = self._new_buffer(nbytes)
        self._charge(buf, nbytes)
        return buf

    def adopt(self, tensor: torch.Tensor) -> bool:
        """Charge an existing tensor (an opaque packed weight too) to this tier; False (nothing charged) when it
        does not fit."""
        nbytes = tensor.numel() * tensor.element_size()
        if not self.can_allocate(nbytes):
            return False
        self._charge(tensor, nbytes)
        return True

    def free(self, buf: torch.Tensor) -> None:
        nbytes = self._live.pop(_key(buf), None)
        if nbytes is None:
            raise ValueError(f"{self.name}: buffer {_key(buf):#x} was not allocated here")
        self.used -= nbytes

    def _charge(self, buf: torch.Tensor, nbytes: int) -> None:
        if nbytes:
            self._live[_key(buf)] = nbytes
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def footprint(self, nbytes: int) -> int:
        """The bytes a buffer of `nbytes` really takes: CPU buffers are ALIGN-aligned for O_DIRECT reads,
        which costs up to ALIGN bytes of padding at each end."""
        return aligned_span(0, nbytes).length + ALIGN if self.device.type == "cpu" else nbytes

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return aligned_buffer(nbytes - ALIGN, pin=self.pin)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def check_integrity(self) -> None:
        assert self.used == sum(self._live.values()), f"{self.name}: used does not match live buffers"
        assert self.capacity is None or self.used <= self.capacity, f"{self.name}: over budget"


def take(tier: MemoryTier, nbytes: int, what: str, lower: str | None = None) -> torch.Tensor:
    """A buffer of `nbytes` from `tier`, or an OffloadError naming the flag that sets its budget (and `lower`, the
    flag that sized what needs the buffer, when there is one)."""
    buf = tier.allocate(nbytes)
    if buf is None:
        advice = f": lower {lower} or raise --{tier.name}-memory" if lower else ""
        raise OffloadError(
            f"--{tier.name}-memory budget of {tier.capacity} bytes cannot hold {what} ({tier.footprint(nbytes)} "
            f"bytes; {tier.used} already in use){advice}"
        )
    return buf


def _key(t: torch.Tensor) -> int:
    """What identifies a charged buffer: its data address; an opaque (oneDNN) tensor has none, so the object's."""
    return id(t) if t.is_mkldnn else t.data_ptr()
