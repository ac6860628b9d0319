"""Where the engine keeps what it builds and measures once: the demo model, hardware profiles."""

from __future__ import annotations

import os
from pathlib import Path

from offload.common import environment


def cache_dir() -> Path:
    """The cache root: $OFFLOAD_CACHE_DIR, else $XDG_CACHE_HOME/offload, else ~/.cache/offload."""
    if explicit := environment.get(environment.CACHE_DIR):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "offload"
    return Path.home() / ".cache" / "offload"
