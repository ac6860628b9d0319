"""A token embedding left in storage: each step reads the rows of its tokens, not the table.

A lookup table is the one weight whose use touches a few rows, so when layers must stream from disk, holding the
whole table (vocab x hidden, 131 MB for a 32k-token vocabulary at hidden 2048 in bf16) on the device spends memory that
buys a resident layer. `StoredEmbedding` instead reads the distinct rows a step's tokens need (runs of adjacent ids
coalesced into one read) through a fixed read buffer, with its own read backend so that its small reads never
queue behind the layer reads in flight; the rows are converted to the compute dtype and moved to the device.
"""

from __future__ import annotations

import torch

from offload.common.config import embed_read_buffer
from tiers.checkpoint import TORCH_DTYPES
from tiers.io.base import ReadBackend, aligned_span
from tiers.layout import GroupLayout
from tiers.memory import MemoryTier
from tiers.ring import take

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
        unique, index = torch.unique(token_ids, sorted=True, return_inverse=True)
        ids = unique.tolist()
        if ids and (ids[0] < 0 or ids[-1] >= self.vocab):
            bad = ids[0] if ids[0] < 0 else ids[-1]
            raise IndexError(f"token id {bad} is outside the embedding's {self.vocab} rows")
        out = torch.empty(len(ids), self.hidden, dtype=self.dtype)
        done = 0
        for batch in self._batches(ids):
            requests, at = [], 0
            for first, count in batch:
                nbytes = count * self.row_bytes
                requests.append(
                    self.backend.submit(self.path, self.offset + first * self.row_bytes, nbytes, self.buffer[at:])
                )
                at += aligned_span(self.offset + first * self.row_bytes, nbytes).length
            for req, (_, count) in zip(requests, batch, strict=True):
                rows = req.wait().view(self.stored_dtype).view(count, self.hidden)
                out[done : done + count] = rows  # converts to the compute dtype
                done += count
        self.rows_read += len(ids)
        return out.to(self.device), index

    def _batches(self, ids: list[int]) -> list[list[tuple[int, int]]]:
        """Runs of consecutive ids as (first id, count), grouped so each group's aligned spans fit the buffer."""
        runs: list[tuple[int, int]] = []
        for i in ids:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        room = self.buffer.numel()
        batches: list[list[tuple[int, int]]] = [[]]
        used = 0
        for first, count in runs:
            while count:
                take_rows = count
                while self._span(first, take_rows) > room - used and take_rows > 1:
                    take_rows //= 2
                if self._span(first, take_rows) > room - used:  # the buffer is full: start the next batch
                    batches.append([])
                    used = 0
                    continue
                batches[-1].append((first, take_rows))
                used += self._span(first, take_rows)
                first, count = first + take_rows, count - take_rows
        return [b for b in batches if b]

    def _span(self, first: int, count: int) -> int:
        return aligned_span(self.offset + first * self.row_bytes, count * self.row_bytes).length

    def close(self) -> None:
        """Give the read buffer back to its tier (no read is in flight between lookups)."""
        self.tier.free(self.buffer)
