"""quant_matmul's weight formats in plain torch (no triton needed): codes and parameters against the formulas computed
one group at a time in numpy, the nibble layout, the int4 convention against torch's own int4 matmul, round-trip
error bounds, quant_matmul_ref against float64, the CPU dispatcher, and the checks' errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offload.kernels import dispatch
from offload.kernels.quant_matmul import dequantize, quant_matmul, quant_matmul_ref, quantize

GROUP_SIZES = [32, 64, 128]


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] float32 with row and column magnitudes spread over 30x, so groups differ in scale."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.rand(n, 1, generator=gen) * 3 + torch.rand(1, k, generator=gen) * 0.3 + 0.1
    return torch.randn(n, k, generator=gen) * spread


def naive_codes(w: torch.Tensor, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The formulas, one group at a time in float32: (codes [N, K] int, parameters [groups, N, 2 or 1])."""
    w = w.float().numpy()
    n, k = w.shape
    codes = np.zeros((n, k), dtype=np.int64)
    params = np.zeros((k // group_size, n, 2 if bits == 4 else 1), dtype=np.float32)
    for row in range(n):
        for g in range(k // group_size):
            v = w[row, g * group_size : (g + 1) * group_size]
            if bits == 4:
                mn = v.min()
                scale = np.float32(max(np.float32(v.max() - mn), np.float32(1e-6)) / np.float32(15))
                params[g, row] = scale, np.float32(mn + np.float32(8) * scale)
                codes[row, g * group_size : (g + 1) * group_size] = np.clip(np.rint((v - mn) / scale), 0, 15)
            else:
                scale = np.float32(max(np.abs(v).max(), np.float32(1e-8)) / np.float32(127))
                params[g, row] = scale
                codes[row, g * group_size : (g + 1) * group_size] = np.clip(np.rint(v / scale), -127, 127)
    return codes, params


def unpack_nibbles(qweight: torch.Tensor) -> np.ndarray:
    """uint8 [N, K // 2] -> [N, K]: byte j holds element 2j in its low four bits, 2j + 1 in its high four."""
    out = []
    for row in qweight.tolist():
        out.append([nibble for byte in row for nibble in (byte & 0xF, byte >> 4)])
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_codes_and_parameters_match_the_formulas(bits: int, group_size: int) -> None:
    w = weight(7, 256, seed=group_size)
    qweight, scales = quantize(w, bits, group_size)
    codes, params = naive_codes(w, bits, group_size)
    if bits == 4:
        assert qweight.dtype == torch.uint8 and qweight.shape == (7, 128)
        assert scales.shape == (256 // group_size, 7, 2) and scales.dtype == torch.float32
        assert np.array_equal(unpack_nibbles(qweight), codes)
    else:
        assert qweight.dtype == torch.int8 and qweight.shape == (7, 256)
        assert scales.shape == (256 // group_size, 7)
        assert np.array_equal(qweight.numpy(), codes)
        params = params[..., 0]
    assert np.array_equal(scales.numpy(), params)
    assert scales.is_contiguous() and qweight.is_contiguous()


def test_nibble_order_on_known_codes() -> None:
    """A row ramping 0..15 over 16 features quantizes to codes 0..15 (min 0, max 15: scale 1); bytes 0x10, 0x32, ..."""
    w = torch.arange(32, dtype=torch.float32).remainder(16).view(1, 32)
    qweight, scales = quantize(w, 4, 16)
    assert qweight[0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
    assert scales[:, 0].tolist() == [[1.0, 8.0], [1.0, 8.0]]
    assert torch.equal(dequantize(qweight, scales, 4), w)


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch lacks its CPU int4 matmul"
)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_int4_convention_is_torchs(group_size: int) -> None:
    """torch's int4 CPU matmul, given our codes (repacked its way) and our scales_and_zeros as they are, computes
    x @ dequantize(...).T: the two agree on the nibble order, the offset of 8, and the [groups, N, 2] layout."""
    n, k = 48, 256  # torch's packing wants N a multiple of 16
    qweight, scales = quantize(weight(n, k, seed=3), 4, group_size)
    q = torch.from_numpy(unpack_nibbles(qweight)).to(torch.int32)  # [N, K] codes 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales)
    expected = x @ dequantize(qweight, scales, 4).T
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * expected.abs().max().item())


def stored_scale(scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Each weight's float32 scale as stored, [N, K]."""
    s = scales[..., 0] if bits == 4 else scales
    return s.float().repeat_interleave(group_size, 0).t()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_round_trip_within_half_a_step(bits: int, group_size: int) -> None:
    """float32 parameters: every weight reads back within half its group's step (plus float32 rounding)."""
    w = weight(9, 384, seed=1)
    qweight, scales = quantize(w, bits, group_size)
    back = dequantize(qweight, scales, bits)
    assert back.dtype == torch.float32 and back.shape == w.shape
    bound = stored_scale(scales, bits, group_size) / 2 * (1 + 1e-5) + w.abs() * 1e-6
    assert (back - w).abs().le(bound).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_round_trip_with_half_precision_parameters(bits: int, dtype: torch.dtype) -> None:
    """Parameters stored in half precision (codes from the float32 ones): half a step, plus what rounding the scale
    (times the code's distance from the zero point, up to 8 or 127), the zero and the result to `dtype` adds."""
    w = weight(5, 128, seed=2).to(dtype)
    qweight, scales = quantize(w, bits, 32)
    assert scales.dtype == dtype
    back = dequantize(qweight, scales, bits)
    assert back.dtype == dtype
    eps = torch.finfo(dtype).eps
    scale = stored_scale(scales, bits, 32)
    zero = scales[..., 1].float().repeat_interleave(32, 0).t().abs() if bits == 4 else 0
    bound = scale / 2 + eps * (scale * (8 if bits == 4 else 127) + zero + w.float().abs()) * 1.01
    assert (back.float() - w.float()).abs().le(bound).all()
    # a dtype= different from w's
    assert quantize(w.float(), bits, 32, dtype=dtype)[1].dtype == dtype


@pytest.mark.parametrize("bits", [4, 8])
def test_constant_and_zero_groups_read_back_exactly(bits: int) -> None:
    w = torch.cat((torch.zeros(2, 32), torch.full((2, 32), -0.75)), 1)
    qweight, scales = quantize(w, bits, 32)
    back = dequantize(qweight, scales, bits)
    assert torch.equal(back[:, :32], torch.zeros(2, 32))
    assert (back[:, 32:] + 0.75).abs().max() <= (1e-6 if bits == 4 else 0)


def naive_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, bias) -> torch.Tensor:
    """float64 x @ W.T + bias, W from the codes and parameters by the format's formula, written out separately."""
    s = scales.double()
    group_size = x.shape[1] // s.shape[0]
    if bits == 4:
        q = torch.from_numpy(unpack_nibbles(qweight)).double() - 8
        w = q * s[..., 0].repeat_interleave(group_size, 0).t() + s[..., 1].repeat_interleave(group_size, 0).t()
    else:
        w = qweight.double() * s.repeat_interleave(group_size, 0).t()
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matmul_against_float64(bits: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    qweight, scales = quantize(weight(11, 128), bits, 64, dtype=dtype)
    x = torch.randn(3, 128, generator=gen).to(dtype)
    bias = torch.randn(11, generator=gen).to(dtype)
    y = quant_matmul_ref(x, qweight, scales, bits, bias)
    assert y.dtype == dtype and y.shape == (3, 11)
    expected = naive_matmul(x, qweight, scales, bits, bias)
    w = dequantize(qweight, scales, bits).double()
    eps = torch.finfo(dtype).eps
    bound = eps * (x.double().abs() @ w.abs().t() + bias.double().abs()) * 2 + 1e-6
    assert (y.double() - expected).abs().le(bound).all()


def test_dispatcher_runs_the_reference_on_a_cpu() -> None:
    qweight, scales = quantize(weight(6, 64), 8, 32)
    x = torch.randn(2, 64)
    assert torch.equal(quant_matmul(x, qweight, scales, 8), quant_matmul_ref(x, qweight, scales, 8))
    assert dispatch.picked()["quant_matmul"] == "torch"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(4, 48), 4, 32), "K 48 is not a multiple of group_size 32"),
        ((torch.zeros(4, 33), 4, 33), "K must be even, got 33"),
        ((torch.zeros(4, 64), 3, 32), "bits must be 4 or 8, got 3"),
        ((torch.zeros(4, 64, dtype=torch.int32), 8, 32), r"floating weight \[N, K\]"),
        ((torch.zeros(64), 8, 32), r"floating weight \[N, K\]"),
    ],
)
def test_quantize_refuses(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize(*args)


def test_quantize_refuses_an_integer_scale_dtype() -> None:
    with pytest.raises(ValueError, match="floating dtype"):
        quantize(torch.zeros(4, 64), 8, 32, dtype=torch.int32)


def test_dequantize_refuses() -> None:
    q4, s4 = quantize(torch.randn(4, 64), 4, 32)
    q8, s8 = quantize(torch.randn(4, 64), 8, 32)
    with pytest.raises(ValueError, match=r"int4 qweight must be uint8 \[N, K // 2\]"):
        dequantize(q8, s4, 4)
    with pytest.raises(ValueError, match=r"int8 qweight must be int8 \[N, K\]"):
        dequantize(q4, s8, 8)
    with pytest.raises(ValueError, match=r"int4 scales must be \[K // group_size, 4, 2\]"):
        dequantize(q4, s8, 4)
    with pytest.raises(ValueError, match=r"int8 scales must be \[K // group_size, 4\]"):
        dequantize(q8, s8[:, :3], 8)
    with pytest.raises(ValueError, match="scales hold 3 groups, which do not divide K 64"):
        dequantize(q8, torch.ones(3, 4), 8)
    with pytest.raises(ValueError, match="scales must be floating"):
        dequantize(q8, s8.to(torch.int32), 8)


@pytest.mark.parametrize("group_size", [32, 128])
def test_searched_int4_is_never_worse_than_round_to_nearest_in_any_group(group_size: int) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g) * 0.05
    w[::5, ::17] *= 8  # outliers stretch their groups' ranges, where a shrunk range pays
    errs = []
    for method in ("rtn", "search"):
        q, s = quantize(w, 4, group_size, dtype=torch.float32, method=method)
        errs.append((dequantize(q, s, 4) - w).square().view(48, -1, group_size).sum(-1))  # [N, groups]
    rtn, search = errs
    assert (search <= rtn * (1 + 1e-5) + 1e-12).all()
    assert search.sum() < 0.95 * rtn.sum()  # and clearly better overall on these weights


def test_searched_int4_keeps_constant_groups_and_the_layout() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    w[:, :32] = 0.25  # one constant group per row
    q, s = quantize(w, 4, 32, dtype=torch.float32, method="search")
    assert q.shape == (8, 32) and q.dtype == torch.uint8 and s.shape == (2, 8, 2)
    assert torch.equal(dequantize(q, s, 4)[:, :32], w[:, :32])
    with pytest.raises(ValueError, match="method must be one of rtn, search, got 'awq'"):
        quantize(w, 4, 32, method="awq")
