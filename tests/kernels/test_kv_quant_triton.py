"""kv_quant's Triton kernels (in Triton's CPU interpreter, or compiled on a GPU) against quantize_kv_ref /
dequantize_kv_ref: the same record bytes and the same values, bit for bit, for each format over head dims below,
equal to and above the group (odd ones too), token counts that leave a ragged last program, each input dtype, extreme
values, and arbitrary record bytes (NaN scales and codes included); the launchers' checks and the dispatch."""

from __future__ import annotations

import pytest
import torch

from conftest import interpreted

pytest.importorskip("triton")

import offload.kernels.kv_quant as kq  # noqa: E402
from offload.kernels import dispatch  # noqa: E402
from offload.kernels.kv_quant import (  # noqa: E402
    KVQuantFormat,
    dequantize_kv,
    dequantize_kv_ref,
    dequantize_kv_triton,
    quantize_kv,
    quantize_kv_ref,
    quantize_kv_triton,
)

KINDS = ["int8", "int4", "fp8"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (head_dim, group_size): one group, several, 64-wide groups, head_dim below the group (odd: a pad byte, and for
# int4 a last byte with one code)
FORMATS = [(128, 32), (64, 64), (96, 32), (24, 32), (7, 32), (5, 32)]


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Values whose magnitude varies per vector over 0..8."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand(shape[:-1], generator=gen)[..., None] * 8
    return x.to(dtype).to(device)


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values, NaN where NaN (torch.equal alone fails on NaN)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@interpreted
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("head_dim", "group_size"), FORMATS, ids=str)
def test_records_and_values_equal_the_reference(kind: str, head_dim: int, group_size: int) -> None:
    fmt = KVQuantFormat(kind, head_dim, group_size)
    x = sample((13, 3, head_dim), torch.float32, seed=head_dim)  # 39 records: a second program with 7
    records = quantize_kv_triton(x, fmt)
    assert torch.equal(records, quantize_kv_ref(x, fmt))
    for dtype in DTYPES:
        assert torch.equal(dequantize_kv_triton(records, fmt, dtype), dequantize_kv_ref(records, fmt, dtype))


@interpreted
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_inputs(kind: str, dtype: torch.dtype) -> None:
    fmt = KVQuantFormat(kind, 64)
    x = sample((5, 64), dtype, seed=3)
    assert torch.equal(quantize_kv_triton(x, fmt), quantize_kv_ref(x, fmt))


def extreme_rows(width: int) -> torch.Tensor:
    """Zero and constant groups, huge, tiny (subnormal float16 scales), mixed magnitudes, past what float16 scales
    reach, negative zeros, exact ties between codes, [rows, width]."""
    ramp = torch.linspace(-1, 1, width)
    return torch.stack(
        [
            torch.zeros(width),
            torch.full((width,), -3.0),
            torch.full((width,), 1e4) * ramp,
            torch.full((width,), 1e-6) * ramp,
            torch.full((width,), 3e-9) * ramp,
            torch.cat((torch.tensor([6e4]), torch.full((width - 1,), 1e-3))),
            torch.cat((torch.tensor([-5e3]), ramp[1:])),
            torch.cat((torch.tensor([1e9]), torch.zeros(width - 1))),
            torch.cat((torch.tensor([-1e9]), torch.full((width - 1,), 7e4))),
            torch.full((width,), -0.0),
            torch.arange(width) / 2 - 8,  # halves: int8 ties at scale 1/... and int4 ties at scale 1
            torch.arange(width).remainder(16) + 0.5,
        ]
    )


# the interpreter computes with numpy, which warns where float16 overflows to infinity (then clamped to 65504) and
# where NaN parameters make NaN, as they do in the reference
OVERFLOWS = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
NANS = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@interpreted
@OVERFLOWS
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("head_dim", "group_size"), [(64, 32), (7, 32)], ids=str)
def test_extreme_values(kind: str, head_dim: int, group_size: int) -> None:
    fmt = KVQuantFormat(kind, head_dim, group_size)
    x = extreme_rows(head_dim)
    records = quantize_kv_triton(x, fmt)
    assert torch.equal(records, quantize_kv_ref(x, fmt))
    assert_same(dequantize_kv_triton(records, fmt, torch.float32), dequantize_kv_ref(records, fmt, torch.float32))


@interpreted
@NANS
@OVERFLOWS
@pytest.mark.parametrize("kind", KINDS)
def test_any_record_bytes_read_as_the_reference_reads_them(kind: str) -> None:
    """Random bytes: every code (fp8's NaN codes, int8's -128), subnormal, infinite and NaN float16 parameters."""
    fmt = KVQuantFormat(kind, 64)
    gen = torch.Generator().manual_seed(9)
    records = torch.randint(0, 256, (45, fmt.record_bytes), dtype=torch.uint8, generator=gen)
    records[0] = 0xFF
    for dtype in DTYPES:
        assert_same(dequantize_kv_triton(records, fmt, dtype), dequantize_kv_ref(records, fmt, dtype))


@interpreted
def test_large() -> None:
    """Many programs along records and groups: 4 blocks of 16 tokens, 8 heads, head_dim 128."""
    fmt = KVQuantFormat("int4", 128)
    x = sample((4, 16, 8, 128), torch.bfloat16, seed=4)
    records = quantize_kv_triton(x, fmt)
    assert records.shape == (4, 16, 8, fmt.record_bytes)
    assert torch.equal(records, quantize_kv_ref(x, fmt))
    assert torch.equal(
        dequantize_kv_triton(records, fmt, torch.bfloat16), dequantize_kv_ref(records, fmt, torch.bfloat16)
    )


@interpreted
def test_layouts_and_empty_inputs() -> None:
    fmt = KVQuantFormat("int8", 32)
    x = sample((6, 40), torch.float32, seed=5)[:, 4:36]  # rows with a stride
    assert torch.equal(quantize_kv_triton(x, fmt), quantize_kv_ref(x.contiguous(), fmt))
    records = quantize_kv_ref(sample((3, 4, 32), torch.float32, seed=6), fmt)
    strided = records.transpose(0, 1)  # not contiguous along records
    assert torch.equal(
        dequantize_kv_triton(strided, fmt, torch.float32), dequantize_kv_ref(strided, fmt, torch.float32)
    )
    assert quantize_kv_triton(torch.zeros(0, 32), fmt).shape == (0, fmt.record_bytes)
    assert dequantize_kv_triton(torch.zeros(2, 0, fmt.record_bytes, dtype=torch.uint8), fmt, torch.float16).shape == (
        2,
        0,
        32,
    )


def test_launcher_checks() -> None:
    fmt = KVQuantFormat("int4", 32)
    with pytest.raises(ValueError, match=r"kernel quantizes \[\.\.\., 32\] float16, bfloat16 or float32"):
        quantize_kv_triton(torch.zeros(2, 32, dtype=torch.float64), fmt)
    with pytest.raises(ValueError, match=r"kernel quantizes \[\.\.\., 32\]"):
        quantize_kv_triton(torch.zeros(2, 16), fmt)
    with pytest.raises(ValueError, match=r"reads \[\.\.\., 20\] uint8 records"):
        dequantize_kv_triton(torch.zeros(2, 20, dtype=torch.int8), fmt, torch.float32)
    with pytest.raises(ValueError, match="kernel dequantizes to float16, bfloat16 or float32"):
        dequantize_kv_triton(torch.zeros(2, 20, dtype=torch.uint8), fmt, torch.float64)


def test_dispatch(monkeypatch) -> None:
    """The torch path on a CPU; the kernels where Triton is picked, except for dtypes they do not handle."""
    fmt = KVQuantFormat("fp8", 32)
    x = sample((3, 32), torch.float32, seed=7)
    quantize_kv(x, fmt)
    assert dispatch.picked()["kv_quant"] == "torch"
    launched = []
    monkeypatch.setattr(kq, "use_triton", lambda name, device: True)
    monkeypatch.setattr(kq, "quantize_kv_triton", lambda *args: launched.append("q") or quantize_kv_ref(*args))
    monkeypatch.setattr(kq, "dequantize_kv_triton", lambda *args: launched.append("d") or dequantize_kv_ref(*args))
    records = quantize_kv(x, fmt)
    dequantize_kv(records, fmt, torch.bfloat16)
    quantize_kv(x.double(), fmt)
    dequantize_kv(records, fmt, torch.float64)
    assert launched == ["q", "d"]


# on an H200 (Triton 3.6) the compiled int4 kernel's records differed from the reference's in every shape; the
# dispatcher runs the torch code for int4 on CUDA (kernels/kv_quant._unproven) until this passes there
INT4_ON_GPU = pytest.mark.xfail(reason="compiled int4 records differed from the reference on an H200", strict=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", [k if k != "int4" else pytest.param(k, marks=INT4_ON_GPU) for k in KINDS])
@pytest.mark.parametrize(("head_dim", "group_size"), [(128, 32), (128, 64), (64, 32), (24, 32), (7, 32)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_on_gpu(kind: str, head_dim: int, group_size: int, dtype: torch.dtype) -> None:
    """The compiled kernels give the CPU reference's bytes and values."""
    fmt = KVQuantFormat(kind, head_dim, group_size)
    x = torch.cat(
        (sample((1000, 8, head_dim), dtype, seed=8), extreme_rows(head_dim).to(dtype)[:, None].expand(-1, 8, -1))
    )
    expected = quantize_kv_ref(x, fmt)
    assert_same(dequantize_kv_triton(expected.cuda(), fmt, dtype).cpu(), dequantize_kv_ref(expected, fmt, dtype))
    assert torch.equal(quantize_kv_triton(x.cuda(), fmt).cpu(), expected)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_the_dispatcher_on_gpu_runs_the_kernels_proven_there(kind: str) -> None:
    fmt = KVQuantFormat(kind, 64, 32)
    x = sample((10, 2, 64), torch.bfloat16, seed=3).cuda()
    records = quantize_kv(x, fmt)
    assert dispatch.picked()["kv_quant"] == ("torch" if kind == "int4" else "triton")
    assert torch.equal(records.cpu(), quantize_kv_ref(x.cpu(), fmt))
