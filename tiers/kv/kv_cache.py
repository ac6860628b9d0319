"""The paged KV cache's tensors: every layer's keys and values, in blocks of `block_size` tokens.

Which block holds what is the bookkeeping of tiers/kv/blocks.py; `KVCache` holds the tensors the model writes and reads.
The cache stores the compute dtype, or a quantized format (int8, int4, fp8: kernels/kv_quant.py) whose records hold
each token's codes and scales together, so that a block's bytes are complete wherever they go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.kernels.kv_quant import GROUP_SIZE, QUANT_KINDS, KVQuantFormat, dequantize_kv, quantize_kv

# values dequantized at a time when gathering blocks: a float32 scratch of 2 MiB stays in cache, where dequantizing
# 512 blocks (16 tokens, 8 heads, head_dim 128) at once took 2-4x longer on a 2-core VM
DEQUANT_SLICE = 1 << 19


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer's keys and values: what the attention reads (`k`, `v`: [num_blocks, block_size, kv_heads, head_dim]
    in the compute dtype: the cache's own tensors, or `QuantizedKV`s that dequantize the blocks gathered) and where a
    step's new tokens go (`write`). A one-part cache (multi-head latent attention's latent) has `k` only."""

    k: torch.Tensor | QuantizedKV
    v: torch.Tensor | QuantizedKV | None

    @property
    def device(self) -> torch.device:
        """Where the cache lives: attention runs there (on the CPU for a host-resident cache)."""
        return self.k.device

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Store the keys and values [tokens, kv_heads, head_dim] of new tokens at cache `slots` [tokens]
        (block * block_size + offset); a one-part cache takes `k` alone."""
        if (v is None) != (self.v is None):
            raise ValueError("a one-part KV cache writes k alone, a two-part one k and v")
        for cache, new in ((self.k, k), (self.v, v)) if v is not None else ((self.k, k),):
            if isinstance(cache, QuantizedKV):
                cache.write(slots, new)
            else:
                cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new)  # slots are distinct


class KVCache:
    """K and V of every layer, [num_layers, parts, num_blocks, block_size, kv_heads, head_dim], on one device
    (parts: 2, K and V; 1, multi-head latent attention's latent alone); quantized, [num_layers, parts, num_blocks,
    block_size, kv_heads, record_bytes] uint8 (one record per token and head).

    A block's bytes (every layer's K and V of its tokens) leave and enter the cache as one flat uint8 row
    (`read_blocks`, `write_blocks`): the form the host and NVMe tiers store, whatever the cache's format."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: str = "auto",
        group_size: int = GROUP_SIZE,
        pin: bool = False,
        parts: int = 2,
    ) -> None:
        """`dtype`: the compute dtype (what attention reads); `kv_dtype`: what the cache stores ("auto": `dtype`;
        int8, int4, fp8: quantized per `group_size` values along head_dim). `pin`: page-lock a CPU cache when CUDA is
        present (the host part of the pool, which the copy engine reads). `parts`: 2 (K and V) or 1 (a latent)."""
        if parts not in (1, 2):
            raise ValueError(f"a KV cache holds 1 or 2 parts per layer, not {parts}")
        self.quant = _quant_format(kv_dtype, dtype, head_dim, group_size)  # None: the cache stores `dtype`
        width, stored = (head_dim, dtype) if self.quant is None else (self.quant.record_bytes, torch.uint8)
        # torch.empty: pages are committed only as blocks are first written
        shape = (num_layers, parts, num_blocks, block_size, kv_heads, width)
        pinned = pin and device.type == "cpu" and torch.cuda.is_available()
        self._data = torch.empty(shape, dtype=stored, device=device, pin_memory=pinned)
        self.dtype = dtype
        self._layers = [self._layer(i) for i in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        # what a stored block's bytes mean (keys persisted blocks): "bfloat16", "int8-g32", ...
        self.format = _dtype_name(dtype) if self.quant is None else self.quant.name

    @staticmethod
    def block_bytes(
        num_layers: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
        group_size: int = GROUP_SIZE,
        parts: int = 2,
    ) -> int:
        """Bytes of one block: K and V (or the latent) of `block_size` tokens in every layer, scales included."""
        quant = _quant_format(kv_dtype, dtype, head_dim, group_size)
        per_head = head_dim * dtype.itemsize if quant is None else quant.record_bytes  # one token's K, one head
        return parts * num_layers * block_size * kv_heads * per_head

    @property
    def storage(self) -> torch.Tensor:
        """The one tensor holding every block of every layer (the shape and dtype the class docstring gives)."""
        return self._data

    def layer(self, layer: int) -> KVLayer:
        """Layer `layer`'s keys and values: views of the storage, made once (every layer of every step asks)."""
        return self._layers[layer]

    def _layer(self, layer: int) -> KVLayer:
        parts = [self._data[layer, i] for i in range(self._data.shape[1])]
        if self.quant is not None:
            parts = [QuantizedKV(p, self.quant, self.dtype) for p in parts]
        return KVLayer(parts[0], parts[1] if len(parts) == 2 else None)

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), bytes_per_block] uint8 on the CPU: each block's bytes, all layers, K then V (or the latent)."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self._data.device)
        rows = self._data.index_select(2, index).movedim(2, 0).contiguous()  # [n, layers, 2, block, heads, last]
        return rows.view(len(blocks), -1).view(torch.uint8).cpu()

    def write_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Put rows of `read_blocks` form back, block i's bytes into block blocks[i]."""
        if data.shape != (len(blocks), self.bytes_per_block) or data.dtype != torch.uint8:
            raise ValueError(
                f"{len(blocks)} blocks need [{len(blocks)}, {self.bytes_per_block}] uint8, got "
                f"{tuple(data.shape)} {data.dtype}"
            )
        shape = (len(blocks), *self._data.shape[:2], *self._data.shape[3:])
        rows = data.to(self._data.device).view(self._data.dtype).view(shape).movedim(0, 2)
        index = torch.tensor(blocks, dtype=torch.int64, device=self._data.device)
        self._data.index_copy_(2, index, rows)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _quant_format(kv_dtype: str, dtype: torch.dtype, head_dim: int, group_size: int) -> KVQuantFormat | None:
    """The quantized format `kv_dtype` names, or None where the cache stores the compute dtype itself."""
    if kv_dtype in ("auto", _dtype_name(dtype)):
        return None
    if kv_dtype not in QUANT_KINDS:
        raise ValueError(
            f"kv_dtype {kv_dtype!r}: the KV cache stores the compute dtype ({_dtype_name(dtype)}) or one of "
            f"{', '.join(QUANT_KINDS)}"
        )
    return KVQuantFormat(kv_dtype, head_dim, group_size)


@dataclass(frozen=True, slots=True)
class QuantizedKV:
    """One layer's K or V, quantized: `records` [num_blocks, block_size, kv_heads, record_bytes] uint8.

    Paged attention reads it like the cache tensor it stands for, [num_blocks, block_size, kv_heads, head_dim] in
    `dtype` (`shape`, `dtype`, `element_size`, `index_select` along blocks); only the blocks gathered are
    dequantized, never the whole cache."""

    records: torch.Tensor
    fmt: KVQuantFormat
    dtype: torch.dtype  # the compute dtype reads return

    def __post_init__(self) -> None:
        if self.records.dim() != 4 or self.records.shape[3] != self.fmt.record_bytes:
            raise ValueError(
                f"{self.fmt.name} records must be [blocks, block_size, kv_heads, {self.fmt.record_bytes}], "
                f"got {tuple(self.records.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.records.shape[:3], self.fmt.head_dim))

    @property
    def device(self) -> torch.device:
        return self.records.device

    def dim(self) -> int:
        return 4

    def element_size(self) -> int:
        """Bytes of one value as read (dequantized), not as stored."""
        return self.dtype.itemsize

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Blocks `index` [n], dequantized: [n, block_size, kv_heads, head_dim] in `dtype`."""
        if dim != 0:
            raise ValueError(f"a quantized KV cache is gathered along blocks (dim 0), not dim {dim}")
        out = torch.empty((len(index), *self.shape[1:]), dtype=self.dtype, device=self.device)
        step = max(1, DEQUANT_SLICE // self.shape[1:].numel())  # blocks per slice
        for start in range(0, len(index), step):
            records = self.records.index_select(0, index[start : start + step])
            out[start : start + step] = dequantize_kv(records, self.fmt, self.dtype)
        return out

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x [tokens, kv_heads, head_dim] into cache `slots` [tokens] (block * block_size + offset)."""
        self.records.view(-1, *self.records.shape[2:])[slots] = quantize_kv(x, self.fmt)
