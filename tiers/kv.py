"""The paged KV cache's tensors: every layer's keys and values, in blocks of `block_size` tokens.

Which block holds what is the bookkeeping of tiers/blocks.py; `KVCache` holds the tensors the model writes and reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayer:
    """One layer's keys and values: what the attention reads (`k`, `v`: [num_blocks, block_size, kv_heads, head_dim]
    in the compute dtype) and where a step's new tokens go (`write`)."""

    k: torch.Tensor
    v: torch.Tensor

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the keys and values [tokens, kv_heads, head_dim] of new tokens at cache `slots` [tokens]
        (block * block_size + offset)."""
        heads, dim = self.k.shape[2:]
        self.k.view(-1, heads, dim)[slots] = k
        self.v.view(-1, heads, dim)[slots] = v


class KVCache:
    """K and V of every layer, [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], on one device.

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
    ) -> None:
        """`dtype`: the compute dtype (what attention reads); `kv_dtype`: what the cache stores ("auto": `dtype`)."""
        if kv_dtype not in ("auto", str(dtype).removeprefix("torch.")):
            raise ValueError(f"kv_dtype {kv_dtype!r} is not supported yet")
        shape = (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
        # torch.empty: pages are committed only as blocks are first written
        self._data = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.format = str(dtype).removeprefix("torch.")  # what a stored block's bytes mean (keys persisted blocks)

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: str = "auto"
    ) -> int:
        """Bytes of one block: K and V of `block_size` tokens in every layer."""
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize

    @property
    def storage(self) -> torch.Tensor:
        """The one tensor holding every block of every layer."""
        return self._data

    def layer(self, layer: int) -> KVLayer:
        return KVLayer(self._data[layer, 0], self._data[layer, 1])

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // self.num_blocks

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), bytes_per_block] uint8 on the CPU: each block's bytes, all layers, K then V."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self._data.device)
        rows = self._data.index_select(2, index).movedim(2, 0).contiguous()  # [n, layers, 2, block, heads, dim]
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
