"""quant_matmul's fused Triton kernel (in Triton's CPU interpreter, or compiled on a GPU) against quant_matmul_ref and
a float64 computation from the codes, for int4 and int8, group sizes 32 / 64 / 128, decode and prefill row counts
(split-K included), an odd N, with and without bias, in each dtype; one large case; the launcher's checks; and the
dispatcher's choice."""

from __future__ import annotations

import pytest
import torch

from conftest import interpreted

pytest.importorskip("triton")

import offload.kernels.quant_matmul as qm  # noqa: E402
from offload.kernels import dispatch  # noqa: E402
from offload.kernels.quant_matmul import quant_matmul, quant_matmul_ref, quant_matmul_triton, quantize  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = {dtype: torch.finfo(dtype).eps for dtype in DTYPES}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def case(m: int, n: int, k: int, bits: int, group_size: int, dtype: torch.dtype, bias: bool, device: str = "cpu"):
    """(x [m, k], qweight, scales, bias [n] or None), the weight's rows and columns of different magnitudes."""
    gen = torch.Generator().manual_seed(m * 7 + n + k + bits + group_size)
    w = torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) + 0.2)
    qweight, scales = quantize(w, bits, group_size, dtype=dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(qweight), move(scales), move(b)


def float64_product(x, qweight, scales, bits, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T + bias in float64 with W from the codes by the format's formula, the same with |x|, |W| and |bias|:
    the scale of the rounding errors each output may carry)."""
    x, s = x.double().cpu(), scales.double().cpu()
    group_size = x.shape[1] // s.shape[0]
    if bits == 4:
        packed = qweight.cpu().to(torch.int64)
        q = torch.stack((packed & 15, packed >> 4), -1).flatten(1).double() - 8
        scale, zero = (s[..., i].repeat_interleave(group_size, 0).t() for i in (0, 1))
        w, w_abs = q * scale + zero, (q * scale).abs() + zero.abs()  # w_abs: the size of what rounds
    else:
        w = qweight.cpu().double() * s.repeat_interleave(group_size, 0).t()
        w_abs = w.abs()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double().cpu()
    return x @ w.t() + b, x.abs() @ w_abs.t() + b.abs()


def check(y: torch.Tensor, x, qweight, scales, bits, bias) -> None:
    """y against the reference and against float64. Each may differ by the roundings of the dequantized weights
    (to the dtype), the products' sum (float32), and the output: within an ulp of the dtype each, as Triton's CPU
    interpreter truncates to bfloat16 where a GPU rounds to nearest (half an ulp)."""
    dtype = x.dtype
    assert y.dtype == dtype and y.shape == (x.shape[0], qweight.shape[0])
    expected, magnitude = float64_product(x, qweight, scales, bits, bias)
    bound = 2 * EPS[dtype] * magnitude + 1e-6
    assert (y.double().cpu() - expected).abs().le(bound).all()
    ref = quant_matmul_ref(x, qweight, scales, bits, bias)
    assert (y.double() - ref.double()).abs().cpu().le(2 * bound).all()


# (M, group size): decode row counts (split-K: N fills one tile) and prefill (a ragged tile of M), each with groups
# of 32, 64 and 128 somewhere; odd M with bias, even M without
ROWS_AND_GROUPS = [(1, 32), (1, 128), (3, 64), (16, 32), (16, 128), (67, 64), (67, 128)]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "group_size"), ROWS_AND_GROUPS)
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_matches_reference_and_float64(bits: int, group_size: int, m: int, dtype: torch.dtype) -> None:
    bias = m % 2 == 1
    x, qweight, scales, b = case(m, 37, 256, bits, group_size, dtype, bias)
    check(quant_matmul_triton(x, qweight, scales, bits, b), x, qweight, scales, bits, b)


def test_decode_splits_k_and_prefill_does_not() -> None:
    """The cases above cover split-K: N = 37 fills one tile, so the decode configuration splits K."""
    decode = qm._launch_config(1, 37, 256, 32, torch.device("cpu"))
    assert decode.block_m == 16 and decode.split_k > 1
    k_blocks = 256 // decode.block_k
    assert (decode.split_k - 1) * -(-k_blocks // decode.split_k) < k_blocks  # every split sums some K tiles
    prefill = qm._launch_config(67, 37, 256, 32, torch.device("cpu"))
    assert prefill.split_k == 1 and prefill.block_m > 16
    assert 32 % decode.block_k == 0 and 32 % prefill.block_k == 0


@interpreted
def test_large() -> None:
    """Prefill tiles of 128 rows, several N tiles with a ragged last one, 8 K tiles per group row."""
    x, qweight, scales, b = case(300, 130, 1024, 4, 128, torch.bfloat16, bias=True)
    check(quant_matmul_triton(x, qweight, scales, 4, b), x, qweight, scales, 4, b)


@interpreted
def test_rows_with_a_stride() -> None:
    """x rows need unit stride along K only: a slice of a wider tensor works as is."""
    x, qweight, scales, _ = case(5, 40, 128, 8, 64, torch.float32, bias=False)
    wide = torch.cat((x, torch.ones(5, 3)), 1)[:, :128]
    assert not wide.is_contiguous()
    assert torch.equal(quant_matmul_triton(wide, qweight, scales, 8), quant_matmul_triton(x, qweight, scales, 8))


def test_no_rows() -> None:
    x, qweight, scales, _ = case(1, 16, 64, 4, 32, torch.float32, bias=False)
    assert quant_matmul_triton(x[:0], qweight, scales, 4).shape == (0, 16)


def test_launcher_checks() -> None:
    x, q4, s4, b = case(2, 16, 64, 4, 32, torch.float32, bias=True)
    _, q8, s8, _ = case(2, 16, 64, 8, 32, torch.float32, bias=False)
    bad = [
        ((x[:, :32], q4, s4, 4), r"x must be \[M, 64\]"),
        ((x.double(), q4, s4.double(), 4), "x must be float16, bfloat16 or float32"),
        ((x.half(), q4, s4, 4), "scales must have x's dtype torch.float16"),
        ((torch.zeros(64, 2).t(), q4, s4, 4), "x must have unit stride along K"),
        ((x, q8.t().contiguous().t(), s8, 8), "qweight must be contiguous"),
        ((x, q8, s8.t().contiguous().t(), 8), "scales must be contiguous"),
        ((x, q8, s4, 4), "int4 qweight must be uint8"),
        ((x, q4, s8, 8), "int8 qweight must be int8"),
        ((x, q4, s4, 3), "bits must be 4 or 8"),
        ((x, q4, s4, 4, b[:8]), r"bias must be a contiguous \[16\] torch.float32"),
        ((x, q4, s4, 4, b.half()), r"bias must be a contiguous \[16\] torch.float32"),
        ((x.to("meta"), q4, s4, 4), "qweight is on cpu, x on meta"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            quant_matmul_triton(*args)
    q, s = quantize(torch.randn(4, 64), 8, 8)
    with pytest.raises(ValueError, match="group_size a multiple of 16, got 8"):
        quant_matmul_triton(torch.randn(1, 64), q, s, 8)


def test_dispatcher_launches_the_kernel_where_triton_is_picked(monkeypatch) -> None:
    x, qweight, scales, b = case(3, 20, 64, 4, 32, torch.float32, bias=True)
    monkeypatch.setattr(qm, "use_triton", lambda name, device: True)
    launched = []
    monkeypatch.setattr(qm, "quant_matmul_triton", lambda *args: launched.append(args) or quant_matmul_ref(*args))
    quant_matmul(x, qweight, scales, 4, b)
    assert len(launched) == 1
    q, s = quantize(torch.randn(4, 72), 8, 24)  # a group the kernel's tiles cannot follow: the reference runs
    quant_matmul(torch.randn(2, 72), q, s, 8)
    assert len(launched) == 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (7, 1000, 2048), (16, 64, 8192), (333, 4097, 1024)])
def test_compiled_on_gpu(m: int, n: int, k: int, bits: int, dtype: torch.dtype) -> None:
    x, qweight, scales, b = case(m, n, k, bits, 128, dtype, bias=True, device="cuda")
    y = quant_matmul(x, qweight, scales, bits, b)
    assert dispatch.picked()["quant_matmul"] == "triton"
    check(y, x, qweight, scales, bits, b)
