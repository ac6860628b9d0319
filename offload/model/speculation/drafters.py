"""Drafters for speculative decoding: what a decoding sequence may say next, proposed cheaply, verified by the
target model in the same weight pass as the sequence's next token (acceptance.py keeps what the target agrees with).

    drafter = make_drafter("ngram")
    drafts = drafter.propose([ids_a, ids_b], k)  # per sequence up to k token ids; () where it has no guess
    drafter.close()

`ngram` is prompt lookup (as vLLM's and llama.cpp's n-gram speculation): the longest recent n-gram of the sequence
(max_n tokens down to min_n) found earlier in it proposes the tokens that followed its latest earlier occurrence,
repeating them where they run into the n-gram itself (a run of one token proposes more of it).
It needs no model and no memory, and pays where a reply repeats its input: summaries, extraction, edits, code.
With `topk` above 1 it proposes a tree (tree.py): what followed each of the n-gram's latest `topk` earlier
occurrences that continue differently, the latest's the main chain.
A draft model (`--speculate PATH`, or `self`: the target's own int4 copy) is model_drafter.py's, behind the same
interface: one call drafts for every speculating sequence of a step, so a model drafts them as one batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

from offload.common.errors import OffloadError
from offload.model.speculation.tree import DraftTree


class Drafter(Protocol):
    def propose(self, sequences: Sequence[Sequence[int]], k: int) -> list[tuple[int, ...] | DraftTree]:
        """For each of `sequences` (a sequence so far: prompt and output), up to `k` tokens that may follow it, or
        a tree of such continuations."""
        ...

    def close(self) -> None:
        """Release what the drafter holds (a draft model's engine); it proposes nothing afterwards."""
        ...


class NgramDrafter:
    def __init__(self, min_n: int = 1, max_n: int = 4, topk: int = 1) -> None:
        self.min_n, self.max_n, self.topk = min_n, max_n, topk

    def propose(self, sequences: Sequence[Sequence[int]], k: int) -> list[tuple[int, ...] | DraftTree]:
        if self.topk == 1:
            return [self.lookup(ids, k) for ids in sequences]
        return [_tree(self.lookups(ids, k)) for ids in sequences]

    def close(self) -> None:
        pass

    def lookup(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest recent n-gram of `token_ids`."""
        found = self.lookups(token_ids, k, 1)
        return found[0] if found else ()

    def lookups(self, token_ids: Sequence[int], k: int, most: int | None = None) -> list[tuple[int, ...]]:
        """What followed the longest recent n-gram's latest earlier occurrences, up to `most` (the drafter's topk)
        that begin differently, the latest first."""
        most = self.topk if most is None else most
        if k <= 0 or len(token_ids) < 2:
            return []
        ids = array("i", token_ids)  # searched as bytes: a C scan, not a Python loop over the sequence
        data, size = ids.tobytes(), ids.itemsize
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            suffix = ids[len(ids) - n :].tobytes()
            end = len(data) - size  # an occurrence ends at least one token before the sequence does
            found: list[tuple[int, ...]] = []
            while len(found) < most and (at := data.rfind(suffix, 0, end)) >= 0:
                if at % size == 0:  # aligned on a token: the tokens after it are the draft
                    follows = _continue(ids, at // size + n, k)
                    if all(f[0] != follows[0] for f in found):
                        found.append(follows)
                end = at + len(suffix) - 1  # the next one to the left
            if found:
                return found
        return []


def _continue(ids: array, start: int, k: int) -> tuple[int, ...]:
    """k tokens from `start` on; past the end, the run from `start` repeats (a period of len(ids) - start tokens, as
    an overlapping copy in LZ77 does): after "a b a b" the draft goes on "a b a b", after "x x" it goes on "x x"."""
    period = len(ids) - start
    return tuple(ids[start + j % period] for j in range(k))


def _tree(paths: list[tuple[int, ...]]) -> tuple[int, ...] | DraftTree:
    if len(paths) < 2:
        return paths[0] if paths else ()
    return DraftTree.from_paths(paths)


def make_drafter(method: str | None, topk: int = 1) -> Drafter | None:
    """The drafter without a model that `EngineConfig.speculate` names (ngram); None when speculation is off."""
    if method is None:
        return None
    if method == "ngram":
        return NgramDrafter(topk=topk)
    raise OffloadError(f"speculate {method!r} is not a method without a model (ngram): build.py makes draft models")
