"""A token embedding left in storage: each step reads the rows of its tokens, not the table.

A lookup table is the one weight whose use touches a few rows, so when layers must stream from disk, holding the
whole table (vocab x hidden, 131 MB for a 32k-token vocabulary at hidden 2048 in bf16) on the device spends memory
that buys a resident layer. `StoredEmbedding` instead reads the distinct rows a step's tokens need through a fixed
read buffer: ids closer than MERGE_GAP bytes share one read, so a big prefill that needs most rows reads the table
in a few large pieces, and a decode step a few small ones. Its own read backend keeps those reads from queueing
behind the layer reads in flight; the rows are converted to the compute dtype and moved to the device.
"""

from __future__ import annotations

import torch

from offload.common.config import embed_read_buffer
from offload.tiers.io.base import ALIGN, ReadBackend, aligned_span
from offload.tiers.memory import MemoryTier
from offload.tiers.weights.checkpoint import TORCH_DTYPES
from offload.tiers.weights.layout import MERGE_GAP, GroupLayout
from offload.tiers.weights.ring import take

TABLE = "embed"  # the short name of the token table in a family's embedding group
HEAD = "lm_head"  # the head's matrix, absent from the head group when tied to the table


def storable(embed: GroupLayout, head: GroupLayout) -> bool:
    """Whether a family's embedding group is a bare token table, whose rows can be read alone, and the head has
    its own matrix (a tied head multiplies by the whole table every step, so the table stays resident)."""
    table = len(embed.tensors) == 1 and embed.tensors[0].short == TABLE and len(embed.tensors[0].shape) == 2
    return table and HEAD in {t.short for t in head.tensors}


def read_buffer_bytes(layout: GroupLayout) -> int:
    """Bytes of the read buffer a StoredEmbedding of `layout` takes."""
    t = layout.tensors[0]
    return embed_read_buffer(t.nbytes // t.shape[0])


class StoredEmbedding:
    """The rows of a [vocab, hidden] token table read from storage on demand (see the module docstring).

    tier: where the read buffer is charged (the device tier on a CPU device, whose memory it is; else host RAM);
    buffer_bytes: its size (default read_buffer_bytes(layout)).
    """

    def __init__(
        self,
        layout: GroupLayout,
        backend: ReadBackend,
        tier: MemoryTier,
        dtype: torch.dtype,
        device: torch.device,
        buffer_bytes: int | None = None,
    ) -> None:
        if not (len(layout.tensors) == 1 and layout.tensors[0].short == TABLE):
            raise ValueError(f"a stored embedding is one {TABLE!r} table, got {[t.short for t in layout.tensors]}")
        (run,), (t,) = layout.runs, layout.tensors
        self.backend, self.dtype, self.device = backend, dtype, device
        self.path = run.path
        # the table's file offset: the run's aligned span begins at its slot offset
        self.offset = aligned_span(run.offset, run.nbytes).start + t.slot_offset - run.slot_offset
        self.vocab, self.hidden = t.shape
        self.stored_dtype = TORCH_DTYPES[t.dtype][0]
        self.row_bytes = t.nbytes // self.vocab
        self.tier = tier
        nbytes = buffer_bytes or read_buffer_bytes(layout)
        if nbytes < 2 * aligned_span(1, self.row_bytes).length:
            raise ValueError(f"a read buffer of {nbytes} bytes holds no row of {self.row_bytes} bytes at every offset")
        self.buffer = take(tier, nbytes, "the embedding's row buffer")
        self.rows_read = 0  # rows read so far

    def lookup(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, index): the distinct rows `token_ids` name, [rows, hidden] in the compute dtype on the device, and
        each token's row in them (token_ids' shape, on token_ids' device)."""
        if not self.buffer.numel():
            raise RuntimeError("the stored embedding is closed")
        unique, index = torch.unique(token_ids, sorted=True, return_inverse=True)
        ids = unique.tolist()
        if ids and (ids[0] < 0 or ids[-1] >= self.vocab):
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise IndexError(f"token id {bad} is outside the embedding's {self.vocab} rows")
        out = torch.empty(len(ids), self.hidden, dtype=self.dtype)
        done = 0
        for batch in self._batches(self._pieces(ids)):
            requests, at = [], 0
            for first, count, _ in batch:
                start, nbytes = self.offset + first * self.row_bytes, count * self.row_bytes
                requests.append(self.backend.submit(self.path, start, nbytes, self.buffer[at:]))
                at += aligned_span(start, nbytes).length
            for req, (first, count, wanted) in zip(requests, batch, strict=True):
                rows = req.wait().view(self.stored_dtype).view(count, self.hidden)
                if len(wanted) < count:  # the rows between wanted ones were read along, and go
                    rows = rows[torch.tensor(wanted) - first]
                out[done : done + len(wanted)] = rows  # converts to the compute dtype
                done += len(wanted)
        self.rows_read += len(ids)
        return out.to(self.device), index

    def _pieces(self, ids: list[int]) -> list[tuple[int, int, list[int]]]:
        """The reads for sorted distinct `ids`, as (first row, rows, the ids among them): ids closer than MERGE_GAP
        bytes share a read (a gap costs less read along than a request of its own), each read fitting the buffer."""
        gap = max(MERGE_GAP // self.row_bytes, 1)
        most = max((self.buffer.numel() - 2 * ALIGN) // self.row_bytes, 1)  # rows whose span surely fits the buffer
        pieces: list[tuple[int, int, list[int]]] = []
        for i in ids:
            if pieces:
                first, count, wanted = pieces[-1]
                if i - (first + count) < gap and i + 1 - first <= most:
                    wanted.append(i)  # in place: a big prefill puts hundreds of ids in one piece
                    pieces[-1] = (first, i + 1 - first, wanted)
                    continue
            pieces.append((i, 1, [i]))
        return pieces

    def _batches(self, pieces: list[tuple[int, int, list[int]]]) -> list[list[tuple[int, int, list[int]]]]:
        """The pieces in order, grouped so that each group's aligned spans fit the buffer together."""
        room, used = self.buffer.numel(), 0
        batches: list[list[tuple[int, int, list[int]]]] = [[]]
        for piece in pieces:
            span = aligned_span(self.offset + piece[0] * self.row_bytes, piece[1] * self.row_bytes).length
            if used + span > room:
                batches.append([])
                used = 0
            batches[-1].append(piece)
            used += span
        return [b for b in batches if b]

    def close(self) -> None:
        """Give the read buffer back to its tier (no read is in flight between lookups); closing twice is harmless,
        a lookup after it is an error."""
        if self.buffer.numel():
            self.tier.free(self.buffer)
            self.buffer = self.buffer[:0]
