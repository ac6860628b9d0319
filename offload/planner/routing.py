"""How a mixture's routing met its expert cache, as runs measured it, kept per model for later plans.

    record(model, hits, misses, share, batch)   # after a run: its expert lookups, the cache holding `share` of them
    spec = with_measured_routing(spec, model)   # the spec with the exponent the runs measured, for the cost model

The cost model's expert cache holds a chosen expert with probability share ** exponent (scheduler/cost/moe_cost.py's
hit_rate): 1 for uniform routing, the cache a uniform sample of the experts. A trained or random router favours some
experts, and a cache that keeps the most chosen ones hits more often: a run with hit rate h at a cache of share c
measures exponent ln h / ln c, which prices every other cache size of the same model (a one-parameter curve through
(0, 0), the run's point and (1, 1)). Runs add to what earlier runs measured, the earlier ones weighing at most
KEPT_LOOKUPS lookups in all: in all, and apart for each decode batch (a batch of 8 touches most of a layer's experts
a step, and the same cache hits less often for it: on the 26 GB Mixtral-shape file, 96.8% of lookups at batch 1 and
92-93% at 8 with 82-84% of the experts cached, exponents 0.17 and 0.35; pooled, batch 8's lookups, eight times as
many a step, priced batch 1's misses twice over).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from pathlib import Path

from offload.common.model_config import ModelSpec
from offload.common.paths import cache_dir
from offload.planner.run_records import earlier_weight, model_path, read, write

KEPT_LOOKUPS = 1 << 16  # expert lookups the record weighs at most
# a run that hit nearly always at a small cache still leaves misses to price; one that hit less often than its cache's
# share (a tiny cache that the routing keeps turning over) still hits now and then
MIN_EXPONENT, MAX_EXPONENT = 0.02, 4.0


def _path(model: Path | str) -> Path:
    key = hashlib.sha256(str(model_path(model)).encode()).hexdigest()[:24]
    return cache_dir() / "routing" / f"{key}.json"


def exponent(hits: float, misses: float, share: float) -> float | None:
    """The exponent a run's hit rate at a cache of `share` of the experts measures; None where it says nothing (no
    lookups, no misses or no hits, or a cache of none or all)."""
    lookups = hits + misses
    if lookups <= 0 or not 0.0 < share < 1.0 or hits <= 0 or misses <= 0:
        return None
    return min(max(math.log(hits / lookups) / math.log(share), MIN_EXPONENT), MAX_EXPONENT)


def record(model: Path | str, hits: int, misses: int, share: float, batch: int = 1) -> None:
    """Add a run's expert lookups at a cache of `share` of the routed experts, decoding `batch` sequences at a time,
    to the record (a run that measures no exponent leaves it as it was, and so does a folder that cannot be
    written)."""
    measured = exponent(hits, misses, share)
    if measured is None:
        return
    path = _path(model)
    old = read(path) or {}
    lookups, value = _added(old, float(hits + misses), measured)
    by_batch = old.get("by_batch") if isinstance(old.get("by_batch"), dict) else {}
    batch_lookups, batch_value = _added(by_batch.get(str(batch)), float(hits + misses), measured)
    by_batch[str(batch)] = {"lookups": batch_lookups, "exponent": batch_value}
    body = {
        "model": str(model_path(model)),
        "lookups": lookups,
        "exponent": value,
        "by_batch": by_batch,
        "last_run": {"hits": hits, "misses": misses, "cache_share": share, "batch": batch},
        "when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    write(path, body)


def _added(old: dict | None, lookups: float, measured: float) -> tuple[float, float]:
    """(lookups, exponent) of `old`'s counts, as earlier_weight keeps them, with a run's `lookups` at `measured`."""
    weighted = lookups * measured
    try:
        scale = earlier_weight(old["lookups"], lookups, KEPT_LOOKUPS)
        lookups, weighted = lookups + old["lookups"] * scale, weighted + old["lookups"] * scale * old["exponent"]
    except (KeyError, TypeError, ZeroDivisionError):
        pass  # the first run measured, or a record that cannot be read
    return lookups, weighted / lookups


def with_measured_routing(spec: ModelSpec, model: Path | str | None) -> tuple[ModelSpec, str | None]:
    """`spec` with the expert cache's hit exponent the runs of `model` measured, and a line saying so; `spec`
    unchanged (and None) for a dense model or one no run measured."""
    if not spec.num_experts or model is None:
        return spec, None
    body = read(_path(model))
    try:
        value = float(body["exponent"])
    except (KeyError, TypeError, ValueError):
        return spec, None
    if not MIN_EXPONENT <= value <= MAX_EXPONENT:
        return spec, None
    said = (
        f"expert cache hits priced as its share of the experts ** {value:.3g}, measured by runs up to "
        f"{body['when']} UTC ({body['lookups']:.0f} lookups; 1 is uniform routing)"
    )
    per_batch = _per_batch(body.get("by_batch"))
    if len(per_batch) > 1:
        said += "; by decode batch " + ", ".join(f"{b}: {e:.3g}" for b, e in per_batch)
    return dataclasses.replace(spec, expert_hit_exponent=value, expert_hit_exponents=per_batch), said


def _per_batch(by_batch: object) -> tuple[tuple[int, float], ...]:
    """A record's (batch, exponent) pairs, ascending; those that cannot be read are left out."""
    out = []
    for batch, entry in by_batch.items() if isinstance(by_batch, dict) else ():
        try:
            b, e = int(batch), float(entry["exponent"])
        except (KeyError, TypeError, ValueError):
            continue
        if b >= 1 and MIN_EXPONENT <= e <= MAX_EXPONENT:
            out.append((b, e))
    return tuple(sorted(out))
