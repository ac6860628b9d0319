"""The rows `offload plan` prints and writes as JSON, shared by its reports (offload/planner/report.py, compare.py,
latency.py)."""

from __future__ import annotations

from offload.scheduler.cost.predict import Candidate, Prediction

_GB = 1e9


def per_batch(predictions: list[Prediction]) -> dict[int, Prediction]:
    """The best prediction at each batch size: fitting ones first (they come first in `predictions`)."""
    out: dict[int, Prediction] = {}
    for p in predictions:
        out.setdefault(p.candidate.batch, p)
    return out


def candidate_json(c: Candidate) -> dict:
    """The candidate with its placement as layer counts on device / host / disk, as the report prints it."""
    return {
        "batch": c.batch,
        "micro_batches": c.micro_batches,
        "layers": list(c.policy.counts),
        "embedding": c.policy.embed_tier,
        "kv_tier": c.kv_tier,
        "weight_bits": c.weight_bits,
        "kv_bits": c.kv_bits,
        "expert_cache_bytes": c.expert_cache,
    }


def decimal_size(nbytes: float) -> str:
    """Decimal units, as datasheets and `--device-memory 600MB` spell them."""
    if nbytes < _GB:
        return f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e6 or nbytes == 0 else f"{nbytes / 1e3:.0f} kB"
    return f"{nbytes / _GB:.2f} GB" if nbytes < 100 * _GB else f"{nbytes / _GB:.0f} GB"
