"""llama.cpp's deepseek2 files (DeepSeek-V2, DeepSeek-V3, Kimi-K2) and gpt-oss files in Hugging Face terms: config.json
from their metadata (`family_config`), and the checkpoint tensors llama.cpp's converter split or repacked, made back
from the file's (`joined_tensors`). The rest of their tensors are read as any family's (offload/gguf/metadata.py).

deepseek2. The converter writes multi-head latent attention as multi-query attention over the latent: head_count_kv
1, key_length kv_lora_rank + qk_rope_head_dim, value_length kv_lora_rank, and each head's own widths as
attention.key_length_mla (qk_nope_head_dim + qk_rope_head_dim) and value_length_mla (v_head_dim); older files have no
*_mla keys, their key_length and value_length being the heads'. rope.dimension_count is qk_rope_head_dim, q/k rows
are not permuted (llama.cpp rotates deepseek2's pairs interleaved, as stored). Newer files split kv_b_proj
[heads x (nope + v), kv_rank] per head into attn_k_b [heads, kv_rank, nope] (the key part transposed) and attn_v_b
[heads, v, kv_rank]; older ones keep attn_kv_b. Either becomes kv_b_proj, float as `offload convert` keeps it.
Routing: expert_gating_func 2 (sigmoid) is DeepSeek-V3's, choosing by the scores plus exp_probs_b (the correction
bias) among expert_group_used_count of expert_group_count groups, renormalized where expert_weights_norm says;
1 (softmax), or none as in older files, is DeepSeek-V2's. expert_weights_scale is routed_scaling_factor,
leading_dense_block_count first_k_dense_replace, expert_shared_count n_shared_experts. YaRN's mscale_all_dim is stored
times 0.1 as rope.scaling.yarn_log_multiplier, and llama.cpp takes mscale equal to it (as DeepSeek's configs have it).

gpt-oss. Each layer's experts come as stacks [experts, rows, columns]: the interleaved gate_up_proj split into
ffn_gate_exps (its even rows) and ffn_up_exps (its odd ones), or fused as ffn_gate_up_exps (the gate rows, then the
up rows), likewise their biases, and ffn_down_exps. The published MXFP4 blocks are repacked as ggml's block_mxfp4:
the exponent byte, then 16 bytes holding values j and j + 16 in the low and high nibble of byte j, where Hugging
Face's `*_blocks` hold values 2i and 2i + 1 in byte i. Interleaved and repacked back, the experts are the published
`*_blocks` and `*_scales` bit for bit (quantization_config "mxfp4"); stacks of other types become the float
gate_up_proj [experts, hidden, 2 x intermediate] and down_proj [experts, intermediate, hidden]. Sliding-window
attention (attention.sliding_window) is on every other layer from layer 0, llama.cpp's fixed pattern; YaRN from
rope.scaling.*, with the truncate false gpt-oss's config sets (llama.cpp stores none).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, ReaderTensor
from gguf import GGMLQuantizationType as T

from offload.common.deepseek_shape import V2, V3
from offload.common.errors import OffloadError
from offload.common.model_config import GPT_OSS, ModelSpec
from offload.convert.mxfp4_experts import KEPT_FLOAT
from offload.convert.quantize import Planned
from offload.gguf.codes import FLOATS, float_tensor
from offload.gguf.kept import Kept
from offload.kernels.mxfp4 import BLOCK
from offload.tiers.weights.checkpoint import TORCH_DTYPES, TensorSpec

FAMILIES = ("deepseek2", "gpt-oss")
SOFTMAX, SIGMOID = 1, 2  # expert_gating_func: llama.cpp's expert gating function types
YARN = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor"}
EXPERT_STACK = re.compile(r"^blk\.\d+\.ffn_\w+_exps\.weight$")
MXFP4_BYTES = 1 + BLOCK // 2  # ggml's block_mxfp4: the exponent, then 16 bytes of codes
SWIGLU_LIMIT = 7.0  # gpt-oss's expert clamp, fixed in llama.cpp (not in the metadata)


@dataclass(frozen=True, slots=True)
class Joined:
    """A checkpoint tensor made from GGUF tensors that llama.cpp's converter split or repacked."""

    name: str  # in the checkpoint
    sources: tuple[str, ...]  # the GGUF tensors it is made from
    dtype: str  # safetensors code of what is written
    shape: tuple[int, ...]
    qtype: str  # the sources' GGUF type(s), e.g. "MXFP4"
    make: Callable[[dict[str, ReaderTensor]], torch.Tensor]  # the file's tensors -> the checkpoint tensor

    @property
    def weight(self) -> str:
        """The name the import's manifest records it under: MXFP4 blocks and scales as their matrix."""
        return self.name.removesuffix("_blocks").removesuffix("_scales")

    @property
    def kept(self) -> Kept:
        """Every value as gguf.quants.dequantize gives the sources' (rearranged only), MXFP4 as its bits."""
        return Kept("+".join(self.sources), self.qtype, "MXFP4" if self.dtype == "U8" else self.dtype, True)

    @property
    def planned(self) -> Planned:
        return Planned(self.name, TensorSpec(self.sources[0], self.shape), self.dtype, self.shape, "joined")


def family_config(arch: str, meta: Callable, tensors: dict[str, ReaderTensor], path: Path) -> dict:
    """config.json's fields (but dtype and the special tokens) of a deepseek2 or gpt-oss file; `meta(key, default)`
    reads "<arch>.<key>"."""
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    common = {
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "max_position_embeddings": meta("context_length", 4096),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "deepseek2":
        return common | _deepseek2(meta, heads, path)
    return common | _gpt_oss(meta, hidden // heads, common["num_hidden_layers"], tensors, path)


def _deepseek2(meta: Callable, heads: int, path: Path) -> dict:
    gating = meta("expert_gating_func", SOFTMAX)  # llama.cpp reads older files without it as softmax
    if gating not in (SOFTMAX, SIGMOID):
        raise OffloadError(f"{path}: deepseek2.expert_gating_func {gating} is not imported (1 softmax, 2 sigmoid)")
    v3, groups, norm = gating == SIGMOID, meta("expert_group_count", 1), meta("expert_weights_norm", False)
    if norm and not v3:
        raise OffloadError(f"{path}: deepseek2.expert_weights_norm with softmax routing, which DeepSeek-V2 never does")
    rope_dim = meta("rope.dimension_count")
    key = meta("attention.key_length_mla", None) or meta("attention.key_length")
    rope = _rope(meta, "deepseek2", path)
    if rope["rope_type"] == "yarn" and (log_mul := meta("rope.scaling.yarn_log_multiplier", 0.0)):
        rope["mscale"] = rope["mscale_all_dim"] = round(log_mul * 10, 6)  # stored as 0.1 x mscale_all_dim, float32
    return {
        "architectures": [V3 if v3 else V2],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "intermediate_size": meta("feed_forward_length"),
        "moe_intermediate_size": meta("expert_feed_forward_length"),
        "num_key_value_heads": heads,
        "q_lora_rank": meta("attention.q_lora_rank", None),
        "kv_lora_rank": meta("attention.kv_lora_rank"),
        "qk_nope_head_dim": key - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": meta("attention.value_length_mla", None) or meta("attention.value_length"),
        "n_routed_experts": meta("expert_count"),
        "num_experts_per_tok": meta("expert_used_count"),
        "n_shared_experts": meta("expert_shared_count"),
        "first_k_dense_replace": meta("leading_dense_block_count", 0),
        "routed_scaling_factor": meta("expert_weights_scale", 1.0),  # absent: llama.cpp does not scale
        "norm_topk_prob": norm,
        "scoring_func": "sigmoid" if v3 else "softmax",
        "n_group": groups,
        "topk_group": meta("expert_group_used_count", 1),
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy",
        "rope_parameters": rope,
        "attention_bias": False,
    }


def _gpt_oss(meta: Callable, head_dim: int, layers: int, tensors: dict[str, ReaderTensor], path: Path) -> dict:
    head_dim = meta("attention.key_length", head_dim)
    if meta("attention.value_length", head_dim) != head_dim:
        raise OffloadError(f"{path}: gpt-oss.attention.value_length differs from key_length {head_dim}")
    config = {
        "architectures": [GPT_OSS],
        "model_type": "gpt_oss",
        "intermediate_size": meta("expert_feed_forward_length"),
        "num_key_value_heads": meta("attention.head_count_kv"),
        "head_dim": head_dim,
        "num_local_experts": meta("expert_count"),
        "num_experts_per_tok": meta("expert_used_count"),
        "sliding_window": meta("attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "rope_parameters": _rope(meta, "gpt-oss", path) | {"truncate": False},
        "attention_bias": True,
        "swiglu_limit": SWIGLU_LIMIT,
    }
    mxfp4 = {T(t.tensor_type) == T.MXFP4 for name, t in tensors.items() if EXPERT_STACK.match(name)}
    if len(mxfp4) > 1:
        raise OffloadError(f"{path}: some expert stacks are MXFP4 and others not, which one checkpoint cannot hold")
    if mxfp4 == {True}:  # as the published checkpoints say it
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": KEPT_FLOAT}
    return config


def _rope(meta: Callable, arch: str, path: Path) -> dict:
    """rope_parameters: default, or YaRN as the converter writes transformers' rope_parameters."""
    theta = meta("rope.freq_base", 10000.0)
    kind = meta("rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise OffloadError(f"{path}: {arch}.rope.scaling.type {kind!r} is not imported (none and yarn are)")
    rope = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": meta("rope.scaling.factor"),
        "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
    }
    return rope | {hf: v for key, hf in YARN.items() if (v := meta(f"rope.scaling.{key}", None)) is not None}


def joined_tensors(arch: str, tensors: dict[str, ReaderTensor], spec: ModelSpec, path: Path) -> dict[str, Joined]:
    """The checkpoint tensors of `spec` made from several of the file's tensors or repacked, by name."""
    if arch == "deepseek2":
        return {j.name: j for layer in range(spec.num_layers) if (j := _kv_b(layer, tensors, spec, path))}
    if arch == "gpt-oss":
        return {j.name: j for layer in range(spec.num_layers) for j in _experts(layer, tensors, spec, path)}
    return {}


def _kv_b(layer: int, tensors: dict[str, ReaderTensor], spec: ModelSpec, path: Path) -> Joined | None:
    """kv_b_proj from attn_k_b and attn_v_b; None where the file holds attn_kv_b (read as stored) or neither."""
    k_b, v_b = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
    if f"blk.{layer}.attn_kv_b.weight" in tensors or not (k_b in tensors or v_b in tensors):
        return None
    m, heads = spec.mla, spec.num_heads
    _check(tensors, path, {k_b: (heads, m.kv_rank, m.nope_dim), v_b: (heads, m.v_dim, m.kv_rank)})
    name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
    return _float(name, (k_b, v_b), (heads * (m.nope_dim + m.v_dim), m.kv_rank), tensors, path, _join_kv_b)


def _join_kv_b(sources: tuple[str, ...], dtype: torch.dtype, tensors: dict[str, ReaderTensor]) -> torch.Tensor:
    k_b, v_b = (_values(tensors[s], dtype) for s in sources)  # [heads, kv_rank, nope], [heads, v, kv_rank]
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).flatten(0, 1)  # [heads x (nope + v), kv_rank]


def _experts(layer: int, tensors: dict[str, ReaderTensor], spec: ModelSpec, path: Path) -> list[Joined]:
    """A gpt-oss layer's stacked experts as the checkpoint holds them: gate_up (gate and up rows interleaved) and
    down, as MXFP4 blocks and scales or float, and their biases."""
    b, p = f"blk.{layer}.", f"model.layers.{layer}.mlp.experts."
    e, i, h = spec.num_experts, spec.expert_size, spec.hidden_size
    fused = b + "ffn_gate_up_exps.weight" in tensors
    pair = (b + "ffn_gate_up_exps",) if fused else (b + "ffn_gate_exps", b + "ffn_up_exps")
    rows = 2 * i if fused else i
    shapes = {f"{s}.weight": (e, rows, h) for s in pair} | {f"{s}.bias": (e, rows) for s in pair}
    _check(tensors, path, shapes | {b + "ffn_down_exps.weight": (e, h, i), b + "ffn_down_exps.bias": (e, h)})
    gate_up, down = tuple(f"{s}.weight" for s in pair), (b + "ffn_down_exps.weight",)
    out = [
        _float(p + "gate_up_proj_bias", tuple(f"{s}.bias" for s in pair), (e, 2 * i), tensors, path, _gate_up),
        _float(p + "down_proj_bias", (b + "ffn_down_exps.bias",), (e, h), tensors, path, _down),
    ]
    if not spec.mxfp4_experts:  # input-major, as transformers saves them
        out.append(_float(p + "gate_up_proj", gate_up, (e, h, 2 * i), tensors, path, _gate_up, transpose=True))
        return [*out, _float(p + "down_proj", down, (e, i, h), tensors, path, _down, transpose=True)]
    for matrix, sources, out_rows, cols in (("gate_up_proj", gate_up, 2 * i, h), ("down_proj", down, h, i)):
        blocks = (e, out_rows, cols // BLOCK, BLOCK // 2)
        for part, shape in ((0, blocks), (1, blocks[:3])):
            make = partial(_mxfp4_part, sources, part, matrix == "gate_up_proj")
            out.append(Joined(p + matrix + ("_blocks", "_scales")[part], sources, "U8", shape, "MXFP4", make))
    return out


def _float(
    name: str,
    sources: tuple[str, ...],
    shape: tuple[int, ...],
    tensors: dict[str, ReaderTensor],
    path: Path,
    join: Callable,
    transpose: bool = False,
) -> Joined:
    """A float checkpoint tensor `join`ed from `sources`: in their float type where they share one, else float32
    (quantized ones dequantized), its last two dimensions swapped where `transpose`."""
    types = {T(tensors[s].tensor_type) for s in sources}
    for s in sources:
        qtype = T(tensors[s].tensor_type)
        if qtype not in FLOATS and GGML_QUANT_SIZES[qtype][0] == 1:
            raise OffloadError(f"{path}: tensor {s!r} has type {qtype.name}, which the import does not read")
    code = FLOATS[next(iter(types))] if len(types) == 1 and types <= FLOATS.keys() else "F32"

    def make(file: dict[str, ReaderTensor]) -> torch.Tensor:
        w = join(sources, TORCH_DTYPES[code][0], file)
        return w.transpose(-1, -2) if transpose else w

    return Joined(name, sources, code, shape, "+".join(sorted(t.name for t in types)), make)


def _gate_up(sources: tuple[str, ...], dtype: torch.dtype, tensors: dict[str, ReaderTensor]) -> torch.Tensor:
    return _interleaved([_values(tensors[s], dtype) for s in sources])


def _down(sources: tuple[str, ...], dtype: torch.dtype, tensors: dict[str, ReaderTensor]) -> torch.Tensor:
    return _values(tensors[sources[0]], dtype)


def _interleaved(stacks: list[torch.Tensor]) -> torch.Tensor:
    """gate and up stacks [experts, rows, ...] (or one fused stack: the gate rows, then the up rows) -> their rows
    interleaved [experts, 2 x rows, ...], gate's row r at 2r and up's at 2r + 1, as Hugging Face's gate_up_proj."""
    gate, up = stacks if len(stacks) == 2 else stacks[0].chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _mxfp4_part(sources: tuple[str, ...], part: int, gate_up: bool, tensors: dict[str, ReaderTensor]) -> torch.Tensor:
    """MXFP4 stacks as Hugging Face's blocks (part 0) or scales (part 1), gate and up interleaved where `gate_up`."""
    parts = [hf_mxfp4(_raw(tensors[s]))[part] for s in sources]
    return _interleaved(parts) if gate_up else parts[0]


def hf_mxfp4(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml block_mxfp4 rows uint8 [..., n x 17] -> Hugging Face's MXFP4 (blocks [..., n, 16], scales [..., n]),
    the same bits: each block's exponent byte is its scale, its values re-paired into bytes (module docstring)."""
    b = raw.reshape(*raw.shape[:-1], -1, MXFP4_BYTES)
    values = np.concatenate((b[..., 1:] & 15, b[..., 1:] >> 4), axis=-1)  # [..., n, 32] codes in value order
    blocks = values[..., 0::2] | (values[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(b[..., 0]))


def _raw(g: ReaderTensor) -> np.ndarray:
    """A tensor's bytes uint8 [..., rows, bytes per row]."""
    shape = _shape(g)
    return np.asarray(g.data).view(np.uint8).reshape(*shape[:-1], -1)


def _values(g: ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor [..., rows, columns] as float: float types as stored, quantized ones as gguf dequantizes them."""
    return float_tensor(_raw(g), T(g.tensor_type), _shape(g))[0].to(dtype)


def _shape(g: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(g.shape))


def _check(tensors: dict[str, ReaderTensor], path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """An OffloadError naming the first tensor of `shapes` the file lacks or holds in another shape."""
    for name, shape in shapes.items():
        if name not in tensors:
            raise OffloadError(f"{path}: no tensor {name!r}")
        if _shape(tensors[name]) != shape:
            raise OffloadError(f"{path}: tensor {name!r} has shape {list(_shape(tensors[name]))}, not {list(shape)}")
