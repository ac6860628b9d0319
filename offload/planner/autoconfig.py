"""Resolving a config for a workload: what the planner decides where the config says None, and the batch the cost
model picks.

`resolve` is the one step every face takes (the API, the command line, the server, batch jobs): budgets left None
become what they mean when unset (no host layers, no KV tiers below the device, no expert cache), and the batch and
the KV cache, where the user fixed neither, are sized by `autoconfigure` whenever there is a budget to size them in,
else get their defaults.

When the user fixes neither the batch nor the KV cache, the engine asks scheduler/cost/predict.py which batch gives
the highest predicted throughput within the device budget, among the policies this engine runs (the checkpoint's
weight width, KV cache on the device), and sizes the KV cache, the step and the micro-batches to match: the KV cache
holds the whole batch at its longest, every prompt is prefilled in one pass over the weights, and micro-batches are
the size the cost model assumed.

Under a cap on the whole process (`EngineConfig.memory`, on a CPU device, where the device tier is RAM) the device
budget is the cap minus what the process holds when it plans and MEMORY_RESERVE; the engine's device tier then gets
that budget less the activations the cost model counted in it, which the engine allocates outside its tier.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import NamedTuple

import torch

from offload.common.config import DEFAULT_KV_CACHE, DEFAULT_MAX_NUM_SEQS, EngineConfig, Policy
from offload.common.dtypes import DTYPE_BYTES
from offload.common.errors import OffloadError
from offload.common.hardware import HardwareProfile
from offload.common.model_config import ModelSpec
from offload.common.sizes import format_size
from offload.common.tier import Tier
from offload.planner.machine_budget import machine_budgets
from offload.planner.routing import with_measured_routing
from offload.scheduler.cost.predict import Budgets, Candidate, Prediction, Workload, make_context, tier_memory
from offload.scheduler.cost.search import best, search
from offload.tiers.kv.kv_cache import KVCache

# bytes of a process's peak RSS beyond its RSS when it planned and the device bytes the cost model predicted (weights,
# KV cache, ring, activations, logits): allocator slack, decode attention's copy of a layer's K/V, the read threads,
# Python objects, sampling. Measured on the 1.1B streaming checkpoint (bf16, 128-token prompts, 16 new tokens, CPU):
# 39 MiB at batch 16 (every layer streamed), 80 and 94 MiB at batch 128 (2 and 3 layers resident), 14 MiB at batch
# 64 (all resident). Part of it grows with the bytes a step moves: 0.24-0.28 GB on the 26 GB Mixtral-shape GGUF at batch
# 8 on a 2-core AMD EPYC (a 256-token prefill's experts through the dense product: dequantized slices, oneDNN's
# buffers, the allocator's arenas), which took the run 27 MB past its cap under the earlier 192 MiB. About twice that
MEMORY_RESERVE = 512 << 20


KV_BITS = {"int8": 8, "fp8": 8, "int4": 4}  # --kv-dtype -> the cost model's kv_bits; float formats: the dtype's


# what an engine is planned for when its caller names no workload (the endpoint's, unless its flags say otherwise)
DEFAULT_WORKLOAD = Workload(prompt_len=512, gen_len=128, requests=DEFAULT_MAX_NUM_SEQS)
# budgets whose None means nothing of that tier
_NONE_IS_ZERO = ("host_memory", "kv_host_memory", "kv_disk_memory", "expert_cache_memory", "expert_host_memory")


def needs_plan(config: EngineConfig) -> bool:
    """A budget was given and neither the batch nor the KV cache: the cost model sizes both for the workload."""
    fixed = config.kv_cache_bytes is not None or config.max_num_seqs is not None
    return config.memory is not None or (config.device_memory is not None and not fixed)


def _unset_as_zero(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, **{n: 0 for n in _NONE_IS_ZERO if getattr(config, n) is None})


class Resolved(NamedTuple):
    config: EngineConfig  # as the engine runs it
    prediction: Prediction | None  # the cost model's, where it chose the batch
    assumed: str | None  # the machine's budgets the plan assumed where the caller gave none, and why (None: none)


def resolve(
    model_dir: Path, config: EngineConfig, workload: Workload | None = None, hardware: HardwareProfile | None = None
) -> Resolved:
    """`config` as the engine runs it, for `workload` (None: DEFAULT_WORKLOAD), the cost model's prediction where
    it chose the batch, and the budgets assumed for a model that does not fit a machine given no budget
    (offload/planner/machine_budget.py). Resolving a resolved config returns it unchanged."""
    from offload.model.loader import load_spec

    spec, _ = load_spec(model_dir)
    dtype = spec.dtype if config.dtype == "auto" else config.dtype
    config, assumed = machine_budgets(model_dir, config, dtype, on_cpu(config), process_rss())
    moe_auto = spec.num_experts > 0 and config.expert_cache_memory is None  # by expert, where the plan says so
    config = _unset_as_zero(config)
    prediction = None
    if needs_plan(config):
        w = workload or DEFAULT_WORKLOAD
        try:
            config, prediction = autoconfigure(
                model_dir, config, [w.prompt_len] * (w.requests or 1), w.gen_len, hardware, moe_auto
            )
        except OffloadError as exc:
            if assumed is None:
                raise
            raise OffloadError(f"{assumed}; {exc}") from None
    config = dataclasses.replace(
        config,
        max_num_seqs=config.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        kv_cache_bytes=config.kv_cache_bytes or DEFAULT_KV_CACHE,
    )
    return Resolved(config, prediction, assumed)


def on_cpu(config: EngineConfig) -> bool:
    """Whether `config` runs on the CPU (its device tier is RAM)."""
    return config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())


def autoconfigure(
    model_dir: Path,
    config: EngineConfig,
    prompt_lens: list[int],
    max_new_tokens: int,
    hardware: HardwareProfile | None = None,
    moe_auto: bool = False,
) -> tuple[EngineConfig, Prediction]:
    """`config` with max_num_seqs, kv_cache_bytes, max_step_tokens and micro_batch_tokens chosen by the cost model.
    With `config.memory` (a cap on the process) the result has the device budget derived from it instead.
    moe_auto: a mixture's expert cache is the cost model's choice too (none, or what the budget leaves once every
    layer's dense part is resident), not config.expert_cache_memory.

    hardware: None = this machine's profile (`offload probe`'s, measured quickly now if there is none).
    """
    from offload.model.loader import load_spec

    if not prompt_lens:
        raise OffloadError("no prompts to plan for")
    config = _unset_as_zero(config)
    spec, _ = load_spec(model_dir)  # one read of config.json: the spec the engine runs is what the cost model prices
    spec, _ = with_measured_routing(spec, model_dir)  # a mixture's expert cache hits as its runs measured
    if hardware is None:
        from offload.planner.probe import local_profile

        hardware = local_profile()
    dtype = spec.dtype if config.dtype == "auto" else config.dtype
    device_budget = config.device_memory
    if config.memory is not None:
        device_budget = memory_budget(config)
    requests = len(prompt_lens)
    prompt = max(prompt_lens)  # the KV cache and activations must hold the longest
    workload = Workload(prompt, max_new_tokens, requests)
    batches = sorted({1 << i for i in range(13) if 1 << i < requests} | {requests})
    predictions = search(
        spec,
        hardware,
        workload,
        dtype=dtype,
        budgets=Budgets(device=device_budget, host=config.host_layer_memory),
        batches=batches,
        kv_tiers=(Tier.DEVICE,),
        ring_slots=config.ring_slots,
        block_size=config.block_size,
        kv_group=config.kv_group_size,
        kv_bits=(KV_BITS.get(config.kv_dtype, 8 * DTYPE_BYTES[dtype]),),
        weight_bits=(spec.quant.bits if spec.quant is not None else 8 * DTYPE_BYTES[dtype],),
        # taken from the device budget before any layer is placed
        expert_caches=None if moe_auto else (config.expert_cache_memory,),
    )
    chosen = best(predictions, runnable_only=True)
    if chosen is None and config.memory is not None:
        short = predictions[0].overflow.get(Tier.DEVICE, 0)
        held = config.memory - MEMORY_RESERVE - config.host_total - device_budget  # the RSS memory_budget read
        raise OffloadError(
            f"memory of {format_size(config.memory)} is {format_size(short)} short of one sequence of "
            f"{prompt + max_new_tokens} tokens (this process held {format_size(held)} when it planned, and "
            f"{format_size(MEMORY_RESERVE)} is kept for what the cost model does not count)"
        )
    if chosen is None:
        over = ", ".join(f"{t} by {format_size(b)}" for t, b in predictions[0].overflow.items())
        raise OffloadError(
            f"no batch fits the budgets: even one sequence of {prompt + max_new_tokens} tokens is over {over} "
            "(raise --device-memory, or give --kv-cache-memory and --max-num-seqs yourself)"
        )
    device_memory = config.device_memory
    if config.memory is not None:  # the engine's device tier: what the budget leaves beside the activations
        device_memory = device_budget - activation_bytes(spec, hardware, dtype, config, chosen.candidate, workload)
    budgeted = dataclasses.replace(config, memory=None, device_memory=device_memory)  # now the device budget
    return sized(budgeted, spec, dtype, chosen, workload), chosen


def sized(
    config: EngineConfig, spec: ModelSpec, dtype: str, prediction: Prediction, workload: Workload
) -> EngineConfig:
    """`config` with the batch, KV cache, step and micro-batches of `prediction` for `workload`: the KV cache holds
    the whole batch at its longest, every prompt of the batch is prefilled in one pass over the weights, and
    micro-batches are the size the cost model assumed."""
    cand = prediction.candidate
    blocks = -(-(workload.prompt_len + workload.gen_len) // config.block_size)
    try:
        geometry = (spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim, getattr(torch, dtype))
        per_block = KVCache.block_bytes(*geometry, config.kv_dtype, config.kv_group_size, spec.kv_parts)
    except ValueError as exc:  # a KV format the model's head_dim does not take
        raise OffloadError(f"--kv-dtype {config.kv_dtype}: {exc}") from None
    step_tokens = cand.batch * workload.prompt_len  # every prompt of the batch in one pass over the weights
    return dataclasses.replace(
        config,
        expert_cache_memory=int(cand.expert_cache) if cand.expert_cache else config.expert_cache_memory,
        max_num_seqs=cand.batch,
        kv_cache_bytes=cand.batch * blocks * per_block,
        max_step_tokens=max(step_tokens, cand.batch),
        micro_batch_tokens=max(math.ceil(step_tokens / cand.micro_batches), 1),
    )


def process_rss() -> int:
    """Bytes this process holds resident now."""
    import psutil

    return psutil.Process().memory_info().rss


def memory_budget(config: EngineConfig) -> int:
    """The device budget `config.memory` leaves: the cap minus this process's RSS now, MEMORY_RESERVE and the host RAM
    the engine keeps (host_total), which the same RAM holds (bytes; below zero when the process already holds more,
    so that the search says by how much one sequence is short)."""
    if not on_cpu(config):
        raise OffloadError(
            "memory caps the process's RAM, which holds the weights and KV cache only on a CPU device: "
            "on CUDA give device_memory (--device-memory) and host_memory (--host-memory)"
        )
    return config.memory - process_rss() - MEMORY_RESERVE - config.host_total


def activation_bytes(
    shape: ModelSpec, hardware: HardwareProfile, dtype: str, config: EngineConfig, cand: Candidate, workload: Workload
) -> int:
    """What the cost model counts on the device for `cand` beyond what the engine's device tier is charged (the
    embedding, head, layers, ring, KV cache and expert cache): a step's activations and logits (bytes)."""
    ctx = make_context(shape, hardware, dtype, config.block_size, config.kv_group_size)
    bare = tier_memory(ctx, dataclasses.replace(cand, policy=Policy(())), workload)[Tier.DEVICE]  # no layer placed
    kv = cand.batch * ctx.kv_bytes(workload.prompt_len + workload.gen_len, cand.kv_bits)
    kv = kv if cand.kv_tier == Tier.DEVICE else 0  # host KV is counted in the host tier
    return int(bare - ctx.embed_bytes - ctx.head_bytes - kv - cand.expert_cache)


def describe(prediction: Prediction) -> str:
    c = prediction.candidate
    dev, host, disk = c.policy.counts
    return (
        f"batch {c.batch} in {c.micro_batches} micro-batch{'es' if c.micro_batches > 1 else ''}, "
        f"layers {dev} resident / {host} host / {disk} streamed: "
        f"predicted {prediction.tokens_per_second:.3g} tokens/s, {prediction.bound}-bound"
    )
