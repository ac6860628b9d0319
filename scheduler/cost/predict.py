"""The cost model: how long a policy takes on a machine, and the search for the one with the highest throughput.

In the spirit of FlexGen's. The prefetch pipeline overlaps a layer's disk read, its host-to-device copy and
the compute of the layer before it, so a layer costs the slowest of those resources; a step costs the sum
over its layers plus the head; a batch costs one prefill step and gen_len - 1 decode steps at a context that
grows by one token each. Compute is a roofline: the larger of the FLOPs over the GEMM rate at that many rows
(measured by `offload probe`, or a derated datasheet figure) and the bytes read over memory bandwidth. The rest of
a layer (norms, rotary, SiLU * up, attention) is priced at the rates the probe measured through the engine's own
code where the profile has them, else at the memory bandwidth and the GEMM rate.

A micro-batch is a token budget, as in the engine: a prefill of `batch` prompts runs in `micro_batches` pieces,
and a decode step's one token per sequence fills as few micro-batches of that budget as it needs (usually one).
Plain numbers in, plain numbers out: no tensors, no files. The search over policies is `scheduler.cost.search`.

Over 400 lines: the model of a layer's step (`_layer_step`), of a whole step of one kind (`_step`) and of a step that
mixes prefill and decode (`mixed_step_seconds`, for scheduler/cost/queueing.py) share one set of prices, and the memory
a policy holds (`tier_memory`) is counted beside them so that time and memory stay the same model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offload.common.config import BLOCK_SIZE, KV_GROUP_SIZE, Policy, embed_read_buffer
from offload.common.dtypes import DTYPE_BYTES
from offload.common.errors import OffloadError
from offload.common.hardware import ComputeUnit, HardwareProfile
from offload.common.model_config import GPT_OSS, ModelSpec
from offload.common.tier import Tier
from offload.scheduler.cost.attention_cost import attention_seconds, host_kv_attention
from offload.scheduler.cost.gemm_rates import (
    curve_rate,
    elementwise_bytes,
    gemm_seconds,
    matmul_rate,
    quantized_curve,
)
from offload.scheduler.cost.moe_cost import (
    average_routed_params,
    expert_params,
    expert_read_rate,
    expert_step,
    expert_wait,
)

# Python cost of the engine's loop around one decoder layer for one micro-batch (seconds): fetching its weights,
# the call; what the layer itself costs at the least is the profile's measured layer_floor, where it has one.
LAYER_OVERHEAD = 150e-6
MXFP4_BITS = 4.25  # gpt-oss's published experts: a 4-bit value and a block of 32 values' 8-bit exponent
# rows from which quantized weights are dequantized for the dense GEMM (fewer: kernels that read the codes as they
# are, kernels/quant_linear.py and kernels/gguf_linear.py)
DEQUANT_FROM_ROWS = 32
QUANT_GROUP = 64  # weights per scale and zero point when weights are quantized (FlexGen's group size)


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_len: int  # tokens per prompt
    gen_len: int  # new tokens per request
    requests: int | None = None  # None: throughput of one full batch, however large the best batch is

    def __post_init__(self) -> None:
        for name in ("prompt_len", "gen_len"):
            if getattr(self, name) < 1:
                raise OffloadError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.requests is not None and self.requests < 1:
            raise OffloadError(f"requests must be at least 1, got {self.requests}")


@dataclass(frozen=True, slots=True)
class Budgets:
    """Bytes each tier may hold; None = the whole memory of that tier in the hardware profile."""

    device: int | None = None
    host: int | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """One policy: the batch, how it is split, where weights and KV cache live, and their precision."""

    batch: int  # sequences advanced together by each step
    micro_batches: int  # the batch runs as this many micro-batches, each reusing the layer's loaded weights
    policy: Policy  # each decoder layer's tier, and the device ring that streamed layers pass through
    kv_tier: str = Tier.DEVICE  # HOST on CUDA: attention on the CPU next to the cache, or the cache copied up
    weight_bits: int = 16
    kv_bits: int = 16
    # bytes of the device budget for a mixture's expert cache: its routed experts leave their layers and are read
    # when chosen (scheduler/cost/moe_cost.py); 0 = they are placed and streamed with their layers
    expert_cache: int = 0

    @property
    def micro_batch(self) -> int:
        """Sequences per prefill micro-batch."""
        return -(-self.batch // self.micro_batches)

    def decode_micro_batches(self, prompt_len: int) -> int:
        """Micro-batches of a decode step: one token per sequence in micro-batches of the prefill's token budget."""
        budget = -(-self.batch * prompt_len // self.micro_batches)
        return -(-self.batch // budget)


@dataclass(frozen=True, slots=True)
class Prediction:
    candidate: Candidate
    prefill_seconds: float  # one batch's prompts, up to the first token of each
    decode_seconds: float  # one batch's remaining gen_len - 1 tokens
    rounds: int  # batches run one after another to serve every request
    generated_tokens: int  # over all rounds
    memory: dict[str, int]  # peak bytes per tier (Tier.DEVICE, Tier.HOST; "disk": bytes written beyond the checkpoint)
    overflow: dict[str, int]  # bytes over budget per tier; empty when the policy fits
    resources: dict[str, float]  # seconds of one round each resource is busy: disk, link, compute, host
    unsupported: tuple[str, ...] = field(default_factory=tuple)  # what this engine cannot run yet
    # the first round's prefill, where it differs: a mixture streamed by expert starts with its expert cache empty,
    # so the first prompts read every expert they touch (on the 26 GB Mixtral-shape file, 18-20 GB before the first
    # token, priced at the warm cache's 4% of misses as 4 s where runs took 19-33 s); None: prefill_seconds. Only
    # the time to first token counts it: rounds are priced warm, as the layers' own reads at load are not priced
    first_prefill_seconds: float | None = None

    @property
    def fits(self) -> bool:
        return not self.overflow

    @property
    def round_seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def total_seconds(self) -> float:
        return self.rounds * self.round_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.total_seconds, 1e-12)

    @property
    def ttft_seconds(self) -> float:
        """Time to first token of the first round's sequences."""
        return self.prefill_seconds if self.first_prefill_seconds is None else self.first_prefill_seconds

    @property
    def bound(self) -> str:
        """The resource busiest over a round: what a faster machine would have to improve."""
        return max(self.resources, key=self.resources.__getitem__)


# ---- the model of a step -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Context:
    shape: ModelSpec
    hw: HardwareProfile
    dtype: str  # compute dtype
    dtype_bytes: int
    block_size: int
    kv_group: int = KV_GROUP_SIZE  # KV values per scale in a quantized KV cache (--kv-group-size)

    @property
    def on_cpu(self) -> bool:
        return self.hw.device_kind == "cpu"

    def ring_layers(self, policy: Policy) -> int:
        """Layers that pass through the device ring every step: those streamed from disk, and on CUDA those in
        host RAM too (a CPU device reads host layers in place)."""
        _, host, nvme = policy.counts
        return nvme if self.on_cpu else host + nvme

    @property
    def embed_storable(self) -> bool:
        """Whether the embedding is a bare token table apart from the head, which may stay in storage (a step reading
        its tokens' rows: Policy.embed_tier NVME). A GGUF file's table in blocks stays resident (the engine reads
        float rows alone, tiers/weights/embedding.py's `storable`)."""
        s = self.shape
        blocks = self.held_bits("embed_bits") > 0
        return not s.tie_word_embeddings and s.params.embed == s.vocab_size * s.hidden_size and not blocks

    @property
    def embed_bytes(self) -> float:
        """The token table as the engine holds it: a GGUF file's blocks where it stores the table so, else the
        compute dtype."""
        return self._held(self.shape.params.embed, "embed_bits")

    @property
    def head_bytes(self) -> float:
        """The LM head as the engine holds it (0 where it is the tied token table)."""
        return self._held(self.shape.params.head, "head_bits")

    def held_bits(self, field: str) -> float:
        """Bits a weight of the table ("embed_bits") or head ("head_bits") as held in blocks; 0 for a float one."""
        return getattr(self.shape.quant, field) if self.shape.quant is not None else 0.0

    def _held(self, params: int, field: str) -> float:
        bits = self.held_bits(field)
        return params * bits / 8 if bits else params * self.dtype_bytes

    @property
    def embed_row_bytes(self) -> int:
        return self.shape.hidden_size * self.dtype_bytes

    def placed_params(self, cand: Candidate) -> int:
        """One decoder layer's parameters as the policy places them: without its routed experts when they stream
        through the expert cache."""
        return self.shape.params.layer - (int(average_routed_params(self.shape)) if cand.expert_cache else 0)

    def placed_bytes(self, cand: Candidate) -> float:
        """One decoder layer's bytes as the policy places them: placed_params at the candidate's width, and MXFP4
        experts (gpt-oss as published) that stay in the layer at 4.25 bits a weight."""
        params = self.placed_params(cand)
        if not self.shape.mxfp4_experts or cand.expert_cache:
            return self.weight_bytes(params, cand.weight_bits)
        routed = average_routed_params(self.shape)
        return self.weight_bytes(int(params - routed), cand.weight_bits) + routed * MXFP4_BITS / 8

    def expert_bytes(self, weight_bits: int) -> float:
        """One routed expert's bytes at a candidate's width; MXFP4 experts at 4.25 bits a weight, as stored."""
        if self.shape.mxfp4_experts:
            return expert_params(self.shape) * MXFP4_BITS / 8
        return self.weight_bytes(expert_params(self.shape), weight_bits)

    def expert_slots(self, cand: Candidate) -> int | None:
        """Experts the candidate's expert cache holds; None without one."""
        if not cand.expert_cache:
            return None
        return int(cand.expert_cache // self.expert_bytes(cand.weight_bits))

    def quant_kernel(self, bits: int, decode: bool = False) -> str | None:
        """The quantized kernel a CPU device multiplies weights of `bits` with ("gguf": a GGUF file's blocks read in
        place, "gguf_decode" those at a decode step's rows where the profile measured them apart, "int4": the
        engine's int4 codes; its profile may have measured any); None for float weights, int8, and a CUDA device
        (whose quantized kernels the probe does not measure)."""
        if bits >= 8 * self.dtype_bytes or not self.on_cpu:
            return None
        quant = self.shape.quant
        if quant is not None and quant.layout == "gguf" and quant.bits == bits:
            return "gguf_decode" if decode and self.hw.device.gguf_decode_matmul_curve.get(self.dtype) else "gguf"
        return "int4" if bits == 4 else None

    def weight_bytes(self, params: int, bits: int) -> float:
        if bits >= 8 * self.dtype_bytes:
            return params * self.dtype_bytes
        quant = self.shape.quant
        if quant is not None and quant.layout == "gguf" and quant.stored_bits and quant.bits == bits:
            return params * quant.stored_bits / 8  # GGUF blocks read in place: their scales inside
        # + a scale and a zero per group, held in the compute dtype: the checkpoint's group where it is quantized
        group = quant.group_size if quant is not None and quant.bits == bits and quant.group_size else QUANT_GROUP
        return params * bits / 8 + params / group * 2 * self.dtype_bytes

    def kv_bytes(self, tokens: int, kv_bits: int) -> float:
        """KV cache of `tokens` tokens of one sequence, across layers, in whole blocks; a quantized one (kv_quant.py)
        also stores a float16 scale per `kv_group` values, and int4 a float16 zero."""
        bits = kv_bits + ((16 if kv_bits == 8 else 32) / self.kv_group if kv_bits < 8 * self.dtype_bytes else 0)
        return -(-tokens // self.block_size) * self.block_size * self.shape.kv_bytes_per_token(bits / 8)


def _layer_step(
    ctx: Context,
    cand: Candidate,
    tier: str,
    micro_batches: int,
    seqs_per_mb: int,
    context: int,
    prefill: bool,
    floor_rows: int | None = None,
    cold: bool = False,
) -> dict[str, float]:
    """Seconds one decoder layer keeps each resource busy in one step (they overlap: the layer costs the max).
    Every micro-batch of the step costs the same (the last may be smaller: ignored); a prefill micro-batch holds
    `seqs_per_mb` whole prompts of `context` tokens, a decode one `seqs_per_mb` tokens. The layer costs at least
    its floor at `floor_rows` rows a micro-batch (its own rows by default; 0: no floor, where a step's other part
    counts the floor for both). `cold`: the expert cache holds nothing yet, so every expert touched is read."""
    s, hw = ctx.shape, ctx.hw
    rows_per_mb = seqs_per_mb * (context if prefill else 1)
    w_bytes = ctx.placed_bytes(cand)
    active = s.params.active_layer - s.experts_per_token * expert_params(s)  # routed experts: priced below
    active_bytes = ctx.weight_bytes(active, cand.weight_bits)
    busy = {"disk": 0.0, "link": 0.0, "compute": 0.0, "host": 0.0}
    if tier == Tier.NVME:
        busy["disk"] = w_bytes / hw.disk_read
    if tier != Tier.DEVICE and not ctx.on_cpu:
        busy["link"] = w_bytes / hw.host_to_device
    attn_unit = hw.host if cand.kv_tier == Tier.HOST and not ctx.on_cpu else hw.device
    packed = ctx.on_cpu and tier == Tier.DEVICE  # the engine packs resident layers where that pays
    kernel = ctx.quant_kernel(cand.weight_bits, decode=not prefill)
    compute = gemm_seconds(hw.device, ctx.dtype, active, active_bytes, rows_per_mb, packed, kernel)
    compute += _elementwise_seconds(ctx, rows_per_mb)
    dequantized = cand.weight_bits < 8 * ctx.dtype_bytes and rows_per_mb >= DEQUANT_FROM_ROWS
    if dequantized and not quantized_curve(hw.device, ctx.dtype, kernel):  # a measured curve has it already
        compute += s.params.active_layer * ctx.dtype_bytes / hw.device.memory_bandwidth
    attention = seqs_per_mb * attention_seconds(ctx, attn_unit, cand.kv_bits, context, prefill)
    floor = layer_floor_seconds(hw.device, ctx.dtype, rows_per_mb if floor_rows is None else floor_rows)
    if floor:  # a small layer costs its calls, not its bytes
        on_device = compute + (attention if attn_unit is hw.device else 0.0)
        compute += max(floor - on_device, 0.0)
    compute += LAYER_OVERHEAD
    compute *= micro_batches
    attention *= micro_batches
    if s.num_experts:  # the touched experts; with expert streaming the misses are read after the router chose them
        expert_bytes = ctx.expert_bytes(cand.weight_bits)
        slots, cuda = ctx.expert_slots(cand), (hw.host, hw.host_to_device) if not ctx.on_cpu else ()
        slots = 0 if cold and slots is not None else slots
        packed_ex = packed and not cand.expert_cache  # streamed experts are not packed
        ex = expert_step(
            s, hw.device, ctx.dtype, expert_bytes, rows_per_mb, micro_batches, slots, packed_ex, *cuda, kernel=kernel
        )
        compute += ex.compute_seconds
        # waits on the router, overlaps the experts' compute (moe_cost.expert_wait); read an expert a request
        rate = expert_read_rate(hw, expert_bytes)
        busy["serial"] = expert_wait(ex, ex.read_bytes / rate, expert_bytes / rate)
        busy["reads"] = ex.read_bytes / rate  # the disk's busy time, hidden behind the experts' compute or not
        busy["serial_link"] = ex.cold_seconds  # so do the misses' copies (or CPU runs) on CUDA
    if attn_unit is hw.host and not ctx.on_cpu:  # host KV: the CPU attends, or the blocks go to the device, as the
        # engine chooses (offload/model/host_attention.py)
        h = host_kv_attention(ctx, cand.kv_bits, rows_per_mb, seqs_per_mb, context, prefill)
        if h.staged:
            compute, busy["link"] = compute + micro_batches * h.device, busy["link"] + micro_batches * h.kv_link
        else:  # the CPU attends beside the GEMMs
            busy["host"], busy["link"] = attention, busy["link"] + micro_batches * h.query_link
    else:
        compute += attention
    busy["compute"] = compute
    return busy


def layer_floor_seconds(unit: ComputeUnit, dtype: str, rows: int) -> float:
    """The least a decoder layer costs on `unit` for `rows` rows, however small: the probe's tiny layer at that
    many rows (layer_floor_curve), else at one row (layer_floor); 0 without either."""
    if rows < 1:
        return 0.0
    if curve := unit.layer_floor_curve.get(dtype):
        return rows / curve_rate(curve, rows)
    return unit.layer_floor.get(dtype, 0.0)


def _elementwise_seconds(ctx: Context, rows: int) -> float:
    s, unit = ctx.shape, ctx.hw.device
    traffic = rows * elementwise_bytes(
        s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, _intermediate(s), ctx.dtype_bytes
    )
    if curve := unit.elementwise_curve.get(ctx.dtype):
        return traffic / curve_rate(curve, rows)
    return traffic / unit.memory_bandwidth


def _step(
    ctx: Context, cand: Candidate, context: int, prefill: bool, prompt_len: int, cold: bool = False
) -> dict[str, float]:
    """Seconds one step keeps each resource busy, summed over layers; its wall time the busiest resource's sum (the
    layers off the device are spread through the model, Policy.fill, so each is read and copied while the layers
    before it compute) and what waits in series (expert reads a layer cannot start before its routing). `cold`: the
    expert cache holds nothing yet (the first step)."""
    s = ctx.shape
    micro_batches = cand.micro_batches if prefill else cand.decode_micro_batches(prompt_len)
    seqs = -(-cand.batch // micro_batches)
    total = {"disk": 0.0, "link": 0.0, "compute": 0.0, "host": 0.0, "wall": 0.0}
    overlapped = {"disk": 0.0, "link": 0.0, "compute": 0.0, "host": 0.0}
    for tier, count in zip(Tier, cand.policy.counts, strict=True):
        if not count:
            continue
        busy = _layer_step(ctx, cand, tier, micro_batches, seqs, context, prefill, cold=cold)
        serial = {"disk": busy.pop("serial", 0.0), "link": busy.pop("serial_link", 0.0)}
        reads = busy.pop("reads", 0.0)
        for k, v in busy.items():
            total[k] += count * (v + serial.get(k, 0.0))
            overlapped[k] += count * v
        total["disk"] += count * max(reads - serial["disk"], 0.0)  # expert reads the compute hid: busy, not waited
        total["wall"] += count * sum(serial.values())
    total["wall"] += max(overlapped.values())
    if cand.policy.embed_tier == Tier.NVME:  # the step's token rows, read before the first layer (whole 4 KiB blocks)
        tokens = cand.batch * (prompt_len if prefill else 1)
        row = -(-ctx.embed_row_bytes // 4096) * 4096
        reading = min(tokens, s.vocab_size) * row / ctx.hw.disk_read
        total["disk"] += reading
        total["wall"] += reading
    # head: final norm + LM head on the last token of each sequence (resident on the device)
    head_params = s.vocab_size * s.hidden_size
    bits = ctx.held_bits("embed_bits" if s.tie_word_embeddings else "head_bits")  # a tied head is the table
    held = head_params * bits / 8 if bits else head_params * ctx.dtype_bytes
    kernel = ctx.quant_kernel(4, decode=not prefill) if bits else None  # a GGUF file's blocks, through their kernel
    head = gemm_seconds(ctx.hw.device, ctx.dtype, head_params, held, cand.batch, ctx.on_cpu and not bits, kernel)
    total["compute"] += head
    total["wall"] += head
    return total


def decode_step_seconds(ctx: Context, cand: Candidate, context: int, prompt_len: int) -> float:
    """Wall seconds of one decode step of `cand`'s batch at a context of `context` tokens."""
    return _step(ctx, cand, context, False, prompt_len)["wall"]


def tier_memory(ctx: Context, cand: Candidate, workload: Workload) -> dict[str, int]:
    """Peak bytes `cand` holds per tier: weights, KV cache, activations, ring and staging buffers."""
    s = ctx.shape
    n_dev, n_host, n_disk = cand.policy.counts
    ring = cand.policy.ring_slots
    w = ctx.placed_bytes(cand)
    kv = cand.batch * ctx.kv_bytes(workload.prompt_len + workload.gen_len, cand.kv_bits)
    rows = cand.micro_batch * workload.prompt_len  # the prefill micro-batch sets the activation peak
    # live in a layer: input, q/k/v, attention output, gate and up (and their product), all in compute dtype,
    # plus the hidden states every micro-batch keeps between layers and the float32 logits of the last tokens
    per_token = 3 * s.hidden_size + s.num_heads * s.head_dim * 2 + 2 * s.num_kv_heads * s.head_dim
    per_token += 3 * _intermediate(s)
    activations = rows * per_token * ctx.dtype_bytes
    activations += cand.batch * workload.prompt_len * s.hidden_size * ctx.dtype_bytes
    activations += cand.batch * s.vocab_size * 4
    embed = ctx.embed_bytes
    host = 0
    if cand.policy.embed_tier == Tier.NVME:  # only a read buffer: on the device's own memory, or pinned host RAM
        embed = 0
        if ctx.on_cpu:
            embed = embed_read_buffer(ctx.embed_row_bytes)
        else:
            host = embed_read_buffer(ctx.embed_row_bytes)
    device = embed + ctx.head_bytes + n_dev * w + activations + cand.expert_cache
    if ctx.ring_layers(cand.policy):
        device += ring * w
    host += (n_host * w if n_host else 0) + (ring * w if n_disk and not ctx.on_cpu else 0)
    host += cand.expert_cache if not ctx.on_cpu else 0  # on CUDA, as many experts again in pinned host RAM
    if cand.kv_tier == Tier.DEVICE:
        device += kv
    else:
        host += kv
    disk = n_disk * w if cand.weight_bits < 8 * ctx.dtype_bytes else 0  # a quantized copy to stream from
    return {Tier.DEVICE: int(device), Tier.HOST: int(host), "disk": int(disk)}


def _intermediate(s: ModelSpec) -> int:
    """The MLP width, recovered from the active parameter count (attention and norms removed)."""
    attn = s.hidden_size * s.num_heads * s.head_dim * 2 + s.hidden_size * s.num_kv_heads * s.head_dim * 2
    return max((s.params.active_layer - attn) // (3 * s.hidden_size), s.hidden_size)


def predict(
    shape: ModelSpec,
    hw: HardwareProfile,
    workload: Workload,
    cand: Candidate,
    *,
    dtype: str | None = None,
    budgets: Budgets = Budgets(),
    block_size: int = BLOCK_SIZE,
    kv_group: int = KV_GROUP_SIZE,
) -> Prediction:
    """Time and memory of `cand` on `hw` for `workload`, its streamed layers passing through its policy's ring."""
    ctx = make_context(shape, hw, dtype, block_size, kv_group)
    placed, ring = len(cand.policy.layer_tiers), cand.policy.ring_slots
    if placed != shape.num_layers:
        raise ValueError(f"candidate places {placed} layers, the model has {shape.num_layers}")
    if ctx.ring_layers(cand.policy) and ring < 2:
        raise ValueError(f"candidate streams layers through the device ring: it needs at least 2 slots, got {ring}")
    prefill = _step(ctx, cand, workload.prompt_len, True, workload.prompt_len)
    first = _step(ctx, cand, workload.prompt_len, True, workload.prompt_len, cold=True) if cand.expert_cache else None
    resources = {k: v for k, v in prefill.items() if k != "wall"}
    decode_wall = 0.0
    for i in range(1, workload.gen_len):
        step = _step(ctx, cand, workload.prompt_len + i, False, workload.prompt_len)
        decode_wall += step["wall"]
        for k in resources:
            resources[k] += step[k]
    requests = workload.requests if workload.requests is not None else cand.batch
    rounds = -(-requests // cand.batch)
    memory = tier_memory(ctx, cand, workload)
    return Prediction(
        candidate=cand,
        prefill_seconds=prefill["wall"],
        first_prefill_seconds=first["wall"] if first else None,
        decode_seconds=decode_wall,
        rounds=rounds,
        generated_tokens=requests * workload.gen_len,
        memory=memory,
        overflow=_overflow(ctx, memory, budgets),
        resources=resources,
        unsupported=_unsupported(ctx, cand),
    )


def make_context(
    shape: ModelSpec, hw: HardwareProfile, dtype: str | None, block: int, kv_group: int = KV_GROUP_SIZE
) -> Context:
    """What every prediction for this model on this machine shares; fails early, in one line, on a bad dtype."""
    dtype = dtype or shape.dtype
    if dtype not in DTYPE_BYTES:
        raise OffloadError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    matmul_rate(hw.device, dtype, 1)  # fails early, naming the dtype, when the device has no such GEMM
    return Context(shape, hw, dtype, DTYPE_BYTES[dtype], block, kv_group)


def capacity(hw: HardwareProfile, budgets: Budgets) -> dict[str, int]:
    """Bytes each tier may hold: the budgets, else the profile's memories (on a CPU machine the host tier gets
    what RAM the device arena leaves)."""
    device = budgets.device if budgets.device is not None else hw.device.memory
    host = budgets.host if budgets.host is not None else hw.host.memory
    if hw.device_kind == "cpu" and budgets.host is None:
        host = max(hw.host.memory - device, 0)  # one RAM holds both the device arena and the host tier
    return {Tier.DEVICE: device, Tier.HOST: host}


def _overflow(ctx: Context, memory: dict[str, int], budgets: Budgets) -> dict[str, int]:
    cap = capacity(ctx.hw, budgets)
    return {t: memory[t] - cap[t] for t in cap if memory[t] > cap[t]}


def _unsupported(ctx: Context, cand: Candidate) -> tuple[str, ...]:
    missing = []  # 8- and 4-bit weights run from a checkpoint `offload convert` wrote
    if cand.kv_bits < 8 * ctx.dtype_bytes and cand.kv_bits not in (8, 4):
        missing.append(f"{cand.kv_bits}-bit KV cache")  # --kv-dtype int8 and int4 run
    if ctx.shape.architecture == GPT_OSS and cand.weight_bits < 8 * ctx.dtype_bytes:
        missing.append("int4/int8 weights for gpt-oss (offload convert --quant mxfp4 writes its experts' format)")
    return tuple(missing)


def mixed_step_seconds(
    ctx: Context, cand: Candidate, decode_seqs: int, context: int, prefills: int, prompt_len: int
) -> float:
    """Wall seconds of one step of a continuous batch: `decode_seqs` sequences decoding one token each at a context
    of `context` tokens, and `prefills` prompts of `prompt_len` tokens computed whole, in one pass over the weights
    (what the engine's steps are once requests arrive one by one). Per layer, the weights are read once for both;
    their compute adds up."""
    s = ctx.shape
    wall = 0.0
    for tier, count in zip(Tier, cand.policy.counts, strict=True):
        if not count:
            continue
        parts = []
        decode_mb = cand.decode_micro_batches(prompt_len)
        decode_rows = -(-decode_seqs // decode_mb) if decode_seqs else 0
        if decode_seqs:  # the floor is the whole layer's: counted once, by the prefill part where there is one
            floor_rows = 0 if prefills else None
            parts.append(_layer_step(ctx, cand, tier, decode_mb, decode_rows, context, False, floor_rows))
        if prefills:
            mb = min(cand.micro_batches, prefills)
            rows = -(-prefills // mb)
            parts.append(_layer_step(ctx, cand, tier, mb, rows, prompt_len, True, rows * prompt_len + decode_rows))
        if not parts:
            continue
        compute = sum(p["compute"] for p in parts)
        host = sum(p["host"] for p in parts)
        serial = sum(p.get("serial", 0.0) + p.get("serial_link", 0.0) for p in parts)
        reads = max(max(p["disk"] for p in parts), max(p["link"] for p in parts))
        wall += count * (max(compute, host, reads) + serial)
    rows = decode_seqs + prefills
    if cand.policy.embed_tier == Tier.NVME:
        tokens = decode_seqs + prefills * prompt_len
        wall += min(tokens, s.vocab_size) * (-(-ctx.embed_row_bytes // 4096) * 4096) / ctx.hw.disk_read
    head_params = s.vocab_size * s.hidden_size
    wall += gemm_seconds(ctx.hw.device, ctx.dtype, head_params, head_params * ctx.dtype_bytes, rows, ctx.on_cpu)
    return wall
