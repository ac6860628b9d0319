"""Speculative decoding in the plan: the acceptance runs measured, kept per model and drafter, and the chain length
the cost model prices best (scheduler/cost/speculation_cost.py), for `offload plan --speculate` and for the engine's own
`--num-speculative-tokens` when the user gives none.

    record(model, "self", counters)             # after a run: its drafts verified and accepted, added to the record
    rate = acceptance(model, "self")            # the last run's measured rate, else the assumed one, and which
    price = planned_k(spec, hw, dtype, cand, workload, rate.value, draft_for(spec, hw, dtype, "self"))

The acceptance is per drafted token of a chain (the a of E = (1 - a^(k+1)) / (1 - a)): the runs' counts give tokens
a pass and the average chain length, and a is what makes the formula meet them (acceptance_for). Where no run of this
model and drafter measured one, the plan assumes ASSUMED and says so. Trees (--speculative-topk N) are kept apart,
a record for each N: theirs is a per depth (any of the N candidates there holding the target's token), from the runs'
tokens a pass and the average depth of their trees; a tree no run measured is priced at the chain's a, which it
cannot do worse than.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import time
from pathlib import Path
from typing import NamedTuple

from offload.common.config import BLOCK_SIZE, MAX_TOPK, SPECULATE, EngineConfig, Policy
from offload.common.dtypes import DTYPE_BYTES
from offload.common.errors import OffloadError
from offload.common.hardware import HardwareProfile
from offload.common.model_config import ModelSpec
from offload.common.outputs import CoreCounters
from offload.common.paths import cache_dir
from offload.common.quant import WeightQuant
from offload.planner.profiles import load_profile, local_profile_path
from offload.planner.rows import candidate_json
from offload.planner.run_records import earlier_weight, model_path, read, write
from offload.scheduler.cost.predict import Candidate, Workload, make_context
from offload.scheduler.cost.search import best
from offload.scheduler.cost.speculation_cost import Draft, SpeculationPrice, acceptance_for, best_k

# per drafted token, where no run measured it: `self` (the same weights in 4 bits) agrees with its target on most
# tokens (92.5% of drafts accepted in chains of 8 on SmolLM2-135M-Instruct: a = 0.98); n-gram lookup only where the
# text repeats itself; another model, as well as a small model of the family predicts its large one
ASSUMED = {"self": 0.9, "ngram": 0.3, "model": 0.6}
KEPT_PASSES = 256  # verify passes the record weighs at most: earlier runs' shrink to make room for a new one's
DEFAULT_K = 4  # drafts a sequence and step where no hardware profile is saved to plan by
PLANNED_WORKLOAD = Workload(512, 128)  # what the engine plans its chain length for: a chat's prompt and reply
SELF_BITS = 4  # `self` drafts with the target's int4 copy (offload/draft_core.py's SELF_QUANT)


class Acceptance(NamedTuple):
    value: float  # per drafted token
    source: str  # where it came from, said in the plan


def _key(model: Path | str, method: str, topk: int) -> str:
    tree = f"\0top {topk}" if topk > 1 else ""  # a chain's record keeps the key it had before trees
    return hashlib.sha256(f"{model_path(model)}\0{_drafter(method)}{tree}".encode()).hexdigest()[:24]


def _drafter(method: str) -> str:
    return method if method in SPECULATE else str(Path(method).resolve())


def _path(model: Path | str, method: str, topk: int = 1) -> Path:
    return cache_dir() / "speculation" / f"{_key(model, method, topk)}.json"


COUNTS = ("verify_passes", "drafted_tokens", "accepted_tokens", "draft_depth")  # a record's, as CoreCounters names them


def record(model: Path | str, method: str, counters: CoreCounters, topk: int = 1) -> None:
    """Add what a run of `model` speculating with `method` (trees of the top `topk`) measured to what earlier runs
    did, the earlier ones weighing at most KEPT_PASSES passes in all (so the record follows the model's recent use). A
    folder or file that cannot be written leaves the record as it was: the run's output does not depend on it."""
    counts = {name: getattr(counters, name) for name in COUNTS}
    if counts["verify_passes"] <= 0 or counts["drafted_tokens"] <= 0:
        return
    counts["draft_depth"] = counts["draft_depth"] or counts["drafted_tokens"]  # not counted: chains, their length
    path = _path(model, method, topk)
    old = read(path)
    try:
        scale = earlier_weight(old["verify_passes"], counts["verify_passes"], KEPT_PASSES)
        # a record from before depths were counted: its chains' depth is their length
        earlier = {name: old[name] if name in old else old["drafted_tokens"] for name in COUNTS}
        counts = {name: counts[name] + earlier[name] * scale for name in COUNTS}
    except (KeyError, TypeError, ZeroDivisionError):
        pass  # the first run measured, or a record that cannot be read: this run's alone
    body = {
        "model": str(model_path(model)),
        "method": _drafter(method),
        "topk": topk,
        **counts,
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    write(path, body)


def acceptance(model: Path | str, method: str, given: float | None = None, topk: int = 1) -> Acceptance:
    """The acceptance to price `method` with: `given` (--acceptance), else what the runs of `model` measured (with
    trees of the top `topk`: theirs, per depth), else, for a tree, the chain's, else the assumed one."""
    if given is not None:
        return Acceptance(given, "given")
    body = read(_path(model, method, topk))
    try:
        passes, drafted, accepted = body["verify_passes"], body["drafted_tokens"], body["accepted_tokens"]
        depth = body.get("draft_depth", drafted)  # chains recorded before depths were counted: their length
        value = acceptance_for((accepted + passes) / passes, depth / passes)
        return Acceptance(
            value,
            f"measured by runs up to {body['when']} UTC: {accepted:.0f} of {drafted:.0f} drafts accepted in "
            f"{passes:.0f} passes, {(accepted + passes) / passes:.2f} tokens a pass"
            + (f" from trees {depth / passes:.1f} deep" if topk > 1 else ""),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        if topk > 1:
            chain = acceptance(model, method)
            return Acceptance(chain.value, f"the chain's, as no run measured trees of {topk}: {chain.source}")
        kind = method if method in ASSUMED else "model"
        return Acceptance(ASSUMED[kind], f"assumed for {kind} (no run of this model measured it)")


def measured_trees(model: Path | str, method: str) -> list[int]:
    """The tree sizes (candidates at each depth) runs of `model` with `method` measured."""
    return [n for n in range(2, MAX_TOPK + 1) if _path(model, method, n).exists()]


def draft_for(
    spec: ModelSpec, hw: HardwareProfile, dtype: str, method: str, draft_spec: ModelSpec | None = None
) -> Draft | None:
    """The draft model a pass runs: `self`'s int4 copy of `spec` (groups of 32, or the model's own codes), a draft
    model's (`draft_spec`, else the spec of the directory `method` names), or None for n-gram lookup."""
    if method == "ngram":
        return None
    if method == "self":
        quant = spec.quant if spec.quant is not None and spec.quant.bits == SELF_BITS else WeightQuant(4, 32, "cpu")
        draft_spec = dataclasses.replace(spec, quant=quant)
    elif draft_spec is None:
        from offload.model.loader import load_spec

        draft_spec, _ = load_spec(Path(method))
    bits = draft_spec.quant.bits if draft_spec.quant is not None else 8 * DTYPE_BYTES[dtype]
    shares = method == "self" and hw.device_kind == "cpu"  # the target holds its table and head (draft_core.py)
    return Draft(make_context(draft_spec, _on_cpu(hw), dtype, BLOCK_SIZE), bits, shares)


def _on_cpu(hw: HardwareProfile) -> HardwareProfile:
    """The draft runs on the CPU whatever the target's device (offload/draft_core.py): `hw` with its host as device."""
    if hw.device_kind == "cpu":
        return hw
    return dataclasses.replace(hw, device=hw.host, device_kind="cpu")


def planned_k(
    spec: ModelSpec,
    hw: HardwareProfile,
    dtype: str,
    cand: Candidate,
    workload: Workload,
    rate: float,
    draft: Draft | None,
    topk: int = 1,
) -> SpeculationPrice:
    """The chain length (a tree's depth) with the most tokens a second for `cand` at the middle of `workload`'s
    generation."""
    ctx = make_context(spec, hw, dtype, BLOCK_SIZE)
    context = workload.prompt_len + workload.gen_len // 2
    return best_k(ctx, cand, context, workload.prompt_len, rate, draft, topk)


def lines(price: SpeculationPrice, rate: Acceptance, method: str, batch: int, draft: Draft | None) -> list[str]:
    """What `offload plan --speculate` prints for a batch."""
    drafting = "drafting free (n-gram lookup)"
    if draft is not None:
        drafting = (
            f"draft {price.k} x {_time(price.draft_seconds / price.k)} on the CPU, {draft.nbytes / 1e9:.3g} GB resident"
        )
    verdict = f"{price.speedup:.2f}x the tokens/s"
    if price.speedup < 1:
        verdict += ": slower than plain decoding at this batch, leave --speculate off"
    shape = f"k = {price.k} drafts a sequence, acceptance {rate.value:.3f} a draft"
    if price.topk > 1:
        shape = f"trees of the top {price.topk}, k = {price.k} deep, acceptance {rate.value:.3f} a depth"
    return [
        f"speculate {method} at batch {batch}: {shape} ({rate.source})",
        f"          {price.tokens_per_pass:.2f} tokens a pass; a pass {_time(price.pass_seconds)} (verify "
        f"{price.drafted + 1} rows a sequence {_time(price.verify_seconds)}, {drafting}) against a plain step's "
        f"{_time(price.plain_seconds)}: {verdict}",
    ]


def _time(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculate",
        metavar="METHOD",
        help="also price speculative decoding at the best policy of batch 1 and the best overall: ngram, self or PATH",
    )
    p.add_argument(
        "--acceptance",
        type=float,
        metavar="A",
        help="share of drafted tokens accepted, each (default: the last run's of this model, else an assumed one)",
    )
    p.add_argument(
        "--speculative-topk",
        type=int,
        metavar="N",
        help="price trees of the top N at each depth (default: chains and the tree sizes runs of this model measured)",
    )


def plan_section(
    args: argparse.Namespace, shape: ModelSpec, hw: HardwareProfile, dtype: str, workload: Workload, predictions: list
) -> tuple[str, list[dict]]:
    """`offload plan --speculate`'s text (after the plan's) and JSON rows: the best k, tokens a pass and speedup at
    the best runnable policy of batch 1 (a stream's latency) and at the best runnable one (throughput); empty without
    the flag."""
    if not getattr(args, "speculate", None):
        return "", []
    if args.acceptance is not None and not 0.0 <= args.acceptance <= 1.0:
        raise OffloadError(f"--acceptance must be a share between 0 and 1, got {args.acceptance}")
    topk = getattr(args, "speculative_topk", None)
    if topk is not None and not 1 <= topk <= MAX_TOPK:
        raise OffloadError(f"--speculative-topk must be in 1..{MAX_TOPK}, got {topk}")
    sizes = [topk] if topk is not None else [1, *measured_trees(args.model, args.speculate)]
    rates = {n: acceptance(args.model, args.speculate, args.acceptance, n) for n in sizes}
    # a GGUF draft file's shape is read from its header by offload/cli.py's main, as the model's is
    draft = draft_for(shape, hw, dtype, args.speculate, getattr(args, "draft_shape", None))
    ones = [p for p in predictions if p.candidate.batch == 1 and p.fits and not p.unsupported]
    chosen = [p for p in (ones[:1] + [best(predictions, runnable_only=True)]) if p is not None]
    text, rows, seen = ["", ""], [], set()
    for p in chosen:
        if p.candidate in seen:
            continue
        seen.add(p.candidate)
        # the tree size with the most tokens/s of those priced (a chain, and the trees runs measured)
        prices = [planned_k(shape, hw, dtype, p.candidate, workload, rates[n].value, draft, n) for n in sizes]
        price = max(prices, key=lambda q: (q.speedup, -q.topk))
        rate = rates[price.topk]
        text += lines(price, rate, args.speculate, p.candidate.batch, draft)
        if len(prices) > 1:
            text.append("          priced: " + ", ".join(f"top {q.topk} {q.speedup:.2f}x" for q in prices))
        rows.append(
            {
                "candidate": candidate_json(p.candidate),
                "method": args.speculate,
                "k": price.k,
                "topk": price.topk,
                "acceptance": rate.value,
                "acceptance_source": rate.source,
                "tokens_per_pass": price.tokens_per_pass,
                "pass_seconds": price.pass_seconds,
                "verify_seconds": price.verify_seconds,
                "draft_seconds": price.draft_seconds,
                "plain_step_seconds": price.plain_seconds,
                "speedup": price.speedup,
                "tokens_per_second": p.tokens_per_second * price.speedup,
            }
        )
    return "\n".join(text), rows


def engine_k(
    model: Path, spec: ModelSpec, dtype: str, config: EngineConfig, policy: Policy, draft_dir: Path | None = None
) -> tuple[int, str]:
    """The engine's drafts a sequence and step, and why: the user's, else the chain length the cost model prices
    best for the engine's own placement at batch 1 (a stream) by this machine's saved profile and the acceptance
    runs of this model measured (or the assumed one), else DEFAULT_K where no profile is saved. draft_dir: the
    draft model's directory as the engine resolved it (`--speculate PATH`)."""
    if config.num_speculative_tokens is not None:
        return config.num_speculative_tokens, "given"
    path = local_profile_path()
    try:
        hw = load_profile(path)
    except OffloadError:
        return DEFAULT_K, f"no hardware profile to plan by at {path} (offload probe)"
    topk = config.speculative_topk
    rate = acceptance(model, config.speculate, topk=topk)
    bits = spec.quant.bits if spec.quant is not None else 8 * DTYPE_BYTES[dtype]
    cand = Candidate(1, 1, policy, weight_bits=bits, expert_cache=config.expert_cache_memory or 0)
    draft_spec = None
    if draft_dir is not None and config.speculate != "self":
        from offload.model.loader import load_spec

        draft_spec, _ = load_spec(draft_dir)
    draft = draft_for(spec, hw, dtype, config.speculate, draft_spec)
    price = planned_k(spec, hw, dtype, cand, PLANNED_WORKLOAD, rate.value, draft, topk)
    per = "a draft" if topk == 1 else f"a depth of the top {topk}"
    return price.k, (
        f"planned: {price.tokens_per_pass:.2f} tokens a pass at acceptance {rate.value:.2f} {per}, {rate.source}; "
        f"{price.speedup:.2f}x plain predicted"
    )
