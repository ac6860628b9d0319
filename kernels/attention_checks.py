"""The launch checks the Triton attention kernels share (kernels/paged_decode.py, kernels/paged_prefill.py): a bad
operand is a ValueError naming it before any kernel runs."""

from __future__ import annotations

import torch

from offload.common import environment

MAX_HEAD_DIM = 256
LATENT_MAX_DIM = 1024  # a latent cache's width: DeepSeek-V3's 512 + 64, padded to 1024 in the decode kernel
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_operands(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, max_head_dim: int = MAX_HEAD_DIM
) -> None:
    """Raise ValueError unless q [tokens, Hq, D] and the caches [num_blocks, block_size, Hkv, D] can be launched
    on: matching shapes, one float dtype, one device, the last dimension of each contiguous."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not match cache heads/dim {tuple(k_cache.shape[2:])}")
    if q.shape[2] > max_head_dim:
        raise ValueError(f"head_dim {q.shape[2]} is over {max_head_dim}")
    if q.dtype not in FLOAT_DTYPES or not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"dtypes: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}; want one of {FLOAT_DTYPES}"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    check_device(q.device, k_cache=k_cache, v_cache=v_cache)


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is on `device`, a CUDA device or (under the interpreter) the CPU."""
    if device.type != "cuda" and not environment.interpreting():
        raise ValueError(f"q is on {device}: Triton kernels need a CUDA device, or TRITON_INTERPRET=1 on a CPU")
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")


def check_index(name: str, t: torch.Tensor, dims: int) -> None:
    """Raise ValueError unless `t` is an int32/int64 tensor of `dims` dimensions, contiguous in its last one."""
    if t.dtype not in INDEX_DTYPES or t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D int32 or int64 tensor, got {t.dim()}-D {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Raise ValueError unless `sinks` is None or a float [Hq] on q's device."""
    if sinks is None:
        return
    if sinks.shape != (q.shape[1],) or sinks.device != q.device or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be float [{q.shape[1]}] on {q.device} (one per query head), got {sinks.dtype} "
            f"{tuple(sinks.shape)} on {sinks.device}"
        )


def check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1 position, got {window}")
