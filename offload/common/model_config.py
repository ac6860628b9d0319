"""A model's shape, read once from its config.json: what the runtime builds and what the planner counts.

`parse_model_config` is the one reader of config.json. It knows every architecture `offload plan` can price
(the Llama family and its mixtures of experts, OPT); which of them the engine can run is the model registry's business
(offload/model/registry.py), which checks a parsed spec before loading any weight. Parameter counts equal the
parameters transformers creates for the config (tied weights counted once), per decoder layer, which every
supported architecture keeps uniform: a mixture whose config makes some layers dense (Qwen-MoE's mlp_only_layers,
decoder_sparse_step) is counted as if every layer were sparse, an upper bound (no published one does).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from offload.common.config_fields import REQUIRED, eos, flag, integer, model_dtype
from offload.common.deepseek_shape import V2, V3, LatentAttention, Routing, deepseek_fields
from offload.common.dtypes import DTYPES
from offload.common.errors import OffloadError
from offload.common.gpt_oss_shape import gpt_oss_fields
from offload.common.quant import WeightQuant, parse_quant
from offload.common.rope_spec import RopeSpec, parse_rope

LLAMA_LIKE = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
QWEN_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
DEEPSEEK = (V2, V3)  # their shape read by offload/common/deepseek_shape.py
GPT_OSS = "GptOssForCausalLM"  # its shape read by offload/common/gpt_oss_shape.py
SUPPORTED = (*LLAMA_LIKE, *DEEPSEEK, GPT_OSS, "OPTForCausalLM")


class ParamCounts(NamedTuple):
    """Parameters by the unit the engine places and streams."""

    layer: int  # one decoder layer, every expert included
    active_layer: int  # what each token multiplies by in one layer (mixture of experts: the routed experts only)
    embed: int  # input embeddings (and learned positions)
    head: int  # final norm plus the LM head when it is not tied to the embeddings


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only transformer. `params` is derived from the other fields for the Llama family
    (pre-norm RMSNorm, grouped-query attention, gated MLP or a mixture of them) unless given."""

    architecture: str  # config.json's architectures[0]
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP width (Mixtral: also each expert's)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope: RopeSpec | None  # None: learned positions (OPT)
    dtype: str  # the checkpoint's declared dtype, one of DTYPES
    name: str = ""  # what reports call the model: a directory's or a known model's name
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0  # routed experts per layer; 0 for a dense MLP
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # one routed expert's MLP width; 0: intermediate_size
    shared_expert_size: int = 0  # the sigmoid-gated expert every token also runs (Qwen2-MoE); 0: none
    norm_topk_prob: bool = True  # rescale each token's top-k routing probabilities to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of a mixture whose MLP is dense (intermediate_size wide)
    # per layer: attend only to the last `window` positions, or None for full causal attention
    sliding_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False  # a learned logit per query head in every softmax (gpt-oss: `sinks`)
    swiglu_limit: float | None = None  # gpt-oss's experts: gate clamped above, up on both sides, at this value
    swiglu_alpha: float = 1.702  # ... and gate * sigmoid(alpha * gate) as the activation
    mxfp4_experts: bool = False  # gpt-oss's routed experts stored in MXFP4 (kernels/mxfp4.py), as published
    # DeepSeek's multi-head latent attention: the cache holds one latent per token and layer (one "KV head" of
    # head_dim = mla.width values, and no V part); None: K and V per KV head
    mla: LatentAttention | None = None
    routing: Routing = Routing()  # how a mixture's router chooses and weighs experts
    mtp_layers: int = 0  # DeepSeek's multi-token-prediction layers in the checkpoint: not run, decoding needs none
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    params: ParamCounts | None = None
    quant: WeightQuant | None = None  # the linear weights' quantization (config.json's quantization_config)
    # an expert cache holding a share c of the routed experts hits c ** this: 1 for uniform routing, less where runs
    # of the model measured it (offload/planner/routing.py); the cost model's, not the checkpoint's
    expert_hit_exponent: float = 1.0
    # the same per decode batch the runs measured it at, (batch, exponent) ascending: a batch's step touches more of
    # each layer's experts than one sequence's, and a skewed router's cache hits less often for it
    expert_hit_exponents: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise OffloadError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise OffloadError(
                f"config.json: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.dtype not in DTYPES:
            raise OffloadError(f"config.json: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise OffloadError(
                f"config.json: num_experts_per_tok ({self.experts_per_token}) must be between 1 and the "
                f"number of experts ({self.num_experts})"
            )
        if len(self.sliding_windows) not in (0, self.num_layers):
            raise OffloadError(f"config.json: {len(self.sliding_windows)} layer types for {self.num_layers} layers")
        if self.params is None:
            object.__setattr__(self, "params", _llama_like_params(self))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def expert_size(self) -> int:
        """One routed expert's MLP width."""
        return self.moe_intermediate_size or self.intermediate_size

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (else a dense MLP of intermediate_size)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def total_params(self) -> int:
        p = self.params
        return self.num_layers * p.layer + p.embed + p.head

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def kv_parts(self) -> int:
        """Tensors the KV cache holds per layer: K and V, or multi-head latent attention's one latent."""
        return 1 if self.mla else 2

    @property
    def rope_dim(self) -> int:
        """The rotated width of a query or key head (MLA rotates only its decoupled part)."""
        return self.mla.rope_dim if self.mla else self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V (or MLA's latent) of one token across all layers (bytes)."""
        return self.kv_parts * self.num_layers * self.kv_size * dtype_bytes


def read_config(model_dir: Path) -> dict:
    """`model_dir/config.json` as a dict; errors name the directory or the file."""
    if not model_dir.is_dir():
        raise OffloadError(f"{model_dir}: model directory not found")
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise OffloadError(f"{path}: not found (a model directory holds config.json and *.safetensors)") from None
    except json.JSONDecodeError as exc:
        raise OffloadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise OffloadError(f"{path}: not a JSON object")
    return config


def parse_model_config(config: dict, source: str, name: str = "") -> ModelSpec:
    """The spec of a parsed config.json; errors name `source` (the file) and the field."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise OffloadError(f"{source}: field 'architectures' must name the model class, got {archs!r}")
    arch = archs[0]
    if arch not in SUPPORTED:
        raise OffloadError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if arch in DEEPSEEK:
        fields = deepseek_fields(config, source)
        params = ParamCounts(*fields.pop("params"))
        spec = ModelSpec(architecture=arch, name=name, params=params, rope=parse_rope(config, source), **fields)
        quant = parse_quant(config, source)
        return spec if quant is None else dataclasses.replace(spec, quant=quant)
    if arch == GPT_OSS:
        fields = gpt_oss_fields(config, source)
        fields.pop("rope_theta")
        spec = ModelSpec(
            architecture=arch,
            name=name,
            params=ParamCounts(*fields.pop("params")),
            rope=parse_rope(config, source),
            **fields,
        )
        q = config.get("quantization_config")
        if isinstance(q, dict) and q.get("quant_method") == "mxfp4":  # the published experts, read as stored
            return dataclasses.replace(spec, mxfp4_experts=True)
        quant = parse_quant(config, source)
        return spec if quant is None else dataclasses.replace(spec, quant=quant)
    spec = _opt_spec(config, name, source) if arch == "OPTForCausalLM" else _llama_like_spec(config, arch, name, source)
    quant = parse_quant(config, source)
    return spec if quant is None else dataclasses.replace(spec, quant=quant)


def _llama_like_spec(config: dict, arch: str, name: str, source: str) -> ModelSpec:
    hidden = integer(config, "hidden_size", source)
    heads = integer(config, "num_attention_heads", source)
    layers = integer(config, "num_hidden_layers", source)
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise OffloadError(f"{source}: hidden_act {act!r} is not supported (the Llama family uses silu)")
    qwen2, qwen3 = arch == "Qwen2ForCausalLM", arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    # transformers' Mistral has no attention biases whatever the config says; Qwen2 always has q/k/v biases,
    # Qwen2-MoE unless its qkv_bias says otherwise
    attention_bias = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    bias = flag(config, "attention_bias", source, False) and arch in attention_bias
    qwen2_moe_bias = arch == "Qwen2MoeForCausalLM" and flag(config, "qkv_bias", source, True)
    return ModelSpec(
        architecture=arch,
        name=name,
        vocab_size=integer(config, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=integer(config, "intermediate_size", source),
        num_layers=layers,
        num_heads=heads,
        # transformers' defaults: Llama falls back to full multi-head attention; the others' defaults are not
        # the published models' values, so their configs must say
        num_kv_heads=integer(config, "num_key_value_heads", source, heads if arch == "LlamaForCausalLM" else REQUIRED),
        # Qwen3Config's default head_dim is 128, not hidden_size / heads (Qwen3MoeConfig keeps hidden_size / heads)
        head_dim=integer(config, "head_dim", source, 128 if arch == "Qwen3ForCausalLM" else hidden // heads),
        max_position=integer(config, "max_position_embeddings", source, 2048),
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        rope=parse_rope(config, source),
        dtype=model_dtype(config, source),
        hidden_act="silu",
        tie_word_embeddings=flag(config, "tie_word_embeddings", source, False),
        qkv_bias=qwen2 or qwen2_moe_bias or bias,
        o_bias=bias,
        mlp_bias=flag(config, "mlp_bias", source, False) and arch == "LlamaForCausalLM",
        qk_norm=qwen3,
        sliding_windows=_sliding_windows(config, arch, layers),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos(config),
        **_experts(config, arch, layers, source),
    )


def _experts(config: dict, arch: str, num_layers: int, source: str) -> dict:
    """The ModelSpec fields of a mixture of experts (none for a dense architecture)."""
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=integer(config, "num_local_experts", source),
            experts_per_token=integer(config, "num_experts_per_tok", source),
        )
    if arch not in QWEN_MOE:
        return {}
    step = integer(config, "decoder_sparse_step", source, 1)
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise OffloadError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    shared = integer(config, "shared_expert_intermediate_size", source) if arch == "Qwen2MoeForCausalLM" else 0
    # published configs say num_experts; transformers 5 writes Qwen3-MoE's as num_local_experts
    experts = "num_experts" if config.get("num_local_experts") is None else "num_local_experts"
    return dict(
        num_experts=integer(config, experts, source),
        experts_per_token=integer(config, "num_experts_per_tok", source),
        moe_intermediate_size=integer(config, "moe_intermediate_size", source),
        shared_expert_size=shared,
        norm_topk_prob=flag(config, "norm_topk_prob", source, False),
        # transformers' rule: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step
        dense_layers=tuple(i for i in range(num_layers) if i in only or (i + 1) % step),
    )


def _llama_like_params(s: ModelSpec) -> ParamCounts:
    h, q, kv = s.hidden_size, s.q_size, s.kv_size
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
    attention += (q + 2 * kv if s.qkv_bias else 0) + (h if s.o_bias else 0)
    attention += 2 * s.head_dim if s.qk_norm else 0  # q_norm, k_norm over head_dim
    mlp = 3 * h * s.intermediate_size  # gate, up, down
    mlp += 2 * s.intermediate_size + h if s.mlp_bias else 0
    norms = 2 * h  # input and post-attention RMSNorm
    if s.num_experts:
        expert = 3 * h * s.expert_size
        always = s.num_experts * h  # the router, and the shared expert with its gate where there is one
        always += 3 * h * s.shared_expert_size + h if s.shared_expert_size else 0
        layer = attention + norms + always + s.num_experts * expert
        active = attention + norms + always + s.experts_per_token * expert
    else:
        layer = active = attention + norms + mlp
    head = h + (0 if s.tie_word_embeddings else s.vocab_size * h)  # final RMSNorm + lm_head
    return ParamCounts(layer, active, s.vocab_size * h, head)


def _opt_spec(config: dict, name: str, source: str) -> ModelSpec:
    """Post-2022 OPT: LayerNorms with bias, biased projections, learned positions, optional embedding projection."""
    h = integer(config, "hidden_size", source)
    ffn = integer(config, "ffn_dim", source)
    heads = integer(config, "num_attention_heads", source)
    vocab = integer(config, "vocab_size", source)
    max_position = integer(config, "max_position_embeddings", source)
    proj = integer(config, "word_embed_proj_dim", source, h)
    bias = flag(config, "enable_bias", source, True)
    norm = 2 * h if flag(config, "layer_norm_elementwise_affine", source, True) else 0  # weight + bias
    final_norm = flag(config, "do_layer_norm_before", source, True) and not flag(
        config, "_remove_final_layer_norm", source, False
    )
    project = proj * h if proj != h else 0  # project_in (embeddings) and project_out (head), no bias
    tied = flag(config, "tie_word_embeddings", source, True)
    layer = 4 * h * h + 2 * h * ffn + 2 * norm  # q, k, v, out_proj, fc1, fc2, two LayerNorms
    layer += 4 * h + ffn + h if bias else 0
    params = ParamCounts(
        layer=layer,
        active_layer=layer,
        # OPT's learned positions keep 2 rows ahead of position 0, a fairseq padding legacy
        embed=vocab * proj + (max_position + 2) * h + project,
        head=(norm if final_norm else 0) + project + (0 if tied else vocab * proj),
    )
    return ModelSpec(
        architecture="OPTForCausalLM",
        name=name,
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=ffn,
        num_layers=integer(config, "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=h // heads,
        max_position=max_position,
        rms_norm_eps=1e-5,  # LayerNorm's epsilon
        rope=None,
        dtype=model_dtype(config, source),
        hidden_act=str(config.get("activation_function", "relu")),
        tie_word_embeddings=tied,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos(config),
        params=params,
    )


def _sliding_windows(config: dict, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers if window else ()
    if architecture == "Qwen3MoeForCausalLM":  # every layer slides when the config says so
        return (window,) * num_layers if config.get("use_sliding_window") and window else ()
    if architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM"):
        if not config.get("use_sliding_window") or not window:
            return ()
        types = config.get("layer_types")
        first = config.get("max_window_layers", num_layers)
        if types is None and architecture == "Qwen2MoeForCausalLM":  # every other layer below max_window_layers
            types = ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(num_layers)]
        elif types is None:
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return ()
