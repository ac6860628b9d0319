"""mxfp4_linear: the Triton kernel (in Triton's CPU interpreter here, compiled on CUDA) against the reference that
dequantizes W whole, over odd row and column counts, with and without a bias; the launcher's checks."""

from __future__ import annotations

import pytest
import torch

from conftest import interpreted
from offload.kernels.mxfp4 import quantize_mxfp4
from offload.kernels.mxfp4_linear import mxfp4_linear, mxfp4_linear_ref

pytest.importorskip("triton")

from offload.kernels.mxfp4_linear import mxfp4_linear_triton  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks, scales = quantize_mxfp4(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, blocks, scales, torch.randn(n, generator=g).to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 32), (3, 70, 96), (17, 130, 64), (65, 33, 128)])
@pytest.mark.parametrize("biased", [False, True])
def test_kernel_equals_the_dequantized_product(dtype, m, n, k, biased):
    x, blocks, scales, bias = operands(m, n, k, dtype)
    bias = bias if biased else None
    got = mxfp4_linear_triton(x, blocks, scales, bias)
    want = mxfp4_linear_ref(x.float(), blocks, scales, None if bias is None else bias.float())
    assert got.shape == (m, n) and got.dtype == dtype
    tol = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=TOLERANCE[dtype])


def test_off_cuda_the_reference_runs():
    x, blocks, scales, bias = operands(2, 8, 64, torch.float32)
    torch.testing.assert_close(mxfp4_linear(x, blocks, scales, bias), mxfp4_linear_ref(x, blocks, scales, bias))


def test_checks_name_the_bad_operand():
    x, blocks, scales, bias = operands(2, 8, 64, torch.float32)
    with pytest.raises(ValueError, match=r"blocks must be \[N, 3, 16\] uint8 for K 96"):
        mxfp4_linear_triton(torch.zeros(2, 96), blocks, scales)
    with pytest.raises(ValueError, match=r"scales must be \[N, 2\] uint8"):
        mxfp4_linear_triton(x, blocks, scales[:, :1])
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        mxfp4_linear_triton(x, blocks, scales, bias[:4])
    with pytest.raises(ValueError, match="x must be"):
        mxfp4_linear_triton(x.int(), blocks, scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_compiled_kernel_on_cuda_equals_the_dequantized_product(dtype):
    x, blocks, scales, bias = (t.cuda() for t in operands(33, 2880, 2880, dtype))
    got = mxfp4_linear(x, blocks, scales, bias)  # dispatches to the kernel on CUDA
    want = mxfp4_linear_ref(x.float(), blocks, scales, bias.float())
    tol = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=TOLERANCE[dtype])
