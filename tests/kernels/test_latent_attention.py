"""latent_attention_ref and the Triton decode kernel's latent form (values: the first v_dim values of each cached
vector, one KV head for every query head) against attention computed independently in float64 over each sequence's
contiguous vectors; a quantized cache; the input checks."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import Case, make_case

from conftest import interpreted
from offload.kernels.kv_quant import KVQuantFormat, quantize_kv
from offload.kernels.latent_attention import latent_attention, latent_attention_ref
from offload.kernels.paged_attention import PagedBatch
from offload.tiers.kv.kv_cache import QuantizedKV

# (context_len, query_len): prefills, a chunk mid-context, decodes of several lengths (one group padded)
SEQS = ((7, 7), (13, 5), (1, 1), (20, 1), (33, 1), (18, 2))
DECODES = ((1, 1), (20, 1), (33, 1), (70, 1))
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def latent_case(seqs, block_size: int, heads: int, width: int, dtype: torch.dtype, seed: int = 0) -> Case:
    """A cache of one KV head of `width` (NaN in every slot no sequence owns) and `heads` query heads."""
    return make_case(seqs, block_size, heads, 1, width, dtype, seed)


def naive(case: Case, scale: float, v_dim: int) -> torch.Tensor:
    """Causal softmax(q c^T * scale) c[:, :v_dim] per sequence and head, in float64: [T, H, v_dim]."""
    out = torch.empty(*case.q.shape[:2], v_dim, dtype=torch.float64)
    for s, ctx in enumerate(case.batch.context_lens):
        q0, q1 = case.batch.query_start[s], case.batch.query_start[s + 1]
        c = case.keys[s][:, 0].double()  # [ctx, width]
        scores = torch.einsum("thw,nw->thn", case.q[q0:q1].double(), c) * scale
        pos = torch.arange(ctx - (q1 - q0), ctx)[:, None, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, None, :] > pos, float("-inf"))
        out[q0:q1] = scores.softmax(-1) @ c[:, :v_dim]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("block_size", "heads", "kv_rank", "rope"), [(4, 4, 27, 6), (16, 8, 32, 8), (1, 2, 5, 2)])
def test_reference_equals_naive_attention(dtype, block_size, heads, kv_rank, rope):
    case = latent_case(SEQS, block_size, heads, kv_rank + rope, dtype)
    out = latent_attention_ref(case.q, case.k_cache, case.batch, 0.3, kv_rank)
    assert out.shape == (case.q.shape[0], heads, kv_rank) and out.dtype == dtype
    torch.testing.assert_close(out.double(), naive(case, 0.3, kv_rank), atol=ATOL[dtype], rtol=ATOL[dtype])


def test_quantized_cache_reads_what_its_dequantized_values_do():
    """An int8 cache of the latents (groups of 32 along the width): the same attention as a float cache of the values
    the records dequantize to."""
    case = latent_case(DECODES + ((9, 9),), 4, 4, 64, torch.float32)
    fmt = KVQuantFormat("int8", 64, 32)
    clean = torch.nan_to_num(case.k_cache)  # quantizing NaN is undefined; those slots are never read
    records = quantize_kv(clean, fmt)
    quantized = QuantizedKV(records, fmt, torch.float32)
    dequantized = quantized.index_select(0, torch.arange(clean.shape[0]))
    out = latent_attention_ref(case.q, quantized, case.batch, 0.2, 48)
    torch.testing.assert_close(out, latent_attention_ref(case.q, dequantized, case.batch, 0.2, 48))


@interpreted
@pytest.mark.parametrize("partition_size", [None, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_decode_kernel_reads_latents_in_place(partition_size, dtype):
    """paged_decode with v_dim: one program per sequence reads each latent once for every head; split over
    partitions of 16 positions (70 positions: five) or not."""
    pytest.importorskip("triton")
    from offload.kernels.paged_decode import paged_decode

    kv_rank, rope, heads = 27, 6, 4
    case = latent_case(DECODES, 4, heads, kv_rank + rope, dtype, seed=1)
    lens = torch.tensor(case.batch.context_lens)
    out = paged_decode(
        case.q, case.k_cache, case.k_cache, case.batch.block_tables, lens, 0.3, None, partition_size, v_dim=kv_rank
    )
    assert out.shape == (len(DECODES), heads, kv_rank)
    torch.testing.assert_close(out.double(), naive(case, 0.3, kv_rank), atol=ATOL[dtype], rtol=ATOL[dtype])


def test_checks_name_the_bad_operand():
    case = latent_case(((3, 1),), 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="v_dim 9 must be between 1 and the cached width 8"):
        latent_attention(case.q, case.k_cache, case.batch, 1.0, 9)
    with pytest.raises(ValueError, match=r"cache \(\d+, 4, 2, 8\) \[blocks, block, 1, W\]"):
        latent_attention(case.q, case.k_cache.expand(-1, -1, 2, -1), case.batch, 1.0, 4)
    bad = PagedBatch((0, 2), case.batch.context_lens, case.batch.block_tables, case.batch.slot_mapping)
    with pytest.raises(ValueError, match="does not cover 1 query tokens"):
        latent_attention(case.q, case.k_cache, bad, 1.0, 4)


@interpreted
def test_the_dispatcher_s_triton_path_equals_the_reference(monkeypatch):
    """latent_attention as it runs on CUDA (the Triton decode kernel over the batch's memoized tables), here in the
    interpreter, against the reference."""
    pytest.importorskip("triton")
    import offload.kernels.latent_attention as latent

    case = latent_case(DECODES, 4, 4, 33, torch.float32, seed=2)
    want = latent_attention_ref(case.q, case.k_cache, case.batch, 0.3, 27)
    monkeypatch.setattr(latent, "use_triton", lambda name, device: True)
    got = latent.latent_attention(case.q, case.k_cache, case.batch, 0.3, 27)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
