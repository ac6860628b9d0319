"""SwiGLU's product silu(gate) * up: kernels/native.py's one pass over bfloat16 rows on a CPU that runs it, torch's two
ops (F.silu, then the product) anywhere else."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from offload.kernels import choice, native
from offload.kernels.dispatch import record


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate, up [tokens, N] (the halves of a fused gate/up product)."""
    if native.silu_mul_fits(gate, up) and choice.native("silu_mul", gate.shape[0]):
        record("silu_mul", "native")
        return native.silu_mul(gate, up)
    record("silu_mul", "torch")
    return F.silu(gate) * up
