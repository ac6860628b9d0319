"""Decode attention (one query per sequence) over a paged KV cache, split over partitions of the context.

Sequence s has one query, at position context_lens[s] - 1; it attends to the keys at positions [0, context_lens[s])
(or only the last `window` of them), read in place from the cache blocks listed in its row of `block_tables`.

One program handles one (sequence, KV head, context partition): the query heads sharing that KV head are the rows
of one tile, so each K/V value is read once for all of them. Keys are visited in tiles of TILE_N positions, each
position looked up in the block table, so the tile size does not depend on the cache's block size. With more than
one partition each program writes its running max, sum and unnormalised output, and `_combine_kernel` merges the
partitions of each (sequence, query head): one small launch per layer, where a torch reduction would take half a
dozen (max, exp, two weighted sums, a division, a cast) and their float32 temporaries. With one partition the
first kernel writes the output itself.

`paged_decode` launches; `paged_decode_ref` is the same attention in plain torch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from offload.common import environment
from offload.kernels.attention_checks import (
    LATENT_MAX_DIM,
    MAX_HEAD_DIM,
    check_device,
    check_index,
    check_operands,
    check_sinks,
    check_window,
)

PARTITION_SIZE = 512  # context positions per partition when the caller does not choose
TILE_N = 64  # key positions per tile, head dims up to 128; half that above, to bound registers
LOG2E = 1.4426950408889634  # scores are scaled into base 2 so the kernels use exp2


@triton.jit
def load_kv_tile(
    k_head_ptr,
    v_head_ptr,
    table_row,  # the sequence's row of the block table
    tile,
    ctx,
    offs_n,  # [TILE] arange
    offs_d,  # [D_PAD] arange
    d_mask,  # [D_PAD] the key's dims
    v_mask,  # [D_PAD] the value's dims: the key's, or (a latent cache) its first V_DIM
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Key positions [tile * TILE, (tile + 1) * TILE) and their K and V ([TILE, D_PAD] each), read in place through
    the block table. Slots past the context may hold anything (NaN included): they load as 0, never multiplied in."""
    pos = tile * TILE + offs_n
    in_ctx = pos < ctx
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    k_mask, v_mask = in_ctx[:, None] & d_mask[None, :], in_ctx[:, None] & v_mask[None, :]
    k = tl.load(k_head_ptr + block[:, None] * stride_kb + offset[:, None] * stride_kt + offs_d[None, :], k_mask, 0.0)
    v = tl.load(v_head_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt + offs_d[None, :], v_mask, 0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return pos, in_ctx, k, v


@triton.jit
def _decode_kernel(
    q_ptr,  # [S, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    tables_ptr,  # [S, W] block ids
    lens_ptr,  # [S] context lengths
    sinks_ptr,  # [Hq] attention sink logits, read when HAS_SINKS
    out_ptr,  # [S, Hq, V_DIM], written when not SPLIT
    part_m_ptr,  # [S, Hq, P] float32 running max (base 2), written when SPLIT
    part_l_ptr,  # [S, Hq, P] float32 sum of exp2(score - max)
    part_o_ptr,  # [S, Hq, P, V_DIM] float32 unnormalised output
    scale_log2,  # softmax scale * log2(e)
    window,  # a query at p sees keys in (p - window, p]; read only when HAS_WINDOW
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ts,
    stride_os,
    stride_oh,
    num_parts,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,  # the values' width: HEAD_DIM, or fewer (a latent cache's values are its keys' first dims)
    D_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two, at least 16
    GROUP: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,  # GROUP rounded up to a power of two, at least 16 (the smallest dot tile)
    BLOCK_SIZE: tl.constexpr,  # cache positions per block
    TILE: tl.constexpr,
    TILES_PER_PART: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,  # dot operands in float32 (Triton's interpreter gets bfloat16 dots wrong)
    DOT_PRECISION: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    lo = 0  # first visible key position
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    first_tile = lo // TILE + part * TILES_PER_PART
    end_tile = tl.minimum(first_tile + TILES_PER_PART, tl.cdiv(ctx, TILE))

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g  # [G_PAD] query heads of this KV head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    v_mask = offs_d < V_DIM

    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [G_PAD, D_PAD]
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    if HAS_SINKS:  # the sink: one more key, of logit sinks[h] and value 0, counted once, in partition 0
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(part == 0, sink, m_i)
        l_i = tl.where(part == 0, 1.0, l_i)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    k_head_ptr = k_ptr + kv_head * stride_kh
    v_head_ptr = v_ptr + kv_head * stride_vh
    table_row = tables_ptr + seq.to(tl.int64) * stride_ts
    # every tile in [first_tile, end_tile) holds a visible key, so m_i is finite after the first one
    for tile in range(first_tile, end_tile):
        pos, in_ctx, k, v = load_kv_tile(
            k_head_ptr, v_head_ptr, table_row, tile, ctx, offs_n, offs_d, d_mask, v_mask,
            stride_kb, stride_kt, stride_vb, stride_vt, TILE, BLOCK_SIZE, DOT_F32,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [G_PAD, TILE]
        visible = in_ctx & (pos >= lo)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    row = seq.to(tl.int64) * GROUP * tl.num_programs(1) + heads  # [G_PAD] (sequence, query head) rows
    if SPLIT:
        # an empty partition (a short sequence, or keys before the window) writes m=-inf, l=0, acc=0
        tl.store(part_m_ptr + row * num_parts + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + row * num_parts + part, l_i, mask=g_mask)
        o_ptrs = part_o_ptr + ((row * num_parts + part) * V_DIM)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, acc, mask=g_mask[:, None] & v_mask[None, :])
    else:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & v_mask[None, :])


@triton.jit
def _combine_kernel(
    part_m_ptr,  # [S, Hq, P] float32
    part_l_ptr,  # [S, Hq, P] float32
    part_o_ptr,  # [S, Hq, P, D] float32
    out_ptr,  # [S, Hq, D]
    stride_os,
    stride_oh,
    num_parts,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    P_PAD: tl.constexpr,  # num_parts rounded up to a power of two
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    offs_p = tl.arange(0, P_PAD)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < num_parts
    m = tl.load(part_m_ptr + row * num_parts + offs_p, mask=p_mask, other=float("-inf"))
    sums = tl.load(part_l_ptr + row * num_parts + offs_p, mask=p_mask, other=0.0)
    o = tl.load(
        part_o_ptr + (row * num_parts + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=p_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [P_PAD, D_PAD]
    m_max = tl.max(m, 0)  # finite: the partition holding the query's own position is never empty
    w = tl.exp2(m - m_max)  # 0 for empty partitions
    out = tl.sum(o * w[:, None], 0) / tl.sum(sums * w, 0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def tile_for(head_dim: int) -> int:
    return TILE_N if head_dim <= 128 else TILE_N // 2


def dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, DOT_PRECISION): float32 operands under the interpreter; on a GPU the cache's own dtype on the
    tensor cores, and float32 caches multiplied exactly rather than in TF32."""
    interpreting = environment.interpreting()
    return interpreting, "ieee" if dtype == torch.float32 or interpreting else "tf32"


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    partition_size: int | None = None,
    *,
    max_context: int | None = None,
    sinks: torch.Tensor | None = None,
    v_dim: int | None = None,
) -> torch.Tensor:
    """q [S, Hq, D], k_cache/v_cache [num_blocks, block_size, Hkv, D], block_tables [S, W] and context_lens [S]
    (int32 or int64, each length at least 1: the query's own position is in the cache) -> [S, Hq, v_dim] in q's
    dtype. sinks [Hq]: a logit per query head joining each softmax over a value of zero (gpt-oss), or None.
    v_dim: the values' width, their first v_dim dims (None: D); multi-head latent attention's values are the first
    kv_rank dims of its cached latents (k_cache and v_cache the same tensor; kernels/latent_attention.py).

    partition_size: context positions per program (a power of two, at least 16; PARTITION_SIZE by default); the
    partition count follows from the longest context, `max_context` when the caller knows it (else read from
    `context_lens`, one device sync)."""
    check_operands(q, k_cache, v_cache, LATENT_MAX_DIM if v_dim is not None else MAX_HEAD_DIM)
    check_index("block_tables", block_tables, 2)
    check_index("context_lens", context_lens, 1)
    check_device(q.device, block_tables=block_tables, context_lens=context_lens)
    check_window(window)
    num_seqs, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    check_sinks(sinks, q)
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} queries, block_tables {tuple(block_tables.shape)}, context_lens {tuple(context_lens.shape)}"
        )
    partition_size = PARTITION_SIZE if partition_size is None else partition_size
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two of at least 16, got {partition_size}")
    v_dim = head_dim if v_dim is None else v_dim
    if not 0 < v_dim <= head_dim:
        raise ValueError(f"v_dim {v_dim} must be between 1 and head_dim {head_dim}")
    out = q.new_empty(num_seqs, q_heads, v_dim)
    if num_seqs == 0:
        return out
    if max_context is None:
        max_context = int(context_lens.max())

    tile = min(tile_for(head_dim), partition_size)
    tiles = triton.cdiv(max_context, tile)  # tiles a query's visible keys span, at most
    if window is not None:
        tiles = min(tiles, triton.cdiv(window - 1, tile) + 1)
    tiles_per_part = partition_size // tile
    num_parts = max(1, triton.cdiv(tiles, tiles_per_part))
    group = q_heads // kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    dot_f32, precision = dot_options(q.dtype)
    split = num_parts > 1
    if split:
        part_m = torch.empty(num_seqs, q_heads, num_parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty(num_seqs, q_heads, num_parts, v_dim, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_o = out  # not read: SPLIT is off
    _decode_kernel[(num_seqs, kv_heads, num_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        q if sinks is None else sinks,
        out,
        part_m,
        part_l,
        part_o,
        scale * LOG2E,
        window or 0,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_parts,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        D_PAD=d_pad,
        GROUP=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        TILE=tile,
        TILES_PER_PART=tiles_per_part,
        HAS_WINDOW=window is not None,
        SPLIT=split,
        DOT_F32=dot_f32,
        DOT_PRECISION=precision,
        HAS_SINKS=sinks is not None,
    )
    if split:
        _combine_kernel[(num_seqs, q_heads)](
            part_m,
            part_l,
            part_o,
            out,
            out.stride(0),
            out.stride(1),
            num_parts,
            HEAD_DIM=v_dim,
            D_PAD=d_pad,
            P_PAD=triton.next_power_of_2(num_parts),
        )
    return out


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    partition_size: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `paged_decode` computes, one sequence at a time in float32 (partition_size does not change it)."""
    num_seqs, q_heads, _ = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    for s, ctx in enumerate(context_lens.tolist()):
        lo = 0 if window is None else max(0, ctx - window)
        blocks = block_tables[s, : math.ceil(ctx / block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[lo:ctx].float()  # [visible, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[lo:ctx].float()
        k = k.repeat_interleave(q_heads // kv_heads, dim=1)  # [visible, Hq, D]
        v = v.repeat_interleave(q_heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[s].float(), k) * scale  # [Hq, visible]
        if sinks is not None:  # one more logit per head, over a value of zero
            scores = torch.cat((scores, sinks.float()[:, None]), dim=-1)
            v = torch.cat((v, v.new_zeros(1, *v.shape[1:])))
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
