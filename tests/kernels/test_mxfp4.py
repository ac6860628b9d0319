"""MXFP4 blocks: dequantized as transformers dequantizes the published gpt-oss experts, bit for bit; written so that
every value lands on the nearest representable one; the layout (the even value in the low nibble)."""

from __future__ import annotations

import pytest
import torch

from offload.kernels.mxfp4 import E2M1, dequantize_mxfp4, quantize_mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_is_transformers_bit_for_bit(dtype) -> None:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 48, 4, 16), generator=gen, dtype=torch.uint8)  # [experts, out, in/32, 16]
    scales = torch.randint(110, 140, (3, 48, 4), generator=gen, dtype=torch.uint8)
    theirs = mxfp4._convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # input-major, as their model holds it
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2), theirs)


def test_the_layout_and_the_exponent() -> None:
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2 | (0xF << 4)  # value 0: code 2 (+1.0), value 1: code 15 (-6.0)
    blocks[0, 0, 15] = 0x7  # value 30: code 7 (+6.0)
    w = dequantize_mxfp4(blocks, torch.tensor([[127 + 3]], dtype=torch.uint8), torch.float32)  # times 2^3
    assert w.shape == (1, 32) and w[0, 0] == 8.0 and w[0, 1] == -48.0 and w[0, 30] == 48.0
    assert int((w != 0).sum()) == 3


def test_quantization_rounds_each_value_to_the_nearest_representable_one() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 96, generator=gen) * torch.logspace(-3, 2, 8)[:, None]  # rows of very different sizes
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (8, 3, 16) and scales.shape == (8, 3)
    back = dequantize_mxfp4(blocks, scales, torch.float32)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=1)  # each block's power of two
    grid = torch.tensor(sorted(set(E2M1)))  # the representable magnitudes and signs, in units of the step
    nearest = ((w / step)[..., None] - grid).abs().min(-1).values * step
    torch.testing.assert_close((back - w).abs(), nearest, atol=1e-6, rtol=1e-5)
    assert ((w / step).abs() <= 6).all()  # each block's largest value within the format's range
    with pytest.raises(ValueError, match="input width that 32 divides"):
        quantize_mxfp4(torch.ones(2, 40))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks.int(), scales, torch.float32)
