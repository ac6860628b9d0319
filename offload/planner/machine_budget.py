"""The budgets a run given none plans for: what this machine has, as Accelerate's `device_map="auto"` infers
`max_memory`.

A model that fits is run as it always was (every layer resident, the default batch and KV cache). One that does not
is planned under the machine's memory as if the user had given it:

- on a CPU device, a cap on the process (`--memory`) of the RAM available now (this process's own resident bytes
  included, a container's cgroup limit respected) less RAM_RESERVE for the system;
- on CUDA, the device memory free now less DEVICE_RESERVE as `--device-memory`, and, unless `--host-memory` was
  given, the available RAM less RAM_RESERVE as `--host-memory` (layers kept there are not read from disk again).

The planner then places what fits and streams the rest, or refuses, before any weight is read, with the numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.common.config import DEFAULT_KV_CACHE, EngineConfig
from offload.common.errors import OffloadError
from offload.common.sizes import format_size
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import Checkpoint, held_dtype

RAM_RESERVE_FRACTION = 16  # a sixteenth of the machine's RAM is kept for the system ...
RAM_RESERVE_FLOOR = 256 << 20  # ... and at least this much
DEVICE_RESERVE = 512 << 20  # CUDA context, allocator slack and other processes' growth
# a model "fits" when its weights held whole, the KV cache and this much beside them (activations, logits, slack)
# are within the budget; less than that and it is planned under the budget instead
FIT_SLACK = 256 << 20

_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class MachineMemory:
    """Bytes of RAM, as the planner reads them: available now, and the machine's (or the container's) total."""

    available: int
    total: int

    @property
    def reserve(self) -> int:
        return max(self.total // RAM_RESERVE_FRACTION, RAM_RESERVE_FLOOR)


def machine_memory() -> MachineMemory:
    """This machine's RAM: psutil's available and total, each bounded by a cgroup's memory limit where one is set."""
    import psutil

    vm = psutil.virtual_memory()
    available, total = vm.available, vm.total
    limit = _cgroup_limit()
    if limit is not None:
        used, cap = limit
        total = min(total, cap)
        available = min(available, max(cap - used, 0))
    return MachineMemory(available, total)


def _cgroup_limit() -> tuple[int, int] | None:
    """(bytes used, the limit) of this process's memory cgroup where it has a limit, else None. Used is what the
    cgroup charges less its inactive file pages (page cache the kernel reclaims first), as `docker stats` counts."""
    for version, controllers, path in _own_cgroups():
        if version == 2:
            limit_file, usage_file, inactive = "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            limit_file, usage_file, inactive = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        else:
            continue
        folder = _CGROUP / ("unified" if version == 2 and (_CGROUP / "unified").is_dir() else "") / path
        if version == 1:
            folder = _CGROUP / "memory" / path
        try:
            text = (folder / limit_file).read_text().strip()
            if text == "max" or int(text) >= 1 << 60:  # v1 writes "no limit" as a huge number
                continue
            stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
            used = int((folder / usage_file).read_text()) - int(stat.get(inactive, 0))
            return max(used, 0), int(text)
        except (OSError, ValueError):
            continue
    return None


def _own_cgroups() -> list[tuple[int, str, str]]:
    """(cgroup version, controllers, path relative to the hierarchy's root) of each cgroup /proc/self/cgroup
    lists this process in."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            hierarchy, controllers, path = parts
            out.append((2 if hierarchy == "0" and not controllers else 1, controllers, path.lstrip("/")))
    return out


def given_no_budget(config: EngineConfig, on_cpu: bool) -> bool:
    """Whether the caller gave no budget the machine's would stand in for."""
    if on_cpu:
        return config.memory is None and config.device_memory is None
    return config.device_memory is None


def held_weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes the checkpoint's tensors take held in memory computing in `dtype`: float tensors in it, integer
    (quantized) ones as stored. Read from the files' headers only."""
    compute = getattr(torch, dtype)
    with BufferedReader() as reader:
        extents = Checkpoint(model_dir, reader).extents.values()
        return sum(math.prod(e.shape) * held_dtype(e.dtype, compute).itemsize for e in extents)


def machine_budgets(
    model_dir: Path, config: EngineConfig, dtype: str, on_cpu: bool, rss: int
) -> tuple[EngineConfig, str | None]:
    """`config` with this machine's budgets where it gave none and the model does not fit without one, and what
    was assumed, to say (None: nothing changed). `rss`: this process's resident bytes now."""
    if not given_no_budget(config, on_cpu):
        return config, None
    held = held_weight_bytes(model_dir, dtype)
    kv = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_KV_CACHE
    ram = machine_memory()
    if on_cpu:
        room = ram.available - ram.reserve - (config.host_memory or 0)
        if held + kv + FIT_SLACK <= room:
            return config, None
        cap = rss + ram.available - ram.reserve
        note = (
            f"no --memory: planned for {format_size(ram.available - ram.reserve)} of the "
            f"{format_size(ram.available)} available (of {format_size(ram.total)}; {format_size(ram.reserve)} kept "
            f"for the system): the weights alone are {format_size(held)}"
        )
        if config.max_num_seqs is not None or config.kv_cache_bytes is not None:  # the batch is the user's
            device = cap - rss - (config.host_memory or 0)
            if device <= kv:
                raise OffloadError(
                    f"{note}; that leaves {format_size(max(device, 0))} beside what this process holds, not enough "
                    f"for the KV cache of {format_size(kv)} and any weights"
                )
            return dataclasses.replace(config, device_memory=device), note
        return dataclasses.replace(config, memory=cap), note
    free, device_total = torch.cuda.mem_get_info()
    room = free - DEVICE_RESERVE
    if held + kv + FIT_SLACK <= room:
        return config, None
    host = config.host_memory if config.host_memory is not None else max(ram.available - ram.reserve, 0)
    note = (
        f"no --device-memory: planned for {format_size(room)} of the {format_size(free)} free on the device (of "
        f"{format_size(device_total)}) and {format_size(host)} of host RAM: the weights alone are {format_size(held)}"
    )
    return dataclasses.replace(config, device_memory=max(room, 0), host_memory=host), note
