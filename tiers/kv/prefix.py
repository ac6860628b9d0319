"""Prefix keys of KV blocks: a hash chain over the tokens, so equal keys mean equal keys and values.

A full block's key is the digest of the previous block's key and its own token ids; the chain starts from a root
naming the model's weights, the KV format and the block size. Two blocks with the same key hold the same tokens
after the same prefix under the same model, so their keys and values are the same and either serves both
sequences. Keys are 16-byte BLAKE2b digests: a collision would take about 2^64 blocks.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

DIGEST_BYTES = 16


def chain_root(fingerprint: dict) -> bytes:
    """The key before the first block: a digest of what makes stored keys and values mean the same thing."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def extend_chain(keys: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """`keys` (the chain of the first len(keys) blocks of `token_ids`) extended over every full block of it."""
    for b in range(len(keys), len(token_ids) // block_size):
        tokens = array("q", token_ids[b * block_size : (b + 1) * block_size]).tobytes()
        keys.append(hashlib.blake2b((keys[-1] if keys else root) + tokens, digest_size=DIGEST_BYTES).digest())
    return keys


class LowerTiers(Protocol):
    """Where KV blocks go when they leave the device part of the pool (tiers/kv/lower_tiers.py): the pool asks it for
    the blocks it lacks; what comes back is opaque to the pool and handed to the device copy before the step."""

    def count(self, keys: Sequence[bytes], disk: bool = True) -> int:
        """Length of the longest run of `keys`, from the first, that a lower tier holds (nothing is read); with `disk`
        False, that a tier above the disk holds."""

    def fetch(self, keys: Sequence[bytes]) -> list[object]:
        """Payloads of the longest run of `keys`, from the first, that a lower tier holds intact (possibly none)."""

    reads_ahead: bool  # whether `prefetch` brings anything up (else it does nothing)

    def prefetch(self, keys: Sequence[bytes], pool) -> None:
        """Start bringing up, in the background, blocks of `keys` (those `pool` lacks) that an admission may soon
        ask for."""

    def land(self, pool) -> None:
        """Make what `prefetch` brought up so far findable (in `pool`, or in a lower tier that `fetch` copies
        from), before admissions."""


@dataclass(slots=True)
class PrefixCounters:
    """Prefix reuse over the pool's life, in tokens of admitted sequences."""

    lookup_tokens: int = 0  # tokens of sequences admitted (each admission, a re-admission after preemption too)
    hit_tokens: int = 0  # of those, tokens whose KV came from cached blocks (not computed)
    device_hit_tokens: int = 0  # hits on blocks already on the device
    promoted_blocks: int = 0  # hits brought back from a lower tier
    demoted_blocks: int = 0  # cached blocks evicted from the device, handed to a lower tier (or dropped)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
