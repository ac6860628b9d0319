"""The one encoding path: a model's tokenizer, loaded once, turning text, token ids and conversations into prompt ids
(and ids back into text) for the API, the command line, the server and batch jobs alike.

The tokenizer is shared by threads (the server encodes requests on its event loop while the core decodes new
tokens), and Hugging Face's fast tokenizers are not safe to call from two threads at once: every call takes one
lock.
"""

from __future__ import annotations

import threading
from pathlib import Path

from offload.common.errors import OffloadError
from offload.openai.tool_calls import render, template_has_tools

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(model_dir: Path):  # -> transformers.PreTrainedTokenizerBase
    from transformers import AutoTokenizer

    if not has_tokenizer(model_dir):
        raise OffloadError(f"{model_dir}: no tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]})")
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise OffloadError(f"{model_dir}: cannot load the tokenizer ({str(exc).splitlines()[0]})") from None


class Prompts:
    """Encodes prompts for one model. `tokenizer` None: the model has none, so prompts must be token ids."""

    def __init__(self, model_dir: Path, tokenizer) -> None:
        self.model_dir = model_dir
        self.tokenizer = tokenizer  # transformers.PreTrainedTokenizerBase | None
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model_dir: Path) -> Prompts:
        return cls(model_dir, load_tokenizer(model_dir) if has_tokenizer(model_dir) else None)

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and self.tokenizer.chat_template is not None

    def encode(self, prompt: str | list[int], index: int | str = 0) -> list[int]:
        """Token ids of a text prompt, or the ids themselves (unchecked: the core checks them against its limits)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt:
            raise OffloadError(f"prompt {index} is empty")
        if self.tokenizer is None:
            raise OffloadError(f"{self.model_dir}: this model has no tokenizer: send token ids")
        with self._lock:
            return list(self.tokenizer(prompt)["input_ids"])

    def encode_chat(self, messages: list[dict], index: int | str = 0, tools: list[dict] | None = None) -> list[int]:
        """The token ids of `messages` under the chat template, ready for the assistant's turn. `tools`: the
        functions the reply may call (OpenAI's function objects), through the template where it has a tools section,
        else through the default tool prompt (offload/openai/tool_calls.py)."""
        if not messages or not all(isinstance(m, dict) and (m.get("content") or m.get("tool_calls")) for m in messages):
            raise OffloadError(f"conversation {index} is empty or has a message without content")
        if not self.has_chat_template:
            raise OffloadError(f"{self.model_dir}: the tokenizer has no chat template")
        extra = {}
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            with_template = template_has_tools(self.tokenizer.chat_template)
            messages = render(messages, tools, with_template)
            if with_template and tools:
                extra["tools"] = [{"type": "function", "function": f} for f in tools]
        with self._lock:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        return list(ids if isinstance(ids, list) else ids["input_ids"])  # transformers 5 returns a BatchEncoding

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def grammar_tokenizer(self, vocab_size: int, eos_ids: tuple[int, ...]):  # -> llguidance.LLTokenizer
        """The tokenizer as llguidance reads it, for constrained decoding (offload/model/structured.py): built from the
        fast tokenizer's own serialization, with the engine's vocabulary size (the width of its logits) and ends."""
        import llguidance.hf

        if self.tokenizer is None:
            raise OffloadError("constrained decoding needs a tokenizer, and this model has none")
        with self._lock:
            try:
                return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
            except ValueError as exc:
                raise OffloadError(
                    f"{self.model_dir}: constrained decoding cannot use this tokenizer ({exc})"
                ) from None
