"""Drafters for speculative decoding: what a decoding sequence may say next, proposed cheaply, verified by the
target model in the same weight pass as the sequence's next token (acceptance.py keeps what the target agrees with).

    drafter = make_drafter("ngram")
    drafts = drafter.propose([ids_a, ids_b], k)  # per sequence up to k token ids; () where it has no guess
    drafter.close()

`ngram` is prompt lookup (as vLLM's and llama.cpp's n-gram speculation): the longest recent n-gram of the sequence
(max_n tokens down to min_n) found earlier in it proposes the tokens that followed its latest earlier occurrence,
repeating them where they run into the n-gram itself (a run of one token proposes more of it).
It needs no model and no memory, and pays where a reply repeats its input: summaries, extraction, edits, code.
A draft model (`--speculate PATH`, or `self`: the target's own int4 copy) is model_drafter.py's, behind the same
interface: one call drafts for every speculating sequence of a step, so a model drafts them as one batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

from offload.common.errors import OffloadError


class Drafter(Protocol):
    def propose(self, sequences: Sequence[Sequence[int]], k: int) -> list[tuple[int, ...]]:
        """For each of `sequences` (a sequence so far: prompt and output), up to `k` tokens that may follow it."""
        ...

    def close(self) -> None:
        """Release what the drafter holds (a draft model's engine); it proposes nothing afterwards."""
        ...


class NgramDrafter:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, sequences: Sequence[Sequence[int]], k: int) -> list[tuple[int, ...]]:
        return [self.lookup(ids, k) for ids in sequences]

    def close(self) -> None:
        pass

    def lookup(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest recent n-gram of `token_ids`."""
        if k <= 0 or len(token_ids) < 2:
            return ()
        ids = array("i", token_ids)  # searched as bytes: a C scan, not a Python loop over the sequence
        data, size = ids.tobytes(), ids.itemsize
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            suffix = ids[len(ids) - n :].tobytes()
            end = len(data) - size  # an occurrence ends at least one token before the sequence does
            while (at := data.rfind(suffix, 0, end)) >= 0:
                if at % size == 0:  # aligned on a token: the tokens after it are the draft
                    return _continue(ids, at // size + n, k)
                end = at + len(suffix) - 1  # the next one to the left
        return ()


def _continue(ids: array, start: int, k: int) -> tuple[int, ...]:
    """k tokens from `start` on; past the end, the run from `start` repeats (a period of len(ids) - start tokens, as
    an overlapping copy in LZ77 does): after "a b a b" the draft goes on "a b a b", after "x x" it goes on "x x"."""
    period = len(ids) - start
    return tuple(ids[start + j % period] for j in range(k))


def make_drafter(method: str | None) -> Drafter | None:
    """The drafter without a model that `EngineConfig.speculate` names (ngram); None when speculation is off."""
    if method is None:
        return None
    if method == "ngram":
        return NgramDrafter()
    raise OffloadError(f"speculate {method!r} is not a method without a model (ngram): build.py makes draft models")
