"""DeepSeek-V2 and DeepSeek-V3 (and Kimi-K2, which is DeepSeek-V3's architecture): multi-head latent attention and
a mixture of fine-grained experts with shared experts, after `first_k_dense_replace` dense layers.

Attention (MLA), per token x, as transformers' DeepseekV3Attention computes it:

    q = q_b(norm(q_a(x)))                       [heads, nope + rope]   (q_proj(x) where q_lora_rank is null)
    latent, k_rope = kv_a(x)                    [kv_rank], [rope]: the latent normalized, k_rope shared by every head
    k_nope, v = kv_b(latent)                    [heads, nope], [heads, v_dim]: decompressed per head
    q_rope, k_rope rotated                      (pairs interleaved: DeepSeek-V2, and V3's rope_interleave)

The cache holds [latent, k_rope] (kv_rank + rope values a token and layer: ModelSpec.mla.width) and nothing else.
- A step of one query per sequence (decode) attends in the latent space: kv_b's key part is absorbed into the query
  (q_nope -> W_uk^T q_nope, kv_rank wide) and its value part applied to the output, so attention reads each cached
  vector once for all heads (kernels/latent_attention.py).
- Any other step (prefill, a prefill chunk beside decode tokens) decompresses each sequence's context into per-head
  keys and values and attends over them, as transformers does.
The softmax scale is (nope + rope) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where configured.
Rotated pairs are reordered (evens, then odds) before the rotation: the same permutation of q's and k's rope dims
leaves their dot products as transformers computes them.

The mixture: routing by offload/model/moe.py's `route` as the spec's Routing says (DeepSeek-V3: sigmoid scores,
biased group-limited choice, scaled weights), each routed expert a SwiGLU read by expert (streamable), plus the
shared experts every token runs. The router is multiplied in float32, as transformers keeps it. kv_b is read whole
in the compute dtype (its short name is not a "*_proj": `offload convert` keeps it in float, as absorption needs).
The multi-token-prediction layers (num_nextn_predict_layers) are not read: decoding does not run them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.kernels.latent_attention import gather_context, latent_attention
from offload.kernels.paged_attention import PagedCache, attend_contiguous, visible_slots
from offload.kernels.paged_batch import PagedBatch
from offload.kernels.rotary import apply_rotary
from offload.model.llama import LlamaFamily, project, rms_norm, swiglu
from offload.model.moe import EXPERT_MATRICES, routed_experts, sub_weights
from offload.model.registry import LayerInput
from offload.tiers.weights.checkpoint import TensorSpec
from offload.tiers.weights.layout import Weights

UNPACKED = ("kv_b", "router")  # not multiplied through linear(): viewed per head, or cast to float32 first


class DeepseekFamily(LlamaFamily):
    tree_attention = False  # latent attention takes no tree mask: a draft tree is verified as its main chain

    def check(self, spec: ModelSpec, source: str) -> None:
        super().check(spec, source)
        if spec.mla is None:
            raise OffloadError(f"{source}: {spec.architecture} needs its latent attention widths (kv_lora_rank)")

    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, TensorSpec]:
        p, a = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn."
        h, m, heads = spec.hidden_size, spec.mla, spec.num_heads
        t = {
            "input_norm": TensorSpec(p + "input_layernorm.weight", (h,)),
            "kv_a_proj": TensorSpec(a + "kv_a_proj_with_mqa.weight", (m.width, h)),
            "kv_a_norm": TensorSpec(a + "kv_a_layernorm.weight", (m.kv_rank,)),
            "kv_b": TensorSpec(a + "kv_b_proj.weight", (heads * (m.nope_dim + m.v_dim), m.kv_rank)),
            "o_proj": TensorSpec(a + "o_proj.weight", (h, heads * m.v_dim)),
            "post_norm": TensorSpec(p + "post_attention_layernorm.weight", (h,)),
        }
        if m.q_rank:
            t["q_a_proj"] = TensorSpec(a + "q_a_proj.weight", (m.q_rank, h))
            t["q_a_norm"] = TensorSpec(a + "q_a_layernorm.weight", (m.q_rank,))
            t["q_b_proj"] = TensorSpec(a + "q_b_proj.weight", (heads * m.qk_dim, m.q_rank))
        else:
            t["q_proj"] = TensorSpec(a + "q_proj.weight", (heads * m.qk_dim, h))
        if not spec.sparse(layer):
            return t | _swiglu_tensors(p + "mlp.", "", spec.intermediate_size, h)
        t["router"] = TensorSpec(p + "mlp.gate.weight", (spec.num_experts, h))
        if spec.routing.score_bias:
            t["score_bias"] = TensorSpec(p + "mlp.gate.e_score_correction_bias", (spec.num_experts,))
        for e in range(spec.num_experts):
            t |= _swiglu_tensors(p + f"mlp.experts.{e}.", f"expert{e}.", spec.expert_size, h)
        return t | _swiglu_tensors(p + "mlp.shared_experts.", "shared.", spec.shared_expert_size, h)

    def packable(self, short: str) -> bool:
        return short not in UNPACKED

    def _attention(self, spec: ModelSpec, layer: int, w: Weights, x: torch.Tensor, inp: LayerInput) -> torch.Tensor:
        m, heads, tokens = spec.mla, spec.num_heads, x.shape[0]
        if "q_a_proj" in w:
            q_low = rms_norm(project(spec, w, "q_a_proj", x, ""), w["q_a_norm"], spec.rms_norm_eps)
            q = project(spec, w, "q_b_proj", q_low, "")
        else:
            q = project(spec, w, "q_proj", x, "")
        q_nope, q_rope = q.view(tokens, heads, m.qk_dim).split((m.nope_dim, m.rope_dim), dim=-1)
        latent, k_rope = project(spec, w, "kv_a_proj", x, "").split((m.kv_rank, m.rope_dim), dim=-1)
        latent = rms_norm(latent, w["kv_a_norm"], spec.rms_norm_eps)  # [tokens, kv_rank]
        if m.interleaved:
            q_rope, k_rope = _pairs_first(q_rope), _pairs_first(k_rope)
        q_rope, k_rope = apply_rotary(q_rope.contiguous(), k_rope[:, None].contiguous(), inp.cos, inp.sin)
        cached = torch.cat((latent, k_rope[:, 0]), dim=-1)[:, None]  # [tokens, 1, width]
        cache, batch = inp.kv.k, inp.batch
        inp.kv.write(batch.slot_mapping, cached.to(inp.kv.device))
        if inp.staging is not None:  # a host-resident cache's blocks, copied to the compute device
            cache, batch = inp.staging.gather(cache, x.device), inp.staging.batch
        kv_b = w["kv_b"].view(heads, m.nope_dim + m.v_dim, m.kv_rank)
        scale = softmax_scale(spec)
        if batch.query_start[-1] == batch.num_seqs:  # one query per sequence: in the latent space
            out = absorbed(spec, q_nope, q_rope, cache, batch, kv_b, scale)
        else:
            out = decompressed(spec, torch.cat((q_nope, q_rope), dim=-1), cache, batch, kv_b, scale)
        return project(spec, w, "o_proj", out.reshape(tokens, heads * m.v_dim), "")

    def _mlp(
        self, spec: ModelSpec, layer: int, w: Weights, x: torch.Tensor, inp: LayerInput, hidden: torch.Tensor
    ) -> torch.Tensor:
        if not spec.sparse(layer):
            return swiglu(spec, w, x)
        # transformers weighs the experts' outputs in float32 (its routing weights' dtype)
        out = routed_experts(spec, w, x, inp.experts, hidden, torch.float32)
        return out + swiglu(spec, sub_weights(w, "shared."), x)


def _swiglu_tensors(prefix: str, short: str, width: int, hidden: int) -> dict[str, TensorSpec]:
    shapes = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
    return {short + m: TensorSpec(prefix + m + ".weight", shapes[m]) for m in EXPERT_MATRICES}


def softmax_scale(spec: ModelSpec) -> float:
    """(nope + rope) ** -0.5, times YaRN's mscale squared where the config gives mscale_all_dim (transformers'
    yarn_apply_mscale)."""
    scale = spec.mla.qk_dim**-0.5
    rope = spec.rope
    if rope.kind != "default" and rope.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def _pairs_first(x: torch.Tensor) -> torch.Tensor:
    """x [..., rope] with its interleaved pairs' first members, then their second: rotate-half order."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def absorbed(
    spec: ModelSpec,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor | PagedCache,
    batch: PagedBatch,
    kv_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention in the latent space: q_nope [tokens, heads, nope] through kv_b's key part [heads, nope, kv_rank]
    into the latent's width, beside q_rope [tokens, heads, rope]; attended over the cached vectors where the cache
    lives; the latent outputs through kv_b's value part -> [tokens, heads, v_dim]."""
    m = spec.mla
    q_latent = torch.bmm(q_nope.transpose(0, 1), kv_b[:, : m.nope_dim])  # [heads, tokens, kv_rank]
    q_abs = torch.cat((q_latent.transpose(0, 1), q_rope), dim=-1)  # [tokens, heads, width]
    o_latent = latent_attention(q_abs.to(cache.device), cache, batch, scale, m.kv_rank).to(q_nope.device)
    out = torch.bmm(o_latent.transpose(0, 1), kv_b[:, m.nope_dim :].transpose(1, 2))  # [heads, tokens, v_dim]
    return out.transpose(0, 1)


def decompressed(
    spec: ModelSpec,
    q: torch.Tensor,
    cache: torch.Tensor | PagedCache,
    batch: PagedBatch,
    kv_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each sequence's queries q [tokens, heads, nope + rope] over its context's keys and values decompressed from
    the cached latents through kv_b [heads, nope + v_dim, kv_rank] -> [tokens, heads, v_dim]."""
    m, heads = spec.mla, spec.num_heads
    out = q.new_empty(q.shape[0], heads, m.v_dim)
    for s in range(batch.num_seqs):
        q0, q1, ctx = batch.query_start[s], batch.query_start[s + 1], batch.context_lens[s]
        c = gather_context(cache, batch, s)[:, 0].to(q.device)  # [ctx, width]
        kv = F.linear(c[:, : m.kv_rank], kv_b.flatten(0, 1)).view(ctx, heads, m.nope_dim + m.v_dim)
        k_nope, v = kv.split((m.nope_dim, m.v_dim), dim=-1)
        k = torch.cat((k_nope, c[:, None, m.kv_rank :].expand(ctx, heads, m.rope_dim)), dim=-1)
        mask = None if q1 - q0 == ctx else visible_slots(ctx, q1 - q0, None, q.device)
        out[q0:q1] = attend_contiguous(q[q0:q1], k, v, scale, mask)
    return out


FAMILY = DeepseekFamily()
