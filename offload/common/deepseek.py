"""DeepSeek-V3's shape, for `offload plan` only: the engine does not run it (offload/model/registry.py says so).

What sets it apart from the Llama family, and how the spec prices it:
- Multi-head latent attention (MLA): q and kv go through low-rank projections (q_lora_rank, kv_lora_rank), and the
  cache holds one latent vector of kv_lora_rank + qk_rope_head_dim values per token and layer instead of K and V per
  head. The spec has one KV "head" of half that width (K and V together: 2 x 1 x head_dim values), so the KV cache
  is priced exactly; attention FLOPs are priced on that width per query head (between MLA's prefill form, 192 + 128
  values per head, and its absorbed decode form, 576 + 512).
- first_k_dense_replace dense layers (intermediate_size wide) before the mixture's layers: n_routed_experts of
  moe_intermediate_size, num_experts_per_tok of them per token, plus n_shared_experts every token runs. The
  parameter counts are the average decoder layer, so the totals are exact.
- The multi-token-prediction module (num_nextn_predict_layers) is not counted: decoding does not run it.
"""

from __future__ import annotations

from offload.common.config_fields import eos, flag, integer, model_dtype


def deepseek_fields(config: dict, source: str) -> dict:
    """The ModelSpec fields (besides architecture and name) of a DeepSeek-V3 config.json; "params" as ParamCounts'
    (layer, active_layer, embed, head) and "rope_theta" for its RopeSpec, which model_config builds."""
    h = integer(config, "hidden_size", source)
    layers = integer(config, "num_hidden_layers", source)
    heads = integer(config, "num_attention_heads", source)
    vocab = integer(config, "vocab_size", source)
    dense_width = integer(config, "intermediate_size", source)
    expert_width = integer(config, "moe_intermediate_size", source)
    experts = integer(config, "n_routed_experts", source)
    per_token = integer(config, "num_experts_per_tok", source)
    shared = integer(config, "n_shared_experts", source, 1) * expert_width
    first_sparse = integer(config, "first_k_dense_replace", source, 1)
    q_rank, kv_rank = integer(config, "q_lora_rank", source), integer(config, "kv_lora_rank", source)
    nope, rope = integer(config, "qk_nope_head_dim", source), integer(config, "qk_rope_head_dim", source)
    v_dim = integer(config, "v_head_dim", source)
    attention = h * q_rank + q_rank + q_rank * heads * (nope + rope)  # q_a, its norm, q_b
    attention += h * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)  # kv_a, its norm, kv_b
    attention += heads * v_dim * h  # o
    always = attention + 2 * h  # input and post-attention norms
    dense = always + 3 * h * dense_width
    router = experts * h + experts  # the gate and its score-correction bias
    sparse_always = always + router + 3 * h * shared
    sparse = sparse_always + experts * 3 * h * expert_width
    sparse_active = sparse_always + per_token * 3 * h * expert_width
    n_dense, n_sparse = min(first_sparse, layers), layers - min(first_sparse, layers)
    tied = flag(config, "tie_word_embeddings", source, False)
    params = (
        (n_dense * dense + n_sparse * sparse) // layers,
        (n_dense * dense + n_sparse * sparse_active) // layers,
        vocab * h,
        h + (0 if tied else vocab * h),
    )
    latent = kv_rank + rope
    return dict(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=dense_width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=latent // 2,
        max_position=integer(config, "max_position_embeddings", source, 4096),
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        rope_theta=float(config.get("rope_theta") or 10000.0),
        dtype=model_dtype(config, source),
        tie_word_embeddings=tied,
        num_experts=experts,
        experts_per_token=per_token,
        moe_intermediate_size=expert_width,
        shared_expert_size=shared,
        norm_topk_prob=flag(config, "norm_topk_prob", source, True),
        dense_layers=tuple(range(n_dense)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos(config),
        params=params,
    )
