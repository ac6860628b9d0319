"""Architecture registry: the `architectures` name in config.json -> the module that runs that family.

A new family is a new module exposing `FAMILY` (a `Family`) plus one line in `ARCHITECTURES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.common.quant import WeightQuant
from offload.kernels.paged_batch import PagedBatch
from offload.kernels.quant_linear import SCALES_SUFFIX
from offload.model.host_attention import Staging
from offload.tiers.kv.kv_cache import KVLayer
from offload.tiers.weights.checkpoint import GGUF_BLOCKS, ModelTensors, TensorGroup, TensorSpec
from offload.tiers.weights.embedding import HEAD
from offload.tiers.weights.embedding import TABLE as EMBED
from offload.tiers.weights.layout import Weights

ARCHITECTURES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "offload.model.deepseek",
    "DeepseekV3ForCausalLM": "offload.model.deepseek",
    "LlamaForCausalLM": "offload.model.llama",
    "MistralForCausalLM": "offload.model.llama",
    "GptOssForCausalLM": "offload.model.gpt_oss",
    "MixtralForCausalLM": "offload.model.moe",
    "Qwen2ForCausalLM": "offload.model.llama",
    "Qwen2MoeForCausalLM": "offload.model.moe",
    "Qwen3ForCausalLM": "offload.model.llama",
    "Qwen3MoeForCausalLM": "offload.model.moe",
}


class ExpertSource(Protocol):
    """One sparse layer's routed experts, kept outside the layer's weights (expert streaming)."""

    @property
    def capacity(self) -> int:
        """The most experts one fetch may ask for."""

    def fetch(
        self, experts: list[int], hidden: torch.Tensor | None = None, rows: list[int] | None = None
    ) -> Mapping[int, Weights]:
        """Expert e's "gate_proj", "up_proj", "down_proj" (and their scales) for each e of `experts` (ascending),
        usable until the next fetch, iterated in the order to run them (those whose weights are ready first); an
        expert's weights may be on the CPU while the compute device is not (it then runs there, on its tokens'
        rows moved to it). `hidden`, given with a layer's last fetch of a micro-batch: the residual stream before
        the layer's MLP [tokens, hidden]; the source may start reading the next sparse layer's experts. `rows`:
        how many tokens each expert runs over, which may decide where it runs."""


@dataclass(slots=True)
class LayerInput:
    """What every layer of one micro-batch shares: rotary tables, the paged-cache view, the layer's KV, a sparse
    layer's experts when they stream apart from its weights, and whether host-resident KV is staged to the device."""

    cos: torch.Tensor  # [tokens, head_dim]
    sin: torch.Tensor  # [tokens, head_dim]
    batch: PagedBatch
    kv: KVLayer  # this layer's cache: read by the attention, written with the micro-batch's new keys and values
    experts: ExpertSource | None = None  # None: the experts are in the layer's weights ("expert{e}.*")
    # a host-resident micro-batch attending on the compute device: the blocks it reads, copied there each layer
    staging: Staging | None = None


class Family(Protocol):
    """The functional forward of one model family; weights arrive as arguments, never read from files."""

    # whether its attention takes a draft tree's mask (PagedBatch.trees); where not, a tree verifies as its main chain
    tree_attention: bool

    def check(self, spec: ModelSpec, source: str) -> None:
        """Raise OffloadError naming `source` when this family cannot run a model of that spec."""

    def embed_tensors(self, spec: ModelSpec) -> dict[str, TensorSpec]: ...

    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, TensorSpec]: ...

    def head_tensors(self, spec: ModelSpec) -> dict[str, TensorSpec]: ...

    def packable(self, short: str) -> bool:
        """Whether float matrix `short` is multiplied as a linear weight [out, in], which the CPU may pack."""
        ...

    def fuse(self, spec: ModelSpec, w: Weights) -> Weights:
        """A layer's weights, held whole in memory, with projections of one input stacked to run as one product."""
        ...

    def embed(self, w: Weights, token_ids: torch.Tensor) -> torch.Tensor: ...

    def layer(self, spec: ModelSpec, layer: int, w: Weights, hidden: torch.Tensor, inp: LayerInput) -> torch.Tensor: ...

    def head(self, spec: ModelSpec, w: Weights, hidden: torch.Tensor) -> torch.Tensor: ...


def get_family(architecture: str, source: str = "config.json") -> Family:
    module = ARCHITECTURES.get(architecture)
    if module is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise OffloadError(f"{source}: unknown architecture {architecture!r} (supported: {known})")
    return importlib.import_module(module).FAMILY


def model_tensors(family: Family, spec: ModelSpec) -> ModelTensors:
    """Every checkpoint tensor the model reads, grouped as the tiers load them."""
    head = family.head_tensors(spec)
    if spec.tie_word_embeddings:
        head = {"norm": head["norm"]}
    layers = tuple(family.layer_tensors(spec, i) for i in range(spec.num_layers))
    embed = family.embed_tensors(spec)
    if spec.quant is not None:
        layers = tuple(quantized_tensors(group, spec.quant) for group in layers)
    if spec.quant is not None and spec.quant.layout == "gguf":  # the token table and the head as the file has them
        embed, head = ({s: _as_stored(s, t) if s in (EMBED, HEAD) else t for s, t in g.items()} for g in (embed, head))
    return ModelTensors(embed=embed, head=head, layers=layers)


def _as_stored(short: str, t: TensorSpec) -> TensorSpec:
    """A GGUF file's matrix `short` read as the file stores it: float, or blocks (kernels/gguf_linear.py)."""
    return TensorSpec(t.name, t.shape, GGUF_BLOCKS, t.row)


def quantized_tensors(group: TensorGroup, quant: WeightQuant) -> TensorGroup:
    """A layer's tensors as `offload convert` stores them under `quant`: each projection matrix ("*_proj", named
    "<prefix>.weight", not in quant.unquantized) whose input width a group size divides becomes its codes
    ("<prefix>.qweight") and scales ("<prefix>.scales", short name "<short>.scales"); norms, biases and the rest stay
    as they are."""
    out: TensorGroup = {}
    for short, t in group.items():
        if not _quantizable(short, t, quant):
            out[short] = t
            continue
        if quant.layout == "gguf":  # blocks as the file holds them, scales inside: one tensor
            out[short] = _as_stored(short, t)
            continue
        prefix = t.name.removesuffix(".weight")
        n, k = t.shape
        out[short] = TensorSpec(prefix + ".qweight", quant.codes_shape(n, k), quant.code_dtype)
        out[short + SCALES_SUFFIX] = TensorSpec(prefix + SCALES_SUFFIX, quant.scales_shape(n, k))
    return out


def _quantizable(short: str, t: TensorSpec, quant: WeightQuant) -> bool:
    """Whether `offload convert` quantizes this layer tensor: a projection matrix with a usable group size, not one
    the format keeps in float."""
    return (
        short.endswith("_proj")
        and t.name not in quant.unquantized
        and len(t.shape) == 2
        and t.name.endswith(".weight")
        and quant.group(t.shape[1]) is not None
    )
