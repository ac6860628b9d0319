"""`offload plan --plot FILE.png`: predicted tokens/s against batch size, one line per placement."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import defaultdict

from offload.common.errors import OffloadError
from offload.scheduler.cost.predict import Prediction


def plot(predictions: list[Prediction], path: str, title: str) -> None:
    """Predicted tokens/s against batch size, one line per placement (KV tier and precision), fitting points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OffloadError("--plot needs matplotlib (pip install matplotlib)") from None
    lines: dict[str, dict[int, float]] = defaultdict(dict)
    for p in predictions:
        if not p.fits:
            continue
        c = p.candidate
        label = f"KV on {c.kv_tier}" + ("" if c.weight_bits == c.kv_bits >= 16 else f", w{c.weight_bits}/kv{c.kv_bits}")
        lines[label][c.batch] = max(lines[label].get(c.batch, 0.0), p.tokens_per_second)
    if not lines:
        raise OffloadError("--plot: no policy fits, nothing to draw")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(lines.items()):
        xs = sorted(points)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences per step)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = f"{path}.partial"
    try:  # written whole or not at all
        fig.savefig(tmp, dpi=120, format=os.path.splitext(path)[1].lstrip(".") or "png")
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OffloadError(f"--plot {path}: cannot write it ({getattr(exc, 'strerror', None) or exc})") from None
    finally:
        plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)
