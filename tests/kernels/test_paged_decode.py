"""paged_decode (the Triton kernel, in Triton's CPU interpreter here) against paged_decode_ref and against
attention computed independently in float64 over contiguous K/V, and the launcher's input checks."""

from __future__ import annotations

import pytest
import torch

from conftest import interpreted

pytest.importorskip("triton")

from test_paged_attention import Case, make_case  # noqa: E402

from offload.kernels.paged_decode import paged_decode, paged_decode_ref  # noqa: E402

ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
RTOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# context lengths: one token, odd lengths ending just past a block boundary (every block size), and the longest
# over several partitions of 32
CONTEXTS = (1, 33, 130)
# (block_size, q_heads, kv_heads, head_dim): every block size, GQA ratios 1, 2, 3 (padded) and 4, head dims
# 32, 64, 128 and 48 (padded)
GEOMETRIES = [(16, 2, 2, 64), (32, 4, 1, 32), (64, 8, 2, 64), (128, 4, 2, 128), (16, 6, 2, 48)]


def naive_attention(case: Case, scale: float, window: int | None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per sequence, in float64 on each sequence's contiguous K/V: [T, Hq, D]."""
    q_heads, kv_heads = case.q.shape[1], case.keys[0].shape[1]
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    q = case.q.cpu()  # on the CPU, where the contiguous K/V are kept
    for s, ctx in enumerate(case.batch.context_lens):
        q0, q1 = case.batch.query_start[s], case.batch.query_start[s + 1]
        k = case.keys[s].double().repeat_interleave(q_heads // kv_heads, dim=1)  # [ctx, Hq, D]
        v = case.values[s].double().repeat_interleave(q_heads // kv_heads, dim=1)
        q_pos = torch.arange(ctx - (q1 - q0), ctx)[:, None]  # [q_len, 1]
        k_pos = torch.arange(ctx)[None, :]  # [1, ctx]
        lo = torch.zeros_like(q_pos) if window is None else q_pos - window + 1
        mask = torch.where((k_pos <= q_pos) & (k_pos >= lo), 0.0, float("-inf")).double()  # [q_len, ctx]
        scores = torch.einsum("thd,nhd->htn", q[q0:q1].double(), k) * scale + mask
        out[q0:q1] = torch.einsum("htn,nhd->thd", scores.softmax(-1), v)
    return out


def decode_case(contexts, block_size, q_heads, kv_heads, head_dim, dtype, seed=0) -> Case:
    """One query per sequence; K/V in shuffled blocks, NaN in every slot no sequence owns."""
    return make_case(tuple((ctx, 1) for ctx in contexts), block_size, q_heads, kv_heads, head_dim, dtype, seed)


def run(case: Case, scale: float, window: int | None, partition_size: int | None, launch=paged_decode):
    tables, lens = case.batch.block_tables, torch.tensor(case.batch.context_lens, device=case.q.device)
    return launch(case.q, case.k_cache, case.v_cache, tables, lens, scale, window, partition_size)


def assert_matches(case: Case, out: torch.Tensor, scale: float, window: int | None) -> None:
    dtype = case.q.dtype
    assert out.shape == case.q.shape and out.dtype == dtype
    ref = run(case, scale, window, None, paged_decode_ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=RTOL[dtype])
    naive = naive_attention(case, scale, window).to(out.device)
    torch.testing.assert_close(out.double(), naive, atol=ATOL[dtype], rtol=RTOL[dtype])


@interpreted
@pytest.mark.parametrize("partition_size", [None, 32], ids=["one-partition", "split-32"])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "head_dim"), GEOMETRIES)
def test_decode_matches_ref_and_naive(block_size, q_heads, kv_heads, head_dim, window, partition_size) -> None:
    case = decode_case(CONTEXTS, block_size, q_heads, kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    assert_matches(case, run(case, scale, window, partition_size), scale, window)


@interpreted
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_decode_dtypes(dtype: torch.dtype, window: int | None) -> None:
    case = decode_case((17, 64, 100), 32, 4, 2, 64, dtype, seed=1)  # 64: a context ending on a block boundary
    assert_matches(case, run(case, 0.125, window, 32), 0.125, window)


@interpreted
def test_decode_large_context_over_many_partitions() -> None:
    """1,500 positions in partitions of 256 (6 of them), next to a context shorter than one partition."""
    case = decode_case((1500, 1029, 3), 16, 8, 2, 128, torch.bfloat16, seed=2)
    assert_matches(case, run(case, 128**-0.5, None, 256), 128**-0.5, None)


@interpreted
def test_partitioning_does_not_change_the_result() -> None:
    case = decode_case((150, 45), 16, 4, 1, 64, torch.float32, seed=3)
    whole = run(case, 0.1, None, 512)
    for partition_size in (16, 64):
        torch.testing.assert_close(run(case, 0.1, None, partition_size), whole, atol=1e-6, rtol=1e-6)


@interpreted
def test_window_one_returns_own_value() -> None:
    """With window 1 the query sees only its own position: the output is that position's V, for each head."""
    case = decode_case((1, 40, 97), 16, 4, 2, 32, torch.float32, seed=4)
    out = run(case, 0.5, 1, 16)
    for s, ctx in enumerate(case.batch.context_lens):
        torch.testing.assert_close(out[s], case.values[s][ctx - 1].repeat_interleave(2, dim=0), atol=1e-6, rtol=0)


@interpreted
def test_int32_tables_and_lengths_give_the_same_result() -> None:
    case = decode_case((3, 50), 16, 4, 2, 32, torch.float32, seed=5)
    tables, lens = case.batch.block_tables, torch.tensor(case.batch.context_lens, device=case.q.device)
    wide = paged_decode(case.q, case.k_cache, case.v_cache, tables, lens, 0.2, partition_size=32)
    narrow = paged_decode(case.q, case.k_cache, case.v_cache, tables.int(), lens.int(), 0.2, partition_size=32)
    assert torch.equal(wide, narrow)


@interpreted
def test_query_with_strided_heads() -> None:
    """q need only be contiguous in head_dim: a view into a wider qkv projection is read in place."""
    case = decode_case((5, 70), 16, 4, 2, 32, torch.float32, seed=6)
    qkv = torch.cat([case.q, torch.zeros_like(case.q)], dim=1)  # [S, 2 * Hq, D]
    case.q = qkv[:, :4]
    assert not case.q.is_contiguous()
    assert_matches(case, run(case, 0.3, None, None), 0.3, None)


# --- launcher checks ---------------------------------------------------------------------------


def small() -> Case:
    return decode_case((5, 3), block_size=2, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)


def call(case: Case, **changes) -> torch.Tensor:
    args = {
        "q": case.q,
        "k_cache": case.k_cache,
        "v_cache": case.v_cache,
        "block_tables": case.batch.block_tables,
        "context_lens": torch.tensor(case.batch.context_lens),
        "scale": 1.0,
    } | changes
    return paged_decode(**args)


def last_dim_strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose last dimension has stride 2."""
    wide = torch.stack([t, t], dim=-1)  # [..., D, 2]
    return wide[..., 0]


@interpreted
def test_small_case_is_accepted() -> None:
    case = small()
    torch.testing.assert_close(call(case).double(), naive_attention(case, 1.0, None), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        pytest.param(lambda c: {"q": c.q.half()}, "dtype", id="q-dtype-differs"),
        pytest.param(lambda c: {"v_cache": c.v_cache.double()}, "dtype", id="v-dtype-differs"),
        pytest.param(
            lambda c: {"q": c.q.long(), "k_cache": c.k_cache.long(), "v_cache": c.v_cache.long()},
            "dtype",
            id="integer-operands",
        ),
        pytest.param(lambda c: {"q": c.q.flatten(1)}, "shapes", id="q-not-3d"),
        pytest.param(lambda c: {"v_cache": c.v_cache[:, :, :1]}, "shapes", id="v-shape-differs"),
        pytest.param(lambda c: {"q": c.q[:, :3].contiguous()}, "heads", id="heads-not-multiple"),
        pytest.param(lambda c: {"q": last_dim_strided(c.q)}, "q must be contiguous", id="q-last-dim-strided"),
        pytest.param(
            lambda c: {"k_cache": last_dim_strided(c.k_cache)}, "k_cache must be contiguous", id="k-last-dim-strided"
        ),
        pytest.param(
            lambda c: {"v_cache": last_dim_strided(c.v_cache)}, "v_cache must be contiguous", id="v-last-dim-strided"
        ),
        pytest.param(lambda c: {"block_tables": c.batch.block_tables.float()}, "block_tables", id="tables-not-integer"),
        pytest.param(
            lambda c: {"block_tables": last_dim_strided(c.batch.block_tables)},
            "block_tables must be contiguous",
            id="tables-last-dim-strided",
        ),
        pytest.param(lambda c: {"context_lens": torch.tensor([[5, 3]])}, "context_lens", id="lens-not-1d"),
        pytest.param(lambda c: {"context_lens": torch.tensor([5, 3, 1])}, "queries", id="lens-count-differs"),
        pytest.param(lambda c: {"partition_size": 24}, "partition_size", id="partition-not-power-of-two"),
        pytest.param(lambda c: {"partition_size": 8}, "partition_size", id="partition-under-16"),
        pytest.param(lambda c: {"window": 0}, "window", id="window-zero"),
        pytest.param(lambda c: {"k_cache": object()}, "k_cache must be a torch.Tensor", id="cache-not-tensor"),
    ],
)
def test_launcher_rejects_bad_inputs(bad, message: str) -> None:
    case = small()
    with pytest.raises(ValueError, match=message):
        call(case, **bad(case))


def test_launcher_rejects_cpu_tensors_outside_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        call(small())


# --- compiled on a GPU -------------------------------------------------------------------------


def to_cuda(case: Case) -> Case:
    b = case.batch
    batch = type(b)(b.query_start, b.context_lens, b.block_tables.cuda(), b.slot_mapping.cuda())
    return Case(case.q.cuda(), case.k_cache.cuda(), case.v_cache.cuda(), batch, case.keys, case.values)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("partition_size", [None, 16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "head_dim"), [*GEOMETRIES, (16, 8, 1, 256)])
def test_decode_on_gpu(block_size, q_heads, kv_heads, head_dim, dtype, window, partition_size) -> None:
    case = to_cuda(decode_case(CONTEXTS, block_size, q_heads, kv_heads, head_dim, dtype))
    scale = head_dim**-0.5
    assert_matches(case, run(case, scale, window, partition_size), scale, window)


@pytest.mark.gpu
@CUDA
def test_decode_large_on_gpu() -> None:
    case = to_cuda(decode_case((5000, 1029, 3, 2048), 16, 32, 8, 128, torch.bfloat16, seed=2))
    assert_matches(case, run(case, 128**-0.5, None, None), 128**-0.5, None)


@interpreted
@pytest.mark.parametrize("partition_size", [None, 32], ids=["one-partition", "split-32"])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "head_dim"), [GEOMETRIES[0], GEOMETRIES[4]])
def test_sinks_join_each_softmax_once_whatever_the_partitions(
    block_size, q_heads, kv_heads, head_dim, window, partition_size
):
    """The sink counts once per query head, in the first partition, so a split context merges to the same
    attention; against the torch reference and paged_attention_ref (itself checked against a dense reference)."""
    from offload.kernels.paged_attention import paged_attention_ref

    case = decode_case(CONTEXTS, block_size, q_heads, kv_heads, head_dim, torch.float32, seed=3)
    sinks = torch.linspace(-1.0, 4.0, q_heads)
    tables, lens = case.batch.block_tables, torch.tensor(case.batch.context_lens)
    scale = head_dim**-0.5
    out = paged_decode(case.q, case.k_cache, case.v_cache, tables, lens, scale, window, partition_size, sinks=sinks)
    ref = paged_decode_ref(case.q, case.k_cache, case.v_cache, tables, lens, scale, window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=ATOL[torch.float32], rtol=RTOL[torch.float32])
    dense = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, scale, window, sinks)
    torch.testing.assert_close(out, dense, atol=ATOL[torch.float32], rtol=RTOL[torch.float32])
    assert not torch.allclose(out, run(case, scale, window, partition_size), atol=1e-3)  # the sinks count
    with pytest.raises(ValueError, match=f"sinks must be float \\[{q_heads}\\]"):
        paged_decode(case.q, case.k_cache, case.v_cache, tables, lens, scale, window, sinks=sinks[1:])
