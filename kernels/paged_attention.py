"""Attention of packed, ragged queries over a paged KV cache.

Each sequence s contributes query_lens[s] query tokens (a prefill chunk or one decode token), packed
back to back in `q`. Its keys and values live in the blocks listed in its row of `block_tables`;
its queries are the last query_lens[s] of its context_lens[s] positions, and attend causally
(optionally only to the last `window` positions).

`paged_attention_ref` is the pure-torch reference; `paged_attention` dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GATHER_BYTES = 64 << 20  # bytes of K/V gathered at once for single-query (decode) sequences


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Where each sequence of a micro-batch sits in the packed queries and in the KV cache."""

    query_start: tuple[int, ...]  # [S + 1] offsets of each sequence's queries in the packed tokens
    context_lens: tuple[int, ...]  # [S] tokens in the cache after this step's writes
    block_tables: torch.Tensor  # [S, max_blocks] int64 block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 cache slot (block * block_size + offset) of each new token

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k_cache/v_cache [num_blocks, block_size, Hkv, D] -> [T, Hq, D]."""
    _check(q, k_cache, v_cache, batch)
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    singles = [s for s in range(batch.num_seqs) if batch.query_start[s + 1] - batch.query_start[s] == 1]
    batched = set(singles) if len(singles) > 1 else set()  # decode tokens: one batched product, not a call each
    if batched:
        _attend_single_queries(q, k_cache, v_cache, batch, singles, scale, window, out)
    for s in range(batch.num_seqs):
        if s in batched:
            continue
        q0, q1, ctx = batch.query_start[s], batch.query_start[s + 1], batch.context_lens[s]
        blocks = batch.block_tables[s, : -(-ctx // block_size)]
        k = k_cache[blocks].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        q_pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [q_len, ctx]
        if window is not None:
            mask &= k_pos > q_pos - window
        # a batch dimension of one: 4-D inputs take torch's fused CPU kernel (5-7x faster than the 3-D path)
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )  # [1, Hq, q_len, D]
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def _attend_single_queries(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    seqs: list[int],
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """Sequences with one query each (at position context_len - 1), gathered and padded to a common context,
    a group at a time so the gathered K/V stay under GATHER_BYTES."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    per_block = 2 * block_size * kv_heads * head_dim * k_cache.element_size()  # K and V of one block, bytes
    seqs = sorted(seqs, key=lambda s: batch.context_lens[s])  # similar lengths together: less padding
    i = 0
    while i < len(seqs):
        longest = -(-batch.context_lens[seqs[i]] // block_size)
        j = i + 1
        while j < len(seqs):
            longest_j = -(-batch.context_lens[seqs[j]] // block_size)
            if (j - i + 1) * longest_j * per_block > GATHER_BYTES:
                break
            longest, j = longest_j, j + 1
        group = torch.tensor(seqs[i:j], device=q.device)
        rows = torch.tensor([batch.query_start[s] for s in seqs[i:j]], device=q.device)
        lens = torch.tensor([batch.context_lens[s] for s in seqs[i:j]], device=q.device)[:, None]
        blocks = batch.block_tables[group, :longest]  # [n, blocks]
        k = k_cache[blocks].flatten(1, 2)  # [n, blocks * block_size, Hkv, D]
        v = v_cache[blocks].flatten(1, 2)
        pos = torch.arange(k.shape[1], device=q.device)[None, :]
        valid = pos < lens  # [n, L]; the query sits at lens - 1
        if window is not None:
            valid &= pos > lens - 1 - window
        # padding slots past a context may hold anything (even NaN): zero them, so masked weights of 0 multiply
        # zeros; k and v are fresh copies (gathered). A slice per sequence writes only the padding, where one
        # broadcast masked_fill over the whole gather cost as much as the gather itself.
        for row, s in enumerate(seqs[i:j]):
            k[row, batch.context_lens[s] :] = 0
            v[row, batch.context_lens[s] :] = 0
        o = F.scaled_dot_product_attention(
            q[rows][:, :, None, :],  # [n, Hq, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )  # [n, Hq, 1, D]
        out[rows] = o[:, :, 0, :]
        i = j


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not match cache heads/dim {tuple(k_cache.shape[2:])}")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    starts = batch.query_start
    if len(starts) != batch.num_seqs + 1 or starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_start {starts} does not cover {q.shape[0]} query tokens from 0")
    capacity = batch.block_tables.shape[1] * k_cache.shape[1]  # tokens a block-table row can address
    for s, ctx in enumerate(batch.context_lens):
        if not 0 <= starts[s + 1] - starts[s] <= ctx <= capacity:
            raise ValueError(
                f"sequence {s}: {starts[s + 1] - starts[s]} queries, context {ctx}, block table holds {capacity}"
            )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention over the paged cache; the Triton kernel takes over on CUDA once it lands."""
    return paged_attention_ref(q, k_cache, v_cache, batch, scale, window)
