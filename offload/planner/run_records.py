"""What runs of a model measured, kept in the cache for the model's later plans (offload/planner/routing.py's
expert-cache hits, offload/planner/speculation.py's drafts accepted): one small JSON file a record, written whole or
not at all, and never a reason for a run to fail."""

from __future__ import annotations

import json
from pathlib import Path

from offload.tiers.weights.checkpoint import indexed_source


def model_path(model: Path | str) -> Path:
    """The model a record is kept for: a GGUF file run in place by the file (the engine runs the folder of its
    metadata in the cache, `offload plan` reads the file), anything else by its path."""
    path = Path(model).resolve()
    return (indexed_source(path) or path).resolve() if path.is_dir() else path


def earlier_weight(earlier: float, this_run: float, most: float) -> float:
    """The factor an earlier record's counts (`earlier` of the unit `most` caps) keep when a run adds `this_run`:
    together they weigh at most `most`, the run's first (the record follows the model's recent use)."""
    return min(1.0, max(most - this_run, 0.0) / earlier)


def read(path: Path) -> dict | None:
    """The record at `path`; None where there is none or it cannot be read."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def write(path: Path, body: dict) -> None:
    """`body` at `path`, replacing what was there in one rename; a folder or file that cannot be written leaves the
    record as it was (the run's output does not depend on it)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
