"""Rates of the engine's own compute paths on one device, each the median of timed runs: memory copies, GEMMs
through offload.kernels.linear, the rest of a decoder layer (its non-GEMM work through the Llama layer's functions,
and attention through offload.kernels.paged_attention), and pinned host<->device copies. `offload probe` builds a
hardware profile from them; each rate is in the units the cost model prices that work in.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from offload.common.config import BLOCK_SIZE
from offload.common.hardware import ComputeUnit

MIN_REPEATS = 3  # timed runs per measurement, after one warm-up run


class LayerShape(NamedTuple):
    """The decoder layer the rest-of-layer measurements run: Llama's proportions for a hidden size."""

    heads: int  # query heads of head_dim
    kv_heads: int  # a quarter as many
    intermediate: int  # MLP width, 11/4 of hidden (TinyLlama's 5632 for 2048)


def layer_shape(hidden: int, head_dim: int) -> LayerShape:
    return LayerShape(hidden // head_dim, hidden // head_dim // 4, hidden * 11 // 4)


def measure_copy(device: torch.device, nbytes: int, min_seconds: float = 0.2) -> float:
    """Memory bandwidth in bytes/s: a `nbytes` tensor copy moves 2 * nbytes (read + write)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / typical_seconds(lambda: dst.copy_(src), device, min_seconds)


def measure_matmul(
    device: torch.device,
    dtype: str,
    rows: tuple[int, ...],
    k: int,
    n: int,
    min_seconds: float = 0.2,
    weight_pool_bytes: int = 0,
    packed: bool = False,
) -> tuple[tuple[int, float], ...]:
    """((rows, FLOP/s), ...) of kernels.linear for [rows, k] x [k, n] in `dtype`; successive products cycle
    through copies of the weight that together take at least `weight_pool_bytes`. `packed`: the copies packed for
    the CPU's GEMM (kernels.linear.pack_weight), as the engine keeps its resident layers."""
    from offload.kernels.linear import linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    w = torch.randn(n, k, generator=gen).to(device=device, dtype=dt)  # [n, k]
    pool = [w] + [w.clone() for _ in range(1, -(-weight_pool_bytes // (w.numel() * w.element_size())))]
    if packed:
        pool = [pack_weight(copy) for copy in pool]
    weights = itertools.cycle(pool)
    x_all = torch.randn(rows[-1], k, generator=gen).to(device=device, dtype=dt)  # [max rows, k]
    curve = []
    for r in rows:
        x = x_all[:r]  # [r, k]
        seconds = typical_seconds(lambda x=x: linear(x, next(weights)), device, min_seconds)
        curve.append((r, 2 * r * k * n / seconds))
    return tuple(curve)


def measure_quantized_matmul(
    kind: str, rows: tuple[int, ...], hidden: int, inter: int, min_seconds: float = 0.2, weight_pool_bytes: int = 0
) -> tuple[tuple[int, float], ...]:
    """((rows, FLOP/s), ...) of the engine's quantized products of bfloat16 rows on the CPU, an MLP's two shapes
    together ([rows, hidden] x [hidden, inter], then [rows, inter] x [inter, hidden]: the matrices most of a model's
    bytes are in, and a kernel's rate differs between them by a fifth), the FLOPs counted as the dense product's:
    `kind` "int4" (codes in groups of 32 in torch's CPU packing, through kernels/quant_linear.py and the paths
    kernels/choice.py timed) or "gguf" (Q4_0 blocks as a GGUF file holds them, through kernels/gguf_linear.py), or
    "gguf_decode" (the same as a decode step's rows: kernels/choice.py's decode_rows).
    Weight copies are cycled as measure_matmul's, each shape's in half of `weight_pool_bytes`."""
    x_all = torch.randn(rows[-1], max(hidden, inter), generator=torch.Generator().manual_seed(0)).bfloat16()
    shapes = [_quantized_weights(kind, n, k, weight_pool_bytes // 2) for n, k in ((inter, hidden), (hidden, inter))]
    curve = []
    for r in rows:
        seconds = 0.0
        for (product, weights), k in zip(shapes, (hidden, inter), strict=True):
            x = x_all[:r, :k].contiguous()  # [r, k]
            call = lambda x=x, p=product, w=weights: p(x, next(w))  # noqa: E731
            seconds += typical_seconds(call, torch.device("cpu"), min_seconds)
        curve.append((r, 2 * 2 * r * hidden * inter / seconds))
    return tuple(curve)


def _quantized_weights(kind: str, n: int, k: int, pool_bytes: int) -> tuple[Callable, Iterator]:
    """The product for `kind`, and its copies of a random W [n, k] in that format, cycled, `pool_bytes` in all."""
    from offload.common.quant import WeightQuant
    from offload.kernels.gguf_linear import gguf_linear
    from offload.kernels.quant_linear import quant_linear, to_cpu_layout

    gen = torch.Generator().manual_seed(0)
    if kind == "int4":
        fmt = WeightQuant(4, 32, "cpu")
        codes = to_cpu_layout(torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8), 4)
        scales = (torch.rand(k // 32, n, 2, generator=gen) * 0.02).to(torch.bfloat16)  # [groups, n, scale/zero]
        weight, nbytes = (codes, scales), codes.numel() + 2 * scales.numel()
        product = lambda x, w: quant_linear(x, w[0], w[1], fmt)  # noqa: E731
    elif kind in ("gguf", "gguf_decode"):
        blocks = torch.randint(0, 256, (n, k // 32, 18), generator=gen, dtype=torch.uint8)  # [n, blocks, 2 + 16]
        scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).to(torch.float16)
        blocks[..., :2] = scale.view(torch.uint8)  # each block's f16 scale, then its 32 codes in 16 bytes
        weight, nbytes = blocks, blocks.numel()
        product = gguf_linear if kind == "gguf" else _decoding(gguf_linear)
    else:
        raise ValueError(f"unknown quantized kind {kind!r} (known: int4, gguf, gguf_decode)")
    clone = (lambda w: tuple(t.clone() for t in w)) if kind == "int4" else torch.clone
    copies = [weight] + [clone(weight) for _ in range(1, -(-pool_bytes // nbytes))]
    return product, itertools.cycle(copies)


def _decoding(product: Callable) -> Callable:
    """`product` called on a decode step's rows (kernels/choice.py's decode_rows)."""
    from offload.kernels.choice import decode_rows

    def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with decode_rows(True):
            return product(x, w)

    return call


def measure_elementwise(
    device: torch.device, dtype: str, rows: tuple[int, ...], hidden: int, head_dim: int, min_seconds: float = 0.2
) -> tuple[tuple[int, float], ...]:
    """((rows, bytes/s), ...) of a layer's non-GEMM work, as the engine's Llama layer does it: the input norm,
    rotary embedding of q and k, the KV-cache write, a residual add, the post-attention norm, SiLU(gate) * up and
    the second residual add; bytes as scheduler.cost.gemm_rates.elementwise_bytes counts them."""
    from offload.model.llama import rms_norm
    from offload.model.rope import apply_rope
    from offload.scheduler.cost.gemm_rates import elementwise_bytes

    heads, kv_heads, inter = layer_shape(hidden, head_dim)
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    n = rows[-1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    x, attn_out, down_out = rand(n, hidden), rand(n, hidden), rand(n, hidden)  # [n, hidden]
    q, k, v = rand(n, heads, head_dim), rand(n, kv_heads, head_dim), rand(n, kv_heads, head_dim)
    cos, sin = rand(n, head_dim), rand(n, head_dim)  # [n, head_dim]
    gate, up = rand(n, inter), rand(n, inter)  # [n, inter]
    norm_weight = torch.ones(hidden, device=device, dtype=dt)
    k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)  # one slot per row, in a shuffled order
    slots = torch.randperm(n, generator=gen).to(device)

    def rest(r: int) -> torch.Tensor:
        rms_norm(x[:r], norm_weight, 1e-5)
        q_rot, k_rot = apply_rope(q[:r], cos[:r], sin[:r]), apply_rope(k[:r], cos[:r], sin[:r])
        k_cache[slots[:r]] = k_rot
        v_cache[slots[:r]] = v[:r]
        h = x[:r] + attn_out[:r]
        rms_norm(h, norm_weight, 1e-5)
        F.silu(gate[:r]) * up[:r]
        return h + down_out[:r] + q_rot[:, 0, :1]  # q_rot used, so nothing is skipped

    per_row = elementwise_bytes(hidden, heads * head_dim, kv_heads * head_dim, inter, dt.itemsize)
    return tuple((r, r * per_row / typical_seconds(lambda r=r: rest(r), device, min_seconds)) for r in rows)


def measure_attention(
    device: torch.device,
    dtype: str,
    lengths: tuple[int, ...],
    hidden: int,
    head_dim: int,
    prefill_tokens: int,
    decode_seqs: int,
    min_seconds: float = 0.2,
    block_size: int = BLOCK_SIZE,
) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]]:
    """Through kernels.paged_attention over a paged cache whose blocks are scattered: ((prompt tokens, FLOP/s), ...)
    of causal attention over whole prompts of each length (as many prompts as fill `prefill_tokens`), and
    ((context tokens, bytes/s), ...) of one decode query for each of `decode_seqs` sequences over a cache of that
    length (the K and V bytes of the context per second). FLOPs as the cost model counts them: 2 x (QK + PV) over
    half of the square."""
    from offload.kernels.paged_attention import paged_attention
    from offload.kernels.paged_batch import PagedBatch

    heads, kv_heads, _ = layer_shape(hidden, head_dim)
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    scale = head_dim**-0.5

    def step(query_lens: list[int], context: int) -> Callable[[], torch.Tensor]:
        per_seq = -(-context // block_size)
        blocks = torch.randperm(len(query_lens) * per_seq, generator=gen)  # scattered, as after many steps
        tables = blocks.view(len(query_lens), per_seq)  # [seqs, blocks per sequence]
        positions = [torch.arange(context - n, context) for n in query_lens]
        slots = torch.cat(
            [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, positions, strict=True)]
        )
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        batch = PagedBatch(tuple(starts), (context,) * len(query_lens), tables.to(device), slots.to(device))
        cache = (blocks.numel(), block_size, kv_heads, head_dim)
        k_cache = torch.randn(cache, generator=gen).to(device=device, dtype=dt)
        v_cache = torch.randn(cache, generator=gen).to(device=device, dtype=dt)
        q = torch.randn(starts[-1], heads, head_dim, generator=gen).to(device=device, dtype=dt)
        return lambda: paged_attention(q, k_cache, v_cache, batch, scale)

    prefill, decode = [], []
    for n in lengths:
        seqs = max(prefill_tokens // n, 1)
        flops = seqs * 2.0 * (2 * heads * head_dim) * n * n / 2
        prefill.append((n, flops / typical_seconds(step([n] * seqs, n), device, min_seconds)))
        kv_bytes = decode_seqs * n * 2 * kv_heads * head_dim * dt.itemsize
        decode.append((n, kv_bytes / typical_seconds(step([1] * decode_seqs, n), device, min_seconds)))
    return tuple(prefill), tuple(decode)


def measure_layer_floor(
    device: torch.device, dtype: str, min_seconds: float = 0.2, seqs: int = 1, tokens: int = 1
) -> float:
    """Seconds the engine's Llama layer takes for `tokens` new tokens of each of `seqs` sequences of a tiny model
    (tiny_model_config: hidden 256, 4 heads of 64, one K/V head, MLP 704), each sequence's cache holding 16 tokens
    or its new ones if more: at one token about what any layer costs however small, its calls' dispatch rather than
    bytes or FLOPs (on this project's 2-core VMs a [1, 64] x [64, 64] product took 7 us, [1, 256] x [256, 256]
    28 us, and such a layer 0.6 ms)."""
    from offload.common.model_config import parse_model_config
    from offload.kernels.paged_batch import PagedBatch
    from offload.model.llama import FAMILY
    from offload.model.registry import LayerInput
    from offload.model.rope import cos_sin, inverse_frequencies
    from offload.tiers.kv.kv_cache import KVLayer

    spec = parse_model_config(tiny_model_config(dtype, layers=1), "the probe's tiny layer")
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    weights = {
        name: (torch.randn(t.shape, generator=gen) * 0.05).to(device=device, dtype=dt)
        for name, t in FAMILY.layer_tensors(spec, 0).items()
    }
    context = max(tokens, BLOCK_SIZE)
    blocks = -(-context // BLOCK_SIZE)  # per sequence
    cache = torch.zeros(seqs * blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, device=device, dtype=dt)
    tables = torch.arange(seqs * blocks, device=device).reshape(seqs, blocks)
    positions = torch.arange(context - tokens, context, device=device).repeat(seqs)  # each sequence's new tokens
    slots = tables.gather(1, (positions // BLOCK_SIZE).reshape(seqs, tokens)).flatten() * BLOCK_SIZE
    batch = PagedBatch(
        tuple(range(0, seqs * tokens + 1, tokens)), (context,) * seqs, tables, slots + positions % BLOCK_SIZE
    )
    cos, sin = cos_sin(inverse_frequencies(spec.rope, spec.head_dim), positions, dt)
    inp = LayerInput(cos, sin, batch, KVLayer(cache, cache.clone()))
    hidden = torch.randn(seqs * tokens, spec.hidden_size, generator=gen).to(device=device, dtype=dt)
    return typical_seconds(lambda: FAMILY.layer(spec, 0, weights, hidden, inp), device, min_seconds)


FLOOR_PROMPT = 128  # the floor curve's rows are prompts of up to this many tokens


def measure_layer_floor_curve(
    device: torch.device, dtype: str, rows: tuple[int, ...], min_seconds: float = 0.2
) -> tuple[tuple[int, float], ...]:
    """((rows, rows/s), ...): the tiny layer of measure_layer_floor run on each number of rows, as prompts of up to
    FLOOR_PROMPT tokens (one prompt of `rows` tokens up to that, then `rows` / FLOOR_PROMPT of them): what a layer
    costs at the least for that many rows, however small its matrices. At 128 rows the tiny layer took 1.7 ms on
    this project's 2-core VMs, where the rates measured on 2048-wide matrices priced a 256-wide layer at 0.8."""
    shapes = {}  # rows -> (prompts, tokens each); rows that round to the same count are measured once
    for r in rows:
        seqs = -(-r // FLOOR_PROMPT)
        shapes[seqs * (r // seqs)] = (seqs, r // seqs)
    return tuple(
        (n, n / measure_layer_floor(device, dtype, min_seconds, seqs, tokens))
        for n, (seqs, tokens) in sorted(shapes.items())
    )


def tiny_model_config(dtype: str, layers: int) -> dict:
    """config.json of the probe's tiny Llama (TINY_LAYER's shape, a 256-token vocabulary)."""
    shape = layer_shape(256, 64)  # 4 heads, one K/V head, MLP 704
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 256,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": 1024,
        "torch_dtype": dtype,
    }


def measure_links(device: torch.device, nbytes: int, min_seconds: float = 0.2) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes/s of copies between pinned host memory and `device`."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / typical_seconds(lambda: dev.copy_(host, non_blocking=True), device, min_seconds)
    d2h = nbytes / typical_seconds(lambda: host.copy_(dev, non_blocking=True), device, min_seconds)
    return h2d, d2h


def typical_seconds(fn: Callable[[], object], device: torch.device, min_seconds: float) -> float:
    """Median wall time of `fn` over at least MIN_REPEATS runs and `min_seconds`, after one warm-up. The median,
    not the shortest: a rate the engine sustains (on this project's shared VMs a probe taking the shortest runs
    once rated bf16 products at 512 rows 2.3x faster than at 2048, a brief fast spell the engine never saw)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times: list[float] = []
    while len(times) < MIN_REPEATS or (sum(times) < min_seconds and len(times) < 100):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_expert_units(
    device: torch.device, dtype: str, hidden: int, width: int, min_seconds: float = 0.05
) -> tuple[ComputeUnit, ComputeUnit, float]:
    """(host, device, host-to-device bytes/s), measured now at one routed expert's shape ([rows, hidden] x [hidden,
    width]), for pricing where a cold expert runs when no saved CUDA profile has these rates: each processor's GEMM
    curve over EXPERT_ROWS rows and its memory bandwidth, and the link for one expert's bytes. About a second."""
    dt = getattr(torch, dtype)

    def unit(where: torch.device) -> ComputeUnit:
        curve = measure_matmul(where, dtype, EXPERT_ROWS, hidden, width, min_seconds)
        bandwidth = measure_copy(where, 1 << 26, min_seconds)
        return ComputeUnit(
            memory=0,
            memory_bandwidth=bandwidth,
            matmul_flops={dtype: max(r for _, r in curve)},
            matmul_curve={dtype: curve},
        )

    h2d, _ = measure_links(device, 3 * hidden * width * dt.itemsize, min_seconds)
    return unit(torch.device("cpu")), unit(device), h2d


EXPERT_ROWS = (1, 4, 16, 64, 256)  # the token counts a cold expert's price is measured at
