"""Paged attention of bfloat16 caches on the CPU through kernels/native.py's kernel, every query of a batch in one
call: a decode token and each query of a prompt chunk alike are one row, attending its sequence's positions up to
its own (from its window's first), read in place through its sequence's block table.

Which sequences it takes is kernels/choice.py's: decode tokens where the kernel was timed faster than torch's path
for that many sequences, a prompt chunk where it was for a chunk of that length (against torch's causal SDPA over
the sequence's gathered blocks); the caller attends the others.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from offload.kernels import choice, native
from offload.kernels.paged_batch import PagedBatch


class Rows(NamedTuple):
    """The query rows taken here, each one's sequence table and the positions it attends, built once per batch and
    window."""

    index: torch.Tensor | None  # [R] int64: the rows of q (None: every row, in order)
    tables: torch.Tensor  # [R, max_blocks] int32: its sequence's block table
    lens: torch.Tensor  # [R] int32: its position + 1
    starts: torch.Tensor  # [R] int32: the first position it attends (its window's, else 0)
    longest: int  # the most positions a row spans (its scores' scratch)
    seqs: frozenset[int]  # the sequences whose queries these are: the others are left to the caller


def rows(batch: PagedBatch, window: int | None) -> Rows:
    key = ("native_rows", window)
    if key not in batch.memo:
        q_lens = [batch.query_start[s + 1] - batch.query_start[s] for s in range(batch.num_seqs)]
        # decode tokens, and verify chunks of a speculating engine, whose rows must each attend as a decode token
        # alone would (the prompt path's causal SDPA rounds apart, and greedy replies parted at near-ties): one a
        # sequence, a step's rows for the choice
        decoding = sum(choice.as_one_row(n) for n in q_lens)
        decode = decoding > 0 and choice.native("decode_attention", decoding)
        keep = [
            s
            for s, n in enumerate(q_lens)
            if (decode if choice.as_one_row(n) else choice.native("prompt_attention", n))
        ]
        if decode and max(q_lens) == 1:  # a decode step: one row a sequence, every one kept
            index, lens = None, torch.tensor(batch.context_lens, dtype=torch.int64)
            tables = batch.block_tables.to(torch.int32).contiguous()
        else:
            sel = torch.tensor(keep, dtype=torch.int64)
            n = torch.tensor(q_lens, dtype=torch.int64)[sel]
            within = torch.arange(int(n.sum())) - (n.cumsum(0) - n).repeat_interleave(n)  # a row's place in its chunk
            index = torch.tensor(batch.query_start[:-1], dtype=torch.int64)[sel].repeat_interleave(n) + within
            ends = torch.tensor(batch.context_lens, dtype=torch.int64)[sel]
            lens = (ends - n).repeat_interleave(n) + within + 1  # a sequence's queries are the last of its positions
            tables = batch.block_tables[sel].to(torch.int32).repeat_interleave(n, dim=0).contiguous()
            index = None if len(keep) == batch.num_seqs else index
        starts = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
        longest = max((batch.context_lens[s] for s in keep), default=1)
        batch.memo[key] = Rows(index, tables, lens.to(torch.int32), starts.to(torch.int32), longest, frozenset(keep))
    return batch.memo[key]


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, frozenset[int]]:
    """q [T, Hq, D] over caches [num_blocks, block_size, Hkv, D] -> ([T, Hq, D], the sequences attended): the rows
    of any other sequence (where torch's path was timed faster) are left for the caller to fill.
    native.decode_attention_fits must hold."""
    r = rows(batch, window)
    if r.index is None:
        return native.decode_attention(q, k_cache, v_cache, r.tables, r.lens, r.starts, scale, r.longest), r.seqs
    out = torch.empty_like(q)
    if len(r.index):
        out[r.index] = native.decode_attention(
            q[r.index], k_cache, v_cache, r.tables, r.lens, r.starts, scale, r.longest
        )
    return out, r.seqs
