"""A draft tree's queries (speculative decoding): each node attends the cached positions and its own ancestors, at
the position of its depth; on the native CPU kernel, bit for bit what a decode step over the node's own path gives."""

from __future__ import annotations

import pytest
import torch

from offload.kernels import choice, native
from offload.kernels.paged_attention import paged_attention_ref
from offload.kernels.paged_batch import PagedBatch
from offload.model.engine import _tree_rows
from offload.scheduler.drafts import depths
from offload.scheduler.plan import SeqChunk

BLOCK, HQ, HKV, D = 4, 4, 2, 64
PARENTS = (-1, 0, 1, -1, 3, 0, 5)  # the main chain 0-1-2, a branch 3-4 from the root, a branch 5-6 from node 0
CACHED = 10  # positions before the root's


def _case(window: int | None = None):
    gen = torch.Generator().manual_seed(3)
    ctx = CACHED + 1 + len(PARENTS)  # the root at CACHED, then the nodes
    table = [6, 1, 4, 0, 3]  # blocks out of order
    k = torch.randn(8, BLOCK, HKV, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(8, BLOCK, HKV, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(1 + len(PARENTS), HQ, D, generator=gen).to(torch.bfloat16)
    tokens, scored = (0,) * (1 + len(PARENTS)), (CACHED, CACHED + len(PARENTS))
    chunk = SeqChunk(7, tokens, CACHED, tuple(table), scored=scored, drafted=len(PARENTS), parents=PARENTS)
    tree, positions = _tree_rows(chunk)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(CACHED, ctx)])
    batch = PagedBatch((0, len(q)), (ctx,), torch.tensor([table]), slots, trees={0: tree})
    return q, k, v, table, batch, positions


def _alone(q_row, k, v, table, path_slots, window):
    """One query over the cached positions and its path copied to consecutive slots: a decode step's attention."""
    n = CACHED + 1 + len(path_slots)  # the cached ones, the root, the path
    flat_k, flat_v = k.view(-1, HKV, D), v.view(-1, HKV, D)
    where = [table[p // BLOCK] * BLOCK + p % BLOCK for p in [*range(CACHED + 1), *path_slots]]
    blocks = -(-n // BLOCK)
    kk = torch.zeros(blocks * BLOCK, HKV, D, dtype=torch.bfloat16)
    vv = torch.zeros_like(kk)
    kk[:n], vv[:n] = flat_k[where], flat_v[where]
    start = 0 if window is None else max(0, n - window)
    return native.decode_attention(
        q_row[None], kk.view(blocks, BLOCK, HKV, D), vv.view(blocks, BLOCK, HKV, D),
        torch.arange(blocks, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32),
        torch.tensor([start], dtype=torch.int32), D**-0.5, n,
    )[0]  # fmt: skip


def test_tree_rows_sit_at_their_depths_and_see_their_ancestors() -> None:
    _, _, _, _, batch, positions = _case()
    assert positions == [CACHED + d for d in [0, *depths(PARENTS)]]
    mask = batch.trees[0][0]
    assert mask[0].nonzero().flatten().tolist() == list(range(CACHED + 1))  # the root: causal
    node6 = mask[7].nonzero().flatten().tolist()  # node 6: the root's, then nodes 0, 5 and itself
    assert node6 == [*range(CACHED + 1), CACHED + 1 + 0, CACHED + 1 + 5, CACHED + 1 + 6]


@pytest.mark.skipif(
    native.cpu_missing() is not None or native._decode_attention() is None, reason="no native kernels here"
)
@pytest.mark.parametrize("window", [None, 9])
def test_a_node_attends_as_a_decode_step_over_its_path_bit_for_bit(monkeypatch, window) -> None:
    monkeypatch.setattr(choice, "_one_row_up_to", [1 + len(PARENTS)])  # a speculating engine's rule
    q, k, v, table, batch, _ = _case(window)
    out = paged_attention_ref(q, k, v, batch, D**-0.5, window)
    ancestry: list[list[int]] = []
    for j, p in enumerate(PARENTS):
        ancestry.append([])
        ancestry[j] = [j] if p < 0 else [*ancestry[p], j]
        path_slots = [CACHED + 1 + a for a in ancestry[j]]
        assert torch.equal(out[1 + j], _alone(q[1 + j], k, v, table, path_slots, window)), f"node {j}"
    assert torch.equal(out[0], _alone(q[0], k, v, table, [], window))  # the root: a decode step's own
    # torch's masked SDPA (where the native kernel is off) agrees to bfloat16's rounding
    monkeypatch.setenv("OFFLOAD_KERNELS", "torch")
    _, _, _, _, fresh, _ = _case(window)
    torch.testing.assert_close(paged_attention_ref(q, k, v, fresh, D**-0.5, window), out, atol=2e-2, rtol=2e-2)
