"""Rotary embeddings: inverse frequencies (default, linear, llama3) against formulas and transformers."""

from __future__ import annotations

import math

import pytest
import torch

from offload.common.model_config import RopeSpec
from offload.model.rope import apply_rope, cos_sin, inverse_frequencies

LLAMA3 = RopeSpec(
    theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
)


def default_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    """1 / theta^(2i / d), i = 0 .. d/2 - 1, in float64."""
    return torch.tensor([1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64)


@pytest.mark.parametrize(("theta", "head_dim"), [(10000.0, 64), (500000.0, 128), (1e6, 24), (10000.0, 2)])
def test_default_frequencies(theta: float, head_dim: int) -> None:
    inv_freq = inverse_frequencies(RopeSpec(theta=theta), head_dim)
    assert inv_freq.shape == (head_dim // 2,)
    assert inv_freq.dtype == torch.float32
    assert inv_freq[0] == 1.0
    torch.testing.assert_close(inv_freq.double(), default_frequencies(theta, head_dim), rtol=1e-6, atol=0)


def test_default_ignores_factor() -> None:
    plain = inverse_frequencies(RopeSpec(theta=10000.0), 32)
    assert torch.equal(inverse_frequencies(RopeSpec(theta=10000.0, factor=4.0), 32), plain)


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_linear_divides_by_factor(factor: float) -> None:
    plain = inverse_frequencies(RopeSpec(theta=10000.0), 64)
    linear = inverse_frequencies(RopeSpec(theta=10000.0, kind="linear", factor=factor), 64)
    assert torch.equal(linear, plain / factor)


def test_llama3_bands() -> None:
    plain = inverse_frequencies(RopeSpec(theta=LLAMA3.theta), 128)
    scaled = inverse_frequencies(LLAMA3, 128)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4.0  # shorter than original / high_freq_factor: kept
    low = wavelen > 8192 / 1.0  # longer than original / low_freq_factor: divided by factor
    mid = ~high & ~low
    assert high.sum() > 0 and low.sum() > 0 and mid.sum() > 0
    assert torch.equal(scaled[high], plain[high])
    assert torch.equal(scaled[low], plain[low] / 8.0)
    assert (scaled[mid] < plain[mid]).all()
    assert (scaled[mid] > plain[mid] / 8.0).all()
    # the band is ordered like the frequencies: higher-frequency components keep more of theirs
    ratio = scaled[mid] / plain[mid]
    assert (ratio[1:] < ratio[:-1]).all()


def test_llama3_smooth_factor_formula() -> None:
    plain = inverse_frequencies(RopeSpec(theta=LLAMA3.theta), 128).double()
    scaled = inverse_frequencies(LLAMA3, 128).double()
    wavelen = 2 * math.pi / plain
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    smooth = (8192 / wavelen[mid] - 1.0) / (4.0 - 1.0)
    expected = (1 - smooth) * plain[mid] / 8.0 + smooth * plain[mid]
    torch.testing.assert_close(scaled[mid], expected, rtol=1e-5, atol=0)


def hf_rope(parameters: dict, head_dim: int):
    """(transformers' LlamaConfig with these rope_parameters, its inverse frequencies, its attention scaling)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=parameters,
    )
    return config, *ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, torch.device("cpu"))


def hf_frequencies(rope_type: str, rope: RopeSpec, head_dim: int) -> torch.Tensor:
    parameters = {"rope_type": rope_type, "rope_theta": rope.theta, "factor": rope.factor}
    if rope_type == "llama3":
        parameters |= {
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position,
        }
    _, inv_freq, attention_scaling = hf_rope(parameters, head_dim)
    assert attention_scaling == 1.0
    return inv_freq


@pytest.mark.parametrize(
    ("rope", "head_dim"),
    [
        (LLAMA3, 128),
        (LLAMA3, 64),
        # the tiny test checkpoint's scaling: short original context, so every band is populated at d=16
        (RopeSpec(theta=500000.0, kind="llama3", factor=8.0, original_max_position=32), 16),
        (
            RopeSpec(
                theta=10000.0,
                kind="llama3",
                factor=32.0,
                low_freq_factor=2.0,
                high_freq_factor=8.0,
                original_max_position=4096,
            ),
            96,
        ),
    ],
)
def test_llama3_matches_transformers(rope: RopeSpec, head_dim: int) -> None:
    ours = inverse_frequencies(rope, head_dim)
    theirs = hf_frequencies("llama3", rope, head_dim)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)


def test_linear_matches_transformers() -> None:
    rope = RopeSpec(theta=10000.0, kind="linear", factor=4.0)
    torch.testing.assert_close(
        inverse_frequencies(rope, 64), hf_frequencies("linear", rope, 64).float(), rtol=1e-6, atol=0
    )


# --- cos_sin and apply_rope --------------------------------------------------------------------


def test_cos_sin_tables() -> None:
    inv_freq = inverse_frequencies(RopeSpec(theta=100.0), 8)
    positions = torch.tensor([0, 1, 5, 1000])
    cos, sin = cos_sin(inv_freq, positions, torch.float32)
    assert cos.shape == sin.shape == (4, 8)
    angles = positions[:, None].double() * inv_freq.double()[None, :]  # [4, 4]
    torch.testing.assert_close(cos[:, :4].double(), angles.cos(), rtol=0, atol=1e-4)
    torch.testing.assert_close(sin[:, :4].double(), angles.sin(), rtol=0, atol=1e-4)
    assert torch.equal(cos[:, :4], cos[:, 4:]) and torch.equal(sin[:, :4], sin[:, 4:])
    assert torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))


def test_cos_sin_dtype() -> None:
    cos, sin = cos_sin(inverse_frequencies(RopeSpec(), 8), torch.arange(3), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16


def rotate(head_dim: int, positions: torch.Tensor, x: torch.Tensor, rope: RopeSpec = LLAMA3) -> torch.Tensor:
    """apply_rope with cos/sin tables built in float64 (cos_sin works in float32 by design)."""
    angles = positions[:, None].double() * inverse_frequencies(rope, head_dim).double()[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # [tokens, head_dim]
    return apply_rope(x, angles.cos(), angles.sin())


def test_apply_rope_matches_complex_rotation() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen, dtype=torch.float64)  # [tokens, heads, head_dim]
    positions = torch.tensor([0, 1, 7, 100, 4095])
    out = rotate(16, positions, x)
    # pair (i, i + d/2) is the complex number x_i + j x_{i+d/2}, turned by position * inv_freq_i
    z = torch.complex(x[..., :8], x[..., 8:])
    angles = positions[:, None].double() * inverse_frequencies(LLAMA3, 16).double()[None, :]  # [5, 8]
    turned = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    expected = torch.cat((turned.real, turned.imag), dim=-1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_apply_rope_preserves_pair_norms() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 24, generator=gen, dtype=torch.float64)
    out = rotate(24, torch.tensor([0, 3, 17, 64, 999, 12345]), x)
    out_norms = out[..., :12] ** 2 + out[..., 12:] ** 2  # pair (i, i + d/2) is one rotating 2-vector
    x_norms = x[..., :12] ** 2 + x[..., 12:] ** 2
    torch.testing.assert_close(out_norms, x_norms, rtol=1e-12, atol=1e-12)


def test_apply_rope_with_cos_sin_tables() -> None:
    """The float32 tables of cos_sin rotate as the float64 angles do, to float32 precision."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 16, generator=gen)
    positions = torch.tensor([0, 1, 9, 31])
    cos, sin = cos_sin(inverse_frequencies(LLAMA3, 16), positions, torch.float32)
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), rotate(16, positions, x.double()), rtol=0, atol=1e-5)


def test_apply_rope_at_position_zero_is_identity() -> None:
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    assert torch.equal(rotate(8, torch.tensor([0]), x), x)


def test_rotated_dot_products_depend_only_on_relative_position() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 32, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 32, generator=gen, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        return float((rotate(32, torch.tensor([m]), q) * rotate(32, torch.tensor([n]), k)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-9)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)


# --- YaRN ----------------------------------------------------------------------------------------------------

YARN = {  # rope_parameters as published configs give them
    "gpt-oss": dict(rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
    "deepseek-like": dict(rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    "mscales apart": dict(rope_theta=10000.0, factor=40.0, mscale=0.707, mscale_all_dim=1.0),
    "qwen-like": dict(rope_theta=1000000.0, factor=4.0),
    "given attention factor": dict(rope_theta=10000.0, factor=8.0, attention_factor=1.25),
}


@pytest.mark.parametrize("name", sorted(YARN))
@pytest.mark.parametrize("head_dim", [64, 24])
def test_yarn_matches_transformers(name: str, head_dim: int) -> None:
    """config.json's yarn parameters, parsed as the engine reads them, give transformers' frequencies and the same
    factor on cos and sin."""
    from offload.common.model_config import parse_model_config
    from offload.model.rope import attention_scale

    parameters = {"rope_type": "yarn", "original_max_position_embeddings": 4096} | YARN[name]
    config, theirs, scaling = hf_rope(parameters, head_dim)
    config.architectures = ["LlamaForCausalLM"]
    rope = parse_model_config(config.to_dict(), "test").rope
    assert rope.kind == "yarn" and rope.factor == YARN[name]["factor"]
    torch.testing.assert_close(inverse_frequencies(rope, head_dim), theirs.float(), rtol=1e-6, atol=0)
    assert attention_scale(rope) == pytest.approx(scaling, rel=1e-12)
    cos, sin = cos_sin(inverse_frequencies(rope, head_dim), torch.arange(5), torch.float32, attention_scale(rope))
    assert cos[0, 0] == pytest.approx(scaling)


def test_yarn_without_a_factor_takes_the_contexts_growth_and_needs_the_original_context() -> None:
    from offload.common.errors import OffloadError
    from offload.common.rope_spec import parse_rope

    config = {
        "max_position_embeddings": 16384,
        "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096},
    }
    assert parse_rope(config, "c").factor == 4.0
    with pytest.raises(OffloadError, match="c: yarn rope scaling needs original_max_position_embeddings"):
        parse_rope({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "c")
