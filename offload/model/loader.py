"""Open a model directory for running: config.json -> (ModelSpec, Family)."""

from __future__ import annotations

from pathlib import Path

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec, parse_model_config, read_config
from offload.model.registry import Family, get_family


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
    return spec, family
