"""Speculative decoding's verification: which of a drafter's tokens the target model accepts, from the logits one
weight pass computed at every drafted position (offload/core.py runs the pass; drafters.py drafts).

Greedy requests accept drafted tokens while each equals the target's own choice, then take the target's token at the
first disagreement (or after the last draft): the output is the target's greedy output wherever the step's rows get
the logits a one-row step would. Sampled requests use rejection sampling for a deterministic draft (Leviathan et al.,
2023; Chen et al., 2023, with the draft distribution a point mass): drafted token d is accepted with probability
p(d) under the target's filtered distribution; a rejection samples from p with d removed; the tokens that come out
are distributed exactly as the target's own sampling would give them.
"""

from __future__ import annotations

import torch

from offload.common.config import SamplingParams
from offload.kernels.argmax import argmax
from offload.model.sampling import filter_logits
from offload.model.speculation.tree import DraftTree, accept_tree


def accept_draft(
    logits: torch.Tensor,
    draft: tuple[int, ...],
    sampled: int,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, ...]:
    """The tokens a request takes from one verified step: the accepted prefix of `draft`, then one token of the
    target's. logits [len(draft) + 1, vocab] float32: row i scores the token after draft[:i]; `sampled`: the token
    already drawn from the last row, the target's own should every drafted token pass."""
    k = len(draft)
    if params.greedy:
        best = argmax(logits[:k]).tolist()
        for i, d in enumerate(draft):
            if best[i] != d:
                return (*draft[:i], best[i])
        return (*draft, sampled)
    for i, d in enumerate(draft):
        probs = filter_logits(logits[i], params).softmax(-1)
        u = torch.rand((), generator=generator, device=logits.device)
        if u < probs[d]:
            continue
        probs[d] = 0.0  # the residual max(p - q, 0) for a point-mass draft q, normalized by multinomial
        return (*draft[:i], int(torch.multinomial(probs, 1, generator=generator).item()))
    return (*draft, sampled)


def accept(
    logits: torch.Tensor,
    draft: tuple[int, ...],
    parents: tuple[int, ...] | None,
    sampled: int,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[tuple[int, ...], list[int] | None]:
    """The tokens a request takes from one verified step, and for a tree (`parents`) the rows of `logits` that chose
    them (a chain's are its first rows): logits [verified + 1, vocab], the drafted positions' rows then the last."""
    draft = draft[: logits.shape[0] - 1]
    if parents is None:
        return accept_draft(logits, draft, sampled, params, generator), None
    return accept_tree(logits, DraftTree(draft, parents[: len(draft)]), sampled, params, generator)
