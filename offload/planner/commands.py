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
first. Sizes are written as a user types them (`--device-memory 16.18GiB`): the budgets rounded down, by at most 0.1%
and never by more than the policy leaves free there, so the command never asks for more than the plan and the engine
still places every layer where the plan did.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from offload.common.config import BLOCK_SIZE, RING_SLOTS, EngineConfig
from offload.common.dtypes import DTYPE_BYTES
from offload.common.hardware import HardwareProfile
from offload.common.knobs import flag_name, knobs, to_flags
from offload.common.model_config import ModelSpec
from offload.common.sizes import parse_size, typed_size
from offload.common.tier import Tier
from offload.scheduler.cost.predict import Budgets, Candidate, Prediction, Workload, capacity, make_context


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
    return _typed_budgets(config, spec, hw, dtype, prediction, cap)


def _typed_budgets(
    config: EngineConfig, spec: ModelSpec, hw: HardwareProfile, dtype: str, prediction: Prediction, cap: dict
) -> EngineConfig:
    """`config` with its tier budgets rounded down to sizes as a user types them (sizes.typed_size), each by no more
    than the room the policy leaves in it, so that the engine still places every layer where the plan did. The KV
    cache's parts stay exact: they are whole blocks."""
    used = prediction.memory
    changes = {"device_memory": _rounded(config.device_memory, cap[Tier.DEVICE] - used[Tier.DEVICE])}
    if config.host_memory is not None:
        changes["host_memory"] = _rounded(config.host_memory, cap[Tier.HOST] - used[Tier.HOST])
    if config.expert_cache_memory:
        changes["expert_cache_memory"] = expert_cache_size(spec, hw, dtype, prediction.candidate)
    return dataclasses.replace(config, **changes)


def expert_cache_size(spec: ModelSpec, hw: HardwareProfile, dtype: str, cand: Candidate) -> int:
    """`cand`'s expert cache (bytes) rounded down to a size as a user types it, holding every expert it held."""
    one = make_context(spec, hw, dtype, BLOCK_SIZE).expert_bytes(cand.weight_bits)
    return _rounded(cand.expert_cache, int(cand.expert_cache - cand.expert_cache // one * one))


def _rounded(nbytes: int, spare: int) -> int:
    return parse_size(typed_size(nbytes, spare))


def command(model: str, config: EngineConfig, verb: str, weight_bits: int = 16) -> str:
    """The shell command that runs `config` on `model` (a directory, or a GGUF file, run at its own width; a public
    name is written as MODEL_DIR, a local copy the user supplies). Sizes are written in units (sizes.typed_size),
    exactly: planned_config rounded them."""
    local = Path(model).is_dir() or Path(model).is_file()
    target = shlex.quote(model) if local else "MODEL_DIR"
    convert = ""
    if weight_bits in (4, 8) and not Path(model).is_file():
        out = f"{target}-int{weight_bits}"
        convert = f"offload convert --model {target} --out {out} --quant int{weight_bits} && "
        target = out
    io = {"batch": " --input requests.jsonl --output results.jsonl", "serve": "", "generate": ""}[verb]
    flags = " ".join(shlex.quote(f) for f in _flags(config))
    return f"{convert}offload {verb} --model {target}{io} {flags}"


def _flags(config: EngineConfig) -> list[str]:
    """to_flags's flags for `config`, each size the one after its flag, written by typed_size instead of in bytes."""
    sizes = {flag_name(f, k): getattr(config, f.name) for f, k in knobs(EngineConfig) if k.size}
    words = to_flags(EngineConfig, config)
    before = ["", *words[:-1]]
    return [typed_size(sizes[flag], 0) if flag in sizes else word for flag, word in zip(before, words, strict=True)]
