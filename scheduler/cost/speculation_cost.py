"""The price of speculative decoding: a drafter proposes k tokens a sequence, the target scores them all in its one
weight pass, and keeps the drafts up to the first it disagrees with, then its own token.

    price = speculate(ctx, cand, context, prompt_len, k, acceptance, draft)    # one chain length
    price = best_k(ctx, cand, context, prompt_len, acceptance, draft)          # the chain length with most tokens/s
    price = best_k(ctx, cand, context, prompt_len, acceptance, draft, topk=3)  # a tree, the top 3 at each depth

Tokens a pass: a chain whose drafts are each accepted with probability a (while every one before it was) yields
E = (1 - a^(k+1)) / (1 - a) tokens a pass (Leviathan et al., 2023): the accepted drafts and the target's own token.
A pass costs the target's decode step at k + 1 rows a sequence (the cost model's own step: the verify rows attend
one by one, as decode tokens each, kernels/cpu_attention.py, and the head scores every row) plus the drafter's k
steps at the batch's rows: a draft model's steps with every weight resident, the first a prefill of what the target
accepted since its last call (priced as a step of that many rows), the others decode steps; n-gram lookup costs the
model nothing (`draft` None). Where weights stream, the verify pass costs about a plain one, so tokens a second
grow with E until the drafter's steps or the verify rows' compute catch up: the best k is where they do. A step
verifies at most MAX_DRAFTED drafted tokens over its batch (scheduler/batcher.py), which caps k for a batch.

A tree (--speculative-topk N) drafts the top N at each of k depths, k x N rows a sequence, and is priced as a chain
of its depth whose every depth holds the target's token with probability a: the chance that one of its N candidates
does, which the runs of that tree measured (offload/planner/speculation.py keeps them apart from the chain's). More
candidates raise a, and the verify rows with it.

Plain numbers in, plain numbers out, like the cost model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from offload.common.config import MAX_DRAFT, Policy
from offload.scheduler.batcher import MAX_DRAFTED
from offload.scheduler.cost.predict import Candidate, Context, decode_step_seconds

# tokens a draft call prefills beyond those the target accepted since the last: the rest of its last partial KV block
# (offload/draft_core.py's blocks of 4 tokens: 1.5 on average, rounded up)
DRAFT_BLOCK_SLACK = 2


def tokens_per_pass(acceptance: float, k: float) -> float:
    """Expected tokens one verify pass yields for a chain of `k` drafts each accepted with probability `acceptance`."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_for(per_pass: float, k: float) -> float:
    """The acceptance a chain of `k` drafts needs to yield `per_pass` tokens a pass (the inverse of tokens_per_pass;
    k may be a run's average): how a run's counts become the rate the planner prices other chain lengths with."""
    if per_pass >= k + 1:
        return 1.0
    if per_pass <= 1.0:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(60):  # bisection: E grows with a
        mid = (low + high) / 2  # strictly between 0 and 1
        low, high = (mid, high) if tokens_per_pass(mid, k) < per_pass else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True, slots=True)
class Draft:
    """The draft model a pass runs k steps of: its context (the target's own shape at 4 bits, for `self`) and width."""

    ctx: Context
    weight_bits: int
    shares_table: bool = False  # its token table and head are the target's (`self` on a CPU target)

    @property
    def nbytes(self) -> float:
        """Its weights, all resident: every layer at its width, the token table and the head in the compute dtype
        (none where the target holds them)."""
        s = self.ctx.shape
        layers = s.num_layers * self.ctx.weight_bytes(s.params.layer, self.weight_bits)
        return layers + (0 if self.shares_table else (s.params.embed + s.params.head) * self.ctx.dtype_bytes)


@dataclass(frozen=True, slots=True)
class SpeculationPrice:
    k: int  # drafts a sequence and pass: a chain's length, a tree's depth
    acceptance: float  # per drafted token, the chain's a (a tree's: per depth, any of its candidates)
    tokens_per_pass: float  # a sequence's, expected
    verify_seconds: float  # the target's step at k + 1 rows a sequence
    draft_seconds: float  # the drafter's k steps
    plain_seconds: float  # the target's one-token decode step, for comparison
    topk: int = 1  # candidates at each depth: a chain 1, a tree more

    @property
    def drafted(self) -> int:
        """Drafted rows a sequence verifies a pass."""
        return self.k * self.topk

    @property
    def pass_seconds(self) -> float:
        return self.verify_seconds + self.draft_seconds

    @property
    def speedup(self) -> float:
        """Tokens a second over plain decoding's."""
        return self.tokens_per_pass * self.plain_seconds / max(self.pass_seconds, 1e-12)


def _drafting(draft: Draft, batch: int, context: int, prompt_len: int, k: int, per_pass: float) -> float:
    """The draft model's k steps for a pass: a prefill of what the target accepted since its last call (about a
    pass's tokens and the rest of a block), then k - 1 decode steps."""
    layers = draft.ctx.shape.num_layers
    cand = Candidate(batch, 1, Policy.from_counts(layers, 0, 0), weight_bits=draft.weight_bits)
    step = decode_step_seconds(draft.ctx, cand, context, prompt_len)
    rows = batch * (math.ceil(per_pass) + DRAFT_BLOCK_SLACK)
    catch_up = decode_step_seconds(draft.ctx, dataclasses.replace(cand, batch=rows), context, prompt_len)
    return catch_up + (k - 1) * step


def speculate(
    ctx: Context,
    cand: Candidate,
    context: int,
    prompt_len: int,
    k: int,
    acceptance: float,
    draft: Draft | None,
    topk: int = 1,
) -> SpeculationPrice:
    """`cand`'s decode step at a context of `context` tokens with `k` drafts a sequence accepted at `acceptance` (a
    tree of the top `topk` at each of `k` depths: k x topk rows, `acceptance` a depth's). A draft model's runners-up
    come with its k steps (their logprobs), so drafting costs the chain's."""
    plain = decode_step_seconds(ctx, cand, context, prompt_len)
    rows = cand.batch * (k * topk + 1)
    verify = decode_step_seconds(ctx, dataclasses.replace(cand, batch=rows), context, prompt_len)
    per_pass = tokens_per_pass(acceptance, k)
    drafting = _drafting(draft, cand.batch, context, prompt_len, k, per_pass) if draft is not None else 0.0
    return SpeculationPrice(k, acceptance, per_pass, verify, drafting, plain, topk)


def best_k(
    ctx: Context,
    cand: Candidate,
    context: int,
    prompt_len: int,
    acceptance: float,
    draft: Draft | None,
    topk: int = 1,
) -> SpeculationPrice:
    """The chain length (a tree's depth) with the most tokens a second for `cand`'s batch (k up to MAX_DRAFT, and
    k x topk x batch up to the drafted tokens a step verifies)."""
    most = max(1, min(MAX_DRAFT, MAX_DRAFTED // max(cand.batch * topk, 1)))
    prices = [speculate(ctx, cand, context, prompt_len, k, acceptance, draft, topk) for k in range(1, most + 1)]
    return max(prices, key=lambda p: (p.speedup, -p.k))
