"""Rotary position embedding parameters as config.json gives them: `RopeSpec` and its one reader, `parse_rope`."""

from __future__ import annotations

from dataclasses import dataclass

from offload.common.config_fields import integer
from offload.common.errors import OffloadError


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary position embedding parameters, as read from config.json."""

    theta: float = 10000.0
    kind: str = "default"  # "default", "linear", "llama3" or "yarn" run; other kinds are kept for the runtime to refuse
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn: the ramp between interpolated and kept frequencies, in rotations over the original context, whether its
    # ends are rounded to whole dimensions, and what scales cos and sin (None: YaRN's own from factor and mscales)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


def parse_rope(config: dict, source: str) -> RopeSpec:
    """config.json's rotary parameters: rope_theta and the scaling (none, linear, llama3, yarn; other kinds kept
    by name for the runtime to refuse)."""
    # transformers 5 writes `rope_parameters` (theta inside); earlier configs `rope_theta` + `rope_scaling`.
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        try:
            return RopeSpec(
                theta=theta,
                kind="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position=int(params["original_max_position_embeddings"]),
            )
        except KeyError as exc:
            raise OffloadError(f"{source}: llama3 rope scaling lacks {exc.args[0]!r}") from None
    if kind == "yarn":
        return _yarn(params, theta, config, source)
    return RopeSpec(theta=theta, kind=str(kind))


def _yarn(params: dict, theta: float, config: dict, source: str) -> RopeSpec:
    """YaRN's fields as transformers reads them: a missing factor is the context's growth over the original."""

    def number(key: str) -> float | None:
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise OffloadError(f"{source}: yarn rope scaling field {key!r} must be a number, got {value!r}")
        return None if value is None else float(value)

    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise OffloadError(f"{source}: yarn rope scaling needs original_max_position_embeddings, got {original!r}")
    factor = number("factor") or integer(config, "max_position_embeddings", source) / original
    return RopeSpec(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position=original,
        beta_fast=number("beta_fast") or 32.0,
        beta_slow=number("beta_slow") or 1.0,
        truncate=bool(params.get("truncate", True)),
        attention_factor=number("attention_factor"),
        mscale=number("mscale"),
        mscale_all_dim=number("mscale_all_dim"),
    )
