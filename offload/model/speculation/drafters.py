"""Drafters for speculative decoding: what a decoding sequence may say next, proposed cheaply, verified by the
target model in the same weight pass as the sequence's next token (acceptance.py keeps what the target agrees with).

    drafter = make_drafter("ngram")
    draft = drafter.propose(token_ids, k)       # up to k token ids; () when it has no guess

`ngram` is prompt lookup (as vLLM's and llama.cpp's n-gram speculation): the longest recent n-gram of the sequence
(max_n tokens down to min_n) found earlier in it proposes the tokens that followed its latest earlier occurrence,
repeating them where they run into the n-gram itself (a run of one token proposes more of it).
It needs no model and no memory, and pays where a reply repeats its input: summaries, extraction, edits, code.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

from offload.common.errors import OffloadError


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens that may follow `token_ids` (the sequence so far, prompt and output)."""
        ...


class NgramDrafter:
    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
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
    """The drafter `EngineConfig.speculate` names; None when speculation is off."""
    if method is None:
        return None
    if method == "ngram":
        return NgramDrafter()
    raise OffloadError(f"speculate must be ngram, got {method!r}")
