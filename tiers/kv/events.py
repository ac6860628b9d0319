"""The KV pool's vocabulary across packages: what the block pools log for the lower tiers to carry out at the step
boundary (the tiers a block may live in are offload/common/tier.py's Tier).

Only the verbs of BlockPool and BlockTables (tiers/kv/blocks.py) emit events, into the log of the pool whose blocks
they name, in the order they happened; `KVTiers.settle` (tiers/kv/lower_tiers.py) replays each log in that order. Plain
Python: the scheduler reasons with the tables that log them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Evicted:
    """A cached block was handed out again: until the step overwrites it, `block` still holds `key`'s bytes, which
    go down first."""

    key: bytes
    block: int


@dataclass(frozen=True, slots=True)
class Promoted:
    """A block found below was registered under `key` in the fresh `block`: `payload` (its row, from the lower
    tiers, opaque to the pool) is copied into it before the next step."""

    key: bytes
    block: int
    payload: object


@dataclass(frozen=True, slots=True)
class Computed:
    """A block the step computed was registered under `key`: its bytes may be written through."""

    key: bytes
    block: int


@dataclass(frozen=True, slots=True)
class MovedDown:
    """A running sequence's KV moved to host RAM: host `block` (of the pool logging it) takes the bytes of the
    device part's `source` block before the next step."""

    block: int
    source: int


@dataclass(frozen=True, slots=True)
class MovedUp:
    """A running sequence's KV moved back to the device part: device `block` (of the pool logging it) takes the
    bytes of the host part's `source` block before the next step."""

    block: int
    source: int


KVEvent = Evicted | Promoted | Computed | MovedDown | MovedUp
