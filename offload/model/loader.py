"""Open a model directory: config.json -> (ModelSpec, Family), and its safetensors checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from offload.common.config import ModelSpec
from offload.common.errors import OffloadError
from offload.model.registry import Family, get_family


def read_config(model_dir: Path) -> dict:
    if not model_dir.is_dir():
        raise OffloadError(f"{model_dir}: model directory not found")
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise OffloadError(f"{path}: not found (a model directory holds config.json and *.safetensors)") from None
    except json.JSONDecodeError as exc:
        raise OffloadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise OffloadError(f"{path}: not a JSON object")
    return config


def load_spec(model_dir: Path) -> tuple[ModelSpec, Family]:
    """The model's shape and the family that runs it, from `model_dir/config.json`."""
    config = read_config(model_dir)
    source = str(model_dir / "config.json")
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise OffloadError(f"{source}: field 'architectures' must name the model class, got {archs!r}")
    family = get_family(archs[0], source)
    try:
        return family.spec_from_config(config, source), family
    except (TypeError, ValueError) as exc:
        raise OffloadError(f"{source}: {exc}") from None
