"""Chunked causal attention of packed, ragged queries over a paged KV cache (prefill).

Sequence s has query_lens[s] queries packed in `q` from query_start[s]: the last query_lens[s] of its
context_lens[s] positions. A query at position p attends to the keys at positions [0, p] (or only (p - window, p]),
read in place from the cache blocks listed in the sequence's row of the block table.

One program handles BLOCK_Q consecutive queries of one sequence and all the query heads of one KV head: its tile
rows are (query, head in group) pairs, so each K/V value is read once per program for the whole group. Keys are
visited in tiles of TILE positions, each looked up in the block table, from the first key any of its queries
sees to the last.

A sequence verifying a draft tree (`batch.trees`: speculative decoding) attends by its mask instead: the keys before
the first column some row does not see are visible to all its rows, the later ones by the mask's bits, read from a
[rows, columns] int8 table of the sequence's own (no sliding window: the dispatcher sends a tree under a window to
torch's SDPA with the mask).

`paged_prefill` launches; `paged_prefill_ref` is the same attention in plain torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from offload.kernels.attention_checks import check_device, check_operands, check_sinks, check_window
from offload.kernels.paged_batch import PagedBatch
from offload.kernels.paged_decode import LOG2E, dot_options, load_kv_tile, tile_for

BLOCK_M = 64  # tile rows: queries times query heads per KV head


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, Hq, D] packed queries
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    out_ptr,  # [T, Hq, D]
    seqs_ptr,  # [n] int32 the sequences attended, one per grid row
    starts_ptr,  # [S + 1] int32 query offsets
    lens_ptr,  # [S] int32 context lengths
    tables_ptr,  # [S, W] int32 block ids
    sinks_ptr,  # [Hq] attention sink logits, read when HAS_SINKS
    free_ptr,  # [S] int32 keys every row of the sequence sees (its context where it verifies no tree); HAS_TREES
    bits_ptr,  # int8 the trees' masks past those keys, each [queries, context - free] row-major; HAS_TREES
    bits_at_ptr,  # [S] int32 where the sequence's mask begins in bits; HAS_TREES
    scale_log2,  # softmax scale * log2(e)
    window,  # a query at p sees keys in (p - window, p]; read only when HAS_WINDOW
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_ts,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two, at least 16
    GROUP: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # queries per program; BLOCK_Q * G_PAD rows, at least 16
    BLOCK_SIZE: tl.constexpr,  # cache positions per block
    TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,  # dot operands in float32 (Triton's interpreter gets bfloat16 dots wrong)
    DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_TREES: tl.constexpr,
):
    seq = tl.load(seqs_ptr + tl.program_id(0))
    kv_head = tl.program_id(2)
    q_start = tl.load(starts_ptr + seq)
    q_len = tl.load(starts_ptr + seq + 1) - q_start
    first_q = tl.program_id(1) * BLOCK_Q  # index of this program's first query in the sequence
    if first_q < q_len:
        ctx = tl.load(lens_ptr + seq)
        rows = tl.arange(0, BLOCK_Q * G_PAD)
        query = first_q + rows // G_PAD  # [M] query index in the sequence
        in_group = rows % G_PAD
        heads = kv_head * GROUP + in_group
        row_mask = (query < q_len) & (in_group < GROUP)
        q_pos = ctx - q_len + query  # [M] absolute position of each row's query
        offs_d = tl.arange(0, D_PAD)
        offs_n = tl.arange(0, TILE)
        d_mask = offs_d < HEAD_DIM

        token = (q_start + query).to(tl.int64)  # [M] row in the packed queries
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [M, D_PAD]
        if DOT_F32:
            q = q.to(tl.float32)

        first_pos = ctx - q_len + first_q
        hi = tl.minimum(first_pos + BLOCK_Q, ctx)  # past the last key any row sees
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(first_pos - window + 1, 0)

        m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
        if HAS_SINKS:  # the sink: one more key, of logit sinks[h] and value 0
            m_i = tl.load(sinks_ptr + heads, mask=in_group < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_Q * G_PAD], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
        k_head_ptr = k_ptr + kv_head * stride_kh
        v_head_ptr = v_ptr + kv_head * stride_vh
        table_row = tables_ptr + seq.to(tl.int64) * stride_ts
        free = ctx
        if HAS_TREES:
            free = tl.load(free_ptr + seq)
            bits_row = bits_ptr + tl.load(bits_at_ptr + seq).to(tl.int64) + query.to(tl.int64) * (ctx - free)
        for tile in range(lo // TILE, tl.cdiv(hi, TILE)):
            pos, _, k, v = load_kv_tile(
                k_head_ptr, v_head_ptr, table_row, tile, ctx, offs_n, offs_d, d_mask, d_mask,
                stride_kb, stride_kt, stride_vb, stride_vt, TILE, BLOCK_SIZE, DOT_F32,
            )  # fmt: skip
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, TILE]
            visible = pos[None, :] <= q_pos[:, None]  # causal; implies pos < ctx
            if HAS_WINDOW:
                visible &= pos[None, :] > q_pos[:, None] - window
            if HAS_TREES:  # past `free`, the tree's own mask
                past = (pos >= free) & (pos < ctx)
                bit = tl.load(
                    bits_row[:, None] + (pos - free)[None, :], mask=row_mask[:, None] & past[None, :], other=0
                )
                visible &= (pos < free)[None, :] | (bit != 0)
            scores = tl.where(visible, scores, float("-inf"))
            # a row may see nothing yet (its window starts later, or it is padding): keep exp2 off -inf - -inf
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows have l_i = 0 and are not stored
        tl.store(
            out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


class PrefillInputs(NamedTuple):
    """The batch as the kernel reads it, built once per batch and device and kept in `batch.memo`."""

    seqs: torch.Tensor  # [n] int32 the sequences attended
    starts: torch.Tensor  # [S + 1] int32 query offsets
    lens: torch.Tensor  # [S] int32 context lengths
    tables: torch.Tensor  # [S, W] int32 block ids
    max_queries: int  # the most queries of one attended sequence


def prefill_inputs(batch: PagedBatch, device: torch.device, seqs: tuple[int, ...] | None = None) -> PrefillInputs:
    key = ("paged_prefill", device, seqs)
    if key not in batch.memo:
        seqs = tuple(range(batch.num_seqs)) if seqs is None else seqs
        starts = batch.query_start
        batch.memo[key] = PrefillInputs(
            seqs=torch.tensor(seqs, dtype=torch.int32, device=device),
            starts=torch.tensor(starts, dtype=torch.int32, device=device),
            lens=torch.tensor(batch.context_lens, dtype=torch.int32, device=device),
            tables=batch.block_tables.to(device=device, dtype=torch.int32).contiguous(),
            max_queries=max((starts[s + 1] - starts[s] for s in seqs), default=0),
        )
    return batch.memo[key]


class TreeInputs(NamedTuple):
    """A batch's draft trees as the kernel reads them (see the module docstring), kept in `batch.memo`."""

    free: torch.Tensor  # [S] int32
    bits: torch.Tensor  # int8, every tree's mask past its free keys, one after another
    bits_at: torch.Tensor  # [S] int32


def tree_inputs(batch: PagedBatch, device: torch.device) -> TreeInputs:
    """`batch.trees` (at least one) as the kernel reads them."""
    key = ("paged_prefill_trees", device)
    if key not in batch.memo:
        free, at, pieces = list(batch.context_lens), [0] * batch.num_seqs, []
        for s, (mask, _, _) in sorted(batch.trees.items()):
            free[s] = int(mask.all(0).int().cumprod(0).sum())  # the leading keys every row sees
            at[s] = sum(p.numel() for p in pieces)
            pieces.append(mask[:, free[s] :].reshape(-1))
        batch.memo[key] = TreeInputs(
            free=torch.tensor(free, dtype=torch.int32, device=device),
            bits=torch.cat(pieces).to(device=device, dtype=torch.int8),
            bits_at=torch.tensor(at, dtype=torch.int32, device=device),
        )
    return batch.memo[key]


def check_batch(q: torch.Tensor, block_size: int, batch: PagedBatch) -> None:
    """Raise ValueError unless the batch covers q's tokens and each context fits its block-table row."""
    starts = batch.query_start
    if len(starts) != batch.num_seqs + 1 or starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"query_start {starts} does not cover {q.shape[0]} query tokens from 0")
    if batch.block_tables.dim() != 2 or batch.block_tables.shape[0] != batch.num_seqs:
        raise ValueError(f"block_tables {tuple(batch.block_tables.shape)} is not [{batch.num_seqs}, max_blocks]")
    capacity = batch.block_tables.shape[1] * block_size  # tokens a block-table row can address
    for s, ctx in enumerate(batch.context_lens):
        if not 0 <= starts[s + 1] - starts[s] <= ctx <= capacity:
            raise ValueError(
                f"sequence {s}: {starts[s + 1] - starts[s]} queries, context {ctx}, block table holds {capacity}"
            )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    *,
    seqs: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k_cache/v_cache [num_blocks, block_size, Hkv, D] -> [T, Hq, D] in q's dtype. sinks [Hq]: a
    logit per query head joining each softmax over a value of zero (gpt-oss), or None.

    seqs: the sequences whose queries are attended (all by default); `out` [T, Hq, D], when given, receives
    their rows and keeps the others, and is returned. Those verifying a draft tree (`batch.trees`) attend by its
    mask, without a window."""
    check_operands(q, k_cache, v_cache)
    check_window(window)
    attended = range(batch.num_seqs) if seqs is None else seqs
    trees = any(s in batch.trees for s in attended)
    if trees and window is not None:
        raise ValueError("paged_prefill attends draft trees without a sliding window")
    check_sinks(sinks, q)
    check_device(q.device, block_tables=batch.block_tables)
    _, block_size, kv_heads, _ = k_cache.shape
    check_batch(q, block_size, batch)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} does not match q, or is not contiguous")
    inputs = prefill_inputs(batch, q.device, None if seqs is None else tuple(seqs))
    if inputs.max_queries == 0:
        return out

    _, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, BLOCK_M // g_pad)
    dot_f32, precision = dot_options(q.dtype)
    grid = (len(inputs.seqs), triton.cdiv(inputs.max_queries, block_q), kv_heads)
    tree = tree_inputs(batch, q.device) if trees else None
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        inputs.seqs,
        inputs.starts,
        inputs.lens,
        inputs.tables,
        q if sinks is None else sinks,
        *((inputs.lens, q, inputs.lens) if tree is None else tree),
        scale * LOG2E,
        window or 0,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        out.stride(0),
        out.stride(1),
        inputs.tables.stride(0),
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE=tile_for(head_dim),
        HAS_WINDOW=window is not None,
        DOT_F32=dot_f32,
        DOT_PRECISION=precision,
        HAS_SINKS=sinks is not None,
        HAS_TREES=trees,
    )
    return out


def paged_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `paged_prefill` computes, one sequence at a time in float32 (a draft tree's rows by its mask)."""
    _, q_heads, _ = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    for s, ctx in enumerate(batch.context_lens):
        q0, q1 = batch.query_start[s], batch.query_start[s + 1]
        if q1 == q0:
            continue
        blocks = batch.block_tables[s, : -(-ctx // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(q_heads // kv_heads, dim=1)  # [ctx, Hq, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(q_heads // kv_heads, dim=1)
        q_pos = torch.arange(ctx - (q1 - q0), ctx, device=q.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(ctx, device=q.device)[None, :]  # [1, ctx]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        if s in batch.trees:
            visible = batch.trees[s][0].to(q.device)
        scores = torch.einsum("thd,nhd->htn", q[q0:q1].float(), k) * scale  # [Hq, q_len, ctx]
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more logit per head, over a value of zero
            scores = torch.cat((scores, sinks.float()[:, None, None].expand(-1, q1 - q0, 1)), dim=-1)
            v = torch.cat((v, v.new_zeros(1, *v.shape[1:])))
        probs = scores.softmax(-1)
        out[q0:q1] = torch.einsum("htn,nhd->thd", probs, v).to(q.dtype)
    return out
