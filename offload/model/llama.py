"""The Llama family: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Pre-norm decoder layers: RMSNorm -> grouped-query attention with RoPE -> residual, RMSNorm -> SwiGLU
MLP -> residual. Numerics follow the Hugging Face reference: norms in float32, everything else in the
compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.kernels.activation import silu_mul
from offload.kernels.gguf_linear import (
    DENSE_FROM_ROWS,
    EXPERT_DENSE_FROM_ROWS,
    gguf_linear,
    gguf_logits,
    gguf_rows,
    is_blocks,
)
from offload.kernels.linear import linear, logits
from offload.kernels.paged_attention import paged_attention
from offload.kernels.quant_linear import SCALES_SUFFIX, quant_linear, stack_outputs
from offload.kernels.rms_norm import fused_rms_norm
from offload.kernels.rotary import apply_rotary, apply_rotary_heads
from offload.model.registry import LayerInput
from offload.tiers.weights.checkpoint import TensorSpec
from offload.tiers.weights.layout import Weights

ROPE_KINDS = ("default", "linear", "llama3", "yarn")  # what offload/model/rope.py computes
# projections of one input that run as one product where a layer's weights are held whole (`LlamaFamily.fuse`):
# the stacked matrix's name -> its parts' and their biases' names. One call instead of three (two) at decode sizes
# saves the dispatch of each: SmolLM2's q, k and v at one row took 33 us as three int4 products, 22 as one (gate and
# up, 63 and 56), on a 2-core EPYC
FUSED = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), ("q_bias", "k_bias", "v_bias")),
    "gate_up_proj": (("gate_proj", "up_proj"), ("gate_bias", "up_bias")),
}
FUSED_BIAS = {"qkv_proj": "qkv_bias", "gate_up_proj": "gate_up_bias"}


class LlamaFamily:
    tree_attention = True  # paged attention with PagedBatch.trees' masks

    def check(self, spec: ModelSpec, source: str) -> None:
        if spec.rope is None or spec.rope.kind not in ROPE_KINDS:
            kind = spec.rope.kind if spec.rope else "learned positions"
            raise OffloadError(f"{source}: rope_type {kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")

    def embed_tensors(self, spec: ModelSpec) -> dict[str, TensorSpec]:
        return {"embed": TensorSpec("model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size))}

    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, TensorSpec]:
        p = f"model.layers.{layer}."
        h, i, q, kv, d = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size, spec.head_dim
        t = {
            "input_norm": TensorSpec(p + "input_layernorm.weight", (h,)),
            "q_proj": TensorSpec(p + "self_attn.q_proj.weight", (q, h)),
            "k_proj": TensorSpec(p + "self_attn.k_proj.weight", (kv, h)),
            "v_proj": TensorSpec(p + "self_attn.v_proj.weight", (kv, h)),
            "o_proj": TensorSpec(p + "self_attn.o_proj.weight", (h, q)),
            "post_norm": TensorSpec(p + "post_attention_layernorm.weight", (h,)),
            "gate_proj": TensorSpec(p + "mlp.gate_proj.weight", (i, h)),
            "up_proj": TensorSpec(p + "mlp.up_proj.weight", (i, h)),
            "down_proj": TensorSpec(p + "mlp.down_proj.weight", (h, i)),
        }
        if spec.qkv_bias:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                t[f"{name}_bias"] = TensorSpec(p + f"self_attn.{name}_proj.bias", (size,))
        if spec.o_bias:
            t["o_bias"] = TensorSpec(p + "self_attn.o_proj.bias", (h,))
        if spec.mlp_bias:
            for name, size in (("gate", i), ("up", i), ("down", h)):
                t[f"{name}_bias"] = TensorSpec(p + f"mlp.{name}_proj.bias", (size,))
        if spec.qk_norm:
            t["q_norm"] = TensorSpec(p + "self_attn.q_norm.weight", (d,))
            t["k_norm"] = TensorSpec(p + "self_attn.k_norm.weight", (d,))
        return t

    def head_tensors(self, spec: ModelSpec) -> dict[str, TensorSpec]:
        lm_head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        return {
            "norm": TensorSpec("model.norm.weight", (spec.hidden_size,)),
            "lm_head": TensorSpec(lm_head, (spec.vocab_size, spec.hidden_size)),
        }

    def packable(self, short: str) -> bool:
        return True  # every matrix of the family is a linear weight [out, in]

    def fuse(self, spec: ModelSpec, w: Weights) -> Weights:
        """A layer's weights with each FUSED group of projections stacked into one matrix (new tensors; the parts
        leave the mapping), where all of a group's parts are present, stored alike (dtype, input features, the
        quantized layout's ability to stack them), and biased all or none. Other tensors are returned as given."""
        out = dict(w)
        for fused, (parts, biases) in FUSED.items():
            if not all(p in w for p in parts) or any(b in w for b in biases) and not all(b in w for b in biases):
                continue
            mats = [w[p] for p in parts]
            if len({(m.dtype, m.shape[1:], m.device) for m in mats}) != 1:
                continue
            scales = [w.get(p + SCALES_SUFFIX) for p in parts]
            if all(sc is None for sc in scales) and (mats[0].is_floating_point() or is_blocks(mats[0])):
                stacked = (torch.cat(mats),)
            elif all(sc is not None for sc in scales) and spec.quant is not None:
                if len({(sc.dtype, sc.shape[0], sc.shape[2:]) for sc in scales}) != 1:
                    continue
                if (stacked := stack_outputs(mats, scales, spec.quant)) is None:
                    continue
            else:
                continue
            for name in (*parts, *(p + SCALES_SUFFIX for p in parts), *biases):
                out.pop(name, None)
            out[fused] = stacked[0]
            if len(stacked) > 1:
                out[fused + SCALES_SUFFIX] = stacked[1]
            if biases[0] in w:
                out[FUSED_BIAS[fused]] = torch.cat([w[b] for b in biases])
        return out

    def embed(self, w: Weights, token_ids: torch.Tensor) -> torch.Tensor:
        if is_blocks(w["embed"]):  # a GGUF token table as the file holds it: float32 rows, the engine casts them
            return gguf_rows(w["embed"], token_ids)
        return F.embedding(token_ids, w["embed"])  # [tokens, hidden]

    def layer(self, spec: ModelSpec, layer: int, w: Weights, hidden: torch.Tensor, inp: LayerInput) -> torch.Tensor:
        # hidden: [tokens, hidden_size]
        x = rms_norm(hidden, w["input_norm"], spec.rms_norm_eps)
        attention = self._attention(spec, layer, w, x, inp)
        x, hidden = fused_rms_norm(attention, w["post_norm"], spec.rms_norm_eps, residual=hidden)  # the residual add
        return hidden + self._mlp(spec, layer, w, x, inp, hidden)

    def _mlp(
        self, spec: ModelSpec, layer: int, w: Weights, x: torch.Tensor, inp: LayerInput, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The MLP of x (the normalized `hidden`, the residual stream after attention)."""
        return swiglu(spec, w, x)

    def _attention(self, spec: ModelSpec, layer: int, w: Weights, x: torch.Tensor, inp: LayerInput) -> torch.Tensor:
        tokens, d = x.shape[0], spec.head_dim
        heads, kv_heads = spec.num_heads, spec.num_kv_heads
        if "qkv_proj" in w and not spec.qk_norm:  # q and k side by side in one product: rotated in one pass
            qkv = project(spec, w, "qkv_proj", x, FUSED_BIAS["qkv_proj"]).view(tokens, heads + 2 * kv_heads, d)
            if spec.quant is not None and spec.quant.interleaved_qk:
                qkv = torch.cat((hf_order(qkv[:, : heads + kv_heads]), qkv[:, heads + kv_heads :]), dim=1)
            q, k = apply_rotary_heads(qkv[:, : heads + kv_heads], inp.cos, inp.sin).split((heads, kv_heads), dim=1)
            v = qkv[:, heads + kv_heads :]
        else:
            q, k, v = projections(spec, w, "qkv_proj", x, (spec.q_size, spec.kv_size, spec.kv_size))
            q, k, v = q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)
            if spec.quant is not None and spec.quant.interleaved_qk:
                q, k = hf_order(q), hf_order(k)
            if spec.qk_norm:
                q = rms_norm(q, w["q_norm"], spec.rms_norm_eps)
                k = rms_norm(k, w["k_norm"], spec.rms_norm_eps)
            q, k = apply_rotary(q, k, inp.cos, inp.sin)
        # write this step's keys and values into their cache slots, then attend over the whole context, where the
        # cache lives (a host-resident cache on CUDA: the query goes to the CPU, the output comes back), or, staged
        # (offload/model/host_attention.py), on the compute device over the blocks copied there
        at = inp.kv.device
        inp.kv.write(inp.batch.slot_mapping, k.to(at), v.to(at))
        sinks = w.get("sinks")  # gpt-oss: a learned logit per head in every softmax
        if (s := inp.staging) is not None:
            k_staged, v_staged = s.gather(inp.kv.k, x.device), s.gather(inp.kv.v, x.device)
            out = paged_attention(q, k_staged, v_staged, s.batch, d**-0.5, spec.window(layer), sinks)
        else:
            sinks = None if sinks is None else sinks.to(at)
            out = paged_attention(q.to(at), inp.kv.k, inp.kv.v, inp.batch, d**-0.5, spec.window(layer), sinks)
            out = out.to(x.device)
        return project(spec, w, "o_proj", out.reshape(tokens, spec.q_size), "o_bias")

    def head(self, spec: ModelSpec, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        x, head = rms_norm(hidden, w["norm"], spec.rms_norm_eps), w["lm_head"]
        return gguf_logits(x, head) if is_blocks(head) else logits(x, head)  # [tokens, vocab], float32


def swiglu(spec: ModelSpec, w: Weights, x: torch.Tensor, dense_from: int = DENSE_FROM_ROWS) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [tokens, hidden] and w's "gate_proj", "up_proj", "down_proj" (and biases).
    `dense_from`: GGUF blocks' rows from which they are dequantized for the dense GEMM (`project`)."""
    gate, up = projections(spec, w, "gate_up_proj", x, dense_from=dense_from)
    return project(spec, w, "down_proj", silu_mul(gate, up), "down_bias", dense_from)


def routed_swiglu(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    """A routed expert's swiglu: its GGUF blocks dequantized for the dense GEMM from EXPERT_DENSE_FROM_ROWS rows."""
    return swiglu(spec, w, x, EXPERT_DENSE_FROM_ROWS)


def projections(
    spec: ModelSpec,
    w: Weights,
    fused: str,
    x: torch.Tensor,
    sizes: tuple[int, ...] | None = None,
    dense_from: int = DENSE_FROM_ROWS,
) -> tuple[torch.Tensor, ...]:
    """The products of x with the parts of FUSED[`fused`]: one product by the stacked matrix, split into the parts'
    `sizes` (None: equal parts), where `w` holds it; else one product a part."""
    parts, biases = FUSED[fused]
    if fused not in w:
        return tuple(project(spec, w, p, x, b, dense_from) for p, b in zip(parts, biases, strict=True))
    y = project(spec, w, fused, x, FUSED_BIAS[fused], dense_from)
    return y.split(sizes, dim=-1) if sizes else y.chunk(len(parts), dim=-1)


def project(
    spec: ModelSpec, w: Weights, name: str, x: torch.Tensor, bias: str, dense_from: int = DENSE_FROM_ROWS
) -> torch.Tensor:
    """x @ W.T + b for the layer's matrix `name`, quantized (codes and scales, or GGUF blocks: dequantized for the
    dense GEMM from `dense_from` rows) or in the compute dtype."""
    scales = w.get(name + SCALES_SUFFIX)
    if scales is None:
        if is_blocks(w[name]):
            return gguf_linear(x, w[name], w.get(bias), dense_from)
        return linear(x, w[name], w.get(bias))
    return quant_linear(x, w[name], scales, spec.quant, w.get(bias))


def hf_order(t: torch.Tensor) -> torch.Tensor:
    """Heads [tokens, heads, head_dim] whose dims are in llama.cpp's interleaved order (the products of q or k rows
    its converter permuted: HF's dim i at 2i, dim head_dim / 2 + i at 2i + 1) in Hugging Face's order again."""
    return t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dim, computed in float32 and cast back before the scale
    (kernels/rms_norm.py: the Triton kernel on CUDA, the torch reference elsewhere)."""
    return fused_rms_norm(x, weight, eps)[0]


FAMILY = LlamaFamily()
