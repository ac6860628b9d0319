"""From a plan to the command that runs it: each policy `offload plan` prints comes with the `offload batch` (or,
with a request rate, `offload serve`) command whose flags make the engine place the model and size its batch as
the plan priced them.

The flags are the EngineConfig the policy means, written by the knob machinery (offload/common/knobs.py's to_flags,
the inverse of the parser's from_args): the tier budgets the plan placed the layers in (the engine's placement
fills them by the same rule, `Policy.fill`), and the batch, KV cache, step and micro-batches as the engine's own
planner sizes them for a prediction (offload/planner/autoconfig.py's `sized`), with the device budget less the
activations the cost model counts in it and the engine allocates beside its tier. A policy with its KV cache in host
RAM gets a KV host part of the whole batch and a device part of one sequence (the device budget grows by that
sequence). A policy with 4- or 8-bit weights runs a checkpoint `offload convert` writes, so its command converts
first.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from offload.common.config import RING_SLOTS, EngineConfig
from offload.common.dtypes import DTYPE_BYTES
from offload.common.hardware import HardwareProfile
from offload.common.knobs import to_flags
from offload.common.model_config import ModelSpec
from offload.common.tier import Tier
from offload.scheduler.cost.predict import Budgets, Prediction, Workload, capacity


def planned_config(
    spec: ModelSpec, hw: HardwareProfile, dtype: str, prediction: Prediction, workload: Workload, budgets: Budgets
) -> EngineConfig:
    """The EngineConfig that runs `prediction`'s policy: the budgets it was placed in, its batch and KV cache."""
    from offload.planner.autoconfig import activation_bytes, sized

    cand = prediction.candidate
    cap = capacity(hw, budgets)
    _, host_layers, _ = cand.policy.counts
    # the engine allocates a step's activations outside its device tier, where the cost model counts them in it
    activations = activation_bytes(spec, hw, dtype, EngineConfig(dtype=dtype), cand, workload)
    config = EngineConfig(
        device_memory=cap[Tier.DEVICE] - activations,
        host_memory=cap[Tier.HOST] if host_layers else None,
        dtype=dtype,
        # the integer KV format of that width (the cost model prices fp8 as int8's 8 bits)
        kv_dtype=f"int{cand.kv_bits}" if cand.kv_bits < 8 * DTYPE_BYTES[dtype] else "auto",
        ring_slots=cand.policy.ring_slots or RING_SLOTS,
        expert_cache_memory=cand.expert_cache or None,
    )
    config = sized(config, spec, dtype, prediction, workload)
    if (
        cand.kv_tier == Tier.HOST
    ):  # the KV host part holds the batch; the device part, one sequence (it cannot be empty)
        one = config.kv_cache_bytes // cand.batch
        config = dataclasses.replace(
            config, kv_host_memory=config.kv_cache_bytes, kv_cache_bytes=one, device_memory=config.device_memory + one
        )
    return config


def command(model: str, config: EngineConfig, verb: str, weight_bits: int = 16) -> str:
    """The shell command that runs `config` on `model` (a directory; a public name is written as MODEL_DIR, a local
    copy the user supplies)."""
    local = Path(model).is_dir()
    target = shlex.quote(model) if local else "MODEL_DIR"
    convert = ""
    if weight_bits in (4, 8):
        out = f"{target}-int{weight_bits}"
        convert = f"offload convert --model {target} --out {out} --quant int{weight_bits} && "
        target = out
    io = {"batch": " --input requests.jsonl --output results.jsonl", "serve": "", "generate": ""}[verb]
    flags = " ".join(shlex.quote(f) for f in to_flags(EngineConfig, config))
    return f"{convert}offload {verb} --model {target}{io} {flags}"
