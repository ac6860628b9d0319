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
    # what the attention derives from the batch once and reuses in every layer of the step
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)
