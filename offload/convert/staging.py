"""What a model write killed midway leaves behind, and SIGTERM during one: offload/convert/quantize.py's `staged`
writes into a folder beside its output named for the writing process (STAGING_MARK, the pid), which the next write
beside it removes once that process is gone (`sweep_staged`: SIGKILL, a crash, a machine lost); SIGTERM raises in
the main thread while one is written (`sigterm_unwinds`), so that the folder is removed before the signal takes its
course."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from offload.common.errors import OffloadError

# `staged`'s folders: ".<out>.partial-<pid>-<mkdtemp's 8 random characters>", the pid the writing process's
STAGING_MARK = ".partial-"
STAGED_NAME = re.compile(r"^\..+" + re.escape(STAGING_MARK) + r"(\d+)-[a-z0-9_]{8}$")


def sweep_staged(parent: Path) -> list[Path]:
    """Remove the folders `staged` left in `parent` whose process is gone (killed outright, or the machine lost);
    returns them. A live process's folder, and anything not named as `staged` names its folders, stay."""
    try:
        entries = list(parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    swept = []
    for path in entries:
        m = STAGED_NAME.match(path.name)
        if m and not _alive(int(m[1])) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            swept.append(path)
    return swept


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (another user's counts)."""
    if pid <= 0:
        return True  # not a process id os.kill would test: keep the folder
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Terminated(BaseException):
    """SIGTERM arrived during a staged write: raised in the main thread so the write unwinds and `staged` cleans up."""


@contextlib.contextmanager
def sigterm_unwinds(out: Path) -> Iterator[None]:
    """For the block's duration in the main thread, SIGTERM raises _Terminated (once: a second one does not cut the
    cleanup short). When the block has unwound, the previous handler is restored and the signal raised again, so
    the process ends as SIGTERM would have ended it; where that handler returns, an OffloadError says the write was
    interrupted. Elsewhere (another thread, SIGTERM ignored or handled outside Python) the block runs as it is."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return
    fired: list[int] = []

    def on_sigterm(signum: int, frame: object) -> None:
        if not fired:
            fired.append(signum)
            raise _Terminated

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, previous)
        signal.raise_signal(signal.SIGTERM)
        raise OffloadError(f"{out}: interrupted by SIGTERM; nothing was written") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
