"""`offload serve`'s settings, declared once as knobs (offload/common/knobs.py): each field's default, help and flag,
from which `offload serve`'s flags and docs/flags.md are generated."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from offload.common import environment
from offload.common.errors import OffloadError
from offload.common.knobs import knob
from offload.common.paths import cache_dir

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # uvicorn's


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """How the server serves. What the command line leaves open ("" or None: the model's name, the API key, the
    Batch API's folder) `for_model` fills in."""

    host: str = knob("127.0.0.1", "server", "address to bind", default_text="127.0.0.1, this machine only")
    port: int = knob(8000, "server", "port to bind", metavar="PORT")
    model_name: str = knob(
        "",
        "server",
        "the `model` clients pass",
        flag="--served-model-name",
        metavar="NAME",
        default_text="the folder name",
    )
    # None: no authentication
    api_key: str | None = knob(
        None,
        "server",
        "require `Authorization: Bearer KEY` on /v1 routes",
        metavar="KEY",
        default_text=f"${environment.API_KEY}; unset: no key",
    )
    # None: no limit
    max_waiting: int | None = knob(
        256, "server", "requests queued beyond the free places in the batch before new ones get 429", metavar="N"
    )
    drain_timeout: float = knob(
        30.0, "server", "on shutdown, seconds running requests get to finish", metavar="SECONDS"
    )
    # a folder (as the flag gives it, a str; for_model makes it a Path); None: no Batch API
    batch_dir: Path | str | None = knob(
        None,
        "server",
        "where the Batch API keeps uploaded files, batches and their results",
        doc="Unfinished batches resume when the server starts again.",
        metavar="DIR",
        default_text="~/.cache/offload/batches/MODEL-NAME",
    )
    log_level: str = knob("info", "server", "uvicorn's log level", choices=LOG_LEVELS)
    # bytes; None: derived from the context window once the model is loaded (offload/server/limits.py)
    max_body_bytes: int | None = knob(
        None,
        "server",
        "largest request body accepted; a larger one gets 413",
        flag="--max-request-size",
        size=True,
        default_text="derived from the context window, see docs/serving.md",
    )

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 0:
            raise OffloadError(f"max_waiting must be >= 0, got {self.max_waiting!r}")
        if self.drain_timeout < 0:
            raise OffloadError(f"drain_timeout must be >= 0, got {self.drain_timeout!r}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise OffloadError(f"max_body_bytes must be >= 1, got {self.max_body_bytes!r}")
        if self.log_level not in LOG_LEVELS:
            raise OffloadError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    def for_model(self, model_dir: Path) -> ServeSettings:
        """These settings with what they leave open filled in for the model in `model_dir`: its folder's name,
        $OFFLOAD_API_KEY, and a Batch API folder in the cache named after the model."""
        name = self.model_name or model_dir.name
        return dataclasses.replace(
            self,
            model_name=name,
            api_key=self.api_key or environment.get(environment.API_KEY) or None,
            batch_dir=Path(self.batch_dir).expanduser() if self.batch_dir else cache_dir() / "batches" / name,
        )
