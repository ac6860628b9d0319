"""offload.kernels.linear: either path, for every size on either side of the upcast threshold, gives the product
of the path it claims: exact float32 products rounded once, or torch's own half-precision GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import offload.kernels.linear as kl
from offload.kernels.linear import SLICE_FEATURES, UPCAST_MIN_ROWS, linear


@pytest.mark.parametrize("upcast", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, UPCAST_MIN_ROWS - 1, UPCAST_MIN_ROWS, 257])
@pytest.mark.parametrize("out_features", [7, SLICE_FEATURES, SLICE_FEATURES + 3])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_its_reference(monkeypatch, upcast, dtype, rows, out_features, bias):
    monkeypatch.setattr(kl, "upcast_is_faster", lambda _dtype: upcast)
    g = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, 48, generator=g).to(dtype)
    w = torch.randn(out_features, 48, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    y = linear(x, w, b)
    assert y.dtype == dtype and y.shape == (rows, out_features)
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    if upcast and dtype != torch.float32 and rows >= UPCAST_MIN_ROWS:
        # the upcast path rounds the exact product once: it is the float32 result in x's dtype
        torch.testing.assert_close(y, exact.to(dtype), atol=0, rtol=0)
    else:
        torch.testing.assert_close(y, F.linear(x, w, b), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_choice_is_measured_once_per_dtype(dtype):
    first = kl.upcast_is_faster(dtype)
    assert isinstance(first, bool)
    assert kl.upcast_is_faster(dtype) is first
    assert kl.upcast_is_faster.cache_info().hits >= 1


def _packable(dtype: torch.dtype) -> bool:
    try:
        kl.pack_weight(torch.ones(4, 4, dtype=dtype))
    except (RuntimeError, AttributeError):
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_gives_torch_s_own_product(dtype, rows, bias):
    """Packing only reorders the weight: the product is F.linear's up to the order of accumulation (an element
    may round to the neighbouring value), for any row count (the weight is packed once, without knowing them) and
    for inputs that are views; it is no further from the exact product than F.linear is."""
    if not _packable(dtype):
        pytest.skip(f"this CPU's oneDNN does not pack {dtype}")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    packed = kl.pack_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape and packed.numel() * packed.element_size() == w.nbytes
    x = torch.randn(48, rows, generator=g).to(dtype).t()  # [rows, 48], not contiguous
    got, dense = linear(x, packed, b), F.linear(x, w, b)
    ulp = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)  # relative spacing of the dtype's values near 1 (at most)
    torch.testing.assert_close(got, dense, atol=ulp, rtol=2 * ulp)
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert (got.float() - exact).abs().max() <= 1.5 * (dense.float() - exact).abs().max() + ulp


def test_packing_is_never_chosen_for_float32_and_is_measured_once():
    assert kl.packing_pays(torch.float32) is False
    first = kl.packing_pays(torch.bfloat16)
    assert kl.packing_pays(torch.bfloat16) is first and kl.packing_pays.cache_info().hits >= 1


def test_packing_must_beat_the_native_kernel_at_one_row_where_it_runs(monkeypatch):
    """Packing replaces the native kernel for resident matrices: it pays only where a packed one-row product is the
    faster (on the AMD EPYC the native kernel took half its time), besides beating torch's GEMM."""
    if not _packable(torch.bfloat16):
        pytest.skip("this CPU's oneDNN does not pack bfloat16")
    from offload.kernels import native as nk

    if not nk.bf16_mm_fits(torch.zeros(1, 1024, dtype=torch.bfloat16), torch.zeros(64, 1024, dtype=torch.bfloat16)):
        pytest.skip("no native bfloat16 kernel here")
    for native_ratio, pays in ((1.5, False), (0.5, True)):
        fake = lambda packed, w, x, dense=None, rounds=9, r=native_ratio: r if dense is nk.bf16_mm else 0.5  # noqa: E731
        monkeypatch.setattr(kl, "_time_ratio", fake)
        kl.packing_pays.cache_clear()
        try:
            assert kl.packing_pays(torch.bfloat16) is pays
        finally:
            kl.packing_pays.cache_clear()


def test_a_verify_steps_rows_through_a_packed_weight_round_as_one_rows(monkeypatch):
    """A speculating engine's verify rows (kernels/choice.py's one-row rule) through a packed weight: each row is what
    a one-row product gives it, however many rows and whatever the shape (oneDNN's GEMM rounds rows apart past 32 on
    the Xeon with AMX; on the EPYC from 2 rows at 2048 x 2048, from 16 at 1536 -> 576)."""
    if not _packable(torch.bfloat16):
        pytest.skip("this CPU's oneDNN does not pack bfloat16")
    from offload.kernels import choice

    g = torch.Generator().manual_seed(5)
    for n, k in ((2048, 2048), (1536, 576), (576, 1536)):
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(65, k, generator=g).to(torch.bfloat16)
        packed = kl.pack_weight(w)
        alone = torch.cat([linear(x[r : r + 1], packed) for r in range(65)])
        with monkeypatch.context() as m:
            m.setattr(choice, "_one_row_up_to", [65])
            assert torch.equal(linear(x, packed), alone), (n, k)
