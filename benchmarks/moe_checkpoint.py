"""The synthetic Mixtral checkpoint of the MoE benchmarks: random bf16 weights, 8 experts, top-2, about 3 GB.

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


def ensure_mixtral(work_dir: Path, shape: Mapping[str, int] = SHAPE, tokenizer: bool = False) -> Path:
    """A random-weight bf16 Mixtral of `shape` in Hugging Face layout under `work_dir`, written once and reused;
    with `tokenizer`, the demo model's tokenizer beside it (built first if missing), for text prompts."""
    name = "mixtral-" + "-".join(f"{shape[k]}" for k in ("num_hidden_layers", "hidden_size", "num_local_experts"))
    model_dir = ensure_checkpoint(work_dir / f"{name}-bf16", shape, family="mixtral")
    if tokenizer:
        _add_tokenizer(model_dir)
    return model_dir


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
