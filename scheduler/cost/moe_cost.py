"""The cost of a mixture's routed experts in one step: how many a step touches, how many of those the expert
cache holds, and what the others cost to read and to multiply.

A step of T tokens routes each to its top k of E experts. Routed uniformly at random, one layer's step touches

    D(T) = E * (1 - (1 - k / E) ** T)

distinct experts (k at T = 1, close to E once T is a few times E / k); each runs once over the T * k / D tokens that
chose it, so a decode step of a large batch reads every expert's weights from memory, not just k of them. Real
routers favour some experts, which touches fewer: D is an upper bound.

With expert streaming (EngineConfig.expert_cache_memory) the experts leave their layers: a cache of S experts of
the L * E routed ones holds a chosen expert with probability min(1, S / (L * E)) (a cache holding a uniform
sample; selection-frequency eviction does better where routing is skewed: runs of the model measure by how much,
offload/planner/routing.py, and the share is raised to that power), and each miss is read from disk after
the router has chosen it. Those reads wait on the router, so they do not overlap the layer's other work; the engine
issues a fetch's reads together and runs each expert as soon as it is there (cached ones first), so they overlap the
experts' own compute: the experts take max(reads + one expert's compute, their compute + one expert's read), a
two-stage pipeline's bound (`expert_wait`).

Plain numbers in, plain numbers out, like scheduler/cost/predict.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from offload.common.dtypes import DTYPE_BYTES
from offload.common.hardware import LARGE_READ_BYTES, SMALL_READ_BYTES, ComputeUnit, HardwareProfile
from offload.common.model_config import ModelSpec
from offload.scheduler.cost.gemm_rates import gemm_seconds

# the engine's Python cost around each routed expert it runs (seconds): finding its weights (the expert cache's
# lookup, a miss's read submitted), three products dispatched, the weighting and the add into the output. Profiled at
# 0.2-0.4 ms on a 2-core EPYC VM (the synthetic DeepSeek-V3 of benchmarks/moe.py, 128 experts a decode step), where
# a decode step's experts cost more in these calls than in their GEMMs
EXPERT_OVERHEAD = 250e-6


class ExpertStep(NamedTuple):
    compute_seconds: float  # the touched experts' GEMMs, every micro-batch of the step
    read_bytes: float  # experts read from disk in the step (expert streaming's misses; 0 without it)
    # on CUDA, the misses' way onto the device: each copied over the link and run there, or run on the CPU from
    # host RAM, whichever is priced faster (EngineConfig.cold_experts "auto"); waits on the router like the reads
    cold_seconds: float = 0.0
    one_seconds: float = 0.0  # one expert's compute (its GEMMs and EXPERT_OVERHEAD)


def expert_params(s: ModelSpec) -> int:
    """One routed expert's parameters: gate, up and down."""
    return 3 * s.hidden_size * s.expert_size


def routed_params(s: ModelSpec) -> int:
    """One sparse layer's routed experts' parameters, all of them."""
    return s.num_experts * expert_params(s)


def average_routed_params(s: ModelSpec) -> float:
    """The routed experts' parameters in the average decoder layer, as ParamCounts counts layers (DeepSeek's leading
    dense layers hold none)."""
    return routed_params(s) * sparse_layers(s) / s.num_layers


def sparse_layers(s: ModelSpec) -> int:
    return sum(s.sparse(i) for i in range(s.num_layers))


def distinct_experts(s: ModelSpec, tokens: float) -> float:
    """Expected distinct experts one layer's router chooses for `tokens` tokens (uniform routing: an upper bound)."""
    e, k = s.num_experts, s.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** max(tokens, 0.0))


def hit_rate(s: ModelSpec, slots: int, tokens: float | None = None) -> float:
    """The chance the expert cache of `slots` experts holds a chosen expert: its share of the routed experts, to the
    power the model's runs measured (s.expert_hit_exponent; 1, a uniform sample, where none did). For a step of
    `tokens` tokens, the power runs measured at that decode batch where they measured it at several
    (s.expert_hit_exponents, interpolated in log(batch), the nearest beyond them)."""
    share = min(1.0, slots / max(sparse_layers(s) * s.num_experts, 1))
    return share ** _exponent(s, tokens)


def _exponent(s: ModelSpec, tokens: float | None) -> float:
    points = s.expert_hit_exponents
    if tokens is None or not points:
        return s.expert_hit_exponent
    x = math.log(max(tokens, 1.0))
    xs = [math.log(b) for b, _ in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = next(i for i, xi in enumerate(xs) if xi >= x)
    f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return points[i - 1][1] + f * (points[i][1] - points[i - 1][1])


def read_bytes(s: ModelSpec, tokens: float, slots: int, expert_bytes: float) -> float:
    """Bytes expert streaming reads for one layer's step of `tokens` tokens: the touched experts the cache of
    `slots` experts misses."""
    return distinct_experts(s, tokens) * (1.0 - hit_rate(s, slots, tokens)) * expert_bytes


def expert_step(
    s: ModelSpec,
    unit: ComputeUnit,
    dtype: str,
    expert_bytes: float,
    rows_per_mb: int,
    micro_batches: int,
    slots: int | None,
    packed: bool,
    host: ComputeUnit | None = None,
    link: float = 0.0,
    kernel: str | None = None,
) -> ExpertStep:
    """One sparse layer's routed experts in a step of `micro_batches` micro-batches of `rows_per_mb` tokens.

    expert_bytes: one expert's weight bytes at the candidate's width; slots: the expert cache's experts (None:
    the experts are placed and streamed with their layer); packed: the experts are packed for the CPU's GEMM;
    host and link (bytes/s host -> device): a CUDA machine's CPU and link, which each miss crosses or runs on;
    kernel: the quantized kernel the experts' products take (gemm_seconds)."""
    touched = distinct_experts(s, rows_per_mb)
    # the rows an expert takes on average, not rounded up: a quantized kernel's time is close to affine in a few rows
    # (its blocks decoded once for all), and 16 rows over 7.2 experts priced at 3 each cost 20% too much
    rows = max(rows_per_mb * s.experts_per_token / max(touched, 1e-9), 1.0)
    per_expert = gemm_seconds(unit, dtype, expert_params(s), expert_bytes, rows, packed, kernel)
    compute = touched * (per_expert + EXPERT_OVERHEAD) * micro_batches
    if slots is None:
        return ExpertStep(compute, 0.0, one_seconds=per_expert + EXPERT_OVERHEAD)
    missed = read_bytes(s, rows_per_mb * micro_batches, slots, expert_bytes)
    if host is None:
        return ExpertStep(compute, missed, one_seconds=per_expert + EXPERT_OVERHEAD)
    cpu = cold_expert_seconds(s, host, dtype, expert_bytes, rows, link)
    copied = copied_expert_seconds(s, unit, dtype, expert_bytes, rows, link) - per_expert  # its compute: counted
    cold = missed / expert_bytes * min(cpu - per_expert, copied)
    return ExpertStep(compute, missed, cold, per_expert + EXPERT_OVERHEAD)


def expert_wait(step: ExpertStep, read_seconds: float, one_read_seconds: float) -> float:
    """Seconds a layer's experts take beyond their compute (step.compute_seconds, counted as compute) for reads of
    `read_seconds` in all, `one_read_seconds` each: the reads and the compute pipelined (module docstring). The
    first miss's read is exposed only for what the cached experts' compute, run meanwhile, does not cover, and only
    in the share of steps that miss at all (read_seconds / one_read_seconds misses expected, most steps none where
    that is below 1): on the 26 GB Mixtral-shape file at batch 8 a whole read a layer priced 1 s a step of waits
    where the run stalled 0.2."""
    if step.read_bytes <= 0:
        return 0.0
    misses = read_seconds / one_read_seconds if one_read_seconds > 0 else 0.0
    cached = max(step.compute_seconds - misses * step.one_seconds, 0.0)
    first = min(misses, 1.0) * max(one_read_seconds - cached, 0.0)
    return max(read_seconds + step.one_seconds - step.compute_seconds, first)


def expert_read_rate(hw: HardwareProfile, expert_bytes: float) -> float:
    """Bytes/s a miss of `expert_bytes` reads at: the probe's small-read rate up to its request size, the large-extent
    rate from the probe's extent up, log-linear between; disk_read where the profile has no small-read rate."""
    small = hw.disk_read_small
    if small is None or expert_bytes >= LARGE_READ_BYTES:
        return hw.disk_read
    if expert_bytes <= SMALL_READ_BYTES:
        return small
    t = math.log(expert_bytes / SMALL_READ_BYTES) / math.log(LARGE_READ_BYTES / SMALL_READ_BYTES)
    return small * (hw.disk_read / small) ** t


def cold_expert_seconds(
    s: ModelSpec, host: ComputeUnit, dtype: str, expert_bytes: float, rows: int, link: float
) -> float:
    """One routed expert run on the CPU over `rows` tokens from host RAM (a cold expert on a CUDA machine): its
    GEMMs on the host, and its tokens' rows moved to the host and its output back over the link (bytes/s)."""
    act_bytes = 2 * rows * s.hidden_size * DTYPE_BYTES[dtype]
    return gemm_seconds(host, dtype, expert_params(s), expert_bytes, rows) + act_bytes / link


def copied_expert_seconds(
    s: ModelSpec, device: ComputeUnit, dtype: str, expert_bytes: float, rows: int, link: float
) -> float:
    """The same expert copied from host RAM to the device over the link (bytes/s) and run there."""
    return expert_bytes / link + gemm_seconds(device, dtype, expert_params(s), expert_bytes, rows)
