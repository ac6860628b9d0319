"""The copy engine: host -> device copies off the compute stream, ordered by events instead of host waits.

On CUDA the copies run on a stream of their own, from page-locked host buffers, so they overlap the compute
stream; an event marks the end of each batch of copies, and the compute stream waits on that event on the
device, never on the host. On a CPU-only machine the same calls copy synchronously and hand back events that
have already completed, so the staged pipeline built on them runs, and is tested, unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch


class Event(Protocol):
    """A point in a stream's work (torch.cuda.Event has this shape)."""

    def query(self) -> bool:
        """Whether the work before the event has finished; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the host until the work before the event has finished."""
        ...


class CopyEngine(ABC):
    """Copies onto the device in issue order, and the events that order them against compute.

    Invariants: copies issued by `copy` run in the order issued, each batch after the `after` event; the event
    returned completes once every copy of the batch has landed. `wait(e)` makes compute issued afterwards run
    after `e` without blocking the host; `record()` marks the compute issued so far. The caller keeps every
    buffer a copy touches alive, and unchanged, until that copy's event has completed.
    """

    device: torch.device

    @abstractmethod
    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Event | None = None) -> Event:
        """Copy each (dst, src) pair in order (same shape; a dtype change converts where dst lives)."""

    @abstractmethod
    def wait(self, event: Event) -> None:
        """Compute issued from now on runs after `event`."""

    @abstractmethod
    def record(self) -> Event:
        """An event that completes when the compute issued so far has finished."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block until every copy issued has landed (before freeing the buffers they touch)."""


class _Done:
    """An event that has already happened: on the CPU every copy and every computation is synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DONE = _Done()


class CpuCopyEngine(CopyEngine):
    """Synchronous copies; every event is complete when it is returned."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Event | None = None) -> Event:
        for dst, src in pairs:
            dst.copy_(src)
        return DONE

    def wait(self, event: Event) -> None:
        pass

    def record(self) -> Event:
        return DONE

    def synchronize(self) -> None:
        pass


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated CUDA stream; sources should be page-locked so that non_blocking copies are
    asynchronous (a pageable source makes CUDA copy it synchronously, which is correct but does not overlap)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Event | None = None) -> Event:
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()


def make_copy_engine(device: torch.device) -> CopyEngine:
    """The copy engine for `device`: CUDA streams and events on a CUDA device, synchronous copies elsewhere."""
    return CudaCopyEngine(device) if device.type == "cuda" else CpuCopyEngine(device)
