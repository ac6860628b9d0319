"""Multi-head latent attention (DeepSeek-V2/V3) in its absorbed form, over a paged cache of latents.

The cache holds one vector per token and layer, c = [latent (kv_rank values), rotated key (rope_dim)], shared by
every head. With the key and value up-projections absorbed (offload/model/deepseek.py), head h's query is
[W_uk,h^T q_nope,h, q_rope,h], its scores are that query's dot products with c, and its output is the
softmax-weighted sum of the latents c[:kv_rank], to which the value up-projection is applied afterwards. That is
multi-query attention over one head of width kv_rank + rope_dim whose values are the first `v_dim` values of its
keys: each token's vector is read once for all heads.

`latent_attention_ref` is the torch reference; `latent_attention` dispatches: on CUDA, with a plain cache and one
query per sequence, kernels/paged_decode.py's kernel with the value width cut to `v_dim`; elsewhere the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from offload.kernels.dispatch import use_triton
from offload.kernels.paged_attention import (
    PagedCache,
    attend_contiguous,
    decode_groups,
    triton_split,
    visible_slots,
    visible_to_group,
)
from offload.kernels.paged_batch import PagedBatch


def latent_attention_ref(
    q: torch.Tensor, cache: torch.Tensor | PagedCache, batch: PagedBatch, scale: float, v_dim: int
) -> torch.Tensor:
    """q [T, H, W], cache [num_blocks, block_size, 1, W] -> [T, H, v_dim]: each sequence's queries (its last
    query_lens positions) over its context, causally; the values are the first v_dim values of each cached vector."""
    _check(q, cache, batch, v_dim)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    _, block_size, _, width = cache.shape
    singles = [s for s in range(batch.num_seqs) if batch.query_start[s + 1] - batch.query_start[s] == 1]
    # one-query sequences grouped by length, every head a query row of the one shared KV head
    for g in decode_groups(batch, singles, block_size, block_size * width * cache.element_size()):
        n, longest = len(g.lens), max(g.lens)
        c = cache.index_select(0, g.blocks).view(n, -1, width)  # [n, slots, W]
        mask = None
        if min(g.lens) < longest:
            c.view(-1, width).index_fill_(0, g.stale, 0)  # slots no sequence wrote may hold anything
            mask = visible_to_group(batch, g, longest, None)  # [n, 1, 1, slots]
        c = c[:, None, :longest]  # [n, 1, slots, W]
        o = F.scaled_dot_product_attention(q[g.rows][:, None], c, c[..., :v_dim], attn_mask=mask, scale=scale)
        out[g.rows] = o[:, 0]  # [n, H, v_dim]
    for s in range(batch.num_seqs):
        q0, q1, ctx = batch.query_start[s], batch.query_start[s + 1], batch.context_lens[s]
        if q1 - q0 == 1:
            continue
        c = gather_context(cache, batch, s)  # [ctx, 1, W]
        mask = visible_slots(ctx, q1 - q0, None, q.device)
        out[q0:q1] = attend_contiguous(q[q0:q1], c, c[..., :v_dim], scale, mask)
    return out


def gather_context(cache: torch.Tensor | PagedCache, batch: PagedBatch, s: int) -> torch.Tensor:
    """Sequence s's cached vectors, gathered from its blocks: [context, heads, W]."""
    ctx = batch.context_lens[s]
    blocks = batch.block_tables[s, : -(-ctx // cache.shape[1])]
    return cache.index_select(0, blocks).flatten(0, 1)[:ctx]


def latent_attention(
    q: torch.Tensor, cache: torch.Tensor | PagedCache, batch: PagedBatch, scale: float, v_dim: int
) -> torch.Tensor:
    """`latent_attention_ref`'s attention; on CUDA, for a plain cache and one query per sequence, the Triton decode
    kernel reads the blocks in place (the query heads of the one KV head as the rows of each tile)."""
    plain = isinstance(cache, torch.Tensor)
    decode = batch.query_start[-1] == batch.num_seqs
    if not (plain and decode and use_triton("paged_attention", q.device)):
        return latent_attention_ref(q, cache, batch, scale, v_dim)
    from offload.kernels.paged_decode import paged_decode  # imports triton, which only this path needs

    _check(q, cache, batch, v_dim)
    split = triton_split(batch, q.device)  # built once a step, kept on the batch for every layer
    return paged_decode(
        q,
        cache,
        cache,
        split.decode_tables,
        split.decode_lens,
        scale,
        max_context=split.max_decode_context,
        v_dim=v_dim,
    )


def _check(q: torch.Tensor, cache: torch.Tensor | PagedCache, batch: PagedBatch, v_dim: int) -> None:
    if q.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1 or q.shape[2] != cache.shape[3]:
        raise ValueError(f"shapes: q {tuple(q.shape)} [T, H, W], cache {tuple(cache.shape)} [blocks, block, 1, W]")
    if not 0 < v_dim <= q.shape[2]:
        raise ValueError(f"v_dim {v_dim} must be between 1 and the cached width {q.shape[2]}")
    if q.dtype != cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, cache {cache.dtype}")
    starts = batch.query_start
    if len(starts) != batch.num_seqs + 1 or starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_start {starts} does not cover {q.shape[0]} query tokens from 0")
