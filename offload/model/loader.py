"""Open a model directory for running: config.json -> (ModelSpec, Family)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec, parse_model_config, read_config
from offload.model.registry import Family, get_family, model_tensors
from offload.tiers.weights.checkpoint import GGUF_INDEX, gguf_extents
from offload.tiers.weights.embedding import HEAD, TABLE


def load_spec(model_dir: Path) -> tuple[ModelSpec, Family]:
    """The model's shape and the family that runs it, from `model_dir/config.json`; an architecture or a
    setting the engine cannot run is an OffloadError naming the file."""
    config = read_config(model_dir)
    source = str(model_dir / "config.json")
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise OffloadError(f"{source}: field 'architectures' must name the model class, got {archs!r}")
    family = get_family(archs[0], source)
    spec = parse_model_config(config, source, name=model_dir.resolve().name)
    family.check(spec, source)
    if spec.quant is not None and spec.quant.layout == "gguf" and (model_dir / GGUF_INDEX).is_file():
        spec = _with_held_table_and_head(spec, family, model_dir)
    return spec, family


def _with_held_table_and_head(spec: ModelSpec, family: Family, model_dir: Path) -> ModelSpec:
    """`spec` whose quantization says at how many bits a weight the engine holds a GGUF file's token table and head
    (their blocks where the file stores them in blocks): what the cost model charges for them."""
    extents, tensors = gguf_extents(model_dir), model_tensors(family, spec)
    bits = {}
    for field, group, short in (("embed_bits", tensors.embed, TABLE), ("head_bits", tensors.head, HEAD)):
        t = group.get(short)
        ext = extents.get(t.name) if t is not None else None
        if ext is not None and ext.dtype == "U8":  # blocks [rows, K / 32, block bytes]
            bits[field] = ext.nbytes * 8 / math.prod(t.shape)
    return dataclasses.replace(spec, quant=dataclasses.replace(spec.quant, **bits)) if bits else spec
