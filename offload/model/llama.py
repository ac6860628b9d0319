"""The Llama family: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Pre-norm decoder layers: RMSNorm -> grouped-query attention with RoPE -> residual, RMSNorm -> SwiGLU
MLP -> residual. Numerics follow the Hugging Face reference: norms in float32, everything else in the
compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.linear import linear
from kernels.paged_attention import paged_attention
from offload.common.config import ModelSpec, RopeSpec
from offload.common.errors import OffloadError
from offload.model.registry import LayerInput
from offload.model.rope import apply_rope
from tiers.checkpoint import TensorSpec
from tiers.layout import Weights

_CONFIG_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "half": "float16",
    "float": "float32",
}


def _require(config: dict, key: str, source: str) -> object:
    if key not in config:
        raise OffloadError(f"{source}: missing field {key!r}")
    return config[key]


def _rope(config: dict, source: str) -> RopeSpec:
    # transformers 5 writes `rope_parameters` (theta inside); earlier configs `rope_theta` + `rope_scaling`.
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        try:
            return RopeSpec(
                theta=theta,
                kind="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position=int(params["original_max_position_embeddings"]),
            )
        except KeyError as exc:
            raise OffloadError(f"{source}: llama3 rope scaling lacks {exc.args[0]!r}") from None
    raise OffloadError(f"{source}: rope_type {kind!r} is not supported (supported: default, linear, llama3)")


def _sliding_windows(config: dict, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if architecture == "MistralForCausalLM":
        return (window,) * num_layers if window else ()
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not config.get("use_sliding_window") or not window:
            return ()
        types = config.get("layer_types")
        if types is None:
            first = config.get("max_window_layers", num_layers)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return ()


def _dtype(config: dict, source: str) -> str:
    raw = config.get("dtype", config.get("torch_dtype", "float32"))
    if raw not in _CONFIG_DTYPES:
        raise OffloadError(f"{source}: dtype {raw!r} is not one of float32, float16, bfloat16")
    return _CONFIG_DTYPES[raw]


def _eos(config: dict) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


class LlamaFamily:
    def spec_from_config(self, config: dict, source: str) -> ModelSpec:
        arch = config["architectures"][0]
        heads = int(_require(config, "num_attention_heads", source))
        hidden = int(_require(config, "hidden_size", source))
        layers = int(_require(config, "num_hidden_layers", source))
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise OffloadError(f"{source}: hidden_act {act!r} is not supported (the Llama family uses silu)")
        qwen2 = arch == "Qwen2ForCausalLM"
        # transformers' Mistral has no attention biases whatever the config says; Qwen2 always has q/k/v biases
        bias = bool(config.get("attention_bias", False)) and arch != "MistralForCausalLM"
        qwen3 = arch == "Qwen3ForCausalLM"
        return ModelSpec(
            architecture=arch,
            vocab_size=int(_require(config, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_require(config, "intermediate_size", source)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or (128 if qwen3 else hidden // heads)),  # transformers' defaults
            max_position=int(config.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_rope(config, source),
            dtype=_dtype(config, source),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or bias,
            o_bias=bias and not qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=qwen3,
            sliding_windows=_sliding_windows(config, arch, layers),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_eos(config),
        )

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

    def embed(self, w: Weights, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, w["embed"])  # [tokens, hidden]

    def layer(self, spec: ModelSpec, layer: int, w: Weights, hidden: torch.Tensor, inp: LayerInput) -> torch.Tensor:
        # hidden: [tokens, hidden_size]
        x = rms_norm(hidden, w["input_norm"], spec.rms_norm_eps)
        hidden = hidden + self._attention(spec, layer, w, x, inp)
        x = rms_norm(hidden, w["post_norm"], spec.rms_norm_eps)
        gate = linear(x, w["gate_proj"], w.get("gate_bias"))
        up = linear(x, w["up_proj"], w.get("up_bias"))
        return hidden + linear(F.silu(gate) * up, w["down_proj"], w.get("down_bias"))

    def _attention(self, spec: ModelSpec, layer: int, w: Weights, x: torch.Tensor, inp: LayerInput) -> torch.Tensor:
        tokens, d = x.shape[0], spec.head_dim
        q = linear(x, w["q_proj"], w.get("q_bias")).view(tokens, spec.num_heads, d)
        k = linear(x, w["k_proj"], w.get("k_bias")).view(tokens, spec.num_kv_heads, d)
        v = linear(x, w["v_proj"], w.get("v_bias")).view(tokens, spec.num_kv_heads, d)
        if spec.qk_norm:
            q = rms_norm(q, w["q_norm"], spec.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], spec.rms_norm_eps)
        q = apply_rope(q, inp.cos, inp.sin)
        k = apply_rope(k, inp.cos, inp.sin)
        # write this step's keys and values into their cache slots, then attend over the whole context
        inp.k_cache.view(-1, spec.num_kv_heads, d)[inp.batch.slot_mapping] = k
        inp.v_cache.view(-1, spec.num_kv_heads, d)[inp.batch.slot_mapping] = v
        out = paged_attention(q, inp.k_cache, inp.v_cache, inp.batch, d**-0.5, spec.window(layer))
        return linear(out.reshape(tokens, spec.q_size), w["o_proj"], w.get("o_bias"))

    def head(self, spec: ModelSpec, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(hidden, w["norm"], spec.rms_norm_eps), w["lm_head"])  # [tokens, vocab]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dim, computed in float32 and cast back before the scale."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


FAMILY = LlamaFamily()
