"""Runs one StepPlan layer-major: each layer's weights are acquired once and serve every micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.common.model_config import ModelSpec
from offload.common.tier import Tier
from offload.kernels.choice import decode_rows
from offload.kernels.paged_batch import PagedBatch, tree_visible
from offload.model.host_attention import HostAttention, Staging, staging
from offload.model.registry import ExpertSource, Family, LayerInput
from offload.model.rope import attention_scale, cos_sin, inverse_frequencies
from offload.scheduler.drafts import depths
from offload.scheduler.plan import MicroBatch, SeqChunk, StepPlan
from offload.tiers.kv.kv_cache import KVCache
from offload.tiers.weights.weight_store import WeightStore


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq_ids: tuple[int, ...]  # chunks that asked for logits, in plan order
    # [len(seq_ids), vocab] float32; with plan.all_logits, [their tokens, vocab] in packed order
    logits: torch.Tensor
    # the logits chunks asked for at their `scored` positions: (seq id, first position, [positions, vocab] float32)
    scored: tuple[tuple[int, int, torch.Tensor], ...] = ()


@dataclass(slots=True)
class _Prepared:
    token_ids: torch.Tensor  # [tokens]
    cos: torch.Tensor  # [tokens, head_dim]
    sin: torch.Tensor
    batch: PagedBatch  # on the device of the micro-batch's KV cache
    logit_rows: torch.Tensor  # [rows] indices into the micro-batch's tokens
    # the rows in logit_rows, in order: (seq id, first position, rows) for scored positions, (seq id, -1, 1) sampled
    segments: list[tuple[int, int, int]]
    kv_tier: str
    staging: Staging | None  # a host micro-batch attending on the compute device
    decode: bool  # one new token a sequence (kernels/choice.py's decode_rows)


class Engine:
    def __init__(
        self,
        spec: ModelSpec,
        family: Family,
        weights: WeightStore,
        kv: KVCache,
        device: torch.device,
        dtype: torch.dtype,
        host_kv: KVCache | None = None,
        experts: dict[int, ExpertSource] | None = None,
        host_attention: HostAttention | None = None,
    ) -> None:
        """`host_kv`: the host part of the KV pool, for micro-batches of sequences whose KV lives in host RAM (their
        attention runs where it lives, on the CPU: the query moves, not the cache; or, where `host_attention` says
        so, on the compute device over their blocks copied there: offload/model/host_attention.py). `experts`: each
        sparse layer's routed experts when they stream apart from the layer's weights
        (offload/model/expert_streaming.py)."""
        self.experts = experts or {}
        self.host_attention = host_attention
        self.staged_micro_batches = 0  # host micro-batches that attended on the compute device, over the run
        self.spec, self.family, self.weights, self.kv = spec, family, weights, kv
        self.caches = {Tier.DEVICE: kv} | ({Tier.HOST: host_kv} if host_kv is not None else {})
        self.device, self.dtype = device, dtype
        self.inv_freq = inverse_frequencies(spec.rope, spec.rope_dim).to(device)
        self.rope_scale = attention_scale(spec.rope)

    @torch.inference_mode()
    def step(self, plan: StepPlan) -> StepOutput:
        prepared = [self._prepare(mb, plan.all_logits) for mb in plan.micro_batches]
        table, token_ids = self.weights.embedding([p.token_ids for p in prepared])  # rows read, if left in storage
        hidden = [self.family.embed(table, ids).to(self.dtype) for ids in token_ids]  # a GGUF table's rows: float32
        for layer in range(self.spec.num_layers):
            w = self.weights.acquire(layer)
            kvs = {tier: cache.layer(layer) for tier, cache in self.caches.items()}
            for i, p in enumerate(prepared):
                inp = LayerInput(p.cos, p.sin, p.batch, kvs[p.kv_tier], self.experts.get(layer), p.staging)
                with decode_rows(p.decode):
                    hidden[i] = self.family.layer(self.spec, layer, w, hidden[i], inp)
            self.weights.release(layer)
        rows = torch.cat([h[p.logit_rows] for h, p in zip(hidden, prepared, strict=True)])
        with decode_rows(all(p.decode for p in prepared)):
            logits = self.family.head(self.spec, self.weights.head, rows).float()
        seq_ids = tuple(c.seq_id for c in plan.chunks if c.wants_logits or plan.all_logits)
        segments = [s for p in prepared for s in p.segments]
        if plan.all_logits or all(pos < 0 for _, pos, _ in segments):
            return StepOutput(seq_ids, logits)
        parts = logits.split([n for _, _, n in segments])
        sampled = [t for t, (_, pos, _) in zip(parts, segments, strict=True) if pos < 0]
        scored = tuple((i, pos, t) for t, (i, pos, _) in zip(parts, segments, strict=True) if pos >= 0)
        return StepOutput(seq_ids, torch.cat(sampled) if sampled else logits[:0], scored)

    def _prepare(self, mb: MicroBatch, all_logits: bool) -> _Prepared:
        block_size = self.kv.block_size
        token_ids, positions, slots, starts, rows, segments = [], [], [], [0], [], []
        trees = {}
        for s, c in enumerate(mb.chunks):
            pos = range(c.start_pos, c.context_len)
            token_ids.extend(c.token_ids)
            if c.parents is not None:
                trees[s], at = _tree_rows(c)
                positions.extend(at)
            else:
                positions.extend(pos)
            slots.extend(c.block_table[p // block_size] * block_size + p % block_size for p in pos)
            if all_logits:
                rows.extend(range(starts[-1], starts[-1] + len(c.token_ids)))
            else:
                if scored := c.scored_positions:
                    rows.extend(starts[-1] + p - c.start_pos for p in scored)
                    segments.append((c.seq_id, scored.start, len(scored)))
                if c.wants_logits:
                    rows.append(starts[-1] + len(c.token_ids) - 1)
                    segments.append((c.seq_id, -1, 1))
            starts.append(starts[-1] + len(c.token_ids))
        width = max(len(c.block_table) for c in mb.chunks)
        tables = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in mb.chunks]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        pos_t = tensor(positions)
        cos, sin = cos_sin(self.inv_freq, pos_t, self.dtype, self.rope_scale)
        cache_device = self.caches[mb.kv_tier].storage.device
        batch = PagedBatch(
            query_start=tuple(starts),
            context_lens=tuple(c.context_len for c in mb.chunks),
            block_tables=torch.tensor(tables, dtype=torch.int64, device=cache_device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=cache_device),
            trees=trees,
        )
        staged, contexts, where = None, batch.context_lens, self.host_attention
        if mb.kv_tier == Tier.HOST and where is not None and where.stage(len(token_ids), len(contexts), sum(contexts)):
            tables_used = [c.block_table for c in mb.chunks]
            staged = staging(tables_used, contexts, batch, block_size, cache_device, self.device)
            self.staged_micro_batches += 1
        decode = all(len(c.token_ids) == 1 for c in mb.chunks)
        return _Prepared(tensor(token_ids), cos, sin, batch, tensor(rows), segments, mb.kv_tier, staged, decode)


def _tree_rows(c: SeqChunk) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]:
    """A chunk verifying a draft tree: its attention mask, key and query positions (PagedBatch.trees), and its rows'
    positions. The tree's nodes follow its root, the sequence's last known token (the chunk's first scored
    position, in every piece of a cut chunk), one slot each; a node sits at the root's position plus its depth and
    sees the slots up to the root and its own ancestors'."""
    root, parents = c.scored[0], c.parents
    depth = torch.tensor(depths(parents), dtype=torch.int64)
    key_pos = torch.arange(c.context_len, dtype=torch.int64)
    nodes = key_pos[root + 1 :]  # the nodes this piece's context reaches: up to its last row
    key_pos[root + 1 :] = root + depth[: len(nodes)]
    rows = torch.arange(c.start_pos, c.context_len)
    mask = torch.arange(c.context_len)[None, :] <= rows[:, None].clamp(max=root)  # causal up to the root
    seen = tree_visible(parents)[: len(nodes), : len(nodes)]
    below = rows > root
    mask[below, root + 1 :] = seen[rows[below] - root - 1]
    query_pos = key_pos[c.start_pos :]
    return (mask, key_pos, query_pos.clone()), query_pos.tolist()
