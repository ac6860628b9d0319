"""The draft model a speculating engine runs beside its target (`--speculate PATH` or `self`): found, checked against
the target's tokenizer, built as an engine of its own on the CPU with every weight resident, and charged to the
target's memory budget before the target places its layers.

    drafter, config = draft_model(model_dir, spec, config, build)   # (None, config) for ngram or no speculation

`self` is the target's own int4 copy (QSpec's idea): the engine's converter (`offload convert --quant int4`, groups of
32, the cpu layout) writes it once into the cache folder, keyed by the target's weights fingerprint, and later runs
reuse it; a target already int4 (an imported GGUF's codes, a converted checkpoint) is its own draft. Its token
table and head are the target's bytes either way (the converter copies them): on the CPU the target takes the draft's
tensors instead of loading its own (`shared_groups`), so the process holds them once and the draft costs its layers
and KV cache alone.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from offload.common.config import SPECULATE, EngineConfig
from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec
from offload.common.paths import cache_dir
from offload.common.quant import WeightQuant
from offload.common.sizes import format_size
from offload.convert.quantize import MANIFEST, convert
from offload.gguf.resolve import resolve_model
from offload.model.loader import load_spec
from offload.model.registry import model_tensors
from offload.model.speculation.model_drafter import ModelDrafter
from offload.planner.autoconfig import on_cpu
from offload.prompts import has_tokenizer, load_tokenizer
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import Checkpoint, weights_fingerprint
from offload.tiers.weights.layout import Weights
from offload.tiers.weights.weight_store import WeightStore

SELF_QUANT = WeightQuant(4, 32, "cpu")  # `self`'s draft: int4 in groups of 32, as `offload convert` writes it
# the draft's KV cache at most (no more than the target's): a sequence longer than it holds gets no draft
DRAFT_KV_BYTES = 64 << 20
# tokens per draft KV block: small, so that the draft's prefix cache serves all but the last few tokens of a sequence
# it drafted for a step before (a call prefills only those and what the target accepted since)
DRAFT_BLOCK_SIZE = 4
DRAFT_MAX_SEQS = 64  # sequences the draft drafts at once, where the target's batch is not fixed


def draft_model(
    model_dir: Path, spec: ModelSpec, config: EngineConfig, build: Callable
) -> tuple[ModelDrafter | None, EngineConfig]:
    """The draft model `config.speculate` names, built with `build` (offload/build.py's), and `config` with the draft's
    resident bytes taken from its budget; (None, config) where speculation uses no model."""
    if config.speculate in SPECULATE and config.speculate != "self":
        return None, config
    draft_dir = self_draft(model_dir, spec) if config.speculate == "self" else resolve_model(config.speculate)
    draft_spec, _ = load_spec(draft_dir)
    if draft_dir != model_dir:
        check_tokenizer(model_dir, spec, draft_dir, draft_spec)
    draft_config = EngineConfig(
        device="cpu",
        dtype=config.dtype,
        kv_cache_bytes=min(config.kv_cache_bytes or DRAFT_KV_BYTES, DRAFT_KV_BYTES),
        max_num_seqs=config.max_num_seqs or DRAFT_MAX_SEQS,
        block_size=DRAFT_BLOCK_SIZE,
    )
    parts = build(draft_dir, draft_config)
    shared = {}
    if config.speculate == "self" and on_cpu(config) and parts.dtype == target_dtype(spec, config):
        shared = shared_groups(model_dir, spec, draft_dir, parts.weights.store)
    # every weight and the KV cache (the draft streams nothing), less what the target takes as its own
    nbytes = parts.device_tier.peak - tensor_bytes(shared)
    drafter = ModelDrafter(parts.core, spec.vocab_size, nbytes, draft_dir, parts.close, config.speculative_topk, shared)
    try:
        return drafter, charged(config, nbytes)
    except OffloadError:
        drafter.close()
        raise


def target_dtype(spec: ModelSpec, config: EngineConfig) -> torch.dtype:
    """The dtype the target computes in, as build() resolves it."""
    return getattr(torch, spec.dtype if config.dtype == "auto" else config.dtype)


def shared_groups(model_dir: Path, spec: ModelSpec, draft_dir: Path, store: WeightStore) -> dict[str, Weights]:
    """The draft's resident token table and head groups ("embed", "head") that its target may hold as its own: those
    whose every tensor both checkpoints store under one name, in one shape and dtype. For `self` these are the same
    bytes: the very files, or the converter's copy of them in the model's dtype (a table stored in another dtype is
    converted, so it is not shared). Loaded by one rule into one dtype, they are the tensors the target would load."""
    _, family = load_spec(model_dir)
    groups = model_tensors(family, spec)
    held = {"head": (groups.head, store.head)}
    if store.table is None:  # the draft holds its table (it has no budget to leave it in storage)
        held["embed"] = (groups.embed, store.embed)
    with BufferedReader() as reader:  # headers only
        mine, theirs = Checkpoint(model_dir, reader), Checkpoint(draft_dir, reader)

    def same(name: str) -> bool:
        if name not in mine or name not in theirs:
            return False
        a, b = mine.extent(name), theirs.extent(name)
        return (a.dtype, a.shape) == (b.dtype, b.shape)

    return {
        name: {short: weights[short] for short in group}
        for name, (group, weights) in held.items()
        if all(same(t.name) and short in weights for short, t in group.items())
    }


def tensor_bytes(groups: dict[str, Weights]) -> int:
    """Bytes of the distinct tensors in `groups` (a tied head is the table itself)."""
    tensors = {id(t): t for weights in groups.values() for t in weights.values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def self_draft(model_dir: Path, spec: ModelSpec) -> Path:
    """The directory of `model_dir`'s int4 copy: the model itself where it is int4 codes the CPU multiplies (the cpu
    layout, a GGUF file's blocks), else its conversion in the cache folder, made on first use."""
    if spec.quant is not None:
        if spec.quant.bits == 4 and spec.quant.layout != "triton":  # int4 codes the CPU multiplies
            return model_dir
        raise OffloadError(
            f"--speculate self: {model_dir} is {spec.quant.name}; self needs a float checkpoint (converted to int4 "
            "once) or one already int4 that the CPU multiplies"
        )
    out = cache_dir() / "draft" / f"{model_dir.name}-{SELF_QUANT.name}-{weights_fingerprint(model_dir)[:16]}"
    if (out / MANIFEST).is_file():
        return out
    print(f"converting {model_dir} to {SELF_QUANT.name} once, as its own draft -> {out}", file=sys.stderr)
    start = time.perf_counter()
    try:
        stats = convert(model_dir, out, SELF_QUANT)
    except (OffloadError, OSError):
        if (out / MANIFEST).is_file():  # another process converted it meanwhile
            return out
        raise
    print(
        f"converted  {format_size(stats.source_bytes)} -> {format_size(stats.bytes_written)} in "
        f"{time.perf_counter() - start:.1f} s (once; later runs reuse it)",
        file=sys.stderr,
    )
    return out


def check_tokenizer(model_dir: Path, spec: ModelSpec, draft_dir: Path, draft_spec: ModelSpec) -> None:
    """OffloadError in one line naming both models unless the draft's token ids mean what the target's do: the same
    tokenizer vocabulary (token -> id), or with no tokenizer on either side, the same vocabulary size."""
    mine, theirs = has_tokenizer(model_dir), has_tokenizer(draft_dir)
    if mine and theirs:
        target, draft = load_tokenizer(model_dir).get_vocab(), load_tokenizer(draft_dir).get_vocab()
        if target == draft:
            return
        differ = next((t for t, i in draft.items() if target.get(t) != i), None)
        why = f"{len(draft)} tokens against {len(target)}" + (f", {differ!r} is {draft[differ]}" if differ else "")
    elif not mine and not theirs and spec.vocab_size == draft_spec.vocab_size:
        return
    else:
        why = f"vocabulary of {draft_spec.vocab_size} against {spec.vocab_size}, a tokenizer on one side only"
    raise OffloadError(
        f"--speculate {draft_dir}: its tokenizer is not the one of {model_dir} ({why}); a draft model must share it"
    )


def charged(config: EngineConfig, nbytes: int) -> EngineConfig:
    """`config` with `nbytes` (the draft, resident in RAM) taken from the budgets that hold RAM: on the CPU the device
    budget, with a CUDA device the host budget; and --memory, a cap on the whole process. Budgets not given stay so."""
    names = ("device_memory" if on_cpu(config) else "host_memory", "memory")
    changes = {}
    for name in names:
        budget = getattr(config, name)
        if budget is None:
            continue
        if budget <= nbytes:
            raise OffloadError(
                f"--{name.replace('_', '-')} {format_size(budget)} leaves nothing for the model once its draft "
                f"({format_size(nbytes)} resident) is charged to it"
            )
        changes[name] = budget - nbytes
    return dataclasses.replace(config, **changes)
