"""A GGUF file's tokenizer (with its chat template) as transformers converts one, written beside the imported model
with generation_config.json.

transformers' tokenizer conversion alone reads nothing but the tokenizer.* metadata (every architecture's files hold
the tokenizer alike), in a fraction of a second; where it fails, AutoTokenizer is tried, which reads a GGUF tokenizer
only for the architectures it loads as models (and parses their model metadata on the way, for seconds: its gpt-oss
reader fails on the rope.scaling keys llama.cpp writes). For SmolLM2's file both write the same tokenizer.json and
chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from gguf import GGUFReader

from offload.common.errors import OffloadError
from offload.gguf.metadata import special_tokens

ERRORS = (OSError, ValueError, KeyError, NotImplementedError)  # what transformers raises for a file it cannot convert
AUTO_ERRORS = (*ERRORS, TypeError)  # ... and AutoTokenizer for model metadata it misreads


def write_tokenizer(path: Path, work: Path, reader: GGUFReader) -> None:
    """The tokenizer of GGUF file `path` saved into `work`, and generation_config.json; an OffloadError names the
    file and its tokenizer kind where transformers cannot convert it."""
    try:  # the tokenizer.* metadata alone: a tenth of a second where AutoTokenizer takes seconds (it parses the model)
        tokenizer = _converted_tokenizer(path)
    except ERRORS:
        try:
            tokenizer = _auto_tokenizer(path)
        except AUTO_ERRORS as exc:
            model = reader.fields.get("tokenizer.ggml.model")
            kind = model.contents() if model is not None else "none"
            raise OffloadError(f"{path}: transformers cannot convert its tokenizer ({kind}): {exc}") from None
    tokenizer.save_pretrained(work)
    (work / "generation_config.json").write_text(json.dumps(special_tokens(reader, path), indent=2))


def _auto_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _converted_tokenizer(path: Path):
    """The file's tokenizer built by transformers' GGUF tokenizer conversion, without the architecture's model."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer, settings = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra)
