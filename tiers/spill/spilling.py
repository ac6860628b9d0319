"""Spilling: streamed layers converted to the compute dtype once, written to --offload-dir and streamed from there.

A float32 checkpoint run in bfloat16 reads twice the bytes it computes with on every pass, and converts them
again; spilled once in the compute dtype, a streamed layer reads only what it uses. `spill_layers` chooses the
layers (those the placement streams, planned on their converted sizes), converts the ones whose files are
missing or bad, and rewrites the model's layout to read them from their files; the files themselves, their
manifest and checksums are tiers/spill/spill_store.py's.

Spill files are a cache of the checkpoint: where the disk has no room for them (a write that fails with ENOSPC,
EDQUOT or EFBIG, or, with no --disk-memory, less free space than they need), the layers left without one stream from
the checkpoint instead, one line on stderr says so, and no partial file is left. A --disk-memory given larger than
the folder can hold is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from offload.common.config import Policy
from offload.common.errors import OffloadError
from offload.common.sizes import format_size
from offload.common.tier import Tier
from offload.tiers.files import DiskFull, check_disk_budget, free_space
from offload.tiers.io.backends import make_backend
from offload.tiers.io.base import ALIGN, ReadBackend, aligned_buffer
from offload.tiers.spill.spill_store import DTYPE_CODES, FORMAT, SpillFile, SpillStore, plan_file
from offload.tiers.weights.checkpoint import TORCH_DTYPES, held_dtype
from offload.tiers.weights.layout import GroupLayout, ModelLayout
from offload.tiers.weights.ring import read


@dataclass(frozen=True, slots=True)
class SpillStats:
    """What `spill_layers` did: which layers stream from spill files instead of the checkpoint, and the bytes."""

    directory: str  # the folder of --offload-dir holding this model's spill files
    dtype: str  # the compute dtype they hold
    convertible: int  # layers whose checkpoint tensors are not all in the compute dtype
    layers: tuple[int, ...]  # layers read from spill files
    nbytes: int  # bytes of those layers' spill files
    bytes_written: int  # bytes written by this engine (0: every file was reused)
    bytes_verified: int  # bytes of reused files read once to check them
    bytes_converted: int  # checkpoint bytes read to convert the written layers
    unwritten: tuple[int, ...] = ()  # layers to spill the disk had no room for: they stream from the checkpoint


def spill_layers(
    layout: ModelLayout,
    plan: Callable[[ModelLayout], Policy],
    dtype: torch.dtype,
    offload_dir: str | Path,
    capacity: int | None = None,
    io_backend: str = "pread",
) -> tuple[ModelLayout, SpillStats]:
    """`layout` with every streamed layer not stored in `dtype` read from a spill file in `dtype` instead.

    The placement is planned on the converted sizes: `plan` (the engine's planner) sees spill layouts for the
    layers it will stream, until it streams no layer left unconverted. Layers already in `dtype` keep their
    checkpoint layout. Nothing is written, and `offload_dir` not even created, when no layer that needs
    converting streams. Reused files are checked first; missing or bad ones are converted and written, those the
    disk has no room for left to stream from the checkpoint. `capacity`: the --disk-memory budget for them (None:
    the free space), refused when larger than the folder can hold.
    """
    name = str(dtype).removeprefix("torch.")
    needs = [
        i
        for i, g in enumerate(layout.layers)
        if any(held_dtype(t.dtype, dtype) != TORCH_DTYPES[t.dtype][0] for t in g.tensors)
    ]
    paths = sorted({r.path for g in (layout.embed, layout.head, *layout.layers) for r in g.runs})
    model_dir = paths[0].parent.resolve()
    digest = hashlib.blake2b(str(model_dir).encode(), digest_size=4).hexdigest()
    tier = SpillStore(offload_dir, capacity, namespace=f"{model_dir.name}-{name}-{digest}")
    if capacity is not None:
        check_disk_budget("--disk-memory", capacity, tier.folder)
    planned = {
        i: plan_file(
            f"layer{i}.bin",
            [(t.short, DTYPE_CODES[held_dtype(t.dtype, dtype)], t.shape) for t in layout.layers[i].tensors],
        )
        for i in needs
    }
    spill = _spilled_layers(layout, planned, tier.folder, plan) if needs else set()
    files = [planned[i] for i in sorted(spill)]
    if capacity is not None and sum(f.size for f in files) > capacity:
        raise OffloadError(
            f"--offload-dir {offload_dir}: needs {format_size(sum(f.size for f in files))} for converted weights, "
            f"more than the --disk-memory budget of {format_size(capacity)}"
        )
    converted = 0  # checkpoint bytes read
    unwritten: list[SpillFile] = []
    if files:
        files_at = [(f, s.st_size, s.st_mtime_ns) for f in paths for s in [os.stat(f)]]
        tier.open({"format": FORMAT, "dtype": name, "files": [[str(p.resolve()), n, t] for p, n, t in files_at]})
        missing = [f for f in files if tier.lookup(f) is None]
        if missing:
            with make_backend(io_backend) as backend:
                by_name = {planned[i].name: layout.layers[i] for i in spill}
                unwritten = _write(tier, missing, lambda f: _convert(by_name[f.name], dtype, backend), files)
                converted = backend.bytes_read
            spill = {i for i in spill if planned[i] not in unwritten}
            files = [planned[i] for i in sorted(spill)]
    layers = tuple(planned[i].layout(tier.folder) if i in spill else g for i, g in enumerate(layout.layers))
    stats = SpillStats(
        directory=str(tier.folder),
        dtype=name,
        convertible=len(needs),
        layers=tuple(sorted(spill)),
        nbytes=sum(f.size for f in files),
        bytes_written=tier.bytes_written,
        bytes_verified=tier.bytes_verified,
        bytes_converted=converted,
        unwritten=tuple(i for i in sorted(planned) if planned[i] in unwritten),
    )
    return replace(layout, layers=layers), stats


def _write(
    tier: SpillStore, missing: list[SpillFile], fill: Callable[[SpillFile], dict], files: list[SpillFile]
) -> list[SpillFile]:
    """Write the `missing` ones of `files` (the others are reused); returns those the disk has no room for, which
    stream from the checkpoint instead (said in one line on stderr). Without a budget, as many as the free space
    holds, in order, are tried."""
    fits = missing
    if tier.capacity is None:
        free = free_space(tier.folder)
        room = free - ALIGN * (len(missing) + 1)  # bytes; less a page per file for the manifest and the folder
        fits, taken = [], 0
        for f in missing:
            if taken + f.size > room:
                break
            fits.append(f)
            taken += f.size
    try:
        if fits:
            tier.write(fits, fill, keep=[f.name for f in files])
    except DiskFull as exc:  # nothing of it is left
        _say_unwritten(str(exc), missing)
        return missing
    if len(fits) < len(missing):
        needed = format_size(sum(f.size for f in missing))
        _say_unwritten(
            f"--offload-dir {tier.directory}: {format_size(free)} free, {needed} needed", missing[len(fits) :]
        )
    return missing[len(fits) :]


def _say_unwritten(why: str, files: list[SpillFile]) -> None:
    layers = f"{len(files)} converted layers stream" if len(files) > 1 else "1 converted layer streams"
    print(f"{why}; {layers} from the checkpoint instead of spill files", file=sys.stderr, flush=True)


def _spilled_layers(
    layout: ModelLayout, planned: dict[int, SpillFile], folder: Path, plan: Callable[[ModelLayout], Policy]
) -> set[int]:
    """The layers to spill: those the plan streams, when planned with spill layouts for exactly those.

    Start from the layers streamed when every convertible layer is spilled (the smallest costs), then add the
    ones each plan still streams from the checkpoint until none is left; a spilled layer the plan keeps resident
    is loaded from its file, as costed. Should the plan not fit, spill every convertible layer (it fit then)."""

    def policy(spill: set[int]) -> Policy:
        layers = tuple(planned[i].layout(folder) if i in spill else g for i, g in enumerate(layout.layers))
        return plan(replace(layout, layers=layers))

    streamed = [i for i, t in enumerate(policy(set(planned)).layer_tiers) if t == Tier.NVME and i in planned]
    spill = set(streamed)
    while True:
        try:
            tiers = policy(spill).layer_tiers
        except OffloadError:
            return set(planned)
        more = {i for i, t in enumerate(tiers) if t == Tier.NVME and i in planned} - spill
        if not more:
            return spill
        spill |= more


def _convert(group: GroupLayout, dtype: torch.dtype, backend: ReadBackend) -> dict[str, torch.Tensor]:
    """A checkpoint group's tensors, read through `backend`; floats converted to `dtype`, integers as stored."""
    buf = aligned_buffer(group.slot_bytes)
    for request in read(backend, group, buf):
        request.wait()
    views = group.views(buf).items()
    return {short: view.to(dtype) if view.dtype.is_floating_point else view.clone() for short, view in views}
