"""Rotary position embeddings: inverse frequencies (with Llama 3 and linear scaling) and their application."""

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
    return inv_freq


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


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [tokens, head_dim] for `positions` [tokens], computed in float32."""
    freqs = positions[:, None].float() * inv_freq[None, :].to(positions.device)  # [tokens, head_dim // 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [tokens, heads, head_dim] by the angles in cos/sin [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
