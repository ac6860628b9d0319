"""The read backends by name: what --io-backend chooses between.

The one module that imports every backend, so the read interface (tiers/io/base.py) imports none of them.
"""

from __future__ import annotations

import torch

from offload.common.errors import OffloadError
from tiers.io.aio import AioBackend, aio_unavailable
from tiers.io.base import ReadBackend
from tiers.io.direct import PreadBackend

BACKENDS = ("auto", "pread", "aio")


def make_backend(name: str = "auto", threads: int = 8) -> ReadBackend:
    """The backend called `name`: "pread" (O_DIRECT preadv on a thread pool), "aio" (DeepSpeed's AsyncIO op,
    libaio) or "auto". `threads` sizes the pread pool.

    "auto" takes aio only on CUDA machines, where buffers are page-locked: on a CPU-only machine the op
    locks and copies through a bounce buffer per read, and measured slower than pread
    (benchmarks/results/io_bandwidth.json)."""
    if name == "pread":
        return PreadBackend(threads=threads)
    if name == "aio":
        return AioBackend()
    if name == "auto":
        use_aio = torch.cuda.is_available() and aio_unavailable() is None
        return AioBackend() if use_aio else PreadBackend(threads=threads)
    raise OffloadError(f"I/O backend {name!r}: unknown; choose one of {', '.join(BACKENDS)}")
