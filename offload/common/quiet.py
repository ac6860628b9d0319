"""Silence one known-harmless line that a dependency prints to stdout, for as long as a block runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# DeepSpeed logs this on every CPU-only import (accelerate imports DeepSpeed when it is installed); on a
# machine without CUDA it is the expected case, and it would land in the middle of the CLI's output.
_DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU"


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _DEEPSPEED_CPU_NOTICE not in record.getMessage()


@contextlib.contextmanager
def quiet_deepspeed_import() -> Iterator[None]:
    logger = logging.getLogger("DeepSpeed")
    notice = _DropNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)
