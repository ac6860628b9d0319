"""Model shapes for planning: parameter counts and KV size per token, from a Hugging Face config.json.

No weights are read: `offload plan` answers for public models (configs/models/*.json) and local directories
alike. Counts are per decoder layer, which all supported architectures keep uniform, and equal the parameters
transformers creates for the config (tied weights counted once).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from offload.common.errors import OffloadError
from offload.model.loader import read_config

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"

LLAMA_LIKE = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED = (*LLAMA_LIKE, "OPTForCausalLM")

_DTYPES = ("float32", "float16", "bfloat16")
_REQUIRED = object()


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    architecture: str  # config.json's architectures[0]
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    dtype: str  # the checkpoint's dtype (torch_dtype), one of offload.common.config.DTYPES
    layer_params: int  # parameters of one decoder layer, every expert included
    active_layer_params: int  # parameters each token multiplies by in one layer (MoE: the routed experts only)
    embed_params: int  # input embeddings (and learned positions)
    head_params: int  # final norm plus the LM head when it is not tied to the embeddings

    @property
    def total_params(self) -> int:
        return self.num_layers * self.layer_params + self.embed_params + self.head_params

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class SizeEstimate:
    """Weight bytes of a model stored in one dtype, as `accelerate estimate-memory` reports them."""

    dtype: str  # "float32", "float16", "bfloat16", "int8" or "int4"
    total_bytes: int
    largest_layer_bytes: int  # the largest unit the engine streams: embeddings, one decoder layer or the head
    largest_layer_name: str  # "embeddings", "decoder layer" or "head"


# bits per parameter. Quantized sizes exclude scales and zero points, and assume every parameter (norms and
# embeddings too) is quantized, as accelerate's estimate does.
_SIZE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "int8": 8, "int4": 4}


def estimate_sizes(shape: ModelShape) -> list[SizeEstimate]:
    """One row per dtype in float32, float16, bfloat16, int8, int4 order; bytes rounded up to whole bytes."""
    parts = {"embeddings": shape.embed_params, "decoder layer": shape.layer_params, "head": shape.head_params}
    largest = max(parts, key=parts.__getitem__)  # ties go to the first in the dict's order
    return [
        SizeEstimate(dtype, _bytes(shape.total_params, bits), _bytes(parts[largest], bits), largest)
        for dtype, bits in _SIZE_BITS.items()
    ]


def _bytes(params: int, bits: int) -> int:
    return -(-params * bits // 8)


def known_models() -> list[str]:
    """Names accepted by load_shape: the stems of configs/models/*.json, lowercase and sorted."""
    return sorted(_model_files())


def _model_files() -> dict[str, Path]:
    return {path.stem.lower(): path for path in MODELS_DIR.glob("*.json")}


def load_shape(model: str) -> ModelShape:
    """The shape of `model`: a directory holding config.json, or a name from known_models() (any case)."""
    path = Path(model)
    if path.is_dir():
        return shape_from_config(read_config(path), path.resolve().name, str(path / "config.json"))
    files = _model_files()
    name = model.lower()
    if name not in files:
        raise OffloadError(
            f"unknown model {model!r}: not a directory holding config.json nor a known name "
            f"(known: {', '.join(sorted(files))})"
        )
    file = files[name]
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise OffloadError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise OffloadError(f"{file}: not a JSON object")
    return shape_from_config(config, name, str(file))


def shape_from_config(config: dict, name: str, source: str) -> ModelShape:
    """The shape transformers builds from `config` (a parsed config.json); errors name `source` and the field."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise OffloadError(f"{source}: field 'architectures' must name the model class, got {archs!r}")
    arch = archs[0]
    if arch not in SUPPORTED:
        raise OffloadError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if arch == "OPTForCausalLM":
        return _opt_shape(config, name, source)
    return _llama_like_shape(config, arch, name, source)


def _llama_like_shape(config: dict, arch: str, name: str, source: str) -> ModelShape:
    """Pre-norm RMSNorm decoders with grouped-query attention and a gated (SwiGLU) MLP or a mixture of them."""
    h = _int(config, "hidden_size", source)
    i = _int(config, "intermediate_size", source)
    heads = _int(config, "num_attention_heads", source)
    # transformers defaults: Llama falls back to full multi-head attention; the others' defaults are not the
    # published models' values, so their configs must say
    kv_heads = _int(config, "num_key_value_heads", source, heads if arch == "LlamaForCausalLM" else _REQUIRED)
    # Qwen3Config's default head_dim is 128, not hidden_size / heads
    head_dim = _int(config, "head_dim", source, 128 if arch == "Qwen3ForCausalLM" else h // heads)
    vocab = _int(config, "vocab_size", source)
    q, kv = heads * head_dim, kv_heads * head_dim

    attention = h * q + 2 * h * kv + q * h  # q, k, v, o projections
    if arch == "Qwen2ForCausalLM":
        attention += q + 2 * kv  # q, k, v biases, always
    elif arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and _flag(config, "attention_bias", source, False):
        attention += q + 2 * kv + h
    if arch == "Qwen3ForCausalLM":
        attention += 2 * head_dim  # q_norm, k_norm over head_dim
    mlp = 3 * h * i  # gate, up, down
    if arch == "LlamaForCausalLM" and _flag(config, "mlp_bias", source, False):
        mlp += 2 * i + h
    norms = 2 * h  # input and post-attention RMSNorm

    if arch == "MixtralForCausalLM":
        experts = _int(config, "num_local_experts", source)
        top_k = _int(config, "num_experts_per_tok", source)
        router = experts * h
        layer = attention + norms + router + experts * mlp
        active = attention + norms + router + top_k * mlp
    else:
        layer = active = attention + norms + mlp

    tied = _flag(config, "tie_word_embeddings", source, False)
    return ModelShape(
        name=name,
        architecture=arch,
        num_layers=_int(config, "num_hidden_layers", source),
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position=_int(config, "max_position_embeddings", source),
        dtype=_dtype(config, source, "bfloat16"),
        layer_params=layer,
        active_layer_params=active,
        embed_params=vocab * h,
        head_params=h + (0 if tied else vocab * h),  # final RMSNorm + lm_head
    )


def _opt_shape(config: dict, name: str, source: str) -> ModelShape:
    """Post-2022 OPT: LayerNorms with bias, biased projections, learned positions, optional embedding projection."""
    h = _int(config, "hidden_size", source)
    ffn = _int(config, "ffn_dim", source)
    heads = _int(config, "num_attention_heads", source)
    vocab = _int(config, "vocab_size", source)
    max_position = _int(config, "max_position_embeddings", source)
    proj = _int(config, "word_embed_proj_dim", source, h)
    bias = _flag(config, "enable_bias", source, True)
    norm = 2 * h if _flag(config, "layer_norm_elementwise_affine", source, True) else 0  # weight + bias
    final_norm = _flag(config, "do_layer_norm_before", source, True) and not _flag(
        config, "_remove_final_layer_norm", source, False
    )
    project = proj * h if proj != h else 0  # project_in (embeddings) and project_out (head), no bias

    layer = 4 * h * h + 2 * h * ffn + 2 * norm  # q, k, v, out_proj, fc1, fc2, two LayerNorms
    if bias:
        layer += 4 * h + ffn + h
    tied = _flag(config, "tie_word_embeddings", source, True)
    return ModelShape(
        name=name,
        architecture="OPTForCausalLM",
        num_layers=_int(config, "num_hidden_layers", source),
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=h // heads,
        vocab_size=vocab,
        max_position=max_position,
        dtype=_dtype(config, source, "float16"),
        layer_params=layer,
        active_layer_params=layer,
        # OPT's learned positions keep 2 rows ahead of position 0, a fairseq padding legacy
        embed_params=vocab * proj + (max_position + 2) * h + project,
        head_params=(norm if final_norm else 0) + project + (0 if tied else vocab * proj),
    )


def _int(config: dict, key: str, source: str, default: object = _REQUIRED) -> int:
    """A positive integer field; null counts as absent, as transformers' configs treat it."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise OffloadError(f"{source}: missing field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OffloadError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def _flag(config: dict, key: str, source: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OffloadError(f"{source}: field {key!r} must be true or false, got {value!r}")
    return value


def _dtype(config: dict, source: str, default: str) -> str:
    key = "dtype" if config.get("dtype") is not None else "torch_dtype"  # transformers 5 writes "dtype"
    value = config.get(key)
    if value is None:
        return default
    if value not in _DTYPES:
        raise OffloadError(f"{source}: field {key!r} is {value!r}, not one of {', '.join(_DTYPES)}")
    return value
