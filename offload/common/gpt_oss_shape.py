"""gpt-oss's shape: what `offload plan` prices and offload/model/gpt_oss.py runs.

What sets it apart from the Llama family, and how the spec prices it:
- Attention with biases on q, k, v and o, and one learned sink logit per head; layers alternate between a sliding
  window (`sliding_window` positions) and full attention, as `layer_types` lists them.
- Every layer a mixture: a router with a bias over `num_local_experts` experts, `num_experts_per_tok` of them per
  token (softmax over the chosen ones), each expert a SwiGLU of `intermediate_size` with biases (gate and up
  stored interleaved in one matrix, clamped activations: the same parameter count).
- The published checkpoints store the experts in MXFP4 (4.25 bits a weight: 32 four-bit values and an 8-bit
  exponent a block) and everything else in bfloat16; the engine reads them as stored (model_config marks the spec's
  mxfp4_experts), or bfloat16 and float32 checkpoints. The spec counts parameters; `offload plan` prices its widths
  (`--quantize` adds 8 and 4 bits, the nearest to MXFP4's experts).
"""

from __future__ import annotations

from offload.common.config_fields import eos, flag, integer, model_dtype
from offload.common.errors import OffloadError

SLIDING, FULL = "sliding_attention", "full_attention"


def gpt_oss_fields(config: dict, source: str) -> dict:
    """The ModelSpec fields (besides architecture and name) of a gpt-oss config.json; "params" as ParamCounts'
    (layer, active_layer, embed, head) and "rope_theta" for its RopeSpec, which model_config builds."""
    h = integer(config, "hidden_size", source)
    layers = integer(config, "num_hidden_layers", source)
    heads = integer(config, "num_attention_heads", source)
    kv_heads = integer(config, "num_key_value_heads", source)
    head_dim = integer(config, "head_dim", source, h // heads)
    vocab = integer(config, "vocab_size", source)
    width = integer(config, "intermediate_size", source)
    experts = integer(config, "num_local_experts", source)
    per_token = integer(config, "num_experts_per_tok", source, integer(config, "experts_per_token", source, 4))
    window = integer(config, "sliding_window", source, 128)
    types = config.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise OffloadError(
            f"{source}: field 'layer_types' must list {SLIDING!r} or {FULL!r} for each of {layers} layers"
        )
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + q + 2 * (h * kv + kv) + q * h + h + heads  # q, k, v, o with biases; the sinks
    always = attention + 2 * h + experts * h + experts  # the two norms, the router and its bias
    expert = h * 2 * width + 2 * width + width * h + h  # gate_up and down, with their biases
    tied = flag(config, "tie_word_embeddings", source, False)
    params = (always + experts * expert, always + per_token * expert, vocab * h, h + (0 if tied else vocab * h))
    return dict(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position=integer(config, "max_position_embeddings", source, 131072),
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-5),
        rope_theta=float(config.get("rope_theta") or 150000.0),
        dtype=model_dtype(config, source),
        tie_word_embeddings=tied,
        qkv_bias=True,
        o_bias=True,
        num_experts=experts,
        experts_per_token=per_token,
        moe_intermediate_size=width,
        norm_topk_prob=True,  # a softmax over the chosen experts' logits: their weights sum to 1
        sliding_windows=tuple(window if t == SLIDING else None for t in types),
        attention_sinks=True,
        swiglu_limit=float(config.get("swiglu_limit") or 7.0),
        swiglu_alpha=float(config.get("swiglu_alpha") or 1.702),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos(config),
        params=params,
    )
