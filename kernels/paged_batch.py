"""Where each sequence of a micro-batch sits in the packed queries and in the paged KV cache: what every attention
kernel (kernels/paged_attention.py and its Triton variants) reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Where each sequence of a micro-batch sits in the packed queries and in the KV cache."""

    query_start: tuple[int, ...]  # [S + 1] offsets of each sequence's queries in the packed tokens
    context_lens: tuple[int, ...]  # [S] tokens in the cache after this step's writes
    block_tables: torch.Tensor  # [S, max_blocks] int64 block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 cache slot (block * block_size + offset) of each new token
    # sequences whose queries verify a tree of drafted tokens (speculative decoding): sequence index -> ([q_len, ctx]
    # bool: the keys each query attends, [ctx] int64: each key's position, [q_len] int64: each query's). A node sits
    # in the slot after the last before it, at the position of its depth, and attends its ancestors only
    trees: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict, compare=False)
    # what the attention derives from the batch once and reuses in every layer of the step
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def tree_visible(parents: tuple[int, ...]) -> torch.Tensor:
    """[n, n] bool: node i sees node j where j is i or one of its ancestors."""
    n = len(parents)
    seen = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i] = seen[p]
        seen[i, i] = True
    return seen
