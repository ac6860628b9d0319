"""Which implementation runs each kernel: the Triton kernel on a CUDA device, the torch path elsewhere.

Every kernel module asks `use_triton(name, device)` before it launches, and the answer is remembered per kernel so
the run summary can say what ran (`summary()`). OFFLOAD_KERNELS=torch forces the torch path everywhere (to compare
or to rule a kernel out); on a CPU the torch path always runs, since Triton's CPU interpreter is for tests only.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from offload.common import environment

_picked: dict[str, str] = {}  # kernel name -> "triton" | "torch", for the kernels that have run


@functools.cache
def triton_missing() -> str | None:
    """Why Triton cannot run here, or None when it can (a CUDA device and an importable triton)."""
    if environment.kernel_mode() == "torch":  # never launch a Triton kernel
        return f"{environment.KERNELS}=torch"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def load_triton() -> tuple[ModuleType | None, ModuleType | None]:
    """(triton, triton.language) where a Triton kernel can run: a CUDA device, or Triton's CPU interpreter
    (TRITON_INTERPRET=1, which the tests set); else (None, None), so that the torch paths never import triton."""
    if not torch.cuda.is_available() and not environment.interpreting():
        return None, None
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None, None
    return triton, tl


def use_triton(name: str, device: torch.device) -> bool:
    """Whether kernel `name` runs its Triton kernel for tensors on `device`; the choice is recorded."""
    triton = device.type == "cuda" and triton_missing() is None
    _picked[name] = "triton" if triton else "torch"
    return triton


def record(name: str, impl: str) -> None:
    """Say that kernel `name` ran on `impl` ("torch", or "native": kernels/native.py) where no Triton choice applies
    (e.g. a CPU-only layout)."""
    _picked[name] = impl


def picked() -> dict[str, str]:
    """Kernel name -> the implementation that ran it last."""
    return dict(_picked)


def summary() -> str:
    """One line for the run summary: which implementation ran which kernels, and why not Triton."""
    if not _picked:
        return ""
    by_impl: dict[str, list[str]] = {}
    for name, impl in sorted(_picked.items()):
        by_impl.setdefault(impl, []).append(name)
    parts = []
    for impl, names in sorted(by_impl.items(), reverse=True):  # triton first
        why = f" ({triton_missing()})" if impl == "torch" and triton_missing() else ""
        parts.append(f"{impl}{why}: {', '.join(names)}")
    return "; ".join(parts)
