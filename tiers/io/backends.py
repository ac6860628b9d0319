"""The read backends by name: what --io-backend chooses between, and how "auto" chooses.

The one module that imports every backend, so the read interface (tiers/io/base.py) imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from offload.common.config import IO_BACKENDS, READ_BACKENDS
from offload.common.errors import OffloadError
from offload.tiers.io.aio import AioBackend, aio_ready
from offload.tiers.io.base import ReadBackend
from offload.tiers.io.direct import PreadBackend


class BackendChoice(NamedTuple):
    """A backend name resolved to one that runs, and why, in a few words for the run summary."""

    name: str  # "pread" or "aio"
    why: str  # "asked", "probe: 1.02 vs aio 0.88 GB/s" (the chosen one's rate first), "no probe: default", ...


def choose_backend(name: str, measured: Mapping[str, float] | None = None, locked_cache: int = 0) -> BackendChoice:
    """Resolve `name`. "pread" and "aio" are taken as asked (make_backend says why aio cannot run). "auto", when
    `measured` (backend -> bytes/s of cold reads, what `offload probe` saved for this machine) holds both, takes
    the faster (pread on a tie, or where aio's op is not built: an automatic choice never waits minutes for
    DeepSpeed's JIT build, `make aio-op` does it); without both rates, the default rule: aio only
    on CUDA machines, where buffers are page-locked. On a CPU-only machine torch pins nothing: a ring's buffers are
    the op's own locked ones where RLIMIT_MEMLOCK allows (tiers/weights/landing.py), which the probe measures as the
    engine uses them; elsewhere the op copies through a bounce buffer per read, measured slower than pread
    (benchmarks/results/io_bandwidth.json). `locked_cache`: bytes of an expert cache in CPU memory torch does not pin
    (a CPU device's), which the op reads directly into only once it has page-locked every slot, at load: 1.5 s a GB
    on the 2-core AMD EPYC VM (32 s for a 20 GB cache, the first token at 44 s against 23-27 s through the pool,
    benchmarks/bigger_than_ram.py), more than the probe's rates can win back, so "auto" takes pread there."""
    if name in READ_BACKENDS:
        return BackendChoice(name, "asked")
    if name != "auto":
        raise OffloadError(f"I/O backend {name!r}: unknown; choose one of {', '.join(IO_BACKENDS)}")
    measured = measured or {}
    if "pread" in measured and "aio" in measured:
        if not aio_ready():
            return BackendChoice("pread", "probe measured aio, but its op is not built or loadable now")
        best, other = sorted(("pread", "aio"), key=lambda b: measured[b], reverse=True)
        rates = f"{measured[best] / 1e9:.2f} vs {other} {measured[other] / 1e9:.2f} GB/s"
        if best == "aio" and locked_cache:
            return BackendChoice("pread", f"probe: aio {rates}, but aio would lock the expert cache's slots at load")
        return BackendChoice(best, f"probe: {rates}")
    why = "no probe: default" if not measured else "probe measured pread alone: default"
    use_aio = torch.cuda.is_available() and aio_ready()
    return BackendChoice("aio" if use_aio else "pread", why)


def make_backend(name: str = "auto", threads: int = 8) -> ReadBackend:
    """The backend called `name`: "pread" (O_DIRECT preadv on a thread pool), "aio" (DeepSpeed's AsyncIO op,
    libaio) or "auto" (choose_backend's default rule, no probe consulted). `threads` sizes the pread pool."""
    name = choose_backend(name).name
    return AioBackend() if name == "aio" else PreadBackend(threads=threads)
