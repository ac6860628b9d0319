"""The Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.build import build
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.core import CoreCounters, Delta
from offload.eval import Perplexity, Progress, check_context, evaluate
from offload.prompts import Prompts
from offload.run_stats import KV_COUNTERS, RunStats
from offload.scheduler.cost.predict import Workload
from offload.scheduler.plan import SeqChunk, StepPlan, split_micro_batches
from offload.tiers.kv.lower_tiers import KVTierCounters
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
    layer_tiers: tuple[str, ...]  # per decoder layer: "device", "host" or "nvme" (the Policy's)
    embed_tier: str  # "device", or "nvme": the token table left in storage
    ring_slots: int  # device buffers streamed layers pass through (0: nothing streams)
    max_model_len: int  # tokens a sequence may reach: the context window within the KV cache

    @property
    def counts(self) -> tuple[int, int, int]:
        """Layers per tier: (device, host, nvme)."""
        return tuple(self.layer_tiers.count(t) for t in ("device", "host", "nvme"))


@dataclass(frozen=True, slots=True)
class EngineStats:
    """`LLM.stats()`: what the engine holds and has done, as plain values."""

    run: RunStats | None  # the last generate call (None before the first)
    placement: Placement
    counters: CoreCounters  # totals over the engine's life
    weights: WeightStats  # the weight store's
    device_used: int  # bytes charged to the device tier now
    host_used: int  # bytes charged to the host tier now
    kv_blocks_used: int  # device KV blocks held by sequences or cached prefixes now
    kv_tiers: KVTierCounters | None  # the KV tiers below the device (None: none configured)


def _completion(prompt: str | None, prompt_ids: list[int], deltas: list[Delta]) -> Completion:
    tokens = tuple(t for d in deltas for t in d.token_ids)
    text = "".join(d.text for d in deltas)
    return Completion(prompt, text, tokens, len(prompt_ids), deltas[-1].finish_reason or "length")


class LLM:
    """A model loaded for generation: `LLM(model_dir).generate(prompts, SamplingParams(...))`. `model=None` runs the
    embedded demo model; a GGUF file runs its import (offload/gguf/importer.py's resolve_model).

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
        from offload.gguf.importer import resolve_model

        model_dir = resolve_model(model) if model is not None else default_model()  # a GGUF file: imported once
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
        kv = self.parts.kv
        kv.tables.pool.drop_cached()
        if kv.tiers is not None:
            kv.tiers.settle(kv.tables.pool)
            kv.tiers.clear_host()

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
        )

    def check_integrity(self) -> None:
        """Every allocator's own checks (the tiers' budgets, the KV block tables): AssertionError on a broken one."""
        p = self.parts
        p.device_tier.check_integrity()
        p.host_tier.check_integrity()
        p.kv.tables.check_integrity()
        if p.kv.host_tables is not None:
            p.kv.host_tables.check_integrity()

    # ---- requests -------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int], index: int | str = 0) -> list[int]:
        """A prompt's token ids (text encoded, ids taken as they are), checked against the engine's limits."""
        return self._check_ids(self.prompts.encode(prompt, index), index)

    def encode_chat(self, messages: list[dict], index: int | str = 0, tools: list[dict] | None = None) -> list[int]:
        """A conversation's token ids under the chat template, checked against the engine's limits; `tools`: the
        functions the reply may call (OpenAI's function objects)."""
        return self._check_ids(self.prompts.encode_chat(messages, index, tools), index)

    def _check_ids(self, ids: list[int], index: int | str) -> list[int]:
        return self.core.check_prompt(ids, index)

    def generate(
        self, prompts: str | list[str], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [self.encode(p, i) for i, p in enumerate(prompts)]
        return self.generate_ids(ids, params, prompts)

    def chat(
        self, conversations: list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        ids = [self.encode_chat(c, i) for i, c in enumerate(conversations)]
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
        checked = [self._check_ids(list(ids), i) for i, ids in enumerate(prompt_ids)]  # all, before any runs
        experts = self.parts.experts.cache if self.parts.experts is not None else None
        before, experts_before = self.core.counters(), experts.stats if experts else None
        self.core.peak_kv_blocks = self.parts.kv.tables.num_used
        rids = [
            self.core.add_request(ids, p, stream_text=False, index=i)
            for i, (ids, p) in enumerate(zip(checked, per_prompt, strict=True))
        ]
        outputs: dict[int, list[Delta]] = {rid: [] for rid in rids}
        try:
            while any(not d or d[-1].finish_reason is None for d in outputs.values()):
                for delta in self.core.step():
                    if delta.request_id in outputs:
                        outputs[delta.request_id].append(delta)
        except BaseException:
            for rid in rids:  # an error or Ctrl-C mid-call leaves no request behind in the core
                self.core.abort(rid)
            self.core.step()
            raise
        if experts is not None:
            experts.settle()  # prefetches in flight are counted where they were started
        after = self.core.counters()
        prompts = prompts or [None] * len(rids)
        completions = [_completion(p, ids, outputs[rid]) for p, ids, rid in zip(prompts, checked, rids, strict=True)]
        self.last_run = RunStats(
            requests=len(rids),
            prompt_tokens=sum(c.prompt_tokens for c in completions),
            generated_tokens=sum(len(c.token_ids) for c in completions),
            prefill_seconds=after.prefill_seconds - before.prefill_seconds,
            decode_seconds=after.decode_seconds - before.decode_seconds,
            decode_tokens=after.decode_tokens - before.decode_tokens,
            steps=after.steps - before.steps,
            preemptions=after.preemptions - before.preemptions,
            peak_kv_blocks=self.core.peak_kv_blocks,
            bytes_read=after.bytes_read - before.bytes_read,
            read_seconds=after.read_seconds - before.read_seconds,
            stall_seconds=after.stall_seconds - before.stall_seconds,
            wall_seconds=time.perf_counter() - called,
            moved_down=after.moved_down - before.moved_down,
            moved_up=after.moved_up - before.moved_up,
            experts=experts.stats - experts_before if experts else None,
            **{f: getattr(after, f) - getattr(before, f) for f in KV_COUNTERS},
        )
        return completions

    def score(self, prompt_ids: list[list[int]]) -> list[torch.Tensor]:
        """Logits [len(ids), vocab] (float32) at every position of each token list: the prompt's scores."""
        ids = [self._check_ids(list(t), i) for i, t in enumerate(prompt_ids)]
        kv = self.parts.kv
        result: list[torch.Tensor] = []
        pending = [(-1 - i, t) for i, t in enumerate(ids)]  # ids no request of the core has (they count up from 0)
        while pending:
            chunks = []
            while pending and (table := kv.tables.grow(pending[0][0], len(pending[0][1]))) is not None:
                seq_id, t = pending.pop(0)
                chunks.append(SeqChunk(seq_id, tuple(t), 0, tuple(table)))
            if not chunks:
                raise OffloadError("a prompt does not fit the KV cache")  # _check_ids makes this unreachable
            plan = StepPlan(split_micro_batches(chunks, self.config.micro_batch_tokens), all_logits=True)
            if kv.tiers is not None:  # blocks evicted to make room go down before the step overwrites them
                kv.tiers.settle(kv.tables.pool)
            logits = self.parts.engine.step(plan).logits
            result.extend(logits.split([len(c.token_ids) for c in chunks]))
            for c in chunks:
                kv.tables.free(c.seq_id)
        return result

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
