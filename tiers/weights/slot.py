"""Device slots: how a group's tensors sit side by side in one device buffer, in the compute dtype.

The staged path copies a group from its host buffer (laid out as read, see tiers/weights/layout.py) into a device
slot: gaps and alignment padding of the reads stay on the host, and tensors stored in another dtype
pass through a scratch buffer and are converted on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.tiers.weights.checkpoint import TORCH_DTYPES, held_dtype
from offload.tiers.weights.layout import GroupLayout

DEVICE_ALIGN = 256  # bytes; what cudaMalloc guarantees, so packed tensors are as aligned as separate allocations


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Where each tensor of a group sits in its device buffer. Tied duplicates (one slot offset) share storage."""

    layout: GroupLayout
    dtype: torch.dtype  # the compute dtype every float tensor is stored in (integer tensors stay as stored)
    offsets: tuple[int, ...]  # bytes from the buffer's start, one per layout.tensors; multiples of DEVICE_ALIGN
    nbytes: int  # bytes the device buffer needs
    copy_bytes: int  # bytes one copy moves host -> device: each distinct tensor once, in its checkpoint dtype
    convert_bytes: int  # bytes of scratch conversion needs: the largest tensor stored in another dtype, else 0

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a typed view into `buf` ([>= nbytes] uint8 on the device)."""
        out = {}
        for t, off in zip(self.layout.tensors, self.offsets, strict=True):
            held = held_dtype(t.dtype, self.dtype)
            out[t.short] = buf[off : off + _nbytes(t.shape, held)].view(held).reshape(t.shape)
        return out

    def copies(
        self, src: torch.Tensor, dst: torch.Tensor, scratch: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(dst, src) pairs that fill `dst` from `src` (the group as read, uint8 on the host), in order: a tensor
        stored in another dtype is copied into `scratch` as is, then converted into `dst` on the device."""
        pairs, done = [], set()
        for t, off in zip(self.layout.tensors, self.offsets, strict=True):
            if off in done:
                continue
            done.add(off)
            raw = src[t.slot_offset : t.slot_offset + t.nbytes]
            stored, held = TORCH_DTYPES[t.dtype][0], held_dtype(t.dtype, self.dtype)
            if stored == held:
                pairs.append((dst[off : off + t.nbytes], raw))
                continue
            assert scratch is not None and scratch.numel() >= t.nbytes, "conversion needs a scratch buffer"
            pairs.append((scratch[: t.nbytes], raw))
            typed = dst[off : off + _nbytes(t.shape, held)].view(held).reshape(t.shape)
            pairs.append((typed, scratch[: t.nbytes].view(stored).reshape(t.shape)))
        return pairs


def slot_layout(layout: GroupLayout, dtype: torch.dtype) -> SlotLayout:
    """The packed device layout of `layout`'s tensors in compute dtype `dtype`."""
    offsets, at, end, copy_bytes, convert_bytes = [], {}, 0, 0, 0
    for t in layout.tensors:
        if t.slot_offset not in at:  # a tied duplicate reuses the first one's place
            at[t.slot_offset] = end
            end += -(-_nbytes(t.shape, held_dtype(t.dtype, dtype)) // DEVICE_ALIGN) * DEVICE_ALIGN
            copy_bytes += t.nbytes
            if TORCH_DTYPES[t.dtype][0] != held_dtype(t.dtype, dtype):
                convert_bytes = max(convert_bytes, t.nbytes)
        offsets.append(at[t.slot_offset])
    return SlotLayout(layout, dtype, tuple(offsets), end, copy_bytes, convert_bytes)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
