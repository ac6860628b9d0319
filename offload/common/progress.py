"""Long work's progress on a terminal (a GGUF import, loading many GB of resident weights): bytes done of a known total
and the time left at the rate so far, one line on stderr rewritten in place, at most every INTERVAL seconds. Where
stderr is not a terminal (a log, a pipe) it writes nothing: the work's final line says what happened."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import TextIO

INTERVAL = 0.25  # seconds between updates of the line, at the least


def decimal_size(nbytes: float) -> str:
    """A size in decimal units, as a file manager shows a file's: "26.4 GB", "93 MB"."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def duration(seconds: float) -> str:
    """A time left, to the second under an hour: "1h02m", "4m05s", "12s"."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """`advance(n)` as bytes are done; `say(note)` for a step without a count; `close()` clears the line. On a
    terminal each update rewrites the line: "importing  12.3 GB/30.1 GB  41%  4m05s left" (the label in a column
    of 10, as the commands' other lines have theirs)."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.label, self.total, self.clock = label, total, clock
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.shown = bool(isatty and isatty())
        self.done = 0  # bytes
        self._start, self._last, self._width = clock(), -math.inf, 0

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if self.shown and now - self._last >= INTERVAL:
            self._last = now
            self._write(self.line(now))

    def line(self, now: float) -> str:
        done, total = min(self.done, self.total), max(self.total, 1)
        text = f"{self.label:<10} {decimal_size(done)}/{decimal_size(self.total)}  {100 * done // total}%"
        elapsed = now - self._start
        if done and elapsed > 0:
            text += f"  {duration(elapsed * (total - done) / done)} left"
        return text

    def say(self, note: str) -> None:
        if self.shown:
            self._write(f"{self.label:<10} {note}")

    def close(self) -> None:
        """Clear the line, so that what is printed next starts a clean one."""
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def _write(self, text: str) -> None:
        self.stream.write("\r" + text.ljust(self._width))  # padded over a longer previous line
        self.stream.flush()
        self._width = max(self._width, len(text))
