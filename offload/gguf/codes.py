"""GGUF's quantized blocks -> the engine's weight formats (kernels/quant_matmul.py), bit for bit where those hold them.

A GGUF matrix [N, K] is N rows, each a run of blocks along K. The blocks kept exactly (f16 values little-endian):

    Q4_0   18 B / 32 values: d, 16 B of codes                      w = d (q - 8)
    Q4_1   20 B / 32 values: d, m, 16 B of codes                   w = d q + m
    Q4_K  144 B / 256 values: d, dmin, 12 B of eight 6-bit (sc, m), 128 B of codes; sub-block i of 32 values:
                                                                   w = d sc_i q - dmin m_i
    Q8_0   34 B / 32 values: d, 32 int8 codes                      w = d q

Q4_0 and Q4_1 put value j of a block in the low nibble of code byte j and value j + 16 in its high nibble; Q4_K's
128 code bytes are four runs of 32, run c holding sub-block 2c in its low nibbles and 2c + 1 in its high ones.

The engine's int4 is w = (q - 8) * scale + zero per group of 32, so a GGUF group maps to scale = d (Q4_K: d sc_i) and
zero = the value at q = 8: Q4_0 0, Q4_1 m + 8 d, Q4_K 8 d sc_i - dmin m_i. In float32 the engine's (q - 8) * scale is
exact and adding zero rounds once, as GGUF's d q + m does: the values are equal wherever zero itself is exact in
float32 (`Int4Groups.inexact` counts the groups where it is not). int8 is w = q * scale with scale = d: exact.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

FLOATS = {T.F32: "F32", T.F16: "F16", T.BF16: "BF16"}  # the float types, by safetensors code
GROUP = 32  # values per engine group: every kept block type's (sub-)block
INT4_EXACT = (T.Q4_0, T.Q4_1, T.Q4_K)
INT8_EXACT = (T.Q8_0,)
_K_BLOCK = 256  # values per Q4_K super-block
DEQUANT_ROWS = 1024  # rows of a quantized token table or head dequantized at a time, not the whole table at once


class Int4Groups(NamedTuple):
    """A matrix [N, K] in the engine's int4 terms: w = (q - 8) * scale + zero per group of GROUP values."""

    q: np.ndarray  # uint8 [N, K], codes 0..15
    scale: np.ndarray  # float32 [N, K / GROUP]
    zero: np.ndarray  # float32 [N, K / GROUP]
    inexact: int  # groups whose zero float32 rounds (their values may differ from GGUF's by one rounding)


def int4_groups(raw: np.ndarray, qtype: T) -> Int4Groups:
    """raw uint8 [N, row bytes] of Q4_0, Q4_1 or Q4_K rows -> their int4 groups."""
    n = raw.shape[0]
    if qtype == T.Q4_K:
        return _q4_k(raw.reshape(n, -1, 144))
    blocks = raw.reshape(n, -1, 18 if qtype == T.Q4_0 else 20)  # [N, K / 32, bytes]
    d = _f16(blocks[..., 0:2]).astype(np.float64)
    codes = blocks[..., 2:] if qtype == T.Q4_0 else blocks[..., 4:]  # [N, K / 32, 16]
    q = np.concatenate((codes & 15, codes >> 4), axis=-1).reshape(n, -1)  # value j, then value j + 16
    zero = np.zeros_like(d) if qtype == T.Q4_0 else _f16(blocks[..., 2:4]) + 8 * d
    return _groups(q, d, zero)


def _q4_k(blocks: np.ndarray) -> Int4Groups:
    """blocks uint8 [N, K / 256, 144] -> int4 groups of 32."""
    n, nb = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, nb]
    sc, m = _q4_k_scales(blocks[..., 4:16])  # [N, nb, 8] each
    scale = d[..., None].astype(np.float64) * sc  # [N, nb, 8]: at most 17 significant bits, exact
    zero = 8 * scale - dmin[..., None].astype(np.float64) * m
    codes = blocks[..., 16:].reshape(n, nb, 4, 1, 32)
    q = np.concatenate((codes & 15, codes >> 4), axis=3).reshape(n, nb * _K_BLOCK)  # sub-blocks 2c, 2c + 1
    return _groups(q, scale.reshape(n, -1), zero.reshape(n, -1))


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes [..., 12] -> the eight 6-bit scales and mins [..., 8] each (ggml's get_scale_min_k4)."""
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate((lo & 63, (hi & 15) | ((lo >> 6) << 4)), axis=-1)
    m = np.concatenate((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), axis=-1)
    return sc.astype(np.float64), m.astype(np.float64)


def _groups(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> Int4Groups:
    """Codes and float64 parameters -> Int4Groups, counting the zeros float32 cannot hold."""
    zero32 = zero.astype(np.float32)
    inexact = int(np.count_nonzero(zero32.astype(np.float64) != zero))
    return Int4Groups(q.astype(np.uint8), scale.astype(np.float32), zero32, inexact)


def int8_groups(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """raw uint8 [N, row bytes] of Q8_0 rows -> (codes int8 [N, K], scale float32 [N, K / 32]); w = q * scale."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], -1)
    return q, _f16(blocks[..., 0:2]).astype(np.float32)


def _f16(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 (float16 little-endian)."""
    return np.ascontiguousarray(pairs).view("<f2")[..., 0].astype(np.float32)


def engine_int4(g: Int4Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Groups -> (codes uint8 [N, K / 2], even values in the low nibble; scales float32 [K / 32, N, 2]): the
    triton layout of kernels/quant_matmul.py."""
    codes = g.q[:, 0::2] | (g.q[:, 1::2] << 4)
    scales = np.stack((g.scale, g.zero), axis=-1).transpose(1, 0, 2)
    return torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(np.ascontiguousarray(scales))


def engine_int8(q: np.ndarray, scale: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_groups' output -> (codes int8 [N, K], scales float32 [K / 32, N])."""
    return torch.from_numpy(q).contiguous(), torch.from_numpy(scale).t().contiguous()


def float_tensor(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> tuple[torch.Tensor, str]:
    """raw uint8 bytes of a tensor of `shape` as float, and its safetensors code: float types as stored, quantized
    ones as gguf dequantizes them (float32)."""
    if qtype == T.BF16:
        return torch.from_numpy(raw.copy().view(np.int16)).view(torch.bfloat16).reshape(shape), "BF16"
    if qtype in FLOATS:
        return torch.from_numpy(raw.copy().view("<f4" if qtype == T.F32 else "<f2")).reshape(shape), FLOATS[qtype]
    if raw.ndim != 2:
        return torch.from_numpy(gguf_quants.dequantize(raw, qtype)).reshape(shape), "F32"
    out = np.empty((raw.shape[0], math.prod(shape) // max(raw.shape[0], 1)), dtype=np.float32)
    for start in range(0, raw.shape[0], DEQUANT_ROWS):  # gguf's temporaries are several times their rows' output
        out[start : start + DEQUANT_ROWS] = gguf_quants.dequantize(raw[start : start + DEQUANT_ROWS], qtype)
    return torch.from_numpy(out).reshape(shape), "F32"
