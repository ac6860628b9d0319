"""Perplexity of a model on a text, by one stated protocol (`offload eval`, `LLM.perplexity`):

1. the text is tokenized as the model's tokenizer does by default (the engine's one encoding path,
   offload/prompts.py), special tokens included where the tokenizer adds them;
2. the tokens are cut into consecutive, non-overlapping windows of `context` tokens, the last one shorter;
3. each window is scored on its own, from an empty KV cache: its first token is context only, every later token is
   predicted from the tokens before it in the window;
4. perplexity = exp(mean negative log-likelihood, in nats, of every predicted token: all but each window's first).

A last window of one token predicts nothing and is left out. The log-probabilities are computed and summed in float64.
The windows are scored several per step, as many as the KV cache and the step's token limit hold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from offload.common.errors import OffloadError

Scorer = Callable[[list[list[int]]], list[torch.Tensor]]  # token lists -> logits [len(ids), vocab] of each
Progress = Callable[[int, int], None]  # (windows scored, windows in all)


@dataclass(frozen=True, slots=True)
class Perplexity:
    perplexity: float  # exp(nll)
    nll: float  # mean negative log-likelihood per predicted token, nats
    tokens: int  # tokens in the text
    predicted: int  # tokens scored: all but each window's first
    windows: int  # windows scored (a last window of one token is not)
    context: int  # tokens per window

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def check_context(context: int, max_model_len: int) -> None:
    """OffloadError naming `context` unless a window of that many tokens can be scored in one step."""
    if context < 2:
        raise OffloadError(f"context (--context) must be at least 2 tokens, got {context}")
    if context >= max_model_len:
        raise OffloadError(
            f"context (--context) {context} does not fit the engine's context window of {max_model_len} tokens "
            f"(at most {max_model_len - 1})"
        )


def window_spans(num_tokens: int, context: int) -> list[range]:
    """Consecutive, non-overlapping spans of `context` token positions covering `num_tokens`, the last one shorter."""
    return [range(start, min(start + context, num_tokens)) for start in range(0, num_tokens, context)]


def scored_windows(ids: Sequence[int], context: int) -> list[list[int]]:
    """The windows of `ids` that predict something: those of two tokens or more."""
    return [list(ids[w.start : w.stop]) for w in window_spans(len(ids), context) if len(w) > 1]


def window_nll(ids: Sequence[int], logits: torch.Tensor) -> float:
    """Sum of -log p(ids[i] | ids[:i]) for i >= 1, in nats, float64. `logits`: [len(ids), vocab], row i scoring the
    token after position i (the last row predicts past the window and is unused)."""
    if logits.shape[0] != len(ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for a window of {len(ids)} tokens")
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)  # [len(ids) - 1, vocab]
    targets = torch.tensor(ids[1:], dtype=torch.int64, device=logits.device)
    return -log_probs.gather(1, targets[:, None]).sum().item()


def summarize(nll_sum: float, predicted: int, tokens: int, windows: int, context: int) -> Perplexity:
    nll = nll_sum / predicted
    return Perplexity(math.exp(nll), nll, tokens, predicted, windows, context)


def steps(count: int, per_step: int) -> list[range]:
    """Indices of `count` windows grouped `per_step` at a time, in order."""
    return [range(i, min(i + per_step, count)) for i in range(0, count, per_step)]


def evaluate(
    score: Scorer, ids: Sequence[int], context: int, per_step: int, progress: Progress | None = None
) -> Perplexity:
    """The protocol above over token ids, `score` computing the logits of `per_step` windows at a time (all of one
    step's logits are held at once: [their tokens, vocab] float32)."""
    scored = scored_windows(ids, context)
    if not scored:
        raise OffloadError(f"the text has {len(ids)} token(s): nothing to predict (a window needs at least 2)")
    nll_sum = 0.0
    for group in steps(len(scored), per_step):
        batch = [scored[i] for i in group]
        nll_sum += sum(window_nll(w, logits) for w, logits in zip(batch, score(batch), strict=True))
        if progress is not None:
            progress(group.stop, len(scored))
    predicted = sum(len(w) - 1 for w in scored)
    return summarize(nll_sum, predicted, len(ids), len(scored), context)
