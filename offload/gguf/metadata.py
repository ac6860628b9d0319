"""A GGUF file's metadata and tensor names in Hugging Face terms: config.json's fields, each checkpoint tensor's GGUF
name, and the row order llama.cpp's converter gave the Llama family's q and k projections.

The decoder architectures the engine runs under llama.cpp's tensor names are read: llama (Llama, Mistral and the
like; Mixtral where the file has experts), qwen2, qwen3, qwen2moe and qwen3moe; deepseek2 (DeepSeek-V2, V3, Kimi-K2)
and gpt-oss, whose metadata and the tensors llama.cpp's converter split or repacked offload/gguf/families.py reads.
A mixture's routed experts are stored stacked, one [experts, rows, columns] tensor per matrix and layer
(ffn_gate_exps, ...): each expert is read as its slice (`gguf_source`). llama.cpp permutes the rows of Llama's q and
k projections for its interleaved rotary layout (each head's rows, Hugging Face's two halves [2, head_dim / 2],
stored interleaved as [head_dim / 2, 2]); transformers' GGUF loader undoes it and so does `rotary_row_order`. Qwen2,
Qwen3 and gpt-oss keep Hugging Face's order (llama.cpp's NEOX rotary), and so does deepseek2, whose rotated pairs
llama.cpp takes interleaved as DeepSeek's own code does. Rotary scaling: none, linear, or Llama 3's, which llama.cpp
stores as per-frequency divisors (rope_freqs.weight), read back into rope_parameters where it matches Llama 3.1's
band; deepseek2's and gpt-oss's YaRN is read with the rest of their metadata.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from offload.common.errors import OffloadError
from offload.gguf.families import FAMILIES, family_config

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
MIXTRAL = "MixtralForCausalLM"  # a "llama" file with experts
PERMUTED = ("llama",)  # architectures whose q and k rows llama.cpp permutes
GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # DeepSeek's latent attention
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",  # newer files split it: offload/gguf/families.py joins attn_k_b and attn_v_b
}
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# a mixture's layer: the router, the shared expert (Qwen2-MoE, DeepSeek) and its gate, under each family's names
MOE_NAMES = {
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.router": "ffn_gate_inp",  # gpt-oss's, with a bias
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# a layer's tensors whose checkpoint names end in neither .weight nor .bias: DeepSeek-V3's routing bias, gpt-oss's sinks
WHOLE_NAMES = {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias", "self_attn.sinks": "attn_sinks.weight"}
WHOLE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# routed expert e's matrices: llama.cpp stacks each over the experts, [experts, rows, columns], as ffn_*_exps
EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
EXPERT_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
ROPE_FACTORS = "rope_freqs.weight"  # Llama 3 rope scaling as per-frequency divisors: read into config.json
# (low_freq_factor, high_freq_factor, original context) of Llama 3.1 to 3.3's rope scaling, whose factors
# rope_freqs.weight holds without naming them
LLAMA3_BAND = (1.0, 4.0, 8192)
_REQUIRED = object()


def check_magic(path: Path) -> None:
    """An OffloadError naming `path` unless it starts as a GGUF file does."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise OffloadError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")


class _Reader(GGUFReader):
    """gguf's reader, slicing a plain array view of its map: a slice of the np.memmap itself is a memmap, which numpy
    finishes in Python, and a tokenizer's strings are two slices each (a 26 GB Mixtral-shape file's header, 49,152
    tokens and their merges: 2.0 s to parse, 0.57 s this way). The same fields and tensors; their arrays plain views
    of the same map (tests/offload/test_gguf.py holds the two readers equal)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        kind, count = np.dtype(dtype), int(count)
        values = plain[offset : offset + kind.itemsize * count].view(kind)[:count]
        order = self.byte_order if override_order is None else override_order
        return values if order == "I" else values.view(kind.newbyteorder(order))


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader (memory-mapped); an OffloadError names a file that is not GGUF."""
    check_magic(path)
    try:
        return _Reader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise OffloadError(f"{path}: corrupt GGUF file ({str(exc).splitlines()[0]})") from None


def field(reader: GGUFReader, key: str, path: Path, default: object = _REQUIRED):
    """The value of metadata `key`, or `default`; a missing required key is an OffloadError naming it."""
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise OffloadError(f"{path}: GGUF metadata has no {key!r}")
        return default
    return f.contents()


def architecture(reader: GGUFReader, path: Path) -> str:
    arch = field(reader, "general.architecture", path)
    if arch not in ARCHITECTURES and arch not in FAMILIES:
        supported = ", ".join((*ARCHITECTURES, *FAMILIES))
        raise OffloadError(f"{path}: general.architecture {arch!r} is not imported (supported: {supported})")
    return arch


def hf_config(reader: GGUFReader, path: Path, dtype: str) -> dict:
    """config.json's fields for the model in `reader` (its weights stored as `dtype`, the compute dtype)."""
    arch = architecture(reader, path)
    tensors = {t.name: t for t in reader.tensors}

    def meta(key: str, default: object = _REQUIRED):
        return field(reader, f"{arch}.{key}", path, default)

    if "token_embd.weight" not in tensors:
        raise OffloadError(f"{path}: no tensor 'token_embd.weight'")
    if arch in FAMILIES:
        return family_config(arch, meta, tensors, path) | {"dtype": dtype} | special_tokens(reader, path)
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // heads)
    if meta("attention.value_length", head_dim) != head_dim or meta("rope.dimension_count", head_dim) != head_dim:
        raise OffloadError(f"{path}: {arch}.rope.dimension_count or value_length differs from the head size {head_dim}")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta("context_length", 2048),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": _rope(reader, arch, path, meta("rope.freq_base", 10000.0), head_dim),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "dtype": dtype,
    }
    return config | _experts(arch, meta, tensors, path) | special_tokens(reader, path)


def _experts(arch: str, meta, tensors: dict, path: Path) -> dict:
    """config.json's fields of a mixture of experts (none for a dense file). llama.cpp runs every layer of these
    files sparse; it renormalizes the chosen experts' weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE."""
    experts = meta("expert_count", 0)
    if not experts:
        if any("_exps." in name for name in tensors):
            raise OffloadError(f"{path}: stacked experts (ffn_*_exps) but no {arch}.expert_count")
        if arch in ("qwen2moe", "qwen3moe"):
            raise OffloadError(f"{path}: no {arch}.expert_count")
        return {}
    fields = {"num_experts_per_tok": meta("expert_used_count")}
    if arch == "llama":
        return {"architectures": [MIXTRAL], "model_type": "mixtral", "num_local_experts": experts} | fields
    if arch not in ("qwen2moe", "qwen3moe"):
        raise OffloadError(f"{path}: a mixture of experts of {arch}, which the import does not read")
    fields |= {"num_experts": experts, "moe_intermediate_size": meta("expert_feed_forward_length")}
    fields |= {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": arch == "qwen3moe"}
    if arch == "qwen2moe":
        shared = "blk.0.ffn_gate_shexp.weight" in tensors
        fields["shared_expert_intermediate_size"] = meta("expert_shared_feed_forward_length") if shared else 0
    return {"model_type": {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}[arch]} | fields


def _rope(reader: GGUFReader, arch: str, path: Path, theta: float, head_dim: int) -> dict:
    """rope_parameters: default, linear scaling, or Llama 3's from rope_freqs.weight; others are refused."""
    factors = next((t for t in reader.tensors if t.name == ROPE_FACTORS), None)
    if factors is not None:
        return _llama3_rope(np.asarray(factors.data, dtype=np.float32), theta, head_dim, path)
    kind = field(reader, f"{arch}.rope.scaling.type", path, "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {
            "rope_type": "linear",
            "rope_theta": theta,
            "factor": field(reader, f"{arch}.rope.scaling.factor", path),
        }
    raise OffloadError(f"{path}: {arch}.rope.scaling.type {kind!r} is not imported (default and linear are)")


def _llama3_rope(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict:
    """The Llama 3 rope_parameters whose scaling divides each frequency by `factors` (llama.cpp's rope_freqs.weight,
    [head_dim / 2]), for the band Llama 3.1 to 3.3 use (LLAMA3_BAND); other factors are refused."""
    from offload.common.model_config import RopeSpec
    from offload.model.rope import inverse_frequencies

    low, high, original = LLAMA3_BAND
    spec = RopeSpec(theta, "llama3", float(factors.max()), low, high, original)
    implied = inverse_frequencies(RopeSpec(theta), head_dim) / inverse_frequencies(spec, head_dim)
    if factors.shape != implied.shape or not np.allclose(factors, implied.numpy(), rtol=1e-5):
        raise OffloadError(f"{path}: {ROPE_FACTORS} holds rotary factors other than Llama 3.1's scaling: not imported")
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": spec.factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def special_tokens(reader: GGUFReader, path: Path) -> dict:
    """bos_token_id and eos_token_id (the end-of-turn ids llama.cpp also stops at included) where the file says."""
    bos = field(reader, "tokenizer.ggml.bos_token_id", path, None)
    eos = [field(reader, f"tokenizer.ggml.{k}_token_id", path, None) for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    out = {} if bos is None else {"bos_token_id": int(bos)}
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def gguf_source(hf_name: str, tensors: dict) -> tuple[str, int | None]:
    """The GGUF tensor a checkpoint tensor is read from, and which of its stacked experts it is (None: the whole
    tensor): a routed expert's matrix is a slice of llama.cpp's stacked ffn_*_exps, or, in older Mixtral files, a
    tensor of its own (blk.N.ffn_gate.E.weight) when the file has no stack."""
    if m := EXPERT.match(hf_name):
        layer, expert, matrix = m.groups()
        if matrix in EXPERT_NAMES:
            stacked = f"blk.{layer}.ffn_{EXPERT_NAMES[matrix]}_exps.weight"
            alone = f"blk.{layer}.ffn_{EXPERT_NAMES[matrix]}.{expert}.weight"
            return (alone, None) if stacked not in tensors and alone in tensors else (stacked, int(expert))
    name = gguf_name(hf_name)
    if name not in tensors and ".ffn_norm." in name:  # gpt-oss's files call it post_attention_norm
        name = name.replace(".ffn_norm.", ".post_attention_norm.")
    return name, None


def gguf_name(hf_name: str) -> str:
    """The GGUF name of a checkpoint tensor ("model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight")."""
    if (m := WHOLE.match(hf_name)) and m[2] in WHOLE_NAMES:
        return f"blk.{m[1]}.{WHOLE_NAMES[m[2]]}"
    if m := LAYER.match(hf_name):
        layer, module, kind = m.groups()
        if module in LAYER_NAMES:
            return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"
        if module in MOE_NAMES:
            return f"blk.{layer}.{MOE_NAMES[module]}.{kind}"
    else:
        module, _, kind = hf_name.rpartition(".")
        if module in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[module]}.{kind}"
    raise OffloadError(f"the engine reads {hf_name!r}, which has no GGUF name here")


def rotary_row_order(arch: str, name: str, rows: int, config: dict) -> np.ndarray | None:
    """Row indices that put GGUF tensor `name`'s rows back in Hugging Face's order (out[i] = gguf[order[i]]), or
    None where they are in it already: transformers' reverse_permute_weights, applied to row numbers."""
    if arch not in PERMUTED or not re.search(r"\.attn_[qk]\.", name):
        return None
    heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)
