"""Typed fields of a parsed config.json: each reader names the file and the field when a value is wrong."""

from __future__ import annotations

from offload.common.dtypes import DTYPES, canonical_dtype
from offload.common.errors import OffloadError

REQUIRED = object()  # the default of a field that must be present


def eos(config: dict) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def integer(config: dict, key: str, source: str, default: object = REQUIRED) -> int:
    """A positive integer field; null counts as absent, as transformers' configs treat it."""
    value = config.get(key)
    if value is None:
        if default is REQUIRED:
            raise OffloadError(f"{source}: missing field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OffloadError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
    return value


def flag(config: dict, key: str, source: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OffloadError(f"{source}: field {key!r} must be true or false, got {value!r}")
    return value


def model_dtype(config: dict, source: str) -> str:
    """The checkpoint's dtype; a config that names none holds float32 weights, as transformers reads it."""
    key = "dtype" if config.get("dtype") is not None else "torch_dtype"  # transformers 5 writes "dtype"
    value = config.get(key)
    if value is None:
        return "float32"
    dtype = canonical_dtype(value)
    if dtype is None:
        raise OffloadError(f"{source}: field {key!r} is {value!r}, not one of {', '.join(DTYPES)}")
    return dtype
