"""Model specs for planning: parameter counts equal those of the models transformers builds (on the meta device)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, toy_spec
from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec, parse_model_config
from offload.planner.models import (
    MODELS_DIR,
    SizeEstimate,
    estimate_sizes,
    known_models,
    load_model_spec,
)

TINY_OPT = dict(
    vocab_size=300, hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=256
)

# name -> (transformers config class, kwargs): each variant switches on what sets a family apart
VARIANTS = {
    "llama": ("LlamaConfig", TINY),
    "llama-biases-tied-head-dim": (
        "LlamaConfig",
        TINY | dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, head_dim=24),
    ),
    "llama-mha": ("LlamaConfig", TINY | dict(num_key_value_heads=None)),
    "mistral": ("MistralConfig", TINY | dict(sliding_window=7)),
    "mistral-head-dim-tied": ("MistralConfig", TINY | dict(head_dim=24, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", TINY),
    "qwen2-tied": ("Qwen2Config", TINY | dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", TINY | dict(head_dim=24)),
    "qwen3-bias-tied": ("Qwen3Config", TINY | dict(head_dim=24, attention_bias=True, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", TINY | dict(num_local_experts=4, num_experts_per_tok=2)),
    "opt": ("OPTConfig", TINY_OPT),
    "opt-projected-untied-no-bias": (
        "OPTConfig",
        TINY_OPT | dict(word_embed_proj_dim=32, tie_word_embeddings=False, enable_bias=False),
    ),
    "opt-post-norm-no-affine": (
        "OPTConfig",
        TINY_OPT | dict(do_layer_norm_before=False, layer_norm_elementwise_affine=False),
    ),
}

MODELS = [
    "deepseek-v3",
    "gpt-oss-120b",
    "gpt-oss-20b",
    "kimi-k2",
    "llama-3.1-405b",
    "llama-3.1-70b",
    "llama-3.1-8b",
    "mistral-7b",
    "mixtral-8x22b",
    "mixtral-8x7b",
    "opt-175b",
    "opt-30b",
    "qwen2.5-72b",
    "qwen2.5-7b",
    "qwen3-235b-a22b",
    "qwen3-30b-a3b",
    "tinyllama-1.1b",
]


def meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def counts(model) -> tuple[int, list[int], int]:
    """(embed, [params of each decoder layer], head) as ModelSpec splits them; tied weights are listed once."""
    embed, head, layers = 0, 0, {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "layers" in parts:
            i = int(parts[parts.index("layers") + 1])
            layers[i] = layers.get(i, 0) + p.numel()
        elif {"embed_tokens", "embed_positions", "project_in"} & set(parts):
            embed += p.numel()
        else:  # final norm, project_out, lm_head
            head += p.numel()
    return embed, [layers[i] for i in sorted(layers)], head


def assert_matches(shape: ModelSpec, model) -> None:
    embed, layers, head = counts(model)
    assert len(layers) == shape.num_layers
    assert set(layers) == {shape.params.layer}
    assert shape.params.embed == embed
    assert shape.params.head == head
    assert shape.total_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_configs_match_transformers(variant, tmp_path):
    import transformers

    class_name, kwargs = VARIANTS[variant]
    config = getattr(transformers, class_name)(**kwargs)
    model = meta_model(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp_path)  # the config.json a checkpoint directory would hold

    shape = load_model_spec(str(tmp_path))

    assert_matches(shape, model)
    assert shape.name == tmp_path.name
    assert shape.architecture == type(model).__name__
    attn = (
        model.model.layers[0].self_attn if hasattr(model.model, "layers") else model.model.decoder.layers[0].self_attn
    )
    assert shape.head_dim == attn.head_dim
    assert shape.num_kv_heads * shape.head_dim == attn.k_proj.out_features
    if variant != "mixtral":
        assert shape.params.active_layer == shape.params.layer


def test_mixtral_active_params_count_only_the_routed_experts():
    from transformers import MixtralConfig

    shape = parse_model_config(
        MixtralConfig(
            **TINY, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"]
        ).to_dict(),
        "tiny",
        "test",
    )
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v (2 kv heads of 16), o
    norms, router, expert = 2 * 64, 4 * 64, 3 * 64 * 96
    assert shape.params.layer == attention + norms + router + 4 * expert
    assert shape.params.active_layer == attention + norms + router + 2 * expert == 49_536


def test_known_models_are_the_files_in_configs():
    assert known_models() == MODELS
    assert sorted(p.name for p in MODELS_DIR.glob("*.json")) == [f"{m}.json" for m in MODELS]


@pytest.mark.parametrize("name", MODELS)
def test_published_model_matches_transformers(name):
    from transformers import AutoConfig

    fields = json.loads((MODELS_DIR / f"{name}.json").read_text())
    assert isinstance(fields["_source"], str) and fields["_source"]
    kwargs = {k: v for k, v in fields.items() if k not in ("_source", "model_type")}
    model = meta_model(AutoConfig.for_model(fields["model_type"], **kwargs))

    shape = load_model_spec(name)

    assert type(model).__name__ == shape.architecture == fields["architectures"][0]
    if shape.architecture == "DeepseekV3ForCausalLM":  # dense and sparse layers: totals (see the test below)
        assert 0 <= _stored(model) - shape.total_params < shape.num_layers
    else:
        assert_matches(shape, model)


def _stored(model) -> int:
    """Parameters plus DeepSeek's routers' score-correction biases (buffers the checkpoint stores)."""
    biases = (b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + sum(biases)


def test_published_counts_anchor():
    shape = load_model_spec("llama-3.1-8b")
    assert shape.total_params == 8_030_261_248
    assert shape.kv_bytes_per_token(2) == 131_072  # 2 (K, V) * 32 layers * 8 kv heads * 128 * 2 bytes


def test_mixtral_8x7b_active_params():
    shape = load_model_spec("mixtral-8x7b")
    dense = shape.params.layer - 6 * 3 * 4096 * 14336  # 6 of 8 experts idle per token
    assert shape.params.active_layer == dense
    active_total = shape.num_layers * shape.params.active_layer + shape.params.embed + shape.params.head
    assert round(active_total / 1e9, 1) == 12.9  # Mistral's published "12.9B active parameters"


def test_names_are_case_insensitive():
    assert load_model_spec("Llama-3.1-8B") == load_model_spec("llama-3.1-8b")


@pytest.mark.parametrize(
    ("fields", "dtype"),
    [
        ({"torch_dtype": "float16"}, "float16"),
        ({"dtype": "float32", "torch_dtype": "bfloat16"}, "float32"),
        ({"torch_dtype": "bf16"}, "bfloat16"),
        ({"torch_dtype": None}, "float32"),  # what transformers loads a config without a dtype in
    ],
)
def test_dtype(fields, dtype):
    config = llama_8b() | fields
    assert parse_model_config(config, "test", "m").dtype == dtype


def test_opt_dtype_defaults_to_float32_like_every_architecture():
    config = json.loads((MODELS_DIR / "opt-30b.json").read_text())
    del config["torch_dtype"]
    assert parse_model_config(config, "test", "m").dtype == "float32"


def llama_8b() -> dict:
    return json.loads((MODELS_DIR / "llama-3.1-8b.json").read_text())


def error(fn, *args) -> str:
    with pytest.raises(OffloadError) as info:
        fn(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_name_lists_the_known_ones():
    message = error(load_model_spec, "llama-9000")
    assert "'llama-9000'" in message
    assert all(name in message for name in MODELS)


def test_missing_field_names_file_and_field(tmp_path):
    config = llama_8b()
    del config["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = error(load_model_spec, str(tmp_path))
    assert str(tmp_path / "config.json") in message
    assert "'intermediate_size'" in message


@pytest.mark.parametrize(
    ("field", "value"), [("hidden_size", "4096"), ("num_hidden_layers", 0), ("tie_word_embeddings", "no")]
)
def test_ill_typed_field_names_field_and_value(field, value):
    message = error(parse_model_config, llama_8b() | {field: value}, "some/config.json")
    assert "some/config.json" in message
    assert repr(field) in message and repr(value) in message


def test_mixtral_needs_its_expert_counts():
    config = json.loads((MODELS_DIR / "mixtral-8x7b.json").read_text())
    del config["num_experts_per_tok"]
    assert "'num_experts_per_tok'" in error(parse_model_config, config, "test")


def test_bad_dtype_names_the_value():
    message = error(parse_model_config, llama_8b() | {"torch_dtype": "int8"}, "test")
    assert "'int8'" in message and "'torch_dtype'" in message


def test_unsupported_architecture_names_it_and_the_supported_ones():
    message = error(parse_model_config, llama_8b() | {"architectures": ["GPT2LMHeadModel"]}, "test")
    assert "'GPT2LMHeadModel'" in message
    assert "LlamaForCausalLM" in message and "OPTForCausalLM" in message


def test_missing_architectures():
    config = llama_8b()
    del config["architectures"]
    assert "'architectures'" in error(parse_model_config, config, "test")


def tiny_shape(embed: int = 1000, head: int = 999) -> ModelSpec:
    return toy_spec(layer=3001, embed=embed, head=head, num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1)


def test_estimate_sizes_exact():
    shape = tiny_shape()
    assert shape.total_params == 8001
    assert estimate_sizes(shape) == [
        SizeEstimate("float32", 32_004, 12_004, "decoder layer"),
        SizeEstimate("float16", 16_002, 6_002, "decoder layer"),
        SizeEstimate("bfloat16", 16_002, 6_002, "decoder layer"),
        SizeEstimate("int8", 8_001, 3_001, "decoder layer"),
        SizeEstimate("int4", 4_001, 1_501, "decoder layer"),  # half bytes round up
    ]


def test_estimate_sizes_largest_layer_ties_go_to_the_embeddings():
    rows = estimate_sizes(tiny_shape(embed=5000, head=5000))
    assert [(row.largest_layer_name, row.largest_layer_bytes) for row in rows][::4] == [
        ("embeddings", 20_000),
        ("embeddings", 2_500),
    ]


def test_estimate_sizes_largest_layer_of_a_big_vocabulary():
    shape = load_model_spec("qwen2.5-7b")  # the untied 152064 x 3584 head outweighs one 233M-parameter layer
    rows = {row.dtype: row for row in estimate_sizes(shape)}
    assert rows["bfloat16"].largest_layer_name == "head"
    assert rows["bfloat16"].largest_layer_bytes == 2 * (152_064 * 3_584 + 3_584)  # lm_head + final norm
    assert rows["int4"].total_bytes == shape.total_params // 2


def test_deepseek_v3_is_priced_from_its_shape():
    """Multi-head latent attention, leading dense layers, routed and shared experts: the spec's totals equal the
    parameters transformers builds (plus the routers' score-correction biases, buffers stored in the checkpoint;
    the average layer rounds down by less than one parameter a layer), its KV cache is the latent per token; the
    engine runs it."""
    from transformers import DeepseekV3Config

    from offload.model.registry import get_family

    config = DeepseekV3Config(
        **TINY | dict(num_key_value_heads=4, intermediate_size=96),
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    )
    model = meta_model(config)
    config.architectures = [type(model).__name__]
    shape = parse_model_config(config.to_dict(), "tiny", "test")
    assert 0 <= _stored(model) - shape.total_params < shape.num_layers
    assert shape.dense_layers == (0,) and shape.num_experts == 8 and shape.shared_expert_size == 32
    assert shape.kv_bytes_per_token(2) == 3 * (32 + 8) * 2  # one latent of kv_lora_rank + rope dims a layer
    big = load_model_spec("deepseek-v3")
    assert round(big.total_params / 1e9) == 671 and round(big.num_layers * big.params.active_layer / 1e9) == 36
    assert type(get_family(big.architecture)).__name__ == "DeepseekFamily"


def test_gpt_oss_is_priced_from_its_shape():
    """Biased attention with sinks, sliding and full layers alternating, every layer a mixture with a biased router
    and biased experts: the spec's counts equal the parameters transformers builds; the published sizes are
    OpenAI's (117B and 21B in all, 5.1B and 3.6B active without the input embedding); the engine runs it."""
    from transformers import GptOssConfig

    from offload.model.registry import get_family

    config = GptOssConfig(
        **TINY | dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=24, intermediate_size=48),
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    model = meta_model(config)
    config.architectures = [type(model).__name__]
    shape = parse_model_config(config.to_dict(), "tiny", "test")
    assert_matches(shape, model)
    assert shape.sliding_windows == (5, None) * 2
    assert shape.qkv_bias and shape.o_bias and shape.num_experts == 4 and shape.experts_per_token == 2
    for name, total, active in (("gpt-oss-120b", 117, 5.1), ("gpt-oss-20b", 21, 3.6)):
        big = load_model_spec(name)
        assert round(big.total_params / 1e9) == total
        assert round((big.num_layers * big.params.active_layer + big.params.head) / 1e9, 1) == active
    assert type(get_family("GptOssForCausalLM")).__name__ == "GptOssFamily"


def test_kimi_k2_is_deepseek_v3_with_more_experts():
    kimi, deepseek = load_model_spec("kimi-k2"), load_model_spec("deepseek-v3")
    assert kimi.architecture == deepseek.architecture and kimi.num_experts == 384 and kimi.num_heads == 64
    assert round(kimi.total_params / 1e12, 2) == 1.03  # Moonshot's "1 trillion total parameters"
    active = kimi.num_layers * kimi.params.active_layer + kimi.params.embed + kimi.params.head
    assert round(active / 1e9) == 33  # "32 billion activated", which leaves out the input embedding
    assert kimi.kv_bytes_per_token(2) == deepseek.kv_bytes_per_token(2)  # the same latent per token and layer


def test_gpt_oss_as_published_weighs_its_experts_at_4_25_bits():
    """One more size row for gpt-oss's published checkpoints: the routed experts in MXFP4, the rest in bfloat16
    (65.2 GB for gpt-oss-120b, where bfloat16 throughout is 234 GB); other models get none."""
    spec = load_model_spec("gpt-oss-120b")
    rows = {row.dtype: row for row in estimate_sizes(spec)}
    experts = spec.num_layers * spec.num_experts * 3 * spec.hidden_size * spec.expert_size
    assert rows["mxfp4 experts"].total_bytes == pytest.approx((spec.total_params - experts) * 2 + experts * 4.25 / 8)
    assert round(rows["mxfp4 experts"].total_bytes / 1e9, 1) == 65.2
    assert round(rows["bfloat16"].total_bytes / 1e9) == 234
    assert "mxfp4 experts" not in {row.dtype for row in estimate_sizes(load_model_spec("deepseek-v3"))}
