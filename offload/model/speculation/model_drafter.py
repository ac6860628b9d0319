"""A draft model as the drafter (`--speculate PATH`, or `self`): a second engine core on the CPU, its weights
resident, with its own small KV cache and prefix cache (offload/draft_core.py finds the model and builds it).

    drafter = ModelDrafter(core, target_vocab, nbytes, model_dir, close)
    drafts = drafter.propose([ids_a, ids_b], k)      # k greedy tokens of the draft model per sequence

A step's speculating sequences are drafted as one batch: each becomes a greedy request for k tokens continuing its
tokens so far (prompt and accepted output), and the draft core steps until all are done. Its prefix cache holds the
blocks of every earlier call, so a call prefills only the tokens since the last full block the draft has seen, then
decodes k - 1 steps. The target verifies the drafts: they change how many tokens a pass yields, never which.
With `topk` above 1 a draft is a tree (tree.py): the greedy continuation, and at each of its positions the draft's
next topk - 1 likeliest tokens as leaves, from the logprobs the draft engine returns with its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from offload.common.config import SamplingParams
from offload.common.outputs import Delta
from offload.model.speculation.tree import DraftTree
from offload.scheduler.batcher import BatchLimits


class DraftCore(Protocol):
    """What the drafter needs of offload/core.py's EngineCore."""

    limits: BatchLimits

    @property
    def has_work(self) -> bool: ...

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams | None = None, stream_text: bool = True, priority: int = 0
    ) -> int: ...

    def step(self) -> list[Delta]: ...

    def abort_all(self) -> list[Delta]: ...


class ModelDrafter:
    """Proposes the draft model's greedy continuation of each sequence. `target_vocab`: token ids the target scores
    (a draft of a larger vocabulary stops before an id outside it); `nbytes`: what the draft holds resident (its
    weights and KV cache) beyond `shared`, charged to the target's budget; `shared`: the draft's weight groups
    ("embed", "head") its target holds as its own instead of loading them; `close`: releases the draft engine."""

    def __init__(
        self,
        core: DraftCore,
        target_vocab: int,
        nbytes: int,
        model_dir: Path,
        close: Callable[[], None],
        topk: int = 1,
        shared: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.core, self.target_vocab, self.nbytes, self.model_dir = core, target_vocab, nbytes, model_dir
        self._close, self.topk, self.shared = close, topk, shared or {}
        self.seconds = 0.0  # wall time spent drafting, over the drafter's life
        self.calls = 0

    def propose(self, sequences: Sequence[Sequence[int]], k: int) -> list[tuple[int, ...] | DraftTree]:
        start = time.perf_counter()
        params = SamplingParams(max_new_tokens=k, ignore_eos=True, logprobs=self.topk if self.topk > 1 else None)
        room = self.core.limits.max_model_len
        rows: dict[int, int] = {}  # draft request id -> index in `sequences`
        for i, ids in enumerate(sequences):
            if k > 0 and ids and len(ids) + k <= room:  # a sequence the draft's window cannot hold gets no draft
                rows[self.core.add_request(list(ids), params, stream_text=False)] = i
        drafts: list[list[int]] = [[] for _ in sequences]
        alternatives: list[list[tuple[int, ...]]] = [[] for _ in sequences]  # each drafted position's top tokens
        try:
            while self.core.has_work:
                for delta in self.core.step():
                    if (i := rows.get(delta.request_id)) is not None:
                        drafts[i].extend(delta.token_ids)
                        alternatives[i].extend(tuple(t[0] for t in lp.top) for lp in delta.logprobs)
        except BaseException:
            self.core.abort_all()  # an error or Ctrl-C mid-draft leaves no request behind in the draft engine
            raise
        self.seconds += time.perf_counter() - start
        self.calls += 1
        if self.topk == 1:
            return [self._known(d[:k]) for d in drafts]
        return [self._tree(self._known(d[:k]), alts) for d, alts in zip(drafts, alternatives, strict=True)]

    def _tree(self, draft: tuple[int, ...], alternatives: list[tuple[int, ...]]) -> DraftTree:
        """`draft`, and at each of its positions the draft's other likeliest tokens (those the target scores)."""
        paths = [draft]
        for i, top in enumerate(alternatives[: len(draft)]):
            paths += [(*draft[:i], t) for t in top[: self.topk] if t != draft[i] and t < self.target_vocab]
        return DraftTree.from_paths(paths)

    def _known(self, draft: list[int]) -> tuple[int, ...]:
        """`draft` up to its first token the target's vocabulary lacks."""
        for n, token in enumerate(draft):
            if token >= self.target_vocab:
                return tuple(draft[:n])
        return tuple(draft)

    def close(self) -> None:
        self._close()
