"""A drafter of draft trees with known acceptance, for benchmarks/speculative.py --synthetic: the plain run's own
tokens hidden in a tree of wrong ones, at the ranks a drafter of that quality would give them.

Its model of a drafter: at every node, the drafter's r-th candidate is the target's token with probability
a (1 - a)^(r - 1) (each candidate, in order, catches it with probability a). The tree of `size` nodes with the most
tokens expected a pass is then the `size` nodes of highest reach, a node's reach being the product of its path's
chances (Sequoia's tree for position-independent acceptance); the tokens a pass takes are expected to be 1 plus the
sum of the nodes' reaches (offload/model/speculation/tree.py's `expected_tokens`). Each proposal draws, at each node
holding the truth, the rank of the next true token (seeded by position, so that reruns draft alike)."""

from __future__ import annotations

import heapq
import random

from offload.model.speculation.tree import DraftTree, expected_tokens
from offload.scheduler.drafts import depths


def best_tree(size: int, accept: float, max_children: int = 16) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(parents, ranks) of the `size` nodes of highest reach, the main chain (rank 1 all the way) first, every
    parent before its children."""
    heap = [(-accept, -1, 1)]  # (-reach, parent, rank)
    nodes: list[tuple[int, int, float]] = []  # parent, rank, reach
    while heap and len(nodes) < size:
        reach, parent, rank = heapq.heappop(heap)
        reach = -reach
        nodes.append((parent, rank, reach))
        heapq.heappush(heap, (-reach * accept, len(nodes) - 1, 1))  # its first child
        if rank < max_children:  # its next sibling
            above = 1.0 if parent < 0 else nodes[parent][2]
            heapq.heappush(heap, (-above * accept * (1 - accept) ** rank, parent, rank + 1))
    chain = []
    at = -1
    while (nxt := next((i for i, (p, r, _) in enumerate(nodes) if p == at and r == 1), None)) is not None:
        chain.append(nxt)
        at = nxt
    order = chain + [i for i in range(len(nodes)) if i not in set(chain)]
    where = {old: new for new, old in enumerate(order)}
    parents = tuple(-1 if nodes[i][0] < 0 else where[nodes[i][0]] for i in order)
    assert all(p < i for i, p in enumerate(parents))
    return parents, tuple(nodes[i][1] for i in order)


class TreeOracle:
    def __init__(self, prompt_len: int, output: list[int], accept: float, vocab: int, size: int) -> None:
        self.prompt_len, self.output, self.accept, self.vocab = prompt_len, output, accept, vocab
        self.parents, self.ranks = best_tree(size, accept)
        self.chance = [accept * (1 - accept) ** (r - 1) for r in self.ranks]
        self.depths = depths(self.parents)  # each node's
        self.depth = max(self.depths, default=0)
        # (tokens generated before the proposal, whole tree knowable, tokens its draws give a pass: 1 + the truth's
        # path in the tree)
        self.starts: list[tuple[int, bool, int]] = []

    def theory(self) -> float:
        return expected_tokens(self.parents, self.chance)

    def propose(self, sequences, k: int) -> list[DraftTree]:
        return [self.tree(ids) for ids in sequences]

    def close(self) -> None:
        pass

    def tree(self, token_ids) -> DraftTree:
        done = len(token_ids) - self.prompt_len
        truth = self.output[done : done + self.depth]
        depth = self.depths
        on = {-1}  # the nodes holding the truth: the root does
        rank_at: dict[int, int] = {}  # such a node -> the rank its next true token has among its candidates
        tokens = []
        for i, (parent, rank) in enumerate(zip(self.parents, self.ranks, strict=True)):
            d = depth[i]
            right = False
            if parent in on and d <= len(truth):
                if parent not in rank_at:
                    rank_at[parent] = self._rank(done, d)
                right = rank_at[parent] == rank
            if right:
                on.add(i)
            base = truth[d - 1] if d <= len(truth) else 0
            tokens.append(base if right else (base + rank) % self.vocab)
        self.starts.append((done, len(truth) == self.depth, 1 + max((depth[i] for i in on if i >= 0), default=0)))
        return DraftTree(tuple(tokens), self.parents)

    def _rank(self, done: int, depth: int) -> int:
        """The rank of the true token among a node's candidates: the first of them that catches it."""
        rng = random.Random(done * 1000 + depth)
        rank = 1
        while rng.random() >= self.accept:
            rank += 1
        return rank

    def tokens_per_pass(self, parted: int | None = None) -> tuple[float, float, int]:
        """Tokens a pass took, what the draws of those passes give, and how many passes: those whose whole tree could
        hold the truth (the last ones run out of it) and, where the reply parted from the plain one at token `parted`,
        that ended before it (the truth the tree hides is the plain run's)."""
        return tokens_per_pass(self.starts, self.depth, len(self.output) if parted is None else parted)


def tokens_per_pass(starts: list[tuple[int, bool, int]], depth: int, end: int) -> tuple[float, float, int]:
    """(tokens a pass took, what its draws give, passes) over the proposals `starts` that were whole and ended
    before `end`: a pass took the distance to the next proposal."""
    kept = [(b[0] - a[0], a[2]) for a, b in zip(starts, starts[1:], strict=False) if a[1] and a[0] + depth <= end]
    n = max(len(kept), 1)
    return sum(t for t, _ in kept) / n, sum(d for _, d in kept) / n, len(kept)
