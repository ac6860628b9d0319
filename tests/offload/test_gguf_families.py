"""GGUF import of llama.cpp's deepseek2 and gpt-oss files: tiny transformers checkpoints written as llama.cpp's
converter writes them (gguf's own tensor name map, its metadata keys, deepseek2's kv_b_proj split per head or kept
whole, gpt-oss's gate/up rows split and MXFP4 blocks repacked as ggml's) are imported and run as transformers runs
the checkpoints; stacked Q4_0 experts and MXFP4 blocks come through bit for bit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map, quants
from gguf import GGMLQuantizationType as T
from gguf.constants import ExpertGatingFuncType, RopeScalingType
from safetensors import safe_open
from safetensors.torch import load_file
from test_gguf import SPECIALS, _alphabet, _one_line_error, add_tokenizer, experts_kept_bit_for_bit

from conftest import make_checkpoint, mxfp4_copy
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.convert.quantize import verify
from offload.gguf.importer import import_gguf
from offload.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

TOKENS = SPECIALS + _alphabet() + ["\u0120t"]
IDS = [5, 9, 40, 41, 42, 100, 200, 7, 8, 9, 10, 11, 3]  # longer than gpt-oss's sliding window (7)
EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
# config.json's DeepSeek fields the metadata carries
DEEPSEEK_FIELDS = (
    *("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace"),
    *("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob"),
)


def _weights(source: Path) -> dict[str, np.ndarray]:
    with safe_open(source / "model.safetensors", "pt") as f:
        names = f.keys()  # a safetensors file is not a mapping
        return {k: f.get_tensor(k).numpy() for k in names}


def _start(path: Path, arch: str, config: dict) -> GGUFWriter:
    """A writer with the metadata llama.cpp's converter writes for every text model (TextModel's), and the tokenizer."""
    w = GGUFWriter(path, arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    rope = config["rope_parameters"]
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    add_tokenizer(w, TOKENS)
    return w


def _finish(w: GGUFWriter, omit: tuple[str, ...]) -> None:
    """Write the file, without the metadata keys and tensors named in `omit`."""
    for name in omit:
        assert w.kv_data[0].pop(name, None) is not None or w.tensors[0].pop(name, None) is not None, name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_deepseek_gguf(
    path: Path, source: Path, split_kv_b: bool = True, experts: T = T.F32, omit: tuple[str, ...] = ()
) -> dict[str, np.ndarray]:
    """The DeepSeek-V2 or -V3 checkpoint in `source` as llama.cpp's converter (DeepseekV2Model) writes it: MLA as
    multi-query attention over the latent, kv_b_proj split per head into k_b (transposed) and v_b (or, as older
    converters did, kept whole with the heads' widths as key and value lengths), each layer's experts stacked
    [experts, rows, columns] in `experts`, the rest F32. Returns the stacks as written, by GGUF name."""
    c = json.loads((source / "config.json").read_text())
    heads, rank, rope = c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    w = _start(path, "deepseek2", c)
    w.add_head_count_kv(1 if split_kv_b else heads)
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    if c["architectures"] == ["DeepseekV3ForCausalLM"]:  # the published configs' scoring_func "sigmoid"
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_vocab_size(c["vocab_size"])
    if c["q_lora_rank"]:
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split_kv_b:
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    if "mscale_all_dim" in c["rope_parameters"]:
        w.add_rope_scaling_yarn_log_mul(0.1 * c["rope_parameters"]["mscale_all_dim"])
    names = get_tensor_name_map(MODEL_ARCH.DEEPSEEK2, c["num_hidden_layers"])

    def add(hf: str, a: np.ndarray) -> None:
        w.add_tensor(names.get_name(hf, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(a))

    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, a in _weights(source).items():
        if m := EXPERT.match(name):
            stacks.setdefault((m[1], m[3]), {})[int(m[2])] = a
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = a.reshape(heads, nope + v, rank)
            add(name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(0, 2, 1))
            add(name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:])
        else:
            add(name.replace("e_score_correction_bias", "e_score_correction.bias"), a)
    written = {}
    for (layer, matrix), parts in stacks.items():
        name = names.get_name(f"model.layers.{layer}.mlp.experts.{matrix}.weight", try_suffixes=(".weight",))
        stack = np.stack([parts[e] for e in range(len(parts))])
        written[name] = stack if experts == T.F32 else quants.quantize(stack, experts)
        w.add_tensor(name, written[name], raw_dtype=None if experts == T.F32 else experts)
    _finish(w, omit)
    return written


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hugging Face's MXFP4 (blocks [..., n, 16]: values 2i and 2i + 1 in byte i; scales [..., n]) as ggml's
    block_mxfp4 rows [..., n x 17]: the scale byte, then values j and j + 16 in the low and high nibble of byte j."""
    values = np.stack((blocks & 15, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = values[..., :16] | (values[..., 16:] << 4)
    return np.concatenate((scales[..., None], qs), axis=-1).reshape(*scales.shape[:-1], -1)


def write_gpt_oss_gguf(path: Path, source: Path, fused: bool = False, omit: tuple[str, ...] = ()) -> dict:
    """The gpt-oss checkpoint in `source` (float or MXFP4 experts) as llama.cpp's converter (GptOssModel) writes it:
    gate_up_proj's rows and bias split into gate (even) and up (odd), or with fuse_gate_up_exps the gate rows then the
    up rows; MXFP4 blocks repacked as ggml's, float stacks output-major; the sinks as attn_sinks.weight. Returns the
    expert stacks' data as written, by GGUF name."""
    c = json.loads((source / "config.json").read_text())
    w = _start(path, "gpt-oss", c)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_expert_count(c["num_local_experts"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    names = get_tensor_name_map(MODEL_ARCH.GPT_OSS, c["num_hidden_layers"])
    weights, written = _weights(source), {}

    def put(name: str, a: np.ndarray, raw_dtype: T | None = None) -> None:
        written[name] = np.ascontiguousarray(a)
        w.add_tensor(name, written[name], raw_dtype=raw_dtype)

    def add(hf: str, a: np.ndarray, raw_dtype: T | None = None) -> None:
        put(names.get_name(hf, try_suffixes=(".weight", ".bias")), a, raw_dtype)

    def add_gate_up(hf: str, gate: np.ndarray, up: np.ndarray, raw_dtype: T | None = None) -> None:
        if not fused:
            add(hf.replace("gate_up_proj", "gate_proj"), gate, raw_dtype)
            add(hf.replace("gate_up_proj", "up_proj"), up, raw_dtype)
            return
        name = names.get_name(hf.replace("gate_up_proj", "gate_proj"), try_suffixes=(".weight", ".bias"))
        put(name.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate((gate, up), axis=1), raw_dtype)

    for name, a in weights.items():
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            blocks, scales = a, weights[name.replace("_blocks", "_scales")]
            hf = name.replace("_blocks", ".weight")
            if "down_proj" in name:
                add(hf, ggml_mxfp4(blocks, scales), T.MXFP4)
            else:
                g, u = ggml_mxfp4(blocks[:, ::2], scales[:, ::2]), ggml_mxfp4(blocks[:, 1::2], scales[:, 1::2])
                add_gate_up(hf, g, u, T.MXFP4)
        elif name.endswith("gate_up_proj_bias"):
            add_gate_up(name.replace("gate_up_proj_bias", "gate_up_proj.bias"), a[:, ::2], a[:, 1::2])
        elif name.endswith("gate_up_proj"):
            t = a.transpose(0, 2, 1)  # [experts, 2 x intermediate, hidden]
            add_gate_up(name + ".weight", t[:, ::2], t[:, 1::2])
        elif name.endswith("down_proj"):
            add(name + ".weight", a.transpose(0, 2, 1))
        elif name.endswith("down_proj_bias"):
            add(name.replace("down_proj_bias", "down_proj.bias"), a)
        else:
            add(name + ".weight" if name.endswith("sinks") else name, a)
    _finish(w, omit)
    return {n: a for n, a in written.items() if "_exps." in n}


def _logits(out: Path, model) -> tuple[torch.Tensor, torch.Tensor]:
    with LLM(out, EngineConfig(dtype="float32")) as llm:
        assert llm.spec.architecture == type(model).__name__
        got = llm.score([IDS])[0]
    with torch.no_grad():
        return got, model(torch.tensor([IDS])).logits[0, -got.shape[0] :]


# ---- deepseek2 ----------------------------------------------------------------------------------------------------


def deepseek_checkpoint(path: Path, family: str, **overrides):
    """A tiny DeepSeek checkpoint of `family` with the tokenizer's vocabulary. V3's YaRN mscale is set to its
    mscale_all_dim, as DeepSeek's configs have them and as llama.cpp reads deepseek2 files (it stores one of them)."""
    from transformers import AutoModelForCausalLM

    model = make_checkpoint(path, family, vocab_size=len(TOKENS), **overrides)
    config = json.loads((path / "config.json").read_text())
    rope = config["rope_parameters"]
    if "mscale_all_dim" not in rope:
        return model
    rope["mscale"] = rope["mscale_all_dim"]
    (path / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """DeepSeek-V3: q from low rank, a dense first layer, sigmoid routing limited to 2 of 4 groups with a
    correction bias, YaRN."""
    path = tmp_path_factory.mktemp("deepseek-v3")
    return path, deepseek_checkpoint(path, "deepseek_v3")


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
def test_deepseek_v3_runs_as_transformers_runs_its_checkpoint(tmp_path: Path, deepseek_v3, split_kv_b: bool):
    """Latent attention (kv_b_proj joined back from k_b and v_b, or read whole), YaRN's mscale, the dense layer,
    group-limited biased routing, the shared experts: float32 weights give transformers' logits."""
    source, model = deepseek_v3
    path = tmp_path / "v3.gguf"
    write_deepseek_gguf(path, source, split_kv_b)
    stats = import_gguf(path, tmp_path / "out", "cpu")
    assert stats.quant is None
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    want = json.loads((source / "config.json").read_text())
    for key in DEEPSEEK_FIELDS:
        assert config[key] == pytest.approx(want[key]), key
    rope = config["rope_parameters"]
    assert rope["mscale"] == rope["mscale_all_dim"] == want["rope_parameters"]["mscale_all_dim"]
    kept = stats.kept["model.layers.1.self_attn.kv_b_proj.weight"]
    assert kept.exact and kept.gguf == (
        "blk.1.attn_k_b.weight+blk.1.attn_v_b.weight" if split_kv_b else "blk.1.attn_kv_b.weight"
    )
    got, want = _logits(tmp_path / "out", model)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_deepseek_v2_runs_as_transformers_runs_its_checkpoint(tmp_path: Path):
    """DeepSeek-V2: q from one projection, softmax routing limited to the best groups, scaled, not renormalized; no
    gating function in the file (read as softmax, as llama.cpp reads it). The tokenizer, which transformers does not
    read from a deepseek2 file through AutoTokenizer, encodes as the checkpoint's own."""
    from transformers import AutoTokenizer

    model = deepseek_checkpoint(tmp_path / "hf", "deepseek_v2")
    path = tmp_path / "v2.gguf"
    write_deepseek_gguf(path, tmp_path / "hf")
    import_gguf(path, tmp_path / "out", "cpu")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["topk_method"] == "group_limited_greedy" and config["routed_scaling_factor"] == 1.5
    got, want = _logits(tmp_path / "out", model)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    messages = [{"role": "user", "content": "hello world"}]  # no " t": the file's one merge leaves it alone
    reference = AutoTokenizer.from_pretrained(tmp_path / "hf").apply_chat_template(messages, add_generation_prompt=True)
    with LLM(tmp_path / "out", EngineConfig(dtype="float32")) as llm:
        assert llm.prompts.encode_chat(messages) == list(reference["input_ids"])


@pytest.mark.parametrize("layout", ["cpu", "triton"])
def test_deepseek_stacked_q4_0_experts_keep_their_blocks_bit_for_bit(tmp_path: Path, layout: str):
    deepseek_checkpoint(tmp_path / "hf", "deepseek_v3", moe_intermediate_size=32)  # Q4_0 blocks divide every row
    path = tmp_path / "q4.gguf"
    stacks = write_deepseek_gguf(path, tmp_path / "hf", experts=T.Q4_0)
    out = tmp_path / "out"
    stats = import_gguf(path, out, layout)
    assert stats.quant.bits == 4 and "model.layers.1.self_attn.q_b_proj.weight" in stats.quant.unquantized
    kept = experts_kept_bit_for_bit(out, stacks, T.Q4_0)
    assert {k["stored"] for n, k in kept.items() if ".experts." in n} == {"int4-g32"}
    assert kept["model.layers.1.self_attn.kv_b_proj.weight"]["stored"] == "F32"  # float, as offload convert keeps it
    assert kept["model.layers.1.mlp.gate.weight"]["stored"] == "F32"
    verify(out)
    with LLM(out, EngineConfig(dtype="float32")) as llm:  # the codes run
        assert len(llm.generate_ids([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3


# ---- gpt-oss ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """gpt-oss float ("float") and with its experts in MXFP4 as published ("mxfp4": kernels/mxfp4.py writes the
    blocks; transformers' model of the same weights has its experts replaced by their dequantized values)."""
    path = tmp_path_factory.mktemp("gpt-oss")
    model = make_checkpoint(path, "gpt_oss", vocab_size=len(TOKENS))
    out = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    reference = mxfp4_copy(path, model, out)
    return {"float": (path, model), "mxfp4": (out, reference)}


def test_the_test_writer_repacks_mxfp4_as_gguf_reads_it():
    """ggml_mxfp4 (this file's stand-in for the converter's repacking) against gguf's own MXFP4 dequantization."""
    blocks, scales = quantize_mxfp4(torch.randn(5, 96) * torch.logspace(-3, 2, 5)[:, None])
    raw = ggml_mxfp4(blocks.numpy(), scales.numpy())
    assert raw.shape == (5, 3 * 17)
    assert torch.equal(
        torch.from_numpy(quants.dequantize(raw, T.MXFP4)), dequantize_mxfp4(blocks, scales, torch.float32)
    )


@pytest.mark.parametrize("form, fused", [("float", False), ("mxfp4", False), ("mxfp4", True)])
def test_gpt_oss_runs_as_transformers_runs_its_checkpoint(tmp_path: Path, gpt_oss, form: str, fused: bool):
    """Sinks, sliding and full layers, biases, the biased router, YaRN (truncate false), the clamped SwiGLU over gate
    and up interleaved back: transformers' logits of the same weights (MXFP4 experts as their dequantized values)."""
    source, model = gpt_oss[form]
    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(path, source, fused)
    stats = import_gguf(path, tmp_path / "out", "cpu")
    assert stats.quant is None
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["layer_types"] == json.loads((source / "config.json").read_text())["layer_types"]
    assert ("quantization_config" in config) == (form == "mxfp4") and config["rope_parameters"]["truncate"] is False
    got, want = _logits(tmp_path / "out", model)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gpt_oss_mxfp4_experts_are_the_published_blocks_bit_for_bit(tmp_path: Path, gpt_oss):
    source, _ = gpt_oss["mxfp4"]
    path = tmp_path / "gpt-oss.gguf"
    stacks = write_gpt_oss_gguf(path, source)
    out = tmp_path / "out"
    stats = import_gguf(path, out, "cpu")
    published, imported = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    for name in (n for n in published if n.endswith(("_blocks", "_scales"))):
        assert imported[name].dtype == torch.uint8 and torch.equal(imported[name], published[name]), name
    config = json.loads((source / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{layer}.mlp.experts.", f"blk.{layer}."
        for e in range(config["num_local_experts"]):
            gate_up = dequantize_mxfp4(imported[p + "gate_up_proj_blocks"][e], imported[p + "gate_up_proj_scales"][e],
                                       torch.float32)  # fmt: skip
            down = dequantize_mxfp4(
                imported[p + "down_proj_blocks"][e], imported[p + "down_proj_scales"][e], torch.float32
            )
            for got, gguf in (
                (gate_up[0::2], "ffn_gate_exps"),
                (gate_up[1::2], "ffn_up_exps"),
                (down, "ffn_down_exps"),
            ):
                assert torch.equal(got, torch.from_numpy(quants.dequantize(stacks[f"{b}{gguf}.weight"][e], T.MXFP4)))
        kept = stats.kept[p + "gate_up_proj"]
        assert kept.exact and kept.stored == "MXFP4" and kept.gguf == f"{b}ffn_gate_exps.weight+{b}ffn_up_exps.weight"
    verify(out)


# ---- refusals -----------------------------------------------------------------------------------------------------


def test_a_missing_key_or_tensor_is_a_one_line_error(capsys, tmp_path: Path, deepseek_v3, gpt_oss):
    cases = [
        (write_deepseek_gguf, deepseek_v3[0], "deepseek2.attention.kv_lora_rank", "GGUF metadata has no"),
        (write_deepseek_gguf, deepseek_v3[0], "blk.2.attn_v_b.weight", "no tensor 'blk.2.attn_v_b.weight'"),
        (write_deepseek_gguf, deepseek_v3[0], "blk.1.exp_probs_b.bias", "no tensor 'blk.1.exp_probs_b.bias'"),
        (write_gpt_oss_gguf, gpt_oss["mxfp4"][0], "gpt-oss.attention.sliding_window", "GGUF metadata has no"),
        (write_gpt_oss_gguf, gpt_oss["mxfp4"][0], "blk.1.attn_sinks.weight", "no tensor 'blk.1.attn_sinks.weight'"),
        (write_gpt_oss_gguf, gpt_oss["mxfp4"][0], "blk.0.ffn_up_exps.weight", "no tensor 'blk.0.ffn_up_exps.weight'"),
    ]
    for i, (write, source, omit, message) in enumerate(cases):
        path, out = tmp_path / f"bad{i}.gguf", tmp_path / f"out{i}"
        write(path, source, omit=(omit,))
        _one_line_error(capsys, ["convert", "--model", str(path), "--out", str(out)], path.name, message)
        assert not out.exists()
