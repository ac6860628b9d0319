"""The prices EngineConfig.host_kv_attention "auto" compares on CUDA (offload/model/host_attention.py): one layer's
attention of a host-resident micro-batch on the CPU against its blocks copied over the link and attended on the
device, from the cost model (scheduler/cost/attention_cost.py) and this machine's saved CUDA profile."""

from __future__ import annotations

import torch

from offload.common.dtypes import DTYPE_BYTES
from offload.common.model_config import ModelSpec
from offload.model.host_attention import HostAttention
from offload.planner.autoconfig import KV_BITS
from offload.planner.profiles import load_profile, local_profile_path
from offload.scheduler.cost.attention_cost import HostKVAttention, host_kv_attention
from offload.scheduler.cost.predict import Context, make_context


def choose_host_attention(
    mode: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device, kv_dtype: str, block: int
) -> HostAttention | None:
    """The choice for `mode` ("auto", "cpu" or "device"); None where host micro-batches simply attend where their KV
    is (a CPU device, unless "device" forces the staging). "auto" on CUDA prices both ways with the saved profile
    when `offload probe` wrote one for a CUDA machine, else takes the rule in HostAttention.stage."""
    if device.type == "cpu":
        return HostAttention("device") if mode == "device" else None
    if mode != "auto":
        return HostAttention(mode)
    path = local_profile_path()
    profile = load_profile(path) if path.exists() else None
    name = str(dtype).removeprefix("torch.")
    if profile is None or profile.device_kind != "cuda" or profile.host_to_device <= 0:
        return HostAttention("auto")
    ctx = make_context(spec, profile, name, block)
    kv_bits = KV_BITS.get(kv_dtype, 8 * DTYPE_BYTES[name])

    def cpu(queries: int, seqs: int, context: int) -> float:
        h = _prices(ctx, kv_bits, queries, seqs, context)
        return h.cpu + h.query_link

    def staged(queries: int, seqs: int, context: int) -> float:
        h = _prices(ctx, kv_bits, queries, seqs, context)
        return h.device + h.kv_link

    return HostAttention("auto", cpu, staged)


def _prices(ctx: Context, kv_bits: int, queries: int, seqs: int, context: int) -> HostKVAttention:
    """The cost model's prices of one layer's attention of a micro-batch of `seqs` sequences averaging queries /
    seqs queries over context / seqs tokens: decode queries at their context, prompt chunks as that share of a whole
    prompt's causal square (a chunk of q queries over c tokens does 2q/c of the c^2/2 a whole prompt of c does)."""
    q, c = queries / seqs, max(context / seqs, 1.0)
    h = host_kv_attention(ctx, kv_bits, queries, seqs, round(c), prefill=q > 1)
    share = min(1.0, 2 * q / c) if q > 1 else 1.0
    return h._replace(cpu=h.cpu * share, device=h.device * share)
