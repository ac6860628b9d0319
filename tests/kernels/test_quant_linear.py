"""quant_linear in the cpu layout: torch's packed int4 codes read back (unpack, dequantize) as its own kernel reads
them, prefill-sized products through the dequantized dense GEMM against the kernel, and stacked parts' codes."""

from __future__ import annotations

import pytest
import torch

from offload.common.quant import WeightQuant
from offload.kernels import choice, native
from offload.kernels import quant_linear as ql
from offload.kernels.quant_matmul import quantize

CPU_INT4 = WeightQuant(4, 32, "cpu")


def cpu_int4(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15 [n, k] int32, torch's CPU packing of them, scales and zeros [k / 32, n, 2] float32)."""
    gen = torch.Generator().manual_seed(seed)
    codes, scales = quantize(torch.randn(n, k, generator=gen), 4, 32, dtype=torch.float32)
    q = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(1).to(torch.int32)  # the triton layout's nibbles
    return q, ql.to_cpu_layout(codes, 4), scales


def kernel_weight(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W [n, k] as torch's int4 kernel dequantizes it: the identity times W.T, in float32."""
    k = packed.shape[1] * 2
    return torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k), packed, 32, scales).t()


@pytest.mark.parametrize("n, k", [(64, 64), (192, 96), (1088, 160)])
def test_unpacking_gives_back_the_codes_and_the_kernels_weights(n: int, k: int) -> None:
    if not ql._unpacks_cpu_int4():
        pytest.skip("this torch packs int4 for this CPU in another layout: its kernel runs every product")
    q, packed, scales = cpu_int4(n, k)
    assert torch.equal(ql.unpack_cpu_int4(packed).int(), q)
    assert torch.equal(ql.dequantize_cpu_int4(packed, scales, 32), kernel_weight(packed, scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_sized_products_run_the_dense_gemm_and_agree_with_the_kernel(dtype, monkeypatch) -> None:
    if not ql._unpacks_cpu_int4():
        pytest.skip("this torch packs int4 for this CPU in another layout: its kernel runs every product")
    _, packed, scales = cpu_int4(1088, 160)  # two slices of DEQUANT_ROWS features, the second partial
    gen = torch.Generator().manual_seed(1)
    # from fewer rows where kernels/native.py runs: its dequantization is 5x torch's
    native_runs = native.int4_fits(torch.zeros(8, 160, dtype=dtype), packed, scales.to(dtype), 32)
    dense_from = next(r for r, p in choice.UNMEASURED["int4"] if p == choice.DENSE) if native_runs else None
    x = torch.randn(dense_from or ql.INT4_DENSE_MIN_ROWS, 160, generator=gen).to(dtype)
    dense = []
    monkeypatch.setattr(ql, "_dense_int4", lambda *a: dense.append(a) or _dense(*a))
    got = ql.quant_linear(x, packed, scales.to(dtype), CPU_INT4)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales.to(dtype))
    assert len(dense) == 1 and got.dtype == dtype
    # float32: the same weights, summed in another order; bfloat16: the weights rounded once to bfloat16 as well
    # (each output rounded to bfloat16 in both: 2.6e-3 of the outputs' norm apart, measured)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 5e-3
    ql.quant_linear(x[:-1], packed, scales.to(dtype), CPU_INT4)  # one row fewer: the kernel (torch's or native)
    assert len(dense) == 1


_dense = ql._dense_int4


def test_stacking_int4_parts_needs_whole_row_blocks() -> None:
    (qa, a, sa), (qb, b, sb) = cpu_int4(64, 64), cpu_int4(128, 64, seed=1)
    codes, scales = ql.stack_outputs([a, b], [sa, sb], CPU_INT4)
    assert torch.equal(codes, ql.to_cpu_layout(quantize_codes(torch.cat([qa, qb])), 4))
    assert torch.equal(scales, torch.cat([sa, sb], dim=1))
    (_, c, sc), (_, d, sd) = cpu_int4(32, 64), cpu_int4(32, 64, seed=1)
    assert ql.stack_outputs([c, d], [sc, sd], CPU_INT4) is None  # half a row block each
    triton = WeightQuant(4, 32, "triton")
    assert ql.stack_outputs([c, d], [sc, sd], triton)[0].shape == (64, 32)


def quantize_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [n, k] in the triton layout (two a byte, even inputs in the low nibble)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
