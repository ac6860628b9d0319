"""Rotary position embeddings: inverse frequencies (with Llama 3, linear and YaRN scaling) and their application."""

from __future__ import annotations

import math

import torch

from offload.common.model_config import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 angular frequencies, scaled as `rope.kind` says."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn_scale(rope, head_dim)
    return inv_freq


def attention_scale(rope: RopeSpec) -> float:
    """What multiplies cos and sin: 1, or YaRN's attention factor (given, or from the factor and the mscales)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(m: float = 1.0) -> float:
        return 1.0 if rope.factor <= 1 else 0.1 * m * math.log(rope.factor) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.mscale) / mscale(rope.mscale_all_dim)
    return mscale()


def _yarn_scale(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    # YaRN: the fastest-turning dimensions (beta_fast rotations or more over the original context) keep their
    # frequency, the slowest (beta_slow or fewer) are divided by `factor`, and a linear ramp over dimension
    # indices blends the two between them
    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return head_dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    kept = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (1.0 / (rope.factor * base)) * (1 - kept) + (1.0 / base) * kept


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    # Wavelengths longer than the original context divide by `factor`; shorter than
    # original / high_freq_factor are kept; the band between is interpolated smoothly.
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = rope.original_max_position / rope.low_freq_factor
    short_wavelen = rope.original_max_position / rope.high_freq_factor
    scaled = torch.where(wavelen > long_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_band, smoothed, scaled)


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [tokens, head_dim] for `positions` [tokens], computed in float32 (times `scale`, YaRN's
    attention factor, before the cast)."""
    freqs = positions[:, None].float() * inv_freq[None, :].to(positions.device)  # [tokens, head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [tokens, heads, head_dim] by the angles in cos/sin [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
