"""The KV pool an engine runs with: block tables with prefix reuse over the device cache, and the host and disk parts
below it, as the engine config's budgets say."""

from __future__ import annotations

from pathlib import Path

import torch

from offload.common.config import EngineConfig
from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.tiers.files import check_disk_budget
from offload.tiers.kv.blocks import BlockPool, BlockTables
from offload.tiers.kv.kv_cache import KVCache
from offload.tiers.kv.lower_tiers import KVTiers
from offload.tiers.kv.prefix import chain_root
from offload.tiers.memory import MemoryTier
from offload.tiers.weights.checkpoint import weights_fingerprint


def kv_key(model_dir: Path, spec: ModelSpec, dtype: torch.dtype, kv: KVCache) -> dict:
    """What makes a cached KV block's bytes mean the same keys and values: the weights, the compute dtype, the cache's
    format and block geometry. Prefix keys chain from it; the disk tier keeps blocks under it."""
    return {
        "weights": weights_fingerprint(model_dir),
        "compute_dtype": str(dtype).removeprefix("torch."),
        "kv_format": kv.format,
        "block_size": kv.block_size,
        "kv_shape": [spec.num_layers, spec.num_kv_heads, spec.head_dim],
    }


def make_kv_pool(
    config: EngineConfig, kv: KVCache, key: dict, spec: ModelSpec
) -> tuple[BlockTables, BlockTables | None, KVTiers | None]:
    """Block tables over `kv`'s blocks (sharing prefixes unless config.prefix_cache is off); with --kv-host-memory,
    tables over the host part's blocks, for sequences whose KV lives in host RAM (else None); and the host and disk
    parts of the pool when --kv-host-memory or --kv-disk-memory give them room (else None). A --kv-disk-memory
    larger than its folder can hold (the free space, and the blocks it holds already) is refused."""
    tiers = None
    if config.kv_host_memory or config.kv_disk_memory:
        if not config.prefix_cache:
            raise OffloadError(
                "--kv-host-memory and --kv-disk-memory keep cached prefix blocks: they need the prefix cache "
                "(drop --no-prefix-cache)"
            )
        disk = None
        if config.kv_disk_memory:
            from offload.tiers.kv.disk_store import KVDiskStore

            folder = Path(config.offload_dir) / "kv"
            check_disk_budget("--kv-disk-memory", config.kv_disk_memory, folder)
            disk = KVDiskStore(folder, key, kv.bytes_per_block, config.kv_disk_memory)
        host = host_kv = None
        if config.kv_host_memory:
            host = MemoryTier("kv host", config.kv_host_memory, torch.device("cpu"), pin=True)
            blocks = config.kv_host_memory // kv.bytes_per_block
            if blocks:
                host_kv = KVCache(
                    spec.num_layers,
                    blocks,
                    kv.block_size,
                    spec.num_kv_heads,
                    spec.head_dim,
                    kv.dtype,
                    torch.device("cpu"),
                    config.kv_dtype,
                    pin=True,
                    group_size=config.kv_group_size,
                    parts=spec.kv_parts,
                )
        tiers = KVTiers(kv, host_kv, host, disk, prefetch=config.kv_prefetch)
    root = chain_root(key) if config.prefix_cache else None
    pool = BlockPool(kv.num_blocks, record=tiers is not None)
    host_tables = None
    if tiers is not None and tiers.host_slots:
        host_tables = BlockTables(tiers.host_pool, config.block_size, root, tiers.below_host)
    return BlockTables(pool, config.block_size, root, tiers), host_tables, tiers
