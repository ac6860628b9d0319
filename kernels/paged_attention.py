"""Attention of packed, ragged queries over a paged KV cache.

Each sequence s contributes query_lens[s] query tokens (a prefill chunk or one decode token), packed
back to back in `q`. Its keys and values live in the blocks listed in its row of `block_tables`;
its queries are the last query_lens[s] of its context_lens[s] positions, and attend causally
(optionally only to the last `window` positions).

The cache is read only through `PagedCache`: a plain tensor, or a quantized layer (kernels/kv_quant.QuantizedKV)
that dequantizes just the blocks gathered.

`paged_attention_ref` is the torch reference, which hands bfloat16 caches on a CPU that runs it to kernels/native.py's
kernel (kernels/cpu_attention.py); `paged_attention` dispatches: the Triton kernels of kernels/paged_decode.py and
kernels/paged_prefill.py on CUDA, the reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from offload.kernels import cpu_attention, native
from offload.kernels.dispatch import record, use_triton
from offload.kernels.paged_batch import PagedBatch

GATHER_BYTES = 64 << 20  # bytes of K/V gathered at once for single-query (decode) sequences
# padded share of the slots a decode group may gather: sorting by length and cutting groups there halves the
# bytes moved for mixed lengths (at 32 sequences of 100..600 tokens, one group padded to the longest took 1.7x
# the time of groups cut at a quarter)
PADDING_SHARE = 0.25


class PagedCache(Protocol):
    """What paged attention reads of one layer's K or V: a [num_blocks, block_size, Hkv, D] tensor, or an object
    standing for one whose `index_select(0, blocks)` returns those blocks in the compute dtype (`dtype`), and whose
    `element_size()` is the bytes of one value so returned."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def dim(self) -> int: ...

    def element_size(self) -> int: ...

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor: ...


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor | PagedCache,
    v_cache: torch.Tensor | PagedCache,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k_cache/v_cache [num_blocks, block_size, Hkv, D] -> [T, Hq, D]. `sinks` [Hq]: a learned logit
    per query head that joins each softmax as one more key with a value of zero (gpt-oss), or None."""
    _check(q, k_cache, v_cache, batch)
    if sinks is not None:
        return _attend_with_sinks(q, k_cache, v_cache, batch, scale, window, sinks)
    batched: frozenset[int] = frozenset()
    if native.decode_attention_fits(q, k_cache, v_cache):  # the queries kernels/choice.py timed faster there
        out, batched = cpu_attention.attend(q, k_cache, v_cache, batch, scale, window)
        if batched:
            record("paged_attention", "native")
    else:
        out = torch.empty_like(q)
    # decode tokens, one sequence or many: grouped by length, one product per group, the query heads folded into
    # their KV heads and the mask left out where every slot gathered is attended (at one sequence, 53 us a layer
    # against 157 for the general path's GQA call with a mask, for 160 positions of SmolLM2's heads)
    singles = [s for s in range(batch.num_seqs) if batch.query_start[s + 1] - batch.query_start[s] == 1]
    singles = [s for s in singles if s not in batched]
    if singles:
        _attend_single_queries(q, k_cache, v_cache, batch, singles, scale, window, out)
        batched = batched | set(singles)
    for s in range(batch.num_seqs):
        if s in batched:
            continue
        q0, q1, ctx = batch.query_start[s], batch.query_start[s + 1], batch.context_lens[s]
        k, v = _context(k_cache, v_cache, batch, s)
        mask = None
        if s in batch.trees:
            mask = tree_slots(batch, s, window, q.device)
        elif q1 - q0 < ctx or (window is not None and window < ctx):  # else plainly causal: is_causal, 15-20% faster
            mask = visible_slots(ctx, q1 - q0, window, q.device)
        out[q0:q1] = attend_contiguous(q[q0:q1], k, v, scale, mask)
    return out


def attend_contiguous(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """One sequence's queries q [q_len, Hq, D] over its keys k [ctx, Hkv, D] and values v [ctx, Hkv, Dv] ->
    [q_len, Hq, Dv]: `mask` [q_len, ctx] (True: attended), or None for plainly causal attention (q_len == ctx)."""
    # a batch dimension of one: 4-D inputs take torch's fused CPU kernel (5-7x faster than the 3-D path)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, Hq, q_len, Dv]
    return o[0].transpose(0, 1)


def _attend_with_sinks(
    q: torch.Tensor,
    k_cache: torch.Tensor | PagedCache,
    v_cache: torch.Tensor | PagedCache,
    batch: PagedBatch,
    scale: float,
    window: int | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, `sinks[h]`, over a value of zero: each sequence's scores
    computed in float32, the sink joined to every row, the softmax taken, the sink's share dropped."""
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [{q.shape[1]}] (one per query head), got {tuple(sinks.shape)}")
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    sink = sinks.to(q.device, torch.float32)[:, None, None]  # [Hq, 1, 1]
    for s in range(batch.num_seqs):
        q0, q1, ctx = batch.query_start[s], batch.query_start[s + 1], batch.context_lens[s]
        k, v = (t.repeat_interleave(group, dim=1) for t in _context(k_cache, v_cache, batch, s))  # [ctx, Hq, D]
        tree = s in batch.trees
        mask = tree_slots(batch, s, window, q.device) if tree else visible_slots(ctx, q1 - q0, window, q.device)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k.float()) * scale
        scores.masked_fill_(~mask, float("-inf"))
        logits = torch.cat((scores, sink.expand(-1, q1 - q0, 1)), dim=-1)  # [Hq, q_len, ctx + 1]
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out


def _context(
    k_cache: torch.Tensor | PagedCache, v_cache: torch.Tensor | PagedCache, batch: PagedBatch, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence s's keys and values, gathered from its blocks: [context, Hkv, D] each."""
    ctx = batch.context_lens[s]
    blocks = batch.block_tables[s, : -(-ctx // k_cache.shape[1])]
    return k_cache.index_select(0, blocks).flatten(0, 1)[:ctx], v_cache.index_select(0, blocks).flatten(0, 1)[:ctx]


def visible_slots(ctx: int, q_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, ctx] bool: the keys each of a sequence's last q_len positions attends to (causal, and the window)."""
    q_pos = torch.arange(ctx - q_len, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def tree_slots(batch: PagedBatch, s: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, ctx] bool: the keys each query of sequence s attends where its queries verify a draft tree
    (`batch.trees`): the cached positions and its ancestors, within the window by position."""
    mask, key_pos, query_pos = batch.trees[s]
    if window is not None:
        mask = mask & (key_pos[None, :] > query_pos[:, None] - window)
    return mask.to(device)


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """One-query sequences of similar length, gathered and padded to a common number of blocks."""

    lens: tuple[int, ...]  # [n] context lengths
    rows: torch.Tensor  # [n] int64 rows of their queries in the packed tokens
    blocks: torch.Tensor  # [n * width] int64 block ids, row by row; a short row repeats its own first block
    stale: torch.Tensor  # [p] int64 flat indices, into the gathered [n * width * block_size] slots, to zero
    every_row: bool  # rows are 0..n-1 and n every query token: the group is the whole packed batch, in its order
    run: int | None  # one sequence whose blocks are consecutive from this one: its K/V are a view, not a gather


def decode_groups(batch: PagedBatch, seqs: list[int], block_size: int, per_block: int) -> list[_DecodeGroup]:
    """Sort by length and cut into groups whose padding stays under PADDING_SHARE of the slots gathered and
    whose K/V stay under GATHER_BYTES. The same for every layer of a step: built once, kept on the batch.

    Masked slots get a weight of exactly 0, which only makes them vanish if they hold finite numbers, and a
    cache slot no sequence has written may hold anything. So a row's padding blocks repeat the sequence's own
    first block (its own keys, finite unless its own output is lost anyway), and only the slots that would
    show what the sequence has not written are zeroed: past its context in its last block, and, when the
    context is shorter than one block, the same offsets in the repeats. That is a few slots per sequence,
    against a quarter of the group for zeroing every padding slot."""
    key = ("decode", block_size)
    if key in batch.memo:
        return batch.memo[key]
    device = batch.block_tables.device
    seqs = sorted(seqs, key=lambda s: batch.context_lens[s])
    nblocks = [-(-batch.context_lens[s] // block_size) for s in seqs]
    groups, i = [], 0
    while i < len(seqs):
        j, held = i + 1, nblocks[i]  # held: blocks of real data in the group
        while j < len(seqs):
            gathered = (j - i + 1) * nblocks[j]
            if gathered * per_block > GATHER_BYTES or gathered - held - nblocks[j] > PADDING_SHARE * gathered:
                break
            held += nblocks[j]
            j += 1
        width = nblocks[j - 1]
        members = seqs[i:j]
        lens = torch.tensor([batch.context_lens[s] for s in members], device=device)[:, None]  # [n, 1]
        owned = torch.tensor(nblocks[i:j], device=device)[:, None]  # [n, 1] blocks each sequence holds
        table = batch.block_tables[torch.tensor(members, device=device), :width]  # [n, width]
        table = torch.where(torch.arange(width, device=device)[None, :] < owned, table, table[:, :1])
        pos = torch.arange(width * block_size, device=device)[None, :]  # [1, slots] position each slot shows
        shown = torch.where(pos < owned * block_size, pos, pos % block_size)  # a repeat shows block 0's positions
        stale = (shown >= lens).flatten().nonzero().flatten()
        rows = torch.tensor([batch.query_start[s] for s in members], device=device)
        every = members == list(range(batch.num_seqs)) and batch.query_start[-1] == len(members)
        ids = table.flatten().tolist()
        run = ids[0] if len(members) == 1 and ids == list(range(ids[0], ids[0] + len(ids))) else None
        groups.append(_DecodeGroup(tuple(lens.flatten().tolist()), rows, table.flatten(), stale, every, run))
        i = j
    batch.memo[key] = groups
    return groups


def _attend_single_queries(
    q: torch.Tensor,
    k_cache: torch.Tensor | PagedCache,
    v_cache: torch.Tensor | PagedCache,
    batch: PagedBatch,
    seqs: list[int],
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """Sequences with one query each (at position context_len - 1): each group's K/V gathered block by block, cut
    to its longest context, then one fused SDPA call per group; where a shorter context or a window masks slots,
    the slots showing what no sequence wrote are zeroed first (see `decode_groups`)."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    per_block = 2 * block_size * kv_heads * head_dim * k_cache.element_size()  # K and V of one block as gathered, bytes
    for g in decode_groups(batch, seqs, block_size, per_block):
        n, longest = len(g.lens), max(g.lens)
        # every sequence attends to all of the group's first `longest` slots when they are all that long and no
        # window cuts them: those slots hold only written positions, so neither zeroing nor a mask is needed
        masked = min(g.lens) < longest or (window is not None and window < longest)
        if g.run is not None and not masked and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor):
            # one sequence on consecutive blocks: the cache itself, read in place (never written here)
            blocks = slice(g.run, g.run + len(g.blocks))
            k = k_cache[blocks].view(1, -1, kv_heads, head_dim)
            v = v_cache[blocks].view(1, -1, kv_heads, head_dim)
        else:
            # index_select along blocks copies whole rows: 4-6x faster than indexing by the 2-D table
            # [n, width * block_size, Hkv, D]
            k = k_cache.index_select(0, g.blocks).view(n, -1, kv_heads, head_dim)
            v = v_cache.index_select(0, g.blocks).view(n, -1, kv_heads, head_dim)
        mask = None
        if masked:
            k.view(-1, kv_heads, head_dim).index_fill_(0, g.stale, 0)
            v.view(-1, kv_heads, head_dim).index_fill_(0, g.stale, 0)
            mask = visible_to_group(batch, g, longest, window)
        # the query heads sharing a KV head act as that head's queries (all at one position, so one mask row
        # serves them): no GQA expansion of K/V, 10-15% less time than enable_gqa at 4 query heads per KV head
        o = F.scaled_dot_product_attention(
            (q if g.every_row else q[g.rows]).view(n, kv_heads, -1, head_dim),  # [n, Hkv, Hq / Hkv, D]
            k[:, :longest].transpose(1, 2),
            v[:, :longest].transpose(1, 2),
            attn_mask=mask,
            scale=scale,
        ).flatten(1, 2)
        if g.every_row:
            out.copy_(o)
        else:
            out[g.rows] = o


def visible_to_group(batch: PagedBatch, group: _DecodeGroup, slots: int, window: int | None) -> torch.Tensor:
    """[n, 1, 1, slots] bool: the key slots each query attends to (its context, or the last `window` of it)."""
    key = ("valid", id(group), window)
    if key not in batch.memo:
        pos = torch.arange(slots, device=group.rows.device)[None, :]
        lens = torch.tensor(group.lens, device=group.rows.device)[:, None]
        valid = pos < lens  # the query sits at lens - 1
        if window is not None:
            valid &= pos > lens - 1 - window
        batch.memo[key] = valid[:, None, None, :]
    return batch.memo[key]


def _check(
    q: torch.Tensor, k_cache: torch.Tensor | PagedCache, v_cache: torch.Tensor | PagedCache, batch: PagedBatch
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not match cache heads/dim {tuple(k_cache.shape[2:])}")
    key = ("checked", q.shape, k_cache.shape, q.dtype, k_cache.dtype, v_cache.dtype)
    if key in batch.memo:  # every layer of a step asks the same
        return
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
    batch.memo[key] = True


class TritonSplit(NamedTuple):
    """The batch split between the Triton kernels, built once per batch and device and kept in `batch.memo`."""

    decode_rows: torch.Tensor | None  # [n] int64 rows of the one-query sequences in q; None when that is every row
    decode_tables: torch.Tensor  # [n, max_blocks] int32 their block tables
    decode_lens: torch.Tensor  # [n] int32 their context lengths
    max_decode_context: int  # the longest of them, so the decode launcher needs no device sync
    prefill_seqs: tuple[int, ...]  # the sequences with any other number of queries


def triton_split(batch: PagedBatch, device: torch.device) -> TritonSplit:
    key = ("triton_split", device)
    if key not in batch.memo:
        starts = batch.query_start
        decode = [s for s in range(batch.num_seqs) if starts[s + 1] - starts[s] == 1]
        rows = torch.tensor([starts[s] for s in decode], dtype=torch.int64, device=device)
        batch.memo[key] = TritonSplit(
            decode_rows=None if len(decode) == starts[-1] else rows,
            decode_tables=batch.block_tables[decode].to(device, torch.int32).contiguous(),
            decode_lens=torch.tensor([batch.context_lens[s] for s in decode], dtype=torch.int32, device=device),
            max_decode_context=max((batch.context_lens[s] for s in decode), default=0),
            prefill_seqs=tuple(
                s for s in range(batch.num_seqs) if starts[s + 1] - starts[s] > 1 and s not in batch.trees
            ),
        )
    return batch.memo[key]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor | PagedCache,
    v_cache: torch.Tensor | PagedCache,
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the paged cache, q [T, Hq, D] -> [T, Hq, D].

    On CUDA with plain-tensor caches the Triton kernels run: one-query sequences through `paged_decode` (split
    over partitions of the context), the others through `paged_prefill`, both reading the blocks in place.
    Elsewhere, and for a quantized cache (kv_quant.QuantizedKV, which dequantizes only the blocks gathered), the
    reference `paged_attention_ref` runs. Both take attention sinks."""
    plain = isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    if not (plain and use_triton("paged_attention", q.device)) or (batch.trees and sinks is not None):
        return paged_attention_ref(q, k_cache, v_cache, batch, scale, window, sinks)
    # imported here: they import triton, which only the Triton path needs
    from offload.kernels.paged_decode import paged_decode
    from offload.kernels.paged_prefill import paged_prefill

    _check(q, k_cache, v_cache, batch)
    split = triton_split(batch, q.device)
    rows = split.decode_rows
    out = None if rows is None else torch.empty_like(q)
    if len(split.decode_lens):
        decoded = paged_decode(
            q if rows is None else q[rows],
            k_cache,
            v_cache,
            split.decode_tables,
            split.decode_lens,
            scale,
            window,
            max_context=split.max_decode_context,
            sinks=sinks,
        )
        if rows is None:  # every query is a decode token
            return decoded
        out[rows] = decoded
    # a draft tree's queries attend by its mask: in the kernel, or under a sliding window through torch's SDPA
    starts = batch.query_start
    trees = [s for s in batch.trees if starts[s + 1] - starts[s] > 1] if window is None else []
    seqs = tuple(sorted((*split.prefill_seqs, *trees)))
    out = paged_prefill(q, k_cache, v_cache, batch, scale, window, seqs=seqs, out=out, sinks=sinks)
    for s in batch.trees if window is not None else ():
        q0, q1 = batch.query_start[s], batch.query_start[s + 1]
        k, v = _context(k_cache, v_cache, batch, s)
        out[q0:q1] = attend_contiguous(q[q0:q1], k, v, scale, tree_slots(batch, s, window, q.device))
    return out
