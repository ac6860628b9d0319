"""y = x @ w.T + b, with the CPU's slow half-precision GEMM avoided for large batches.

On CPUs without native bf16/fp16 matrix units, torch's half-precision GEMM runs several times slower
than float32 (measured on this project's CI machine, an AMD EPYC: 18 vs 86 GFLOP/s at 1024 x 2048 x
5632). Above `UPCAST_MIN_ROWS` rows (prefill) the weight is converted to float32 a slice of output
features at a time, so the scratch stays small; small batches (decode) stay in half precision, where the
conversion would cost more than it saves. CUDA and float32 go straight to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

UPCAST_MIN_ROWS = 64  # tokens; below this the conversion costs more than the faster GEMM saves
SLICE_FEATURES = 1024  # output features converted at a time: scratch = SLICE_FEATURES * in_features * 4 bytes


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, in], w [out, in], b [out] -> [tokens, out] in x's dtype."""
    if x.device.type != "cpu" or w.dtype == torch.float32 or x.shape[0] < UPCAST_MIN_ROWS:
        return F.linear(x, w, b)
    x32 = x.float()
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    for start in range(0, w.shape[0], SLICE_FEATURES):
        end = min(start + SLICE_FEATURES, w.shape[0])
        bias = None if b is None else b[start:end].float()
        out[:, start:end] = F.linear(x32, w[start:end].float(), bias)
    return out
