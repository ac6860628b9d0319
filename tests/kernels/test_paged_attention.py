"""paged_attention (the dispatcher) and paged_attention_ref against dense attention computed independently over
contiguous K/V, and the launcher's input checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from offload.kernels.paged_attention import PagedBatch, paged_attention, paged_attention_ref

ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}

# (context_len, query_len) per sequence: full prefills, chunks starting mid-context, 1-token decodes,
# contexts ending exactly on and just past a 16-token block boundary
SEQS = ((7, 7), (13, 5), (1, 1), (20, 1), (16, 16), (33, 1), (18, 2))


@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D] packed queries
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    batch: PagedBatch
    keys: list[torch.Tensor]  # per sequence [ctx, Hkv, D], contiguous
    values: list[torch.Tensor]


def make_case(
    seqs: tuple[tuple[int, int], ...],
    block_size: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Case:
    """Random contiguous K/V per sequence, scattered into shuffled blocks of a paged cache."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_needed) + 3  # a few blocks no sequence owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    # every slot no sequence owns holds NaN: attention that reads one is caught
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.zeros(len(seqs), max(blocks_needed), dtype=torch.int64)
    keys, values, queries, slots, starts = [], [], [], [], [0]
    for s, (ctx, q_len) in enumerate(seqs):
        table = [order.pop() for _ in range(blocks_needed[s])]
        tables[s, : len(table)] = torch.tensor(table)
        k = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(ctx):
            block, offset = table[pos // block_size], pos % block_size
            k_cache[block, offset] = k[pos]
            v_cache[block, offset] = v[pos]
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(ctx - q_len, ctx)]
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, q_heads, head_dim, generator=gen).to(dtype))
        starts.append(starts[-1] + q_len)
    batch = PagedBatch(
        query_start=tuple(starts),
        context_lens=tuple(ctx for ctx, _ in seqs),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    return Case(torch.cat(queries), k_cache, v_cache, batch, keys, values)


def dense_attention(case: Case, scale: float, window: int | None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per sequence and query head, in float32, on contiguous K/V."""
    q_heads, kv_heads = case.q.shape[1], case.keys[0].shape[1]
    group = q_heads // kv_heads
    out = torch.empty(case.q.shape, dtype=torch.float32)
    for s, ctx in enumerate(case.batch.context_lens):
        q0, q1 = case.batch.query_start[s], case.batch.query_start[s + 1]
        k, v = case.keys[s].float(), case.values[s].float()  # [ctx, Hkv, D]
        for t in range(q0, q1):
            pos = ctx - (q1 - q0) + (t - q0)  # absolute position of query token t
            lo = 0 if window is None else max(0, pos - window + 1)
            mask = torch.full((ctx,), float("-inf"))
            mask[lo : pos + 1] = 0.0
            for h in range(q_heads):
                kv = h // group  # query heads [kv*group, (kv+1)*group) share kv head kv
                scores = k[:, kv] @ case.q[t, h].float() * scale + mask  # [ctx]
                out[t, h] = scores.softmax(0) @ v[:, kv]
    return out


# (block_size, q_heads, kv_heads, head_dim): every block size, GQA ratio 1/2/4 and head_dim at least twice
GEOMETRIES = [(1, 2, 2, 8), (1, 4, 2, 24), (3, 4, 2, 24), (3, 4, 1, 8), (16, 4, 1, 24), (16, 2, 2, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "head_dim"), GEOMETRIES)
def test_ref_matches_dense(
    block_size: int, q_heads: int, kv_heads: int, head_dim: int, window: int | None, dtype: torch.dtype
) -> None:
    case = make_case(SEQS, block_size, q_heads, kv_heads, head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, scale, window)
    assert out.shape == case.q.shape
    assert out.dtype == dtype
    expected = dense_attention(case, scale, window)
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=RTOL[dtype])


def test_ref_matches_dense_large() -> None:
    seqs = ((300, 300), (257, 1), (129, 64), (1, 1))
    case = make_case(seqs, block_size=16, q_heads=8, kv_heads=2, head_dim=128, dtype=torch.float32, seed=1)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, scale=0.1, window=None)
    torch.testing.assert_close(out, dense_attention(case, 0.1, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gather_bytes", [1, 2 * 16 * 2 * 24 * 4 * 3, 64 << 20])
@pytest.mark.parametrize("window", [None, 4])
def test_decode_queries_gathered_in_groups_match_dense(monkeypatch, gather_bytes: int, window: int | None) -> None:
    """Many one-token sequences of mixed lengths (the decode path), gathered one at a time, a few blocks'
    worth at a time, or all at once: the same as dense attention, NaN padding never leaking in."""
    import offload.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "GATHER_BYTES", gather_bytes)
    seqs = tuple((ctx, 1) for ctx in (1, 40, 3, 16, 17, 33, 2, 64, 5)) + ((9, 4),)
    case = make_case(seqs, 16, 4, 2, 24, torch.float32, seed=3)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.2, window)
    torch.testing.assert_close(out, dense_attention(case, 0.2, window), atol=1e-5, rtol=1e-5)


def test_window_one_returns_own_value() -> None:
    """With window 1 each query sees only its own position, so the output is that position's V."""
    case = make_case(SEQS, 3, 4, 2, 8, torch.float32)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.5, window=1)
    for s, ctx in enumerate(case.batch.context_lens):
        q0, q1 = case.batch.query_start[s], case.batch.query_start[s + 1]
        own = case.values[s][ctx - (q1 - q0) :].repeat_interleave(2, dim=1)  # [q_len, Hq, D]
        torch.testing.assert_close(out[q0:q1], own, atol=1e-6, rtol=0)


def test_window_at_least_context_equals_full_attention() -> None:
    case = make_case(SEQS, 3, 4, 2, 8, torch.float32)
    full = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.3)
    windowed = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.3, window=33)
    assert torch.equal(full, windowed)


def test_sequences_are_independent() -> None:
    """Each sequence's output equals the output of a batch holding it alone."""
    case = make_case(SEQS, 3, 4, 2, 8, torch.float32)
    out = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.3, window=5)
    b = case.batch
    for s in range(b.num_seqs):
        q0, q1 = b.query_start[s], b.query_start[s + 1]
        alone = PagedBatch((0, q1 - q0), (b.context_lens[s],), b.block_tables[s : s + 1], b.slot_mapping[q0:q1])
        single = paged_attention_ref(case.q[q0:q1], case.k_cache, case.v_cache, alone, 0.3, window=5)
        torch.testing.assert_close(out[q0:q1], single, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 5])
def test_dispatcher_matches_dense(window: int | None, dtype: torch.dtype) -> None:
    """What the engine calls, whichever implementation the dispatcher picks here, against attention computed
    independently on contiguous K/V."""
    case = make_case(SEQS, 16, 4, 2, 24, dtype, seed=2)
    out = paged_attention(case.q, case.k_cache, case.v_cache, case.batch, 0.2, window)
    assert out.shape == case.q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), dense_attention(case, 0.2, window), atol=ATOL[dtype], rtol=RTOL[dtype])


# --- launcher checks ---------------------------------------------------------------------------


def small_case() -> Case:
    return make_case(((5, 2), (3, 1)), block_size=2, q_heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)


def call_ref(case: Case, **changes) -> torch.Tensor:
    args = {"q": case.q, "k_cache": case.k_cache, "v_cache": case.v_cache, "batch": case.batch} | changes
    return paged_attention_ref(**args, scale=1.0)


def test_small_case_is_accepted() -> None:
    assert call_ref(small_case()).isfinite().all()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda c: {"q": c.q.flatten(1)}, id="q-not-3d"),
        pytest.param(lambda c: {"k_cache": c.k_cache[0]}, id="k-cache-not-4d"),
        pytest.param(lambda c: {"v_cache": c.v_cache[:, :, :1]}, id="v-shape-differs"),
        pytest.param(lambda c: {"q": c.q[..., :4].contiguous()}, id="head-dim-differs"),
        pytest.param(lambda c: {"q": c.q[:, :3].contiguous()}, id="heads-not-multiple"),
        pytest.param(lambda c: {"q": c.q[:2]}, id="query-start-past-q"),
        pytest.param(lambda c: {"q": torch.cat([c.q, c.q[:1]])}, id="q-tokens-uncovered"),
        pytest.param(
            lambda c: {"batch": PagedBatch((0, 3), c.batch.context_lens, c.batch.block_tables, c.batch.slot_mapping)},
            id="query-start-too-short",
        ),
        pytest.param(lambda c: {"q": c.q.half()}, id="q-dtype-differs"),
    ],
)
def test_launcher_rejects_mismatched_inputs(bad) -> None:
    case = small_case()
    with pytest.raises(ValueError):
        call_ref(case, **bad(case))


@pytest.mark.parametrize("launch", [paged_attention, paged_attention_ref])
def test_dispatch_checks_too(launch) -> None:
    case = small_case()
    with pytest.raises(ValueError, match="dtype"):
        launch(case.q.half(), case.k_cache, case.v_cache, case.batch, 1.0)


def test_launcher_rejects_v_cache_dtype_mismatch() -> None:
    case = small_case()
    with pytest.raises(ValueError):
        call_ref(case, v_cache=case.v_cache.half())


def test_launcher_rejects_query_start_not_at_zero() -> None:
    case = small_case()
    b = case.batch
    with pytest.raises(ValueError):
        call_ref(case, batch=PagedBatch((1, 2, 3), b.context_lens, b.block_tables, b.slot_mapping))


def test_launcher_rejects_queries_longer_than_context() -> None:
    case = small_case()
    b = case.batch
    with pytest.raises(ValueError):
        call_ref(case, batch=PagedBatch(b.query_start, (1, 3), b.block_tables, b.slot_mapping))


def test_launcher_rejects_context_beyond_block_table() -> None:
    case = small_case()  # block_tables is [2, 3]: at most 6 tokens of context
    b = case.batch
    with pytest.raises(ValueError):
        call_ref(case, batch=PagedBatch(b.query_start, (7, 3), b.block_tables, b.slot_mapping))


@pytest.mark.parametrize("window", [None, 40, 5])
def test_one_decode_sequence_on_consecutive_blocks_reads_the_cache_in_place(window) -> None:
    """A lone decode sequence whose blocks follow one another attends over a view of the cache (no gather), which
    it leaves as it was; a window that cuts its context takes the gathered, masked path. Either way: dense attention."""
    from offload.kernels.paged_attention import decode_groups

    case = make_case(((33, 1),), 16, 4, 2, 24, torch.float32)
    old = case.batch.block_tables[0, :3].tolist()
    k_cache = torch.full((8, 16, 2, 24), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    k_cache[2:5], v_cache[2:5] = case.k_cache[old], case.v_cache[old]  # blocks 2, 3, 4
    batch = PagedBatch(case.batch.query_start, case.batch.context_lens, torch.tensor([[2, 3, 4]]), torch.tensor([66]))
    before = k_cache.clone(), v_cache.clone()
    out = paged_attention_ref(case.q, k_cache, v_cache, batch, 0.3, window)
    assert decode_groups(batch, [0], 16, 1)[0].run == 2
    torch.testing.assert_close(out, dense_attention(case, 0.3, window), atol=1e-5, rtol=1e-5)
    for now, then in zip((k_cache, v_cache), before, strict=True):
        assert torch.equal(now.nan_to_num(7.0), then.nan_to_num(7.0))


def dense_attention_with_sinks(case: Case, scale: float, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """dense_attention with one more logit per head, sinks[h], over a zero value: exp(s_i) / (sum exp(s_j) + e^sink)."""
    q_heads, kv_heads = case.q.shape[1], case.keys[0].shape[1]
    group = q_heads // kv_heads
    out = torch.empty(case.q.shape, dtype=torch.float32)
    for s, ctx in enumerate(case.batch.context_lens):
        q0, q1 = case.batch.query_start[s], case.batch.query_start[s + 1]
        k, v = case.keys[s].float(), case.values[s].float()
        for t in range(q0, q1):
            pos = ctx - (q1 - q0) + (t - q0)
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(q_heads):
                scores = k[lo : pos + 1, h // group] @ case.q[t, h].float() * scale
                weights = scores.exp() / (scores.exp().sum() + sinks[h].float().exp())
                out[t, h] = weights @ v[lo : pos + 1, h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "head_dim"), [(3, 4, 2, 24), (16, 4, 1, 24)])
def test_sinks_take_their_share_of_every_softmax(dtype, window, block_size, q_heads, kv_heads, head_dim) -> None:
    """Prefill chunks and decode tokens alike; through the dispatcher too (the reference here: the Triton kernels'
    sinks are tested in test_paged_decode.py and test_paged_prefill.py); sinks of -inf are plain attention."""
    case = make_case(SEQS, block_size, q_heads, kv_heads, head_dim, dtype)
    sinks = torch.linspace(-2.0, 3.0, q_heads)
    want = dense_attention_with_sinks(case, 0.3, window, sinks)
    for launch in (paged_attention_ref, paged_attention):
        got = launch(case.q, case.k_cache, case.v_cache, case.batch, 0.3, window, sinks=sinks)
        torch.testing.assert_close(got.float(), want, atol=ATOL[dtype], rtol=RTOL[dtype])
    none = paged_attention_ref(
        case.q, case.k_cache, case.v_cache, case.batch, 0.3, window, sinks=torch.full((q_heads,), float("-inf"))
    )
    torch.testing.assert_close(none.float(), dense_attention(case, 0.3, window), atol=ATOL[dtype], rtol=RTOL[dtype])
    with pytest.raises(ValueError, match=f"sinks must be \\[{q_heads}\\]"):
        paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.3, window, sinks=sinks[:1])
