"""The models `offload plan` knows by name (configs/models/*.json), and what their weights weigh per dtype.

No weights are read: a known model and a local directory alike are their config.json, parsed by
offload/common/model_config.py. A GGUF file is read by the face (offload/gguf/header.py, from its header and tensor
table): its shape as a ModelSpec, and its weights as stored (`StoredWeights`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec, parse_model_config, read_config
from offload.scheduler.cost.moe_cost import routed_params
from offload.scheduler.cost.predict import MXFP4_BITS

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


@dataclass(frozen=True, slots=True)
class SizeEstimate:
    """Weight bytes of a model stored in one dtype, as `accelerate estimate-memory` reports them."""

    dtype: str  # "float32", "float16", "bfloat16", "int8", "int4", or "mxfp4 experts" (gpt-oss as published)
    total_bytes: int
    largest_layer_bytes: int  # the largest unit the engine streams: embeddings, one decoder layer or the head
    largest_layer_name: str  # "embeddings", "decoder layer" or "head"


@dataclass(frozen=True, slots=True)
class StoredType:
    """A model file's tensors of one storage type (a GGUF file's "Q4_0", "Q8_0", "F32", ...)."""

    name: str
    nbytes: int
    weights: int  # the tensors' elements

    @property
    def bits(self) -> float:
        """Bits a weight, block scales included (Q4_0: 4.5, Q4_1: 5, Q8_0: 8.5, Q4_K: 4.5)."""
        return 8 * self.nbytes / max(self.weights, 1)


@dataclass(frozen=True, slots=True)
class StoredWeights:
    """A model file's weights as it stores them (its tensor table's sizes), beside the estimates per dtype."""

    file: str  # the file's name
    types: tuple[StoredType, ...]  # the most bytes first
    largest_layer_bytes: int  # as SizeEstimate's: the embeddings, one decoder layer or the head
    largest_layer_name: str
    imported_bytes: int  # what importing it writes (offload/gguf/importer.py); 0: it runs in place, nothing written

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.types)

    @property
    def bits(self) -> float:
        """Bits a weight over every tensor of the file."""
        return 8 * self.nbytes / max(sum(t.weights for t in self.types), 1)


# bits per parameter. Quantized sizes exclude scales and zero points, and assume every parameter (norms and
# embeddings too) is quantized, as accelerate's estimate does.
_SIZE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "int8": 8, "int4": 4}


def estimate_sizes(spec: ModelSpec) -> list[SizeEstimate]:
    """One row per dtype in float32, float16, bfloat16, int8, int4 order; bytes rounded up to whole bytes. A model
    whose routed experts are stored in MXFP4 (gpt-oss as published) gets one more row, as stored: the experts at
    4.25 bits a weight, the rest in bfloat16."""
    parts = {"embeddings": spec.params.embed, "decoder layer": spec.params.layer, "head": spec.params.head}
    largest = max(parts, key=parts.__getitem__)  # ties go to the first in the dict's order
    rows = [
        SizeEstimate(dtype, _bytes(spec.total_params, bits), _bytes(parts[largest], bits), largest)
        for dtype, bits in _SIZE_BITS.items()
    ]
    if spec.mxfp4_experts:
        experts = routed_params(spec)  # one layer's routed experts
        layer = _bytes(spec.params.layer - experts, 16) + math.ceil(experts * MXFP4_BITS / 8)
        stored = {
            "embeddings": _bytes(spec.params.embed, 16),
            "decoder layer": layer,
            "head": _bytes(spec.params.head, 16),
        }
        name = max(stored, key=stored.__getitem__)
        total = stored["embeddings"] + spec.num_layers * layer + stored["head"]
        rows.append(SizeEstimate("mxfp4 experts", total, stored[name], name))
    return rows


def _bytes(params: int, bits: int) -> int:
    return -(-params * bits // 8)


def known_models() -> list[str]:
    """Names accepted by load_model_spec: the stems of configs/models/*.json, lowercase and sorted."""
    return sorted(_model_files())


def _model_files() -> dict[str, Path]:
    return {path.stem.lower(): path for path in MODELS_DIR.glob("*.json")}


def load_model_spec(model: str) -> ModelSpec:
    """The spec of `model`: a directory holding config.json, or a name from known_models() (any case)."""
    path = Path(model)
    if path.is_dir():
        return parse_model_config(read_config(path), str(path / "config.json"), path.resolve().name)
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
    return parse_model_config(config, str(file), name)
