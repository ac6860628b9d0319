"""The cost model's price of attention: one sequence's in one layer (`attention_seconds`), and, for KV in host RAM
on CUDA, both ways the engine may run it (`host_kv_attention`, offload/model/host_attention.py): on the CPU where
the KV is, the query and output crossing the link, or on the device, the K/V crossing it. scheduler/cost/predict.py
prices policies with them, offload/planner/host_attention_prices.py the engine's choice per micro-batch."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from offload.common.hardware import ComputeUnit, HardwareProfile
from offload.common.model_config import ModelSpec
from offload.scheduler.cost.gemm_rates import curve_rate, matmul_rate


class Context(Protocol):
    """What a price reads of scheduler.cost.predict.Context."""

    shape: ModelSpec
    hw: HardwareProfile
    dtype: str  # compute dtype
    dtype_bytes: int


# Where the profile has no measured attention curves (published cards): per sequence per layer, the paged attention
# reference attends each prefill chunk in its own call and builds each step's decode groups from Python lists
# (seconds); and the passes over a decode step's K/V bytes: the torch reference gathers each sequence's blocks (a
# read and a write) before the fused kernel reads the copy; a kernel reading the blocks in place would make this 1
SEQ_OVERHEAD = 40e-6
DECODE_KV_PASSES = 3


def attention_seconds(ctx: Context, unit: ComputeUnit, kv_bits: int, context: int, prefill: bool) -> float:
    """One sequence's attention in one layer: its whole prompt of `context` tokens (causal: half of the square),
    or one decode query over a cache of `context` tokens (memory-bound)."""
    s = ctx.shape
    if prefill:
        flops = 2.0 * (2 * s.num_heads * s.head_dim) * context * context / 2  # QK and PV
        if curve := unit.prefill_attention_curve.get(ctx.dtype):
            return flops / curve_rate(curve, context)
        return flops / matmul_rate(unit, ctx.dtype, context) + SEQ_OVERHEAD
    kv_bytes = context * 2 * s.num_kv_heads * s.head_dim * kv_bits / 8
    if kv_bits >= 8 * ctx.dtype_bytes and (curve := unit.decode_attention_curve.get(ctx.dtype)):
        return kv_bytes / curve_rate(curve, context)
    return DECODE_KV_PASSES * kv_bytes / unit.memory_bandwidth + SEQ_OVERHEAD


class HostKVAttention(NamedTuple):
    """Seconds of one layer's attention over KV in host RAM, each way and each part."""

    cpu: float  # the CPU's attention
    query_link: float  # the query to the host and the output back
    device: float  # the device's attention
    kv_link: float  # the K/V copied to the device

    @property
    def staged(self) -> bool:
        """Whether the K/V going to the device is faster than the CPU attending."""
        return self.device + self.kv_link < self.cpu + self.query_link


def host_kv_attention(
    ctx: Context, kv_bits: int, queries: int, seqs: int, context: int, prefill: bool
) -> HostKVAttention:
    """`seqs` sequences of `context` tokens each, `queries` query tokens in all (whole prompts with `prefill`, else
    one decode query each), their KV in host RAM of a CUDA machine."""
    s, hw = ctx.shape, ctx.hw
    return HostKVAttention(
        cpu=seqs * attention_seconds(ctx, hw.host, kv_bits, context, prefill),
        query_link=2 * queries * s.num_heads * s.head_dim * ctx.dtype_bytes / hw.host_to_device,
        device=seqs * attention_seconds(ctx, hw.device, kv_bits, context, prefill),
        kv_link=seqs * context * 2 * s.num_kv_heads * s.head_dim * kv_bits / 8 / hw.host_to_device,
    )
