"""Draft trees: several candidate continuations of a sequence verified in the one weight pass of its next step, as
SpecExec (Svirschevski et al., 2024) and Sequoia (Chen et al., 2024) verify them when weights stream: a pass costs
about the same for one row or a few hundred, so more candidates raise the tokens a pass keeps.

A tree is its drafted tokens in an order where every parent comes before its children, each with its parent's index
(-1: the sequence's last token, the root, which the step computes anyway). A chain is the tree whose parents are
-1, 0, 1, ...; a tree's first nodes are its main chain (the longest prefix so linked), and the drafter puts its
likeliest continuation there.

The step computes each node as one more row of the sequence's chunk (scheduler/batcher.py puts them after its last
token), at the position of its depth, attending the sequence's cached positions and its own ancestors
(`visible`, applied by kernels/paged_attention.py); `accept_tree` walks the tree with the target's logits. The main
chain's keys and values are written where the accepted tokens belong, so they stay cached; an accepted token off the
main chain is computed again, as a known token, in the next step's chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.common.config import SamplingParams
from offload.kernels.argmax import argmax
from offload.model.sampling import filter_logits
from offload.scheduler.drafts import main_chain


@dataclass(frozen=True, slots=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # each node's parent: -1 for the root, else an earlier node's index

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree of {len(self.tokens)} tokens has {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree node {i}: parent {p} is not -1 or an earlier node")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_paths(cls, paths: list[tuple[int, ...]]) -> DraftTree:
        """The tree of `paths` (continuations of the same sequence) merged where they share a prefix; the first path
        is the main chain."""
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for path in paths:
            at = -1
            for token in path:
                if (at, token) not in child:
                    child[at, token] = len(tokens)
                    tokens.append(token)
                    parents.append(at)
                at = child[at, token]
        return cls(tuple(tokens), tuple(parents))


def as_draft(draft: tuple[int, ...] | DraftTree, trees: bool) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """A drafter's proposal as a sequence keeps it: its tokens, and its parents where it is a tree (None: a chain).
    `trees`: whether the model's attention takes a tree's mask; where not, a tree is verified as its main chain."""
    if not isinstance(draft, DraftTree):
        return draft, None
    chain = main_chain(draft.parents)
    if chain == len(draft) or not trees:
        return draft.tokens[:chain], None
    return draft.tokens, draft.parents


def accept_tree(
    logits: torch.Tensor,
    tree: DraftTree,
    sampled: int,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[tuple[int, ...], list[int]]:
    """The tokens a request takes from one verified tree, and the rows of `logits` that chose them. logits
    [len(tree) + 1, vocab] float32: row 0 scores the token after the root, row i + 1 the token after node i;
    `sampled`: the token already drawn from the last row.

    From the root, the target chooses its next token (greedy: its argmax; sampled: a draw from its filtered
    distribution); where a child of the current node holds that token the walk moves there, else the chosen token
    ends the step. A draft that is a point mass at each node makes this exact for sampling too: the token taken at
    each node is the target's own draw (SpecInfer's multi-candidate rejection sampling with deterministic drafts)."""
    child = {}
    for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True)):
        child.setdefault((p, t), i)  # the first of equal siblings
    best = argmax(logits).tolist() if params.greedy else None
    last = len(tree) - 1
    taken: list[int] = []
    rows = [0]
    at = -1
    while True:
        if at == last:
            choice = sampled
        elif best is not None:
            choice = best[at + 1]
        else:
            probs = filter_logits(logits[at + 1], params).softmax(-1)
            choice = int(torch.multinomial(probs, 1, generator=generator).item())
        taken.append(choice)
        nxt = child.get((at, choice))
        if nxt is None:
            return tuple(taken), rows
        at = nxt
        rows.append(at + 1)


def expected_tokens(parents: tuple[int, ...], chance: list[float]) -> float:
    """Tokens a pass is expected to take from a tree where node i holds the target's token with probability
    `chance[i]` given that its parent did: 1 (the target's own) plus each node's probability of being reached and
    accepted, the product along its path."""
    reach: list[float] = []
    for i, p in enumerate(parents):
        reach.append(chance[i] * (1.0 if p < 0 else reach[p]))
    return 1.0 + sum(reach)
