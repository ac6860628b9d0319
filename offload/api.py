"""The Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.build import ExpertParts, KVParts, build
from offload.common.config import EngineConfig, Policy, SamplingParams
from offload.common.errors import OffloadError
from offload.common.outputs import CoreCounters, Delta
from offload.common.tier import Tier
from offload.eval import Perplexity, Progress, check_context, evaluate
from offload.planner.routing import record as record_routing
from offload.planner.speculation import record
from offload.prompts import Prompts
from offload.run_stats import RunStats
from offload.scheduler.cost.moe_cost import sparse_layers
from offload.scheduler.cost.predict import Prediction, Workload
from offload.tiers.experts.expert_cache import ExpertStats
from offload.tiers.io.backends import BackendChoice
from offload.tiers.kv.lower_tiers import KVTierCounters
from offload.tiers.kv.prefix import extend_chain
from offload.tiers.spill.spilling import SpillStats
from offload.tiers.weights.weight_store import WeightStats


@dataclass(frozen=True, slots=True)
class Completion:
    prompt: str | None
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str  # "stop" (eos or a stop string) or "length"


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Where a mixture's routed experts live: a cache they stream through by (layer, expert), read from storage, and
    on CUDA the device slots that cache (then in pinned host RAM) fills."""

    per_layer: tuple[int, ...]  # routed experts of each sparse layer, in layer order
    slots: int  # experts the cache holds at once
    budget: int  # bytes given to the cache
    slot_cost: int  # bytes, one expert in the cache
    device_slots: int  # experts the device slots hold at once (0: no device slots, the cache is the device's)
    device_budget: int  # bytes given to the device slots (0: none)
    device_slot_cost: int  # bytes, one expert in a device slot (0: none)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the weights and the KV cache live."""

    device: str
    dtype: str
    weight_bytes: int  # resident on the device
    host_weight_bytes: int  # kept in host RAM
    streamed_bytes_per_pass: int  # read from storage on every step
    device_peak: int  # bytes, everything charged to the device budget
    device_budget: int | None
    host_peak: int
    kv_bytes: int
    kv_blocks: int
    block_size: int
    checkpoint_bytes_read: int
    spill: SpillStats | None  # what --offload-dir holds for this model (None: not set)
    layer_tiers: tuple[Tier, ...]  # per decoder layer: Tier.DEVICE, HOST or NVME (the Policy's)
    embed_tier: Tier  # Tier.DEVICE, or Tier.NVME: the token table left in storage
    ring_slots: int  # device buffers streamed layers pass through (0: nothing streams)
    max_model_len: int  # tokens a sequence may reach: the context window within the KV cache
    kv_format: str  # how the KV cache stores keys and values: "float32", "bfloat16", "int8-g32", ...
    kv_block_bytes: int  # one KV block: every layer's keys and values of block_size tokens
    layer_bytes: tuple[int, ...]  # per decoder layer: bytes of its tensors as the checkpoint stores them
    io_backend: BackendChoice  # which backend reads the checkpoint, and why
    io_note: str  # why the backend refused page-locked read buffers ("" while it has not)
    # where micro-batches of sequences whose KV is in host RAM attend: "auto", "cpu" or "device" (--host-kv-attention;
    # None: no KV host part, or a CPU device, where they attend in place)
    host_kv_attention: str | None
    experts: ExpertPlacement | None  # a mixture's routed experts (None: none stream)

    @property
    def policy(self) -> Policy:
        """The layers' placement as the cost model's type: what a Candidate's `policy` priced."""
        return Policy(self.layer_tiers, self.ring_slots, self.embed_tier)

    @property
    def counts(self) -> tuple[int, int, int]:
        """Layers per tier: (device, host, nvme)."""
        return tuple(self.layer_tiers.count(t) for t in Tier)


@dataclass(frozen=True, slots=True)
class KVHostStats:
    """The host-RAM part of the KV pool now (--kv-host-memory): cached prefix blocks, and the blocks of sequences
    that run from host RAM while the device part is full."""

    slots: int  # blocks it holds at most
    blocks: int  # blocks holding KV: cached prefix blocks and those sequences hold
    blocks_used: int  # blocks sequences hold (cached prefix blocks no sequence holds are not counted)
    peak: int  # bytes charged to its budget at most so far
    budget: int  # bytes
    pinned: bool  # page-locked: copies between it and the device run asynchronously
    hit_tokens: int  # prompt tokens of the sequences admitted here that cached blocks served, over the engine's life
    staged_micro_batches: int  # micro-batches of its sequences that attended on the compute device, over the same


@dataclass(frozen=True, slots=True)
class KVDiskStats:
    """The disk part of the KV pool now (--kv-disk-memory, in --offload-dir): prefix blocks kept across runs."""

    blocks: int  # block files held
    used: int  # bytes they take
    peak: int  # bytes they took at most so far
    budget: int  # bytes
    bytes_read: int  # over the engine's life


@dataclass(frozen=True, slots=True)
class EngineStats:
    """`LLM.stats()`: what the engine holds and has done, as plain values."""

    run: RunStats | None  # the last generate call (None before the first)
    placement: Placement
    counters: CoreCounters  # totals over the engine's life
    weights: WeightStats  # the weight store's
    device_used: int  # bytes charged to the device tier now
    host_used: int  # bytes charged to the host tier now
    kv_blocks_used: int  # device KV blocks sequences hold now (cached prefix blocks no sequence holds are not counted)
    kv_tiers: KVTierCounters | None  # the KV tiers below the device (None: none configured)
    kv_host: KVHostStats | None  # the host part of the KV pool (None: none)
    kv_disk: KVDiskStats | None  # the disk part of the KV pool (None: none)
    experts: ExpertStats | None  # the expert cache's, over the engine's life (None: no experts stream)


def _expert_placement(experts: ExpertParts) -> ExpertPlacement:
    cache, d = experts.cache, experts.slots
    per_layer = Counter(layer for layer, _ in cache.layouts)  # (layer, expert) keys
    device = (0, 0, 0) if d is None else (d.slots, d.budget, d.slot_cost)
    counts = tuple(per_layer[i] for i in sorted(per_layer))
    return ExpertPlacement(counts, cache.slots, cache.budget, cache.slot_cost, *device)


def _kv_host(kv: KVParts, staged_micro_batches: int) -> KVHostStats | None:
    if kv.host_tables is None:
        return None
    tiers = kv.tiers
    return KVHostStats(
        slots=tiers.host_slots,
        blocks=tiers.host_blocks,
        blocks_used=kv.host_tables.num_used,
        peak=tiers.host.peak,
        budget=tiers.host.capacity,
        pinned=tiers.host_kv.storage.is_pinned(),
        hit_tokens=kv.host_tables.counters.hit_tokens,
        staged_micro_batches=staged_micro_batches,
    )


def _kv_disk(kv: KVParts) -> KVDiskStats | None:
    disk = None if kv.tiers is None else kv.tiers.disk
    return None if disk is None else KVDiskStats(disk.blocks, disk.used, disk.peak, disk.capacity, disk.bytes_read)


def _completion(prompt: str | None, prompt_ids: list[int], deltas: list[Delta]) -> Completion:
    tokens = tuple(t for d in deltas for t in d.token_ids)
    text = "".join(d.text for d in deltas)
    return Completion(prompt, text, tokens, len(prompt_ids), deltas[-1].finish_reason or "length")


class LLM:
    """A model loaded for generation: `LLM(model_dir).generate(prompts, SamplingParams(...))`. `model=None` runs the
    embedded demo model; a GGUF file runs in place, or its import (offload/gguf/resolve.py's resolve_model).

    `config` is resolved for `workload` as every face resolves it (offload/planner/autoconfig.py's resolve): with a
    budget and neither the batch nor the KV cache fixed, the cost model sizes both, so `LLM(model,
    EngineConfig(memory=2 << 30))` plans as `offload generate --memory 2GiB` does. `workload` None: the planner's
    default workload. `prompts`: the model's encoder where the caller has loaded it already."""

    def __init__(
        self,
        model: str | Path | None = None,
        config: EngineConfig | None = None,
        workload: Workload | None = None,
        prompts: Prompts | None = None,
    ) -> None:
        from offload.demo import default_model
        from offload.gguf.resolve import resolve_model

        model_dir = resolve_model(model) if model is not None else default_model()  # a GGUF file: in place
        self.parts = build(model_dir, config or EngineConfig(), workload, prompts)
        self.config, self.model_dir, self.spec = self.parts.config, model_dir, self.parts.spec
        self.prompts = self.parts.prompts
        self.core = self.parts.core
        self.max_model_len = self.parts.max_model_len  # the context window: tokens a sequence may reach
        self.last_run: RunStats | None = None

    def close(self) -> None:
        """Let reads in flight land, write the KV blocks queued for disk, close the files. Not usable afterwards."""
        self.parts.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> None:
        """Forget the prefix blocks cached on the device and in host RAM (blocks running requests hold stay), so the
        next requests compute their prompts in full, as a fresh engine would; the disk tier, which persists across
        runs, keeps its blocks."""
        self.core.reset_prefix_cache()

    def token_text(self, token_id: int) -> str:
        """One token as text (what logprobs name it); "" where the model has no tokenizer."""
        return self.prompts.decode([token_id], skip_special_tokens=False) if self.prompts.tokenizer else ""

    @property
    def placement(self) -> Placement:
        p = self.parts
        w = p.weights.store.stats
        return Placement(
            device=str(p.device),
            dtype=str(p.dtype).removeprefix("torch."),
            weight_bytes=w.resident_bytes,
            host_weight_bytes=w.host_bytes,
            streamed_bytes_per_pass=w.streamed_bytes_per_pass,
            device_peak=p.device_tier.peak,
            device_budget=p.device_tier.capacity,
            host_peak=p.host_tier.peak,
            kv_bytes=p.kv.cache.nbytes,
            kv_blocks=p.kv.cache.num_blocks,
            block_size=p.kv.cache.block_size,
            checkpoint_bytes_read=w.bytes_read,
            spill=p.weights.spill,
            layer_tiers=p.weights.policy.layer_tiers,
            embed_tier=p.weights.policy.embed_tier,
            ring_slots=p.weights.policy.ring_slots,
            max_model_len=p.max_model_len,
            kv_format=p.kv.cache.format,
            kv_block_bytes=p.kv.cache.bytes_per_block,
            layer_bytes=tuple(g.tensor_bytes for g in p.weights.store.layouts),
            io_backend=p.weights.io_backend._replace(name=p.weights.backend.name),  # as the backend made names itself
            io_note=p.weights.backend.lock_note,
            host_kv_attention=None if p.engine.host_attention is None else p.engine.host_attention.mode,
            experts=None if p.experts is None else _expert_placement(p.experts),
        )

    def stats(self) -> EngineStats:
        """A snapshot of what the engine holds and has done: the last generate call, the placement, the counters
        over its life, the weight store's and the KV tiers'."""
        p = self.parts
        return EngineStats(
            run=self.last_run,
            placement=self.placement,
            counters=p.core.counters(),
            weights=copy.copy(p.weights.store.stats),  # the counters go on; the snapshot does not
            device_used=p.device_tier.used,
            host_used=p.host_tier.used,
            kv_blocks_used=p.kv.tables.num_used,
            kv_tiers=None if p.kv.tiers is None else copy.copy(p.kv.tiers.counters),
            kv_host=_kv_host(p.kv, p.engine.staged_micro_batches),
            kv_disk=_kv_disk(p.kv),
            experts=None if p.experts is None else p.experts.cache.stats,
        )

    def check_integrity(self) -> None:
        """Every allocator's own checks (the tiers' budgets, the KV block tables): AssertionError on a broken one."""
        p = self.parts
        p.device_tier.check_integrity()
        p.host_tier.check_integrity()
        p.kv.tables.check_integrity()
        if p.kv.host_tables is not None:
            p.kv.host_tables.check_integrity()

    @property
    def given_config(self) -> EngineConfig:
        """The config as the caller gave it; `config` is it resolved for the workload, as the engine runs."""
        return self.parts.given

    @property
    def prediction(self) -> Prediction | None:
        """The cost model's prediction for the resolved config, where it chose the batch (None: the config fixed it)."""
        return self.parts.prediction

    @property
    def assumed_budget(self) -> str | None:
        """The machine's budgets the plan assumed where the config gave none and the model does not fit without one,
        and why (offload/planner/machine_budget.py); None: nothing assumed."""
        return self.parts.assumed

    def prefix_keys(self, token_ids: list[int]) -> list[bytes]:
        """The prefix cache's key of each full block of `token_ids` ([] with the prefix cache off): blocks with equal
        keys hold the same keys and values, and the disk part names a block's file by its key in hex."""
        tables = self.parts.kv.tables
        return [] if tables.root is None else extend_chain([], tables.root, token_ids, tables.block_size)

    # ---- requests -------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int], index: int | str = 0) -> list[int]:
        """A prompt's token ids (text encoded, ids taken as they are), checked against the engine's limits."""
        return self.core.check_prompt(self.prompts.encode(prompt, index), index)

    def encode_chat(self, messages: list[dict], index: int | str = 0, tools: list[dict] | None = None) -> list[int]:
        """A conversation's token ids under the chat template, checked against the engine's limits; `tools`: the
        functions the reply may call (OpenAI's function objects)."""
        return self.core.check_prompt(self.prompts.encode_chat(messages, index, tools), index)

    def generate(
        self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [self.prompts.encode(p, i) for i, p in enumerate(prompts)]  # checked by generate_ids
        return self.generate_ids(ids, params, prompts)

    def chat(
        self, conversations: list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        ids = [self.prompts.encode_chat(c, i) for i, c in enumerate(conversations)]  # checked by generate_ids
        return self.generate_ids(ids, params)

    def generate_ids(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        prompts: list[str] | None = None,
    ) -> list[Completion]:
        """Generate for already-tokenized prompts; one Completion per prompt, in order. `params` is one for all
        prompts or one per prompt (each its own length, temperature, seed, stop strings). Drives the engine core
        until every prompt is done; RunStats covers this call."""
        called = time.perf_counter()
        per_prompt = params if isinstance(params, list) else [params or SamplingParams()] * len(prompt_ids)
        if len(per_prompt) != len(prompt_ids):
            raise OffloadError(f"{len(per_prompt)} sampling params for {len(prompt_ids)} prompts")
        checked = [self.core.check_prompt(list(ids), i) for i, ids in enumerate(prompt_ids)]  # all, before any runs
        experts = self.parts.experts.cache if self.parts.experts is not None else None
        before, experts_before = self.core.counters(), experts.stats if experts else None
        self.core.peak_kv_blocks = self.parts.kv.tables.num_used
        rids = [self.core.add_request(ids, p, stream_text=False) for ids, p in zip(checked, per_prompt, strict=True)]
        outputs: dict[int, list[Delta]] = {rid: [] for rid in rids}
        try:
            while any(not d or d[-1].finish_reason is None for d in outputs.values()):
                for delta in self.core.step():
                    if delta.request_id in outputs:
                        outputs[delta.request_id].append(delta)
        except BaseException:
            self.core.abort_all()  # an error or Ctrl-C mid-call leaves no request behind in the core
            raise
        if experts is not None:
            experts.settle()  # prefetches in flight are counted where they were started
        after = self.core.counters()
        prompts = prompts or [None] * len(rids)
        completions = [_completion(p, ids, outputs[rid]) for p, ids, rid in zip(prompts, checked, rids, strict=True)]
        self.last_run = RunStats.of(
            after - before,
            peak_kv_blocks=self.core.peak_kv_blocks,
            wall_seconds=time.perf_counter() - called,
            experts=experts.stats - experts_before if experts else None,
        )
        if self.config.speculate is not None:  # what this run's drafts measured, for later plans of the model
            record(self.model_dir, self.config.speculate, after - before, self.config.speculative_topk)
        if experts is not None:  # and how its routing met the expert cache
            x = self.last_run.experts
            routed = sparse_layers(self.spec) * self.spec.num_experts
            batch = min(len(rids), self.config.max_num_seqs or len(rids))  # sequences a decode step ran at most
            record_routing(self.model_dir, x.hits, x.misses, experts.slots / routed, batch)
        return completions

    def score(self, prompt_ids: list[list[int]]) -> list[torch.Tensor]:
        """Logits [len(ids), vocab] (float32) at every position of each token list: the prompt's scores."""
        return self.core.score(prompt_ids)

    def perplexity(self, text: str | list[int], context: int = 512, progress: Progress | None = None) -> Perplexity:
        """Perplexity of the model on `text` (or its token ids) by the protocol of offload/eval.py: windows of
        `context` tokens, each scored on its own, as many per step as the device KV cache and the step's token limit
        (--max-step-tokens) hold. `progress(done, total)` is called after each step, in windows."""
        if isinstance(text, str) and not text:
            raise OffloadError("the text is empty")
        tables = self.parts.kv.tables
        check_context(context, min(self.max_model_len, tables.pool.num_blocks * tables.block_size))
        ids = self.prompts.encode(text, "text")
        return evaluate(self.score, ids, context, self._windows_per_step(context), progress)

    def _windows_per_step(self, context: int) -> int:
        """Windows of `context` tokens one step scores: as many as the device KV cache holds, within the step's
        token limit and the batch's sequence limit."""
        tables, limits = self.parts.kv.tables, self.core.limits
        fit = tables.pool.num_blocks // tables.blocks_for(context)
        return max(1, min(fit, limits.max_step_tokens // context, limits.max_num_seqs))
