"""The batch the cost model picks: an EngineConfig sized for a workload on this machine.

When the user fixes neither the batch nor the KV cache, the engine asks scheduler/cost.py which batch gives
the highest predicted throughput within the device budget, among the policies this engine runs (16-bit
weights, KV cache on the device), and sizes the KV cache, the step and the micro-batches to match: the KV
cache holds the whole batch at its longest, every prompt is prefilled in one pass over the weights, and
micro-batches are the size the cost model assumed.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from offload.common.config import EngineConfig
from offload.common.errors import OffloadError
from offload.common.hardware import HardwareProfile
from offload.common.sizes import format_size
from scheduler.cost import Budgets, Prediction, Workload
from scheduler.search import best, search
from tiers.kv import KVCache


def autoconfigure(
    model_dir: Path,
    config: EngineConfig,
    prompt_lens: list[int],
    max_new_tokens: int,
    hardware: HardwareProfile | None = None,
) -> tuple[EngineConfig, Prediction]:
    """`config` with max_num_seqs, kv_cache_bytes, max_step_tokens and micro_batch_tokens chosen by the cost model.

    hardware: None = this machine's profile (`offload probe`'s, measured quickly now if there is none).
    """
    from offload.model.loader import load_spec
    from offload.planner.models import load_model_spec

    if not prompt_lens:
        raise OffloadError("no prompts to plan for")
    spec, _ = load_spec(model_dir)
    shape = load_model_spec(str(model_dir))
    if hardware is None:
        from offload.planner.probe import local_profile

        hardware = local_profile()
    dtype = spec.dtype if config.dtype == "auto" else config.dtype
    requests = len(prompt_lens)
    prompt = max(prompt_lens)  # the KV cache and activations must hold the longest
    workload = Workload(prompt, max_new_tokens, requests)
    batches = sorted({1 << i for i in range(13) if 1 << i < requests} | {requests})
    predictions = search(
        shape,
        hardware,
        workload,
        dtype=dtype,
        budgets=Budgets(device=config.device_memory, host=config.host_memory),
        batches=batches,
        kv_tiers=("device",),
        ring_slots=config.ring_slots,
        block_size=config.block_size,
    )
    chosen = best(predictions, runnable_only=True)
    if chosen is None:
        over = ", ".join(f"{t} by {format_size(b)}" for t, b in predictions[0].overflow.items())
        raise OffloadError(
            f"no batch fits the budgets: even one sequence of {prompt + max_new_tokens} tokens is over {over} "
            "(raise --device-memory, or give --kv-cache-memory and --max-num-seqs yourself)"
        )
    cand = chosen.candidate
    blocks = -(-(prompt + max_new_tokens) // config.block_size)
    per_block = KVCache.block_bytes(
        spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim, getattr(torch, dtype)
    )
    step_tokens = cand.batch * prompt  # every prompt of the batch in one pass over the weights
    planned = dataclasses.replace(
        config,
        max_num_seqs=cand.batch,
        kv_cache_bytes=cand.batch * blocks * per_block,
        max_step_tokens=max(step_tokens, cand.batch),
        micro_batch_tokens=max(math.ceil(step_tokens / cand.micro_batches), 1),
    )
    return planned, chosen


def describe(prediction: Prediction) -> str:
    c = prediction.candidate
    dev, host, disk = c.policy.counts
    return (
        f"batch {c.batch} in {c.micro_batches} micro-batch{'es' if c.micro_batches > 1 else ''}, "
        f"layers {dev} resident / {host} host / {disk} streamed: "
        f"predicted {prediction.tokens_per_second:.3g} tokens/s, {prediction.bound}-bound"
    )
