"""Where a micro-batch whose KV lives in the host part attends, on CUDA (EngineConfig.host_kv_attention).

Two ways, chosen per micro-batch and step. "cpu": on the CPU, over the host cache where it is; the query moves to
the host and the output back (FlexGen's choice: a decode query reads every byte of its context once, as a copy
over the link would). "device": the blocks the micro-batch reads are gathered from the host cache, copied to the
compute device (as stored: a quantized cache moves its records) and attended there; the step's new keys and values
are still written to the host cache, their home. A prompt chunk's attention does work in proportion to its queries
times its context, which a GPU does far faster than a CPU, so copying pays there; a decode query's does not.
"auto" compares both with the cost model's prices (scheduler/cost/attention_cost.py) from this
machine's saved CUDA profile (offload/planner/host_attention_prices.py); without one, it stages micro-batches holding
prompt chunks and keeps decode-only ones on the CPU.

On a CPU device both parts are the same RAM and "auto" never stages; "device" still can, which is how the staging
is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from offload.kernels.paged_batch import PagedBatch
from offload.tiers.kv.kv_cache import QuantizedKV

# (query tokens, sequences, context tokens over the sequences) -> seconds one layer's attention takes that way
Price = Callable[[int, int, int], float]


@dataclass(frozen=True, slots=True)
class HostAttention:
    mode: str  # "auto", "cpu" or "device" (HOST_KV_ATTENTION)
    cpu_seconds: Price | None = None  # on the CPU, the query and output moved over the link
    device_seconds: Price | None = None  # the blocks copied over the link, attended on the device

    def stage(self, queries: int, seqs: int, context: int) -> bool:
        """Whether a host micro-batch of `queries` query tokens of `seqs` sequences over `context` tokens of context
        attends on the compute device."""
        if self.mode != "auto":
            return self.mode == "device"
        if self.cpu_seconds is None or self.device_seconds is None:
            return queries > seqs  # prompt chunks: compute-bound, the device's; decode tokens: memory-bound, stay
        return self.device_seconds(queries, seqs, context) < self.cpu_seconds(queries, seqs, context)


@dataclass(frozen=True, slots=True)
class Staging:
    """A host micro-batch attending on the compute device: the host blocks it reads, and the batch renumbered into
    them."""

    blocks: torch.Tensor  # [n] int64, on the host cache's device: its blocks the micro-batch reads, each once
    batch: PagedBatch  # block tables index `blocks` (0..n-1); on the compute device

    def gather(self, cache: torch.Tensor | QuantizedKV, device: torch.device) -> torch.Tensor | QuantizedKV:
        """One layer's K or V of the staged blocks, [n, block_size, kv_heads, head_dim], copied to `device` as stored
        (a quantized cache's records, dequantized there by the attention)."""
        if isinstance(cache, QuantizedKV):
            return QuantizedKV(_copy_up(cache.records, self.blocks, device), cache.fmt, cache.dtype)
        return _copy_up(cache, self.blocks, device)


def _copy_up(cache: torch.Tensor, blocks: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows `blocks` of `cache` on `device`. To CUDA they are gathered into page-locked memory and copied without
    waiting: the CPU goes on to queue this layer's attention and gather the next layer's blocks while the copy
    engine moves these (torch keeps the page-locked buffer from reuse until its copy is done)."""
    if device.type != "cuda":
        return cache.index_select(0, blocks).to(device)
    staged = torch.empty((blocks.numel(), *cache.shape[1:]), dtype=cache.dtype, pin_memory=True)
    torch.index_select(cache, 0, blocks, out=staged)
    return staged.to(device, non_blocking=True)


def staging(
    tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    batch: PagedBatch,
    block_size: int,
    host: torch.device,
    device: torch.device,
) -> Staging:
    """The staging of a micro-batch whose sequences have block `tables` and `context_lens` (its `batch` as built for
    the host cache): the blocks each sequence's context covers, in first-use order (a shared prefix block once)."""
    index: dict[int, int] = {}
    renumbered = []
    for table, ctx in zip(tables, context_lens, strict=True):
        used = table[: -(-ctx // block_size)]
        renumbered.append([index.setdefault(b, len(index)) for b in used])
    width = max((len(r) for r in renumbered), default=0) or 1
    padded = [r + [0] * (width - len(r)) for r in renumbered]
    staged = PagedBatch(
        query_start=batch.query_start,
        context_lens=batch.context_lens,
        block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
        slot_mapping=batch.slot_mapping.to(device),
        trees=batch.trees,
    )
    return Staging(torch.tensor(list(index), dtype=torch.int64, device=host), staged)
