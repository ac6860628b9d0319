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
    picks: torch.Tensor | None = None  # [R, w] int32: positions a draft tree's node attends after its range
    npicks: torch.Tensor | None = None  # [R] int32: how many


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
            if (decode if choice.as_one_row(n) else s not in batch.trees and choice.native("prompt_attention", n))
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
        picks = npicks = None
        if trees := [s for s in keep if s in batch.trees]:
            lens, starts, picks, npicks = _tree_rows(batch, keep, trees, q_lens, lens, starts, window)
        lens, starts = lens.to(torch.int32), starts.to(torch.int32)
        batch.memo[key] = Rows(index, tables, lens, starts, longest, frozenset(keep), picks, npicks)
    return batch.memo[key]


def _tree_rows(
    batch: PagedBatch,
    keep: list[int],
    trees: list[int],
    q_lens: list[int],
    lens: torch.Tensor,
    starts: torch.Tensor,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of sequences verifying a draft tree: each attends the first run of positions its mask shows (the
    cached ones, within the window), then the rest it shows, picked (its ancestors and itself): the keys a decode
    step over its own path would score, in the same order."""
    lens, starts = lens.clone(), starts.clone()
    picked: dict[int, torch.Tensor] = {}
    first, at = {}, 0  # each kept sequence's first row among the kept rows
    for s in keep:
        first[s], at = at, at + q_lens[s]
    for s in trees:
        mask, key_pos, query_pos = batch.trees[s]
        if window is not None:
            mask = mask & (key_pos[None, :] > query_pos[:, None] - window)
        for r in range(q_lens[s]):
            cols = mask[r].nonzero().flatten()
            run = int(((cols - cols[0]) == torch.arange(len(cols))).cumprod(0).sum())  # the first run's length
            row = first[s] + r
            starts[row], lens[row] = cols[0], cols[0] + run
            if run < len(cols):
                picked[row] = cols[run:]
    width = max((len(p) for p in picked.values()), default=1)
    picks = torch.zeros(len(lens), width, dtype=torch.int32)
    npicks = torch.zeros(len(lens), dtype=torch.int32)
    for row, p in picked.items():
        picks[row, : len(p)], npicks[row] = p, len(p)
    return lens, starts, picks, npicks


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
    args = (r.tables, r.lens, r.starts, scale, r.longest, r.picks, r.npicks)
    if r.index is None:
        return native.decode_attention(q, k_cache, v_cache, *args), r.seqs
    out = torch.empty_like(q)
    if len(r.index):
        out[r.index] = native.decode_attention(q[r.index], k_cache, v_cache, *args)
    return out, r.seqs
