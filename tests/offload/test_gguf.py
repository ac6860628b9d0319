"""GGUF import: small GGUF files written here with gguf's own writer (llama.cpp's names, its q/k row permutation,
its block encodings) are imported, and the engine's view of every imported matrix is compared with
gguf.quants.dequantize, bit for bit where the format keeps the blocks; the models then run as transformers runs the
same files. The real SmolLM2 Q4_1 file runs as transformers runs its float copy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants
from safetensors import safe_open

from offload.api import LLM
from offload.cli import main
from offload.common.config import EngineConfig, SamplingParams
from offload.convert.quantize import MANIFEST, verify
from offload.gguf.codes import engine_int4, int4_groups
from offload.gguf.importer import import_gguf
from offload.gguf.metadata import open_gguf
from offload.kernels.quant_matmul import dequantize
from real_model import reference_perplexity

TESTS = Path(__file__).resolve().parents[1]
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HIDDEN, INTER, LAYERS = 256, 256, 2  # input widths a multiple of 256: Q4_K's and Q6_K's super-blocks
SHAPES = {  # architecture -> (heads, kv heads, head_dim)
    "llama": (4, 2, 64),
    "qwen2": (4, 2, 64),
    "qwen3": (4, 2, 128),  # head_dim apart from hidden / heads (transformers reads Qwen3 GGUFs with 128)
}
HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _random_blocks(rows: int, k: int, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Rows of Q4_K or Q6_K super-blocks built byte by byte (gguf cannot quantize to them): random codes and 6-bit
    scales, f16 super-scales of a weight's size."""
    nb = rows * k // 256
    if qtype == T.Q4_K:  # d, dmin, 12 bytes of scales and mins, 128 bytes of codes
        d = rng.uniform(1e-3, 4e-3, (nb, 2)).astype(np.float16).view(np.uint8)
        rest = rng.integers(0, 256, (nb, 140), dtype=np.uint8)
        blocks = np.concatenate((d, rest), axis=1)
    else:  # Q6_K: 128 bytes low codes, 64 high, 16 int8 scales, d
        rest = rng.integers(0, 256, (nb, 208), dtype=np.uint8)
        blocks = np.concatenate((rest, rng.uniform(1e-4, 1e-3, (nb, 1)).astype(np.float16).view(np.uint8)), axis=1)
    return blocks.reshape(rows, -1)


def _encode(a: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype in (T.Q4_K, T.Q6_K):
        return _random_blocks(a.shape[0], a.shape[1], qtype, rng)
    if qtype in (T.F32, T.F16, T.I32):
        return a.astype({T.F32: np.float32, T.F16: np.float16, T.I32: np.int32}[qtype])
    return quants.quantize(a.astype(np.float32), qtype)


def _llama_cpp_permute(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q and k rows, on rows of any bytes."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def add_tokenizer(w: GGUFWriter, tokens: list[str]) -> None:
    """A byte-level BPE tokenizer of `tokens` (SPECIALS first, one merge), bos 1, eos 2, and CHAT as the template."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT)


def write_gguf(
    path: Path,
    arch: str = "llama",
    qtype: T = T.Q4_0,
    types: dict[str, T] | None = None,
    rope_freqs: np.ndarray | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A 2-layer `arch` model with a byte-level tokenizer and chat template; layer matrices in `qtype` (`types`
    overrides by GGUF name), the embedding Q8_0. Returns every layer matrix's GGUF data in Hugging Face row order."""
    rng = np.random.default_rng(seed)
    heads, kv, d = SHAPES.get(arch, SHAPES["llama"])
    tokens = SPECIALS + _alphabet() + ["\u0120t"]
    w = GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(w, tokens)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.add_tensor(
        "token_embd.weight", quants.quantize(rng.normal(0, 0.5, (len(tokens), HIDDEN)), T.Q8_0), raw_dtype=T.Q8_0
    )
    hf_order = {}
    rows = {"attn_q": heads * d, "attn_k": kv * d, "attn_v": kv * d, "ffn_gate": INTER, "ffn_up": INTER}
    inputs = {"attn_output": heads * d, "ffn_down": INTER}
    for i in range(LAYERS):
        for m in MATRICES:
            name = f"blk.{i}.{m}.weight"
            t = (types or {}).get(name, qtype)
            data = hf_order[name] = _encode(rng.normal(0, 0.15, (rows.get(m, HIDDEN), inputs.get(m, HIDDEN))), t, rng)
            if arch == "llama" and m in ("attn_q", "attn_k"):
                data = _llama_cpp_permute(data, heads if m == "attn_q" else kv)
            w.add_tensor(name, data, raw_dtype=None if t in (T.F32, T.F16, T.I32) else t)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
        if arch == "qwen2":
            for m, size in (("attn_q", heads * d), ("attn_k", kv * d), ("attn_v", kv * d)):
                w.add_tensor(f"blk.{i}.{m}.bias", rng.normal(0, 0.02, size).astype(np.float32))
        if arch == "qwen3":
            for m in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{m}.weight", rng.uniform(0.8, 1.2, d).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf_order


def _hf_name(gguf: str) -> str:
    _, layer, module, kind = gguf.split(".")
    return f"model.layers.{layer}.{HF[module]}.{kind}"


def engine_weight(out: Path, hf_name: str) -> torch.Tensor:
    """What the engine multiplies for `hf_name`, as float32: dequantized codes (the cpu layout's unpacked by torch's
    own int4 kernel times the identity), or the float tensor."""
    quant = json.loads((out / "config.json").read_text()).get("quantization_config")
    prefix = hf_name.removesuffix(".weight")
    with safe_open(out / "model.safetensors", "pt") as f:
        if prefix + ".qweight" not in set(f.keys()):
            return f.get_tensor(hf_name).float()
        codes, scales = f.get_tensor(prefix + ".qweight"), f.get_tensor(prefix + ".scales").float()
    if quant["layout"] == "cpu":
        k = codes.shape[1] * 2
        eye = torch.eye(k)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, codes, k // scales.shape[0], scales).t()
    return dequantize(codes, scales, quant["bits"])


@pytest.mark.parametrize(
    "qtype, layout, stored",
    [
        (T.Q4_0, "cpu", "int4-g32"),
        (T.Q4_0, "triton", "int4-g32"),
        (T.Q4_1, "cpu", "int4-g32"),
        (T.Q4_1, "triton", "int4-g32"),
        (T.Q4_K, "cpu", "int4-g32"),
        (T.Q4_K, "triton", "int4-g32"),
        (T.Q8_0, "triton", "int8-g32"),
        (T.Q8_0, "cpu", "F32"),  # the cpu layout's int8 has one scale per channel: kept float, exact
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_kept_blocks_are_what_gguf_dequantizes_bit_for_bit(tmp_path: Path, qtype: T, layout: str, stored: str):
    path = tmp_path / "m.gguf"
    data = write_gguf(path, qtype=qtype)
    out = tmp_path / "out"
    stats = import_gguf(path, out, layout)
    manifest = json.loads((out / MANIFEST).read_text())["gguf"]["tensors"]
    for gguf, raw in data.items():
        hf = _hf_name(gguf)
        want = torch.from_numpy(quants.dequantize(raw, qtype))
        assert torch.equal(engine_weight(out, hf), want), gguf
        assert manifest[hf]["stored"] == stored and manifest[hf]["exact"], manifest[hf]
    assert (stats.quant is None) == (stored == "F32")
    (embed,) = (t for t in open_gguf(path).tensors if t.name == "token_embd.weight")
    embed = quants.dequantize(embed.data, T.Q8_0)
    assert torch.equal(engine_weight(out, "model.embed_tokens.weight"), torch.from_numpy(embed))
    verify(out)


def test_q4_k_zero_points_float32_cannot_hold_are_counted_and_round_once():
    rng = np.random.default_rng(1)
    blocks = _random_blocks(64, 256, T.Q4_K, rng)  # [64 rows, one super-block each]
    d_dmin = (2.0 ** rng.uniform(-14, -2, (64, 2))).astype(np.float16)  # d and dmin up to 2^12 apart
    blocks[:, 0:4] = d_dmin.view(np.uint8)
    groups = int4_groups(blocks, T.Q4_K)
    got = dequantize(*engine_int4(groups), 4)
    want = torch.from_numpy(quants.dequantize(blocks, T.Q4_K))
    off = (got != want).view(64, 8, 32).any(-1)  # [rows, groups]
    assert 0 < int(off.sum()) <= groups.inexact < 64 * 8
    # the zero point's rounding (half its ulp) carried through the sum's (a value's ulp, both roundings together)
    value = np.maximum(np.abs(got.numpy()), np.abs(want.numpy()))
    bound = np.spacing(np.abs(groups.zero)).repeat(32, axis=1) / 2 + np.spacing(value)
    assert ((got - want).abs().numpy() <= bound).all()


def test_mixed_types_keep_one_format_and_record_the_rest(tmp_path: Path):
    path = tmp_path / "mixed.gguf"
    types = {
        "blk.0.attn_v.weight": T.Q8_0,  # int8: not held by an int4 checkpoint, so float (exact)
        "blk.0.ffn_down.weight": T.Q6_K,  # likewise
        "blk.1.ffn_up.weight": T.Q5_0,  # 5 bits: requantized to int4
        "blk.1.attn_output.weight": T.F16,  # float: as stored
    }
    data = write_gguf(path, qtype=T.Q4_1, types=types)
    out = tmp_path / "out"
    stats = import_gguf(path, out, "cpu")
    floats = {_hf_name(n) for n in types if types[n] != T.Q5_0}
    assert stats.quant.bits == 4 and stats.quant.unquantized == floats
    config = json.loads((out / "config.json").read_text())
    assert sorted(config["quantization_config"]["unquantized"]) == sorted(floats)
    kept = json.loads((out / MANIFEST).read_text())["gguf"]["tensors"]
    for gguf, raw in data.items():
        hf, qtype = _hf_name(gguf), types.get(gguf, T.Q4_1)
        want = torch.from_numpy(quants.dequantize(raw.view(np.uint8), qtype)).reshape(raw.shape[0], -1)
        got = engine_weight(out, hf)
        if qtype == T.Q5_0:
            err = (got - want).norm() / want.norm()
            assert not kept[hf]["exact"] and kept[hf]["stored"] == "int4-g32"
            assert 0 < err < 0.1 and kept[hf]["rel_rms"] == pytest.approx(float(err), rel=1e-3)
        else:
            assert torch.equal(got, want), gguf
            assert kept[hf]["exact"]
    assert kept[_hf_name("blk.1.attn_output.weight")]["stored"] == "F16"
    assert "requantized: relative RMS error up to" in stats.summary()
    with LLM(out, EngineConfig(dtype="float32")) as llm:  # the engine runs the mixed checkpoint
        assert len(llm.generate_ids([[5, 6, 7]], SamplingParams(max_new_tokens=2))[0].token_ids) >= 1


def test_an_int8_checkpoint_requantizes_q6_k_in_the_triton_layout(tmp_path: Path):
    path = tmp_path / "q8.gguf"
    data = write_gguf(path, qtype=T.Q8_0, types={"blk.0.ffn_down.weight": T.Q6_K})
    stats = import_gguf(path, tmp_path / "out", "triton")
    assert stats.quant.name == "int8-g32-triton" and not stats.quant.unquantized
    kept = stats.kept["model.layers.0.mlp.down_proj.weight"]
    assert kept.how == "requantized" and 0 < kept.rel_rms < 0.01
    want = torch.from_numpy(quants.dequantize(data["blk.0.ffn_down.weight"], T.Q6_K))
    err = engine_weight(tmp_path / "out", "model.layers.0.mlp.down_proj.weight") - want
    assert float(err.abs().max()) == pytest.approx(kept.max_abs)


@pytest.mark.parametrize("arch", sorted(SHAPES))
def test_imported_models_compute_what_transformers_computes_from_the_file(tmp_path: Path, arch: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, qtype=T.Q4_K)
    out = tmp_path / "out"
    import_gguf(path, out, "cpu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    messages = [{"role": "user", "content": "the rotary rows"}]
    with LLM(out, EngineConfig(dtype="float32")) as llm:
        ids = llm.prompts.encode_chat(messages)
        assert ids == list(reference.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        got = llm.score([ids])[0]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -got.shape[0] :]
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


# ---- mixtures of experts: transformers' checkpoints written as llama.cpp's converter writes them ------------------

MOE_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# sizes a Q4_0 block divides; every layer sparse, as llama.cpp runs these files
MOE_SHAPE = dict(intermediate_size=96, mlp_only_layers=[], shared_expert_intermediate_size=64)
MOE_HF = {
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
MOE_HF |= {f"mlp.shared_expert.{m}_proj": f"ffn_{m}_shexp" for m in ("gate", "up", "down")}
MOE_HF |= {f"self_attn.{m}_norm": f"attn_{m}_norm" for m in ("q", "k")}
MOE_HF |= {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"} | {v: k for k, v in HF.items()}
EXPERT_HF = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def moe_checkpoint(path: Path, family: str):
    """A transformers mixture of `family` saved to `path`, its vocabulary write_moe_gguf's tokens."""
    from conftest import make_checkpoint

    shape = MOE_SHAPE if family != "mixtral" else {"intermediate_size": 64}
    return make_checkpoint(path, family, vocab_size=len(SPECIALS) + len(_alphabet()) + 1, **shape)


def write_moe_gguf(path: Path, family: str, source: Path, qtype: T) -> dict[str, np.ndarray]:
    """The checkpoint in `source` as llama.cpp's converter writes it: its names, q/k rows permuted for llama, each
    layer's routed experts stacked [experts, rows, columns] per matrix; projections in `qtype`, the rest F32. Returns
    the stacked experts' data as written."""
    config = json.loads((source / "config.json").read_text())
    with safe_open(source / "model.safetensors", "pt") as f:
        names = f.keys()  # a safetensors file is not a mapping
        weights = {k: f.get_tensor(k).float().numpy() for k in names}
    arch, hidden, heads = MOE_ARCH[family], config["hidden_size"], config["num_attention_heads"]
    kv, d = config["num_key_value_heads"], config.get("head_dim") or hidden // heads
    experts = config.get("num_local_experts") or config["num_experts"]
    tokens = SPECIALS + _alphabet() + ["\u0120t"]
    w = GGUFWriter(path, arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_count(experts)
    w.add_expert_used_count(config["num_experts_per_tok"])
    if family != "mixtral":
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    add_tokenizer(w, tokens)

    def add(name: str, a: np.ndarray, quantized: bool) -> np.ndarray:
        data = quants.quantize(a, qtype) if quantized and qtype != T.F32 else a.astype(np.float32)
        w.add_tensor(name, data, raw_dtype=qtype if quantized and qtype != T.F32 else None)
        return data

    add("token_embd.weight", weights["model.embed_tokens.weight"], False)
    add("output_norm.weight", weights["model.norm.weight"], False)
    if "lm_head.weight" in weights:
        add("output.weight", weights["lm_head.weight"], False)
    stacks: dict[str, list[np.ndarray]] = {}
    for name, a in weights.items():
        if not name.startswith("model.layers."):
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        if module.split(".")[1:2] == ["experts"]:  # mlp.experts.E.gate_proj / block_sparse_moe.experts.E.w1
            e, matrix = int(module.split(".")[2]), module.split(".")[3]
            stacks.setdefault(f"blk.{layer}.ffn_{EXPERT_HF[matrix]}_exps.weight", [None] * experts)[e] = a
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            a = _llama_cpp_permute(a, heads if "q_proj" in module else kv)
        if module == "mlp.shared_expert_gate":
            a = a.reshape(-1)  # llama.cpp's [hidden] vector
        add(f"blk.{layer}.{MOE_HF[module]}.{kind}", a, module.endswith("_proj") and kind == "weight")
    written = {}
    for name, parts in stacks.items():
        written[name] = np.stack([quants.quantize(p, qtype) if qtype != T.F32 else p for p in parts])
        w.add_tensor(name, written[name], raw_dtype=None if qtype == T.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.mark.parametrize("family", sorted(MOE_ARCH))
def test_a_mixture_runs_as_transformers_runs_its_checkpoint(tmp_path: Path, family: str):
    """The stacked experts, the router, the shared expert and its gate, the config (experts, top-k, whether the
    top-k weights are renormalized) come through the import: float32 weights give transformers' logits."""
    model = moe_checkpoint(tmp_path / "hf", family)
    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, family, tmp_path / "hf", T.F32)
    stats = import_gguf(path, tmp_path / "out", "cpu")
    assert stats.quant is None
    ids = [5, 9, 40, 41, 42, 100, 200, 7, 8, 9, 10, 11, 3]
    with LLM(tmp_path / "out", EngineConfig(dtype="float32")) as llm:
        assert llm.spec.architecture == type(model).__name__
        got = llm.score([ids])[0]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -got.shape[0] :]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["cpu", "triton"])
def test_each_stacked_expert_keeps_its_q4_blocks_bit_for_bit(tmp_path: Path, layout: str):
    moe_checkpoint(tmp_path / "hf", "qwen2_moe")
    path = tmp_path / "moe.gguf"
    stacks = write_moe_gguf(path, "qwen2_moe", tmp_path / "hf", T.Q4_0)
    out = tmp_path / "out"
    stats = import_gguf(path, out, layout)
    assert stats.quant is not None and stats.quant.bits == 4 and not stats.quant.unquantized
    experts_kept_bit_for_bit(out, stacks, T.Q4_0)
    with LLM(out, EngineConfig(dtype="float32")) as llm:  # the codes run
        assert len(llm.generate_ids([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids) == 3


def experts_kept_bit_for_bit(out: Path, stacks: dict[str, np.ndarray], qtype: T) -> dict:
    """Each expert of each stack written (`stacks`, by GGUF name) is, in the import at `out`, what gguf dequantizes
    its slice to, recorded as exact; returns the manifest's record of every tensor."""
    kept = json.loads((out / MANIFEST).read_text())["gguf"]["tensors"]
    for name, stack in stacks.items():
        layer, matrix = name.split(".")[1], name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
        for e in range(stack.shape[0]):
            hf = f"model.layers.{layer}.mlp.experts.{e}.{matrix}_proj.weight"
            assert torch.equal(engine_weight(out, hf), torch.from_numpy(quants.dequantize(stack[e], qtype))), hf
            assert kept[hf]["gguf"] == name and kept[hf]["exact"]
    return kept


def llama31_factors(theta: float, dim: int, factor: float) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for Llama 3.1's rope scaling (band 1, 4, 8192)."""
    low, high, original = 1.0, 4.0, 8192
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rotary_factors_become_its_rope_scaling(capsys, tmp_path: Path):
    factors = llama31_factors(10000.0, 64, 8.0)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()  # every band
    path = tmp_path / "llama3.gguf"
    write_gguf(path, rope_freqs=factors)
    import_gguf(path, tmp_path / "out", "cpu")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    other = tmp_path / "other.gguf"
    write_gguf(other, rope_freqs=factors * np.linspace(1.0, 1.1, factors.size, dtype=np.float32))
    out = tmp_path / "out2"
    _one_line_error(capsys, ["convert", "--model", str(other), "--out", str(out)], "other than Llama 3.1's scaling")
    assert not out.exists()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path)
    return path


def _one_line_error(capsys, argv: list[str], *fragments: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_bad_files_are_one_line_errors_and_leave_nothing(capsys, tmp_path: Path, tiny_gguf: Path):
    other = tmp_path / "other.gguf"
    write_gguf(other, "gpt2")
    ints = tmp_path / "ints.gguf"
    write_gguf(ints, types={"blk.1.ffn_up.weight": T.I32})
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    out = tmp_path / "out"
    convert = ["convert", "--out", str(out), "--model"]
    _one_line_error(capsys, [*convert, str(other)], "other.gguf: general.architecture 'gpt2' is not imported")
    _one_line_error(capsys, [*convert, str(ints)], "ints.gguf: tensor 'blk.1.ffn_up.weight' has type I32")
    _one_line_error(capsys, [*convert, str(text)], "notes.gguf: not a GGUF file")
    _one_line_error(capsys, ["generate", "--prompt", "x", "--model", str(text)], "notes.gguf: not a GGUF file")
    _one_line_error(capsys, [*convert, str(tiny_gguf), "--quant", "int4"], "do not apply to the GGUF file")
    _one_line_error(capsys, [*convert, str(tiny_gguf.parent)], "--quant int4|int8|mxfp4 is required")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ints.gguf", "notes.gguf", "other.gguf"]
    out.mkdir()
    _one_line_error(capsys, [*convert, str(tiny_gguf)], f"--out {out}: already exists")
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_the_real_model_generates_as_transformers_does(smollm2_gguf: Path, smollm2_float: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "smollm2"
    stats = import_gguf(smollm2_gguf, out, "cpu")
    assert stats.quant.name == "int4-g32-cpu" and not stats.quant.unquantized
    assert all(k.exact and not k.inexact_groups for k in stats.kept.values())
    model = AutoModelForCausalLM.from_pretrained(smollm2_float, dtype=torch.float32).eval()
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity in one sentence."]
    with LLM(out, EngineConfig(dtype="float32")) as llm:
        ids = [llm.prompts.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        completions = llm.generate_ids(ids, SamplingParams(max_new_tokens=16))
        logits = llm.score([ids[0]])[0]
    for prompt, c in zip(ids, completions, strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :]
        assert list(c.token_ids) == want.tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids[0]])).logits[0, -logits.shape[0] :]
    torch.testing.assert_close(logits, want, atol=1e-3, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_the_imported_codes_score_transformers_perplexity_of_the_same_weights(
    smollm2_gguf: Path, smollm2_float: Path, dtype: str
):
    """The Q4_1 codes as imported against transformers' float32 dequantization of the same file, on the first
    paragraphs of the shipped text: within 0.5% in the import's default compute dtype (bfloat16), and within 0.01%
    in float32 (torch's int4 CPU matmul is slow in float32: a shorter excerpt there)."""
    paragraphs = (TESTS / "data" / "eval_text.txt").read_text().split("\n\n")
    text = "\n\n".join(paragraphs[: 6 if dtype == "auto" else 2])
    want = reference_perplexity(smollm2_float, text, 256)
    with LLM(smollm2_gguf, EngineConfig(dtype=dtype)) as llm:
        assert llm.placement.dtype == ("bfloat16" if dtype == "auto" else "float32")
        got = llm.perplexity(text, 256)
    assert got.predicted >= (600 if dtype == "auto" else 150)
    assert got.perplexity == pytest.approx(want, rel=5e-3 if dtype == "auto" else 1e-4)


def test_the_readers_fast_slicing_gives_gguf_s_own_fields_and_tensors(smollm2_gguf: Path):
    """open_gguf slices a plain view of the map (offload/gguf/metadata.py `_Reader`): every field and tensor as gguf's
    own reader gives them, on the real file's 49,152 tokens and merges."""
    from gguf import GGUFReader

    ours, theirs = open_gguf(smollm2_gguf), GGUFReader(smollm2_gguf)
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 20
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.types, got.data) == (want.offset, want.types, want.data), key
        assert [p.tobytes() for p in got.parts] == [p.tobytes() for p in want.parts], key
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert ours.data_offset == theirs.data_offset
    for got, want in zip(ours.tensors, theirs.tensors, strict=True):
        assert (got.name, got.tensor_type, list(got.shape), got.data_offset, got.n_bytes) == (
            want.name, want.tensor_type, list(want.shape), want.data_offset, want.n_bytes,
        )  # fmt: skip
        assert got.data.dtype == want.data.dtype and np.array_equal(got.data[:2], want.data[:2])
