"""paged_prefill (the Triton kernel, in Triton's CPU interpreter here) against paged_prefill_ref and against
attention computed independently in float64 over contiguous K/V; the dispatcher's Triton path; the launcher's
input checks."""

from __future__ import annotations

import pytest
import torch

from conftest import interpreted

pytest.importorskip("triton")

from test_paged_attention import Case, make_case  # noqa: E402
from test_paged_decode import ATOL, CUDA, GEOMETRIES, RTOL, naive_attention, to_cuda  # noqa: E402

import offload.kernels.paged_attention as pa  # noqa: E402
from offload.kernels.paged_attention import PagedBatch, paged_attention, paged_attention_ref  # noqa: E402
from offload.kernels.paged_decode import paged_decode  # noqa: E402
from offload.kernels.paged_prefill import paged_prefill, paged_prefill_ref  # noqa: E402

# (context_len, query_len) per sequence: a full prefill over several query tiles, chunks starting mid-context
# (one ending exactly on a block boundary), one-query sequences, and a sequence with no queries this step
SEQS = ((70, 70), (13, 5), (1, 1), (64, 3), (33, 1), (9, 0))


def assert_matches(case: Case, out: torch.Tensor, scale: float, window: int | None) -> None:
    dtype = case.q.dtype
    assert out.shape == case.q.shape and out.dtype == dtype
    ref = paged_prefill_ref(case.q, case.k_cache, case.v_cache, case.batch, scale, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=RTOL[dtype])
    naive = naive_attention(case, scale, window).to(out.device)
    torch.testing.assert_close(out.double(), naive, atol=ATOL[dtype], rtol=RTOL[dtype])


def run(case: Case, scale: float, window: int | None) -> torch.Tensor:
    return paged_prefill(case.q, case.k_cache, case.v_cache, case.batch, scale, window)


@interpreted
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "head_dim"), GEOMETRIES)
def test_prefill_matches_ref_and_naive(block_size, q_heads, kv_heads, head_dim, window) -> None:
    case = make_case(SEQS, block_size, q_heads, kv_heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    assert_matches(case, run(case, scale, window), scale, window)


@interpreted
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_prefill_dtypes(dtype: torch.dtype, window: int | None) -> None:
    case = make_case(SEQS, 32, 4, 2, 64, dtype, seed=1)
    assert_matches(case, run(case, 0.125, window), 0.125, window)


@interpreted
def test_prefill_large_context() -> None:
    """A 48-token chunk at the end of a 1,100-token context (69 blocks), next to a short full prefill."""
    case = make_case(((1100, 48), (40, 40)), 16, 4, 2, 128, torch.bfloat16, seed=2)
    assert_matches(case, run(case, 128**-0.5, None), 128**-0.5, None)


@interpreted
def test_window_one_returns_own_value() -> None:
    case = make_case(SEQS, 16, 4, 2, 32, torch.float32, seed=3)
    out = run(case, 0.5, 1)
    for s, ctx in enumerate(case.batch.context_lens):
        q0, q1 = case.batch.query_start[s], case.batch.query_start[s + 1]
        own = case.values[s][ctx - (q1 - q0) :].repeat_interleave(2, dim=1)  # [q_len, Hq, D]
        torch.testing.assert_close(out[q0:q1], own, atol=1e-6, rtol=0)


@interpreted
def test_one_query_sequences_agree_with_decode() -> None:
    case = make_case(((40, 1), (7, 1), (100, 1)), 16, 4, 2, 32, torch.float32, seed=4)
    tables, lens = case.batch.block_tables, torch.tensor(case.batch.context_lens)
    decoded = paged_decode(case.q, case.k_cache, case.v_cache, tables, lens, 0.2, 9, partition_size=32)
    torch.testing.assert_close(run(case, 0.2, 9), decoded, atol=1e-6, rtol=1e-6)


@interpreted
def test_chosen_sequences_fill_their_rows_only() -> None:
    case = make_case(SEQS, 16, 4, 2, 32, torch.float32, seed=5)
    out = torch.full_like(case.q, 7.0)
    paged_prefill(case.q, case.k_cache, case.v_cache, case.batch, 0.3, seqs=(1, 3), out=out)
    naive = naive_attention(case, 0.3, None).float()
    starts = case.batch.query_start
    for s in range(case.batch.num_seqs):
        rows = slice(starts[s], starts[s + 1])
        if s in (1, 3):
            torch.testing.assert_close(out[rows], naive[rows], atol=2e-5, rtol=1e-5)
        else:
            assert (out[rows] == 7.0).all()


# --- draft trees (speculative decoding) ------------------------------------------------------

# (context_len, query_len) per sequence, and the trees two of them verify: (root position, each node's parent)
TREE_SEQS = ((70, 70), (18, 8), (1, 1), (30, 12))
TREES = {1: (10, (-1, 0, 1, -1, 3, 0, 5)), 3: (20, (-1, 0, 0, 1, 2, -1, 5, 6, 3))}  # seq 3: 2 tokens before its root


def with_trees(case: Case) -> Case:
    """`case` with TREES: each one's rows are its root's position, then one slot a node (engine._tree_rows)."""
    from offload.model.engine import _tree_rows
    from offload.scheduler.plan import SeqChunk

    b, trees = case.batch, {}
    for seq, (root, parents) in TREES.items():
        ctx, q_len = TREE_SEQS[seq]
        assert root + 1 + len(parents) == ctx
        chunk = SeqChunk(seq, (0,) * q_len, ctx - q_len, (), scored=(root, ctx - 1), drafted=len(parents),
                         parents=parents)  # fmt: skip
        trees[seq], _ = _tree_rows(chunk)
    batch = PagedBatch(b.query_start, b.context_lens, b.block_tables, b.slot_mapping, trees=trees)
    return Case(case.q, case.k_cache, case.v_cache, batch, case.keys, case.values)


def masked_naive(case: Case, scale: float) -> torch.Tensor:
    """Attention in float64 over each sequence's contiguous K/V, a tree's rows by its mask, the others causal."""
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    starts = case.batch.query_start
    for s, ctx in enumerate(case.batch.context_lens):
        q0, q1 = starts[s], starts[s + 1]
        if q0 == q1:
            continue
        k, v = case.keys[s].double(), case.values[s].double()  # [ctx, Hkv, D]
        group = case.q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - (q1 - q0), ctx)[:, None]
        if s in case.batch.trees:
            mask = case.batch.trees[s][0]
        scores = torch.einsum("thd,nhd->htn", case.q[q0:q1].double(), k) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("htn,nhd->thd", probs, v)
    return out


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_draft_trees_rows_attend_by_its_mask(dtype) -> None:
    """Each node sees the cached positions and its ancestors only, beside a full prefill and a one-query sequence."""
    case = with_trees(make_case(TREE_SEQS, 4, 4, 2, 32, dtype, seed=8))
    out = paged_prefill(case.q, case.k_cache, case.v_cache, case.batch, 0.25)
    naive = masked_naive(case, 0.25)
    torch.testing.assert_close(out.double(), naive, atol=ATOL[dtype], rtol=RTOL[dtype])
    ref = paged_prefill_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=RTOL[dtype])
    causal = paged_prefill(case.q, case.k_cache, case.v_cache, make_case(TREE_SEQS, 4, 4, 2, 32, dtype, 8).batch, 0.25)
    rows = slice(*case.batch.query_start[1:3])
    assert not torch.allclose(causal[rows].float(), out[rows].float())  # the masks mattered
    with pytest.raises(ValueError, match="draft trees without a sliding window"):
        paged_prefill(case.q, case.k_cache, case.v_cache, case.batch, 0.25, window=8)


@interpreted
def test_the_dispatcher_sends_trees_through_the_kernel_unless_a_window_needs_sdpa(triton_dispatch) -> None:
    case = with_trees(make_case(TREE_SEQS, 4, 4, 2, 32, torch.float32, seed=9))
    out = paged_attention(case.q, case.k_cache, case.v_cache, case.batch, 0.25)
    torch.testing.assert_close(out.double(), masked_naive(case, 0.25), atol=2e-5, rtol=1e-5)
    assert triton_dispatch == ["decode", "prefill"]
    windowed = paged_attention(case.q, case.k_cache, case.v_cache, case.batch, 0.25, window=128)  # wider than all
    torch.testing.assert_close(windowed, out, atol=2e-5, rtol=1e-5)  # the trees through SDPA, the same attention


# --- the dispatcher's Triton path --------------------------------------------------------------


class WrappedCache:
    """A cache that is not a plain tensor (as kv_quant.QuantizedKV is not): read through index_select."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype = t, t.shape, t.dtype

    def dim(self) -> int:
        return 4

    def element_size(self) -> int:
        return self.t.element_size()

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        return self.t.index_select(dim, index)


@pytest.fixture
def triton_dispatch(monkeypatch) -> list[str]:
    """paged_attention picks Triton here as on CUDA; the returned list records each kernel launched."""
    import offload.kernels.paged_decode as pd
    import offload.kernels.paged_prefill as pp

    launched: list[str] = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            launched.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(pa, "use_triton", lambda name, device: True)
    monkeypatch.setattr(pd, "paged_decode", spy("decode", pd.paged_decode))
    monkeypatch.setattr(pp, "paged_prefill", spy("prefill", pp.paged_prefill))
    return launched


@interpreted
@pytest.mark.parametrize(
    ("seqs", "kernels"),
    [
        pytest.param(SEQS, ["decode", "prefill"], id="mixed"),
        pytest.param(((40, 1), (7, 1), (100, 1)), ["decode"], id="all-decode"),
        pytest.param(((20, 20), (13, 5)), ["prefill"], id="all-prefill"),
    ],
)
def test_dispatcher_runs_the_kernels(triton_dispatch, seqs, kernels) -> None:
    case = make_case(seqs, 16, 4, 2, 32, torch.float32, seed=6)
    for _layer in range(2):  # the second layer reuses what the first built in batch.memo
        out = paged_attention(case.q, case.k_cache, case.v_cache, case.batch, 0.2, window=30)
        torch.testing.assert_close(out.double(), naive_attention(case, 0.2, 30), atol=2e-5, rtol=1e-5)
    assert triton_dispatch == kernels * 2
    assert ("triton_split", case.q.device) in case.batch.memo


def test_dispatcher_keeps_wrapped_caches_on_the_reference(triton_dispatch) -> None:
    case = make_case(SEQS, 16, 4, 2, 32, torch.float32, seed=7)
    k, v = WrappedCache(case.k_cache), WrappedCache(case.v_cache)
    out = paged_attention(case.q, k, v, case.batch, 0.2)
    assert triton_dispatch == []
    assert torch.equal(out, paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.2))


# --- launcher checks ---------------------------------------------------------------------------


def small() -> Case:
    return make_case(((5, 2), (3, 1)), block_size=2, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32)


def call(case: Case, **changes) -> torch.Tensor:
    args = {"q": case.q, "k_cache": case.k_cache, "v_cache": case.v_cache, "batch": case.batch} | changes
    return paged_prefill(**args, scale=1.0)


def with_batch(case: Case, **changes) -> dict:
    b = case.batch
    fields = {"query_start": b.query_start, "context_lens": b.context_lens, "block_tables": b.block_tables}
    return {"batch": PagedBatch(**(fields | changes), slot_mapping=b.slot_mapping)}


@interpreted
def test_small_case_is_accepted() -> None:
    case = small()
    torch.testing.assert_close(call(case).double(), naive_attention(case, 1.0, None), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        pytest.param(lambda c: {"q": c.q.half()}, "dtype", id="q-dtype-differs"),
        pytest.param(lambda c: {"k_cache": c.k_cache.bfloat16()}, "dtype", id="k-dtype-differs"),
        pytest.param(lambda c: {"q": c.q.flatten(1)}, "shapes", id="q-not-3d"),
        pytest.param(lambda c: {"q": c.q[..., :8].contiguous()}, "heads/dim", id="head-dim-differs"),
        pytest.param(lambda c: {"q": c.q.transpose(1, 2)}, "heads/dim|contiguous", id="q-transposed"),
        pytest.param(lambda c: {"q": torch.stack([c.q, c.q], -1)[..., 0]}, "q must be contiguous", id="q-strided"),
        pytest.param(lambda c: {"q": c.q[:2]}, "query_start", id="query-start-past-q"),
        pytest.param(lambda c: with_batch(c, query_start=(1, 2, 3)), "query_start", id="query-start-not-zero"),
        pytest.param(lambda c: with_batch(c, context_lens=(1, 3)), "sequence 0", id="queries-over-context"),
        pytest.param(lambda c: with_batch(c, context_lens=(7, 3)), "block table", id="context-over-table"),
        pytest.param(lambda c: {"window": 0}, "window", id="window-zero"),
        pytest.param(lambda c: {"out": c.q.half()}, "out", id="out-dtype-differs"),
    ],
)
def test_launcher_rejects_bad_inputs(bad, message: str) -> None:
    case = small()
    with pytest.raises(ValueError, match=message):
        call(case, **bad(case))


# --- compiled on a GPU -------------------------------------------------------------------------


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "head_dim"), [*GEOMETRIES, (16, 8, 1, 256)])
def test_prefill_on_gpu(block_size, q_heads, kv_heads, head_dim, dtype, window) -> None:
    case = to_cuda(make_case(SEQS, block_size, q_heads, kv_heads, head_dim, dtype))
    scale = head_dim**-0.5
    assert_matches(case, run(case, scale, window), scale, window)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("window", [None, 300])
def test_dispatcher_on_gpu(window: int | None) -> None:
    seqs = ((3000, 1), (1100, 512), (17, 1), (64, 64))
    case = to_cuda(make_case(seqs, 16, 32, 8, 128, torch.bfloat16, seed=8))
    out = paged_attention(case.q, case.k_cache, case.v_cache, case.batch, 128**-0.5, window)
    assert_matches(case, out, 128**-0.5, window)


@interpreted
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("block_size", "q_heads", "kv_heads", "head_dim"), [GEOMETRIES[0], GEOMETRIES[-1]])
def test_sinks_join_every_rows_softmax(block_size, q_heads, kv_heads, head_dim, window) -> None:
    case = make_case(SEQS, block_size, q_heads, kv_heads, head_dim, torch.float32, seed=4)
    sinks = torch.linspace(-1.0, 4.0, q_heads)
    scale = head_dim**-0.5
    out = paged_prefill(case.q, case.k_cache, case.v_cache, case.batch, scale, window, sinks=sinks)
    ref = paged_prefill_ref(case.q, case.k_cache, case.v_cache, case.batch, scale, window, sinks=sinks)
    dense = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, scale, window, sinks)
    rows = [t for s in range(len(SEQS)) for t in range(case.batch.query_start[s], case.batch.query_start[s + 1])]
    for want in (ref, dense):
        torch.testing.assert_close(out[rows], want[rows], atol=ATOL[torch.float32], rtol=RTOL[torch.float32])
    assert not torch.allclose(out[rows], run(case, scale, window)[rows], atol=1e-3)  # the sinks count


@interpreted
def test_dispatcher_gives_the_kernels_the_sinks(triton_dispatch) -> None:
    case = make_case(SEQS, 16, 4, 2, 32, torch.float32, seed=8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 3.0])
    out = paged_attention(case.q, case.k_cache, case.v_cache, case.batch, 0.2, 30, sinks)
    assert triton_dispatch == ["decode", "prefill"]
    want = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.batch, 0.2, 30, sinks)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_draft_tree_on_gpu(dtype) -> None:
    cpu = with_trees(make_case(TREE_SEQS, 16, 8, 2, 128, dtype, seed=10))
    gpu = to_cuda(cpu)
    b = gpu.batch
    batch = PagedBatch(b.query_start, b.context_lens, b.block_tables, b.slot_mapping, trees=cpu.batch.trees)
    out = paged_prefill(gpu.q, gpu.k_cache, gpu.v_cache, batch, 128**-0.5)
    torch.testing.assert_close(out.cpu().double(), masked_naive(cpu, 128**-0.5), atol=ATOL[dtype], rtol=RTOL[dtype])
