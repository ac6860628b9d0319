"""Where a cold expert runs on a CUDA machine (EngineConfig.cold_experts, offload/model/expert_streaming.py): the
prices "auto" compares, from this machine's saved CUDA profile (`offload probe`), else measured at start."""

from __future__ import annotations

import torch

from offload.common.model_config import ModelSpec
from offload.model.expert_streaming import ColdExperts
from offload.planner.measured_rates import measure_expert_units
from offload.planner.profiles import load_profile, local_profile_path
from offload.scheduler.cost.moe_cost import cold_expert_seconds, copied_expert_seconds


def cold_experts(
    mode: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device, expert_bytes: int
) -> ColdExperts:
    """The choice for `mode` ("auto", "device" or "cpu"). "auto" prices one expert of `expert_bytes` over its rows
    both ways (scheduler/cost/moe_cost.py) with the host's and the device's GEMM curves and the host-to-device link:
    those of the saved profile when it is a CUDA machine's and has this dtype's curves, else measured now at the
    expert's shape (about a second). On a CPU device (the staged path forced, as tests do) there is no link to
    price: "auto" copies."""
    if mode != "auto":
        return ColdExperts(mode)
    if device.type == "cpu":
        return ColdExperts("device")
    name = str(dtype).removeprefix("torch.")
    path = local_profile_path()
    profile = load_profile(path) if path.exists() else None
    if profile is not None and profile.device_kind == "cuda" and name in profile.host.matmul_curve:
        host, dev, link = profile.host, profile.device, profile.host_to_device
    else:
        host, dev, link = measure_expert_units(device, name, spec.hidden_size, spec.expert_size)
    return ColdExperts(
        "auto",
        lambda rows: cold_expert_seconds(spec, host, name, expert_bytes, rows, link),
        lambda rows: copied_expert_seconds(spec, dev, name, expert_bytes, rows, link),
    )
