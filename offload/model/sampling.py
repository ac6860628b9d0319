"""Pick the next token from logits: greedy, or temperature / top-k / top-p / min-p sampling with per-request seeds."""

from __future__ import annotations

import math

import torch

from offload.common.config import SamplingParams
from offload.kernels.argmax import argmax


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] float32 scaled by temperature, with tokens outside top-k, top-p and min-p set to -inf (min-p
    compares probabilities after temperature, as vLLM and SGLang do)."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the tokens ranked above it already hold top_p of the mass; the first stays
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:  # p(token) < min_p * p(most likely) <=> logit < max logit + log(min_p)
        logits = logits.masked_fill(logits < logits.max() + math.log(params.min_p), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [rows, vocab] (float32)."""
    greedy = argmax(logits).tolist()
    tokens = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            tokens.append(greedy[row])
            continue
        probs = filter_logits(logits[row], p).softmax(-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return tokens
