"""DeepSeek-V2 and DeepSeek-V3's shape (Kimi-K2 is DeepSeek-V3's architecture): what `offload plan` prices and
offload/model/deepseek.py runs.

What sets them apart from the Llama family, and how the spec holds it:
- Multi-head latent attention (MLA, `LatentAttention`): q and kv go through low-rank projections (q_lora_rank,
  kv_lora_rank), and the cache holds one latent vector of kv_lora_rank + qk_rope_head_dim values per token and layer
  instead of K and V per head. The spec has one KV "head" of that width and one cache part (`ModelSpec.kv_parts`), so
  the KV cache is priced and allocated exactly; attention FLOPs are priced on that width per query head (MLA's
  absorbed decode form: kv_lora_rank + rope dims for the scores, kv_lora_rank for the values).
- first_k_dense_replace dense layers (intermediate_size wide) before the mixture's layers: n_routed_experts of
  moe_intermediate_size, num_experts_per_tok of them per token, plus n_shared_experts every token runs. The
  parameter counts are the average decoder layer, so the totals are exact.
- Routing (`Routing`): DeepSeek-V3 scores each expert by a sigmoid, chooses by the scores plus a learned bias
  (e_score_correction_bias) among the topk_group best of n_group groups (a group's score: its two best experts),
  weighs by the scores alone, renormalized where norm_topk_prob, times routed_scaling_factor. DeepSeek-V2 takes a
  softmax, greedy or limited to the best groups by their best expert, never renormalized.
- The multi-token-prediction module (num_nextn_predict_layers) is not counted and not run: decoding does not need it.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload.common.config_fields import eos, flag, integer, model_dtype
from offload.common.errors import OffloadError

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")


@dataclass(frozen=True, slots=True)
class LatentAttention:
    """Multi-head latent attention's widths, per head unless said otherwise."""

    q_rank: int | None  # the query's low-rank width (q_lora_rank); None: one q_proj from the hidden state
    kv_rank: int  # the cached latent's width (kv_lora_rank), shared by every head
    nope_dim: int  # each head's key part without rotation, decompressed from the latent
    rope_dim: int  # the rotated key part, one for all heads, cached beside the latent
    v_dim: int  # each head's value, decompressed from the latent
    interleaved: bool = True  # the rotated dims pair up interleaved (x0, x1), (x2, x3), ..., not as two halves

    @property
    def width(self) -> int:
        """Values cached per token and layer: the latent and the rotated key."""
        return self.kv_rank + self.rope_dim

    @property
    def qk_dim(self) -> int:
        """A head's query and key width as decompressed: what the softmax scale is computed from."""
        return self.nope_dim + self.rope_dim


@dataclass(frozen=True, slots=True)
class Routing:
    """How a mixture's router picks each token's experts and weighs their outputs (mixtures before DeepSeek: a
    softmax over every expert, its top-k, in one group, unscaled)."""

    scoring: str = "softmax"  # "softmax" over every expert, or "sigmoid" of each expert's logit on its own
    groups: int = 1  # n_group: the experts split into this many groups of consecutive numbers
    groups_kept: int = 1  # topk_group: a token chooses only among its best groups
    group_score: str = "max"  # a group's score: its best expert's ("max") or its two best's sum ("top2")
    scale: float = 1.0  # routed_scaling_factor: multiplies the routing weights
    score_bias: bool = False  # a learned bias per expert added to the scores for choosing, not for weighing

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS or self.group_score not in GROUP_SCORES:
            raise OffloadError(f"config.json: routing {self.scoring!r} by {self.group_score!r} is not supported")
        if not 0 < self.groups_kept <= self.groups:
            raise OffloadError(f"config.json: topk_group ({self.groups_kept}) must be between 1 and n_group")


def deepseek_fields(config: dict, source: str) -> dict:
    """The ModelSpec fields (besides architecture, name and rope) of a DeepSeek-V2 or -V3 config.json; "params" as
    ParamCounts' (layer, active_layer, embed, head)."""
    arch = config["architectures"][0]
    h = integer(config, "hidden_size", source)
    layers = integer(config, "num_hidden_layers", source)
    heads = integer(config, "num_attention_heads", source)
    vocab = integer(config, "vocab_size", source)
    dense_width = integer(config, "intermediate_size", source)
    expert_width = integer(config, "moe_intermediate_size", source)
    experts = integer(config, "n_routed_experts", source)
    per_token = integer(config, "num_experts_per_tok", source)
    shared = integer(config, "n_shared_experts", source, 1) * expert_width
    first_sparse = config.get("first_k_dense_replace") or 0  # V2's default: every layer sparse
    if not isinstance(first_sparse, int) or isinstance(first_sparse, bool) or first_sparse < 0:
        raise OffloadError(f"{source}: field 'first_k_dense_replace' must be a count of layers, got {first_sparse!r}")
    if flag(config, "attention_bias", source, False):
        raise OffloadError(f"{source}: attention_bias true is not supported for {arch} (published models have none)")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise OffloadError(f"{source}: hidden_act {config.get('hidden_act')!r} is not supported (silu)")
    mla = LatentAttention(
        q_rank=integer(config, "q_lora_rank", source, None),
        kv_rank=integer(config, "kv_lora_rank", source),
        nope_dim=integer(config, "qk_nope_head_dim", source),
        rope_dim=integer(config, "qk_rope_head_dim", source),
        v_dim=integer(config, "v_head_dim", source),
        # DeepSeek-V2 always rotates interleaved pairs; V3 unless rope_interleave is false
        interleaved=arch == V2 or flag(config, "rope_interleave", source, True),
    )
    if mla.rope_dim % 2:
        raise OffloadError(f"{source}: qk_rope_head_dim must be even (rotated in pairs), got {mla.rope_dim}")
    routing = _routing(config, arch, experts, source)
    q_part = h * mla.q_rank + mla.q_rank + mla.q_rank * heads * mla.qk_dim if mla.q_rank else h * heads * mla.qk_dim
    attention = q_part + h * mla.width + mla.kv_rank + mla.kv_rank * heads * (mla.nope_dim + mla.v_dim)  # kv_a, b
    attention += heads * mla.v_dim * h  # o
    always = attention + 2 * h  # input and post-attention norms
    dense = always + 3 * h * dense_width
    router = experts * h + (experts if routing.score_bias else 0)  # the gate and its score-correction bias
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
    return dict(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=dense_width,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=1,
        head_dim=mla.width,
        max_position=integer(config, "max_position_embeddings", source, 4096),
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        dtype=model_dtype(config, source),
        tie_word_embeddings=tied,
        num_experts=experts,
        experts_per_token=per_token,
        moe_intermediate_size=expert_width,
        shared_expert_size=shared,
        norm_topk_prob=arch == V3 and flag(config, "norm_topk_prob", source, True),  # V2 never renormalizes
        dense_layers=tuple(range(n_dense)),
        mla=mla,
        routing=routing,
        mtp_layers=config.get("num_nextn_predict_layers") or 0,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos(config),
        params=params,
    )


def _routing(config: dict, arch: str, experts: int, source: str) -> Routing:
    """V3: sigmoid scores, biased choice among the best groups by their two best experts (topk_method noaux_tc, the
    only one transformers runs); V2: softmax, greedy or limited to the best groups by their best expert."""
    scale = config.get("routed_scaling_factor", 2.5 if arch == V3 else 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise OffloadError(f"{source}: field 'routed_scaling_factor' must be a positive number, got {scale!r}")
    groups, kept = integer(config, "n_group", source, 1), integer(config, "topk_group", source, 1)
    if experts % groups:
        raise OffloadError(f"{source}: n_routed_experts ({experts}) is not a multiple of n_group ({groups})")
    if arch == V3:
        scoring = config.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise OffloadError(f"{source}: scoring_func {scoring!r} is not supported for {arch} (sigmoid)")
        return Routing("sigmoid", groups, min(kept, groups), "top2", float(scale), score_bias=True)
    method = config.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise OffloadError(f"{source}: topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    if method == "greedy":
        groups = kept = 1
    return Routing("softmax", groups, min(kept, groups), "max", float(scale))
