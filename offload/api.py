"""The Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.common.config import EngineConfig, Policy, SamplingParams
from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.convert import check_runnable
from offload.core import Delta, EngineCore
from offload.model.engine import Engine
from offload.model.expert_streaming import expert_caches, layer_experts, model_layouts, read_gates
from offload.model.loader import load_spec
from offload.planner.cold_experts import cold_experts
from offload.planner.host_attention import choose_host_attention
from offload.planner.profiles import saved_read_rates
from offload.run_stats import KV_COUNTERS, RunStats
from offload.scheduler.batcher import BatchLimits
from offload.scheduler.plan import SeqChunk, StepPlan, split_micro_batches
from offload.tiers.checkpoint import Checkpoint
from offload.tiers.device import DeviceTier
from offload.tiers.host import HostTier
from offload.tiers.io.backends import choose_backend, make_backend
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.kv import KVCache
from offload.tiers.kv_pool import kv_key, make_kv_pool
from offload.tiers.layout import ModelLayout
from offload.tiers.placement import place_weights
from offload.tiers.spill import SpillStats, spill_layers
from offload.tiers.weights import WeightStore


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
    spill: SpillStats | None = None  # what --offload-dir holds for this model (None: not set)


def _completion(prompt: str | None, prompt_ids: list[int], deltas: list[Delta]) -> Completion:
    tokens = tuple(t for d in deltas for t in d.token_ids)
    text = "".join(d.text for d in deltas)
    return Completion(prompt, text, tokens, len(prompt_ids), deltas[-1].finish_reason or "length")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise OffloadError(f"device {name!r}: this machine has no CUDA device")
    return torch.device(name)


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(model_dir: Path):  # -> transformers.PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    if not has_tokenizer(model_dir):
        raise OffloadError(f"{model_dir}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise OffloadError(f"{model_dir}: cannot load the tokenizer ({str(exc).splitlines()[0]})") from None


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of `messages` under the tokenizer's chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5 returns a BatchEncoding


def _eos_ids(model_dir: Path, spec: ModelSpec) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's, else config.json's."""
    path = model_dir / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    except json.JSONDecodeError as exc:
        raise OffloadError(f"{path}: not valid JSON ({exc})") from None
    if eos is not None:
        return tuple(eos) if isinstance(eos, list) else (eos,)
    return spec.eos_token_ids


class LLM:
    """A model loaded for generation. `model=None` runs the embedded demo model."""

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None) -> None:
        from offload.demo import ensure_demo_model

        config = config or EngineConfig()
        if config.memory is not None:  # the cap becomes a device budget only where the batch is planned
            raise OffloadError(
                "memory (a cap on the whole process) is turned into a device budget, batch and KV cache by the cost "
                "model: pass the config through offload.planner.autoconfig.autoconfigure, or give device_memory"
            )
        self.config = config
        self.model_dir = Path(model).expanduser() if model is not None else ensure_demo_model()
        self.spec, self.family = load_spec(self.model_dir)
        self.device = resolve_device(config.device)
        check_runnable(self.model_dir, self.spec, self.device)  # a quantized checkpoint this device can multiply
        self.dtype = getattr(torch, self.spec.dtype if config.dtype == "auto" else config.dtype)
        self.eos_ids = _eos_ids(self.model_dir, self.spec)
        self.device_tier = DeviceTier(config.device_memory, self.device)
        self.host_tier = HostTier(config.host_memory or None)  # 0: no budget, so no layer in host RAM (see HostTier)
        self.kv = self._make_kv_cache()
        with BufferedReader() as reader:  # headers only; tensor data goes through the NVMe backend
            checkpoint = Checkpoint(self.model_dir, reader)
            layout, experts = model_layouts(checkpoint, self.family, self.spec, config.expert_cache_memory > 0)
            guess = experts is not None and config.expert_prefetch == "router"
            gates = read_gates(checkpoint, self.family, self.spec) if guess else {}  # the routers, copied to guess
        # what reads the checkpoint, and why: "auto" by the rates `offload probe` saved here, if it ran
        self.io_backend = choose_backend(config.io_backend, saved_read_rates() if config.io_backend == "auto" else None)
        self.backend = make_backend(self.io_backend.name)
        # routed experts stream through a cache of their own, taken from the device budget before layers are placed
        # (on CUDA: device slots, filled from a cache in pinned host RAM, where cold experts may run instead)
        budgets = config.expert_cache_memory, config.expert_host_memory
        self.experts, self.expert_slots = expert_caches(
            experts, self.backend, self.device_tier, self.host_tier, self.dtype, *budgets
        )
        slots = self.expert_slots
        cold = (
            cold_experts(config.cold_experts, self.spec, self.dtype, self.device, slots.expert_bytes) if slots else None
        )
        routed = layer_experts(self.experts, self.spec, gates, self.dtype, config.expert_prefetch, slots, cold)
        self.spill: SpillStats | None = None  # streamed layers converted once into --offload-dir
        if config.offload_dir is not None:
            layout, self.spill = spill_layers(
                layout, self._place, self.dtype, config.offload_dir, config.disk_memory, self.io_backend.name
            )
        self.policy = self._place(layout)
        # a table left in storage reads its rows through a backend of its own, never queued behind layer reads
        self.embed_backend = make_backend(self.io_backend.name, threads=4) if self.policy.embed_tier == "nvme" else None
        self.weights = WeightStore(
            layout,
            self.backend,
            self.policy,
            self.device_tier,
            self.host_tier,
            self.dtype,
            embed_backend=self.embed_backend,
        )
        self.kv_key = kv_key(self.model_dir, self.spec, self.dtype, self.kv)
        self.tables, self.host_tables, self.kv_tiers = make_kv_pool(config, self.kv, self.kv_key, self.spec)
        # a sequence's blocks are all in one part of the pool: the device's, or the host's
        kv_blocks = max(self.kv.num_blocks, self.host_tables.pool.num_blocks if self.host_tables else 0)
        self.max_model_len = min(self.spec.max_position, kv_blocks * config.block_size)
        host_kv = self.kv_tiers.host_kv if self.host_tables is not None else None
        where = None  # where host-resident micro-batches attend
        if host_kv is not None:
            where = choose_host_attention(
                config.host_kv_attention, self.spec, self.dtype, self.device, config.kv_dtype, config.block_size
            )
        self.engine = Engine(
            self.spec, self.family, self.weights, self.kv, self.device, self.dtype, host_kv, routed, where
        )
        limits = BatchLimits(config.max_num_seqs, config.max_step_tokens, config.micro_batch_tokens, self.max_model_len)
        tokenizer = (lambda: self.tokenizer) if has_tokenizer(self.model_dir) else None
        if tokenizer is not None:
            tokenizer()  # loaded with the weights: no generate call pays for it (a first load imports for ~1 s)
        self.core = EngineCore(
            self.engine, self.tables, limits, self.eos_ids, self.weights, tokenizer, self.kv_tiers, self.host_tables
        )
        self.stats: RunStats | None = None

    def _make_kv_cache(self) -> KVCache:
        s, c = self.spec, self.config
        geometry = (s.num_layers, c.block_size, s.num_kv_heads, s.head_dim)
        try:  # a format this model's shape or this torch cannot hold
            per_block = KVCache.block_bytes(*geometry, self.dtype, c.kv_dtype, c.kv_group_size)
        except ValueError as exc:
            raise OffloadError(str(exc)) from None
        if c.kv_cache_bytes < per_block:
            raise OffloadError(
                f"kv cache memory of {c.kv_cache_bytes} bytes holds no block "
                f"(one block of {c.block_size} tokens needs {per_block} bytes)"
            )
        blocks = c.kv_cache_bytes // per_block
        kv = KVCache(
            s.num_layers,
            blocks,
            c.block_size,
            s.num_kv_heads,
            s.head_dim,
            self.dtype,
            self.device,
            c.kv_dtype,
            group_size=c.kv_group_size,
        )
        if not self.device_tier.adopt(kv.storage):
            raise OffloadError(
                f"--kv-cache-memory ({c.kv_cache_bytes} bytes) does not fit --device-memory ({c.device_memory} bytes)"
            )
        return kv

    def _place(self, layout: ModelLayout) -> Policy:
        """Place the layers in what the device budget leaves after the KV cache, the embedding and the head."""
        return place_weights(layout, self.dtype, self.device_tier, self.host_tier, self.config.ring_slots)

    def close(self) -> None:
        """Let reads in flight land, write the KV blocks queued for disk, close the files. Not usable afterwards."""
        self.weights.close()
        if self.expert_slots is not None:
            self.expert_slots.close()  # copies from the host cache's buffers land before those go
        if self.experts is not None:
            self.experts.close()
        self.backend.close()
        if self.embed_backend is not None:
            self.embed_backend.close()
        if self.kv_tiers is not None:
            self.kv_tiers.settle(self.tables.pool)  # the last step's computed blocks, not yet written through
            self.kv_tiers.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> None:
        """Forget the prefix blocks cached on the device and in host RAM (blocks running requests hold stay), so the
        next requests compute their prompts in full, as a fresh engine would; the disk tier, which persists across
        runs, keeps its blocks."""
        self.tables.pool.drop_cached()
        if self.kv_tiers is not None:
            self.kv_tiers.settle(self.tables.pool)
            self.kv_tiers.clear_host()

    def token_text(self, token_id: int) -> str:
        """One token as text (what logprobs name it)."""
        return self.tokenizer.decode([token_id])

    @functools.cached_property
    def tokenizer(self):  # -> transformers.PreTrainedTokenizerBase; loaded by __init__ where the model has one
        return load_tokenizer(self.model_dir)

    @property
    def placement(self) -> Placement:
        return Placement(
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            weight_bytes=self.weights.stats.resident_bytes,
            host_weight_bytes=self.weights.stats.host_bytes,
            streamed_bytes_per_pass=self.weights.stats.streamed_bytes_per_pass,
            device_peak=self.device_tier.peak,
            device_budget=self.device_tier.capacity,
            host_peak=self.host_tier.peak,
            kv_bytes=self.kv.nbytes,
            kv_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            checkpoint_bytes_read=self.weights.stats.bytes_read,
            spill=self.spill,
        )

    # ---- requests -------------------------------------------------------------------------------

    def encode(self, prompt: str, index: int = 0) -> list[int]:
        if not prompt:
            raise OffloadError(f"prompt {index} is empty")
        return self._check_ids(self.tokenizer(prompt)["input_ids"], index)

    def encode_chat(self, messages: list[dict], index: int = 0) -> list[int]:
        if not messages or not all(m.get("content") for m in messages):
            raise OffloadError(f"conversation {index} is empty or has a message without content")
        if self.tokenizer.chat_template is None:
            raise OffloadError(f"{self.model_dir}: the tokenizer has no chat template")
        return self._check_ids(chat_ids(self.tokenizer, messages), index)

    def _check_ids(self, ids: list[int], index: int) -> list[int]:
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
        before, experts_before = self.core.counters(), self.experts.stats if self.experts else None
        self.core.peak_kv_blocks = self.tables.num_used
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
        if self.experts is not None:
            self.experts.settle()  # prefetches in flight are counted where they were started
        after = self.core.counters()
        prompts = prompts or [None] * len(rids)
        completions = [_completion(p, ids, outputs[rid]) for p, ids, rid in zip(prompts, checked, rids, strict=True)]
        self.stats = RunStats(
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
            experts=self.experts.stats - experts_before if self.experts else None,
            **{f: getattr(after, f) - getattr(before, f) for f in KV_COUNTERS},
        )
        return completions

    def score(self, prompt_ids: list[list[int]]) -> list[torch.Tensor]:
        """Logits [len(ids), vocab] (float32) at every position of each token list: the prompt's scores."""
        ids = [self._check_ids(list(t), i) for i, t in enumerate(prompt_ids)]
        result: list[torch.Tensor] = []
        pending = [(-1 - i, t) for i, t in enumerate(ids)]  # ids no request of the core has (they count up from 0)
        while pending:
            chunks = []
            while pending and (table := self.tables.grow(pending[0][0], len(pending[0][1]))) is not None:
                seq_id, t = pending.pop(0)
                chunks.append(SeqChunk(seq_id, tuple(t), 0, tuple(table)))
            if not chunks:
                raise OffloadError("a prompt does not fit the KV cache")  # _check_ids makes this unreachable
            plan = StepPlan(split_micro_batches(chunks, self.config.micro_batch_tokens), all_logits=True)
            if self.kv_tiers is not None:  # blocks evicted to make room go down before the step overwrites them
                self.kv_tiers.settle(self.tables.pool)
            logits = self.engine.step(plan).logits
            result.extend(logits.split([len(c.token_ids) for c in chunks]))
            for c in chunks:
                self.tables.free(c.seq_id)
        return result
