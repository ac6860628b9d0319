"""What a GGUF import kept of each tensor (`Kept`: bit for bit, codes with rounded zero points, or requantized with
its error) and of the whole file (`ImportStats`, whose summary `offload convert` prints)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offload.common.quant import WeightQuant


@dataclass(frozen=True, slots=True)
class Kept:
    """What became of one GGUF tensor."""

    gguf: str
    qtype: str  # its GGUF type, e.g. "Q4_1"
    stored: str  # "int4-g32", "int8-g32", or the float code written ("F32", "F16", "BF16")
    exact: bool  # every value the engine reads equals gguf.quants.dequantize's
    rel_rms: float = 0.0  # requantized: ||w - w'|| / ||w|| over the tensor
    max_abs: float = 0.0  # requantized: max |w - w'|
    inexact_groups: int = 0  # int4 groups whose zero float32 rounds (offload.gguf.codes.Int4Groups.inexact)

    @property
    def how(self) -> str:
        if self.exact:
            return "exact"
        return "codes kept, zero points rounded" if self.inexact_groups else "requantized"


@dataclass(frozen=True, slots=True)
class ImportStats:
    out: Path
    quant: WeightQuant | None
    kept: dict[str, Kept]  # by checkpoint tensor name (the weight's, for codes and scales)
    source_bytes: int  # the GGUF file's size
    bytes_written: int  # the output's weight files

    def summary(self) -> str:
        """One line per (GGUF type -> stored form): how many tensors, and the requantized ones' worst error."""
        kinds: dict[tuple[str, str, str], list[Kept]] = {}
        for k in self.kept.values():
            kinds.setdefault((k.qtype, k.stored, k.how), []).append(k)
        lines = []
        for (qtype, stored, how), kept in sorted(kinds.items()):
            line = f"{len(kept):>5} {qtype:<6} -> {stored:<8} {how}"
            if how != "exact":
                line += (
                    f": relative RMS error up to {max(k.rel_rms for k in kept):.2e}, "
                    f"max abs {max(k.max_abs for k in kept):.2e}"
                )
            lines.append(line)
        return "\n".join(lines)
