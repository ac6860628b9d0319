"""The synthetic checkpoints of the MoE benchmarks: random bf16 weights, a Mixtral (8 experts, top-2, about 3 GB),
and DeepSeek-V3 and gpt-oss scaled down with their expert counts kept (about 1.95 and 1.35 GB).

    python benchmarks/moe_checkpoint.py [--work-dir ~/.cache/offload/bench]

Built once in the work dir and reused (the folder's name changes with the shape). Random routers route tokens
close to uniformly over the experts, so the experts a batch touches are a worst case for any expert cache next to
a trained model's skewed routing.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from bench_common import ensure_checkpoint

SHAPE = {  # 16 layers of 8 experts of 3 x 1024 x 3584: 2.82 GB of experts, 3.0 GB in all
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
QUICK_SHAPE = SHAPE | {"hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 6, "vocab_size": 1000}
# DeepSeek-V3 scaled down, its counts kept (256 routed experts, 8 a token, 1 shared, 8 groups of which 4 are kept,
# sigmoid routing scaled by 2.5, one dense layer in 17 like its 3 in 61) and its ratios to the hidden size near the
# published ones (an expert 0.28x, the dense MLP 2.6x, the q rank 0.22x): 16 sparse layers of 256 experts of
# 3 x 512 x 144 (0.44 MB each, 113 MB a layer: whole-layer streaming's two buffers fit a quarter of the model),
# 1.81 GB of experts, 1.95 GB in all
DEEPSEEK_SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1344,
    "moe_intermediate_size": 144,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 17,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 112,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
DEEPSEEK_QUICK = DEEPSEEK_SHAPE | {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64}
DEEPSEEK_QUICK |= {"n_routed_experts": 32, "num_hidden_layers": 6, "vocab_size": 1000}
# gpt-oss-20b scaled down, its counts kept (32 experts as wide as the hidden size, 4 a token, sliding and full layers
# alternating, heads of 64 with 5 query heads a KV head): 16 layers of 32 experts of 3 x 640 x 640 (2.5 MB each in
# bf16, 79 MB a layer: whole-layer streaming's two buffers fit a quarter of the model), 1.26 GB of experts, 1.35 GB
GPT_OSS_SHAPE = {
    "hidden_size": 640,
    "intermediate_size": 640,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 16,
    "num_attention_heads": 10,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
GPT_OSS_QUICK = GPT_OSS_SHAPE | {"hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 6}
GPT_OSS_QUICK |= {"vocab_size": 1000}
FAMILIES = {  # --family -> (shape, quick shape, the count of experts in its name)
    "mixtral": (SHAPE, QUICK_SHAPE, "num_local_experts"),
    "deepseek_v3": (DEEPSEEK_SHAPE, DEEPSEEK_QUICK, "n_routed_experts"),
    "gpt_oss": (GPT_OSS_SHAPE, GPT_OSS_QUICK, "num_local_experts"),
}


def ensure_mixtral(work_dir: Path, shape: Mapping[str, int] = SHAPE, tokenizer: bool = False) -> Path:
    """A random-weight bf16 Mixtral of `shape` in Hugging Face layout under `work_dir`, written once and reused;
    with `tokenizer`, the demo model's tokenizer beside it (built first if missing), for text prompts."""
    name = "mixtral-" + "-".join(f"{shape[k]}" for k in ("num_hidden_layers", "hidden_size", "num_local_experts"))
    model_dir = ensure_checkpoint(work_dir / f"{name}-bf16", shape, family="mixtral")
    if tokenizer:
        _add_tokenizer(model_dir)
    return model_dir


def ensure_moe(work_dir: Path, family: str, quick: bool = False) -> Path:
    """The synthetic checkpoint of `family` (FAMILIES), written once under `work_dir` and reused."""
    if family == "mixtral":
        return ensure_mixtral(work_dir, QUICK_SHAPE if quick else SHAPE)
    full, small, experts = FAMILIES[family]
    shape = small if quick else full
    name = f"{family}-{shape['num_hidden_layers']}-{shape['hidden_size']}-{shape[experts]}"
    return ensure_checkpoint(work_dir / f"{name}-bf16", shape, family=family)


def _add_tokenizer(model_dir: Path) -> None:
    """The demo model's byte-level tokenizer (its ids are all below the vocabulary size), so that `offload generate`
    takes text prompts."""
    import shutil

    from offload.demo import ensure_demo_model

    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (demo / name).exists() and not (model_dir / name).exists():
            shutil.copyfile(demo / name, model_dir / name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/offload/bench"))
    print(ensure_mixtral(parser.parse_args().work_dir.expanduser(), tokenizer=True))
