"""Read plans: how to fetch a group of checkpoint tensors (one layer) with few large aligned reads.

Tensors of one group that lie close together in one file are read as one run; each run's aligned span gets
its own ALIGN-aligned region of a slot buffer, and each tensor is a view into that region.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from offload.tiers.io.base import ALIGN, aligned_span
from offload.tiers.weights.checkpoint import TORCH_DTYPES, Checkpoint, Extent, ModelTensors, TensorGroup, held_dtype

Weights = dict[str, torch.Tensor]  # short name (e.g. "q_proj") -> tensor on the compute device

MERGE_GAP = 64 << 10  # bytes; tensors closer than this are read in one run (the gap is read and discarded)


@dataclass(frozen=True, slots=True)
class Run:
    """One read: bytes [offset, offset + nbytes) of `path`, landing (aligned) at slot_offset in the slot."""

    path: Path
    offset: int
    nbytes: int
    slot_offset: int  # bytes, a multiple of ALIGN


CONVERT_PIECE = 8 << 20  # bytes of a stored tensor read and converted at a time (`load_buffer_bytes`)


@dataclass(frozen=True, slots=True)
class TensorAt:
    short: str  # the family's name for the tensor ("q_proj")
    slot_offset: int  # bytes from the start of the slot
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class GroupLayout:
    runs: tuple[Run, ...]
    tensors: tuple[TensorAt, ...]
    slot_bytes: int  # bytes a slot needs to hold every run's aligned span

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def read_bytes(self) -> int:
        """Bytes transferred from storage: the runs' aligned spans."""
        return sum(aligned_span(r.offset, r.nbytes).length for r in self.runs)

    def file_offset(self, tensor: TensorAt) -> tuple[Path, int]:
        """Where `tensor`'s bytes start in its file: the run whose slot span holds it, and the offset there."""
        for run in self.runs:
            span = aligned_span(run.offset, run.nbytes)
            if run.slot_offset <= tensor.slot_offset < run.slot_offset + span.length:
                return run.path, span.start + tensor.slot_offset - run.slot_offset
        raise ValueError(f"{tensor.short}: no run holds slot offset {tensor.slot_offset}")

    def views(self, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a typed view into `slot` (the buffer the runs were read into)."""
        out = {}
        for t in self.tensors:
            raw = slot[t.slot_offset : t.slot_offset + t.nbytes]
            dtype = TORCH_DTYPES[t.dtype][0]
            if t.slot_offset % dtype.itemsize:  # a file offset that is not a multiple of the element size
                raw = raw.clone()
            out[t.short] = raw.view(dtype).reshape(t.shape)
        return out


def load_buffer_bytes(group: GroupLayout, dtype: torch.dtype) -> int:
    """Bytes of the buffer a group held whole is read through when the compute device is the CPU: its whole slot;
    or, where every tensor is converted to `dtype` (a float32 checkpoint run in bfloat16) and the slot is larger, a
    piece of CONVERT_PIECE bytes (and the alignment around it) at a time, each converted before the next is read."""
    piece = CONVERT_PIECE + 2 * ALIGN
    converted = all(held_dtype(t.dtype, dtype) != TORCH_DTYPES[t.dtype][0] for t in group.tensors)
    return piece if group.tensors and converted and group.slot_bytes > piece else group.slot_bytes


def group_layout(extents: dict[str, Extent]) -> GroupLayout:
    """The read plan for tensors {short name: extent}; tied duplicates (same extent) are read once."""
    by_file: dict[Path, list[tuple[str, Extent]]] = {}
    for short, ext in extents.items():
        by_file.setdefault(ext.path, []).append((short, ext))
    runs: list[Run] = []
    tensors: list[TensorAt] = []
    slot = 0
    for path, items in sorted(by_file.items()):
        items.sort(key=lambda item: item[1].offset)
        i = 0
        while i < len(items):
            j, end = i + 1, items[i][1].offset + items[i][1].nbytes
            while j < len(items) and items[j][1].offset - end <= MERGE_GAP:
                end = max(end, items[j][1].offset + items[j][1].nbytes)
                j += 1
            start = items[i][1].offset
            span = aligned_span(start, end - start)
            runs.append(Run(path, start, end - start, slot))
            for short, ext in items[i:j]:
                tensors.append(TensorAt(short, slot + ext.offset - span.start, ext.dtype, ext.shape, ext.nbytes))
            slot += span.length
            i = j
    return GroupLayout(tuple(runs), tuple(tensors), slot)


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """Read plans of every weight group. With tied embeddings the head group holds only the final norm."""

    embed: GroupLayout
    head: GroupLayout
    layers: tuple[GroupLayout, ...]


def model_layout(checkpoint: Checkpoint, tensors: ModelTensors) -> ModelLayout:
    """The read plan of every weight group, after checking each tensor's shape and dtype."""
    return ModelLayout(
        embed=_layout(checkpoint, tensors.embed),
        head=_layout(checkpoint, tensors.head),
        layers=tuple(_layout(checkpoint, group) for group in tensors.layers),
    )


def _layout(checkpoint: Checkpoint, group: TensorGroup) -> GroupLayout:
    return group_layout({short: checkpoint.check(t.name, t.shape, t.dtype, t.row) for short, t in group.items()})
