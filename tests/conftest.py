"""Shared fixtures: tiny random checkpoints of each supported family, written by transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)


def family_config(family: str):
    """A tiny transformers config exercising what sets `family` apart."""
    import transformers as tf

    if family == "llama":  # Llama 3 rope scaling, untied head
        return tf.LlamaConfig(**TINY, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "mistral":  # sliding window shorter than the prompts
        return tf.MistralConfig(**TINY, sliding_window=7)
    if family == "qwen2":  # qkv bias, tied head
        return tf.Qwen2Config(**TINY, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norm, head_dim decoupled from hidden_size / heads
        return tf.Qwen3Config(**TINY, head_dim=24, tie_word_embeddings=False)
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def make_checkpoint(path: Path, family: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                    max_shard_size: str | None = None):
    """Save a random `family` model to `path`; returns the transformers model (eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = family_config(family)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # wider weights than the default init make the logits decisive, so greedy paths do not hinge on ties
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
            else:
                p.uniform_(0.8, 1.2)  # norm scales
    model = model.to(dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


@pytest.fixture(scope="session", params=FAMILIES)
def family_checkpoint(request, tmp_path_factory):
    """(family, model dir, transformers model) for each family, fp32."""
    path = tmp_path_factory.mktemp(request.param)
    model = make_checkpoint(path, request.param)
    return request.param, path, model
