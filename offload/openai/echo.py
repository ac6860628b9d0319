"""OpenAI completions' `echo`: the prompt's text before each choice's completion and, with `logprobs`, the prompt's
tokens before the generated ones in `tokens`, `token_logprobs`, `top_logprobs` and `text_offset`, as OpenAI and vLLM
answer it (what lm-evaluation-harness reads to score a continuation).

The prompt's first token has no logprob (nothing precedes it): its `token_logprobs` and `top_logprobs` entries are
null. The others come from the engine's scheduled steps (SamplingParams.prompt_logprobs) on a request's first delta;
a request aborted before that delta has nulls only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from offload.common.outputs import Delta


@dataclass(frozen=True, slots=True)
class Echo:
    """One choice's prompt as echoed."""

    text: str  # the prompt string sent, or the token ids sent, decoded
    ids: tuple[int, ...]  # the prompt's token ids, as the engine ran them

    def before(
        self, text: str, logprobs: dict | None, first: Delta | None, token_text: Callable[[int], str]
    ) -> tuple[str, dict | None]:
        """A choice's `text` and `logprobs` (a completions logprobs object of its generated tokens, their text_offset
        counted after this prompt's text; None without logprobs) with the prompt before them; `first`: the choice's
        first delta (None: it had none)."""
        if logprobs is None:
            return self.text + text, None
        given = first.prompt_logprobs if first is not None else ()
        entries = given if len(given) == len(self.ids) else (None,) * len(self.ids)
        tokens = [token_text(t) for t in self.ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return self.text + text, {
            "tokens": tokens + logprobs["tokens"],
            "token_logprobs": [None if e is None else e.logprob for e in entries] + logprobs["token_logprobs"],
            "top_logprobs": [None if e is None else {token_text(t): v for t, v in e.top} for e in entries]
            + logprobs["top_logprobs"],
            "text_offset": offsets + logprobs["text_offset"],
        }
