"""The asyncio front of the engine core: the core steps in one background thread, async callers await streams.

    front = AsyncFront(llm.core, max_waiting=64)
    front.start()                                   # inside the running event loop
    stream = front.submit(prompt_ids, params)       # QueueFull / Draining at once
    try:
        async for delta in stream: ...
    finally:
        stream.close()                              # aborts the request if it has not finished
    await front.drain(timeout=30.0)                 # no new requests; running ones finish (or are aborted)

The one place that crosses threads. Event-loop side: `submit()` puts commands (add, abort) in an inbox and reads
its request's deltas from an asyncio.Queue; `call()` puts in a function to run on the core between two steps.
Core side: the thread takes the inbox, steps the core while it has work, sleeps on an Event when it has none, and
hands each step's deltas to the loop in one call. A caller that stops reading (a client gone, a task cancelled)
aborts its request, so its KV blocks go back to the pool.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from offload.common.config import SamplingParams
from offload.common.errors import OffloadError
from offload.common.outputs import CoreCounters, Delta
from offload.core import EngineCore

T = TypeVar("T")


class QueueFull(OffloadError):
    """More requests wait than the front accepts (--max-waiting)."""


class Draining(OffloadError):
    """The front is shutting down and takes no new requests."""


@dataclass(eq=False)
class _Stream:
    deltas: asyncio.Queue
    request_id: int | None = None  # set by the core thread once added
    done: bool = False


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The core's state as of its last step, for health and metrics (read on the event loop)."""

    running: int = 0
    waiting: int = 0  # in the core's queue, plus requests not yet handed to it
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    counters: CoreCounters = field(default_factory=CoreCounters)


class RequestStream:
    """One request's deltas as an async iterator; the last one has its finish_reason. An error from the core (a
    refused request, a failed step) is raised from the iteration. close() is idempotent; before the last delta it
    aborts the request."""

    def __init__(self, front: AsyncFront, stream: _Stream) -> None:
        self._front, self._stream = front, stream
        self._closed = False
        self._held: BaseException | None = None  # an error ready() took off the queue, for the next iteration
        self.last_token: float | None = None  # time.perf_counter() of its latest token

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._closed:
            raise StopAsyncIteration
        if self._held is not None:
            item, self._held = self._held, None
            return self._accept(item)
        try:
            item = await self._stream.deltas.get()
        except BaseException:  # cancelled: the caller is gone
            self.close()
            raise
        return self._accept(item)

    def ready(self) -> list[Delta]:
        """The deltas already delivered, without waiting (up to an error, which the next iteration raises): a reader
        that fell behind the engine catches up in one write instead of one per step."""
        taken: list[Delta] = []
        queue = self._stream.deltas
        while not self._closed and self._held is None and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                self._held = item  # the next iteration raises it, after these deltas are written
                break
            taken.append(self._accept(item))
        return taken

    def _accept(self, item: Delta | BaseException) -> Delta:
        if isinstance(item, BaseException):
            self.close()
            raise item
        if self._front.observer is not None:
            self._front.observer(item, self.last_token)
        if item.token_ids:
            self.last_token = item.time
        if item.finish_reason is not None:
            self.close()
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._front._closed(self._stream)


class AsyncFront:
    def __init__(self, core: EngineCore, max_waiting: int | None = None) -> None:
        self.core = core
        self.max_waiting = max_waiting
        self.draining = False
        # ("add", stream, ids, params, priority) | ("abort", stream) | ("call", future, fn)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._streams: dict[int, _Stream] = {}  # core thread only: request id -> its stream
        self._open = 0  # event loop only: streams not finished
        self._pending_adds = 0  # event loop only: adds not yet taken by the core thread
        self._idle = asyncio.Event()
        self.snapshot = Snapshot()
        self._thread = threading.Thread(target=self._run, name="offload-core", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None  # the last exception a step raised, if any did
        self.observer = None  # called on the event loop with (delta, time of the request's previous token or None)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self.snapshot = self._snapshot()
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self.snapshot.waiting + self._pending_adds

    # ---- event loop side ------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> RequestStream:
        """Hand a request to the core; iterate the result for its deltas and close() it when done with it (closing
        early aborts the request). Raises Draining or QueueFull at once, before anything is queued. A request of a
        later priority class (background jobs, which bound what they queue themselves) is not held to the queue
        limit, and waits behind every request of an earlier class."""
        if self.draining or self._stop:
            raise Draining("the server is shutting down")
        # the batch's free places take requests at the next step: only what lies beyond them waits
        free = max(0, self.core.limits.max_running - self.snapshot.running)
        if priority == 0 and self.max_waiting is not None and self.num_waiting - free >= self.max_waiting:
            raise QueueFull(
                f"{self.num_waiting} requests are waiting for {free} free places in the batch; the limit "
                f"(--max-waiting) is {self.max_waiting} beyond those"
            )
        stream = _Stream(asyncio.Queue())
        self._open += 1
        self._pending_adds += 1
        self._idle.clear()
        self._send(("add", stream, prompt_ids, params, priority))
        return RequestStream(self, stream)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the core thread between two steps (the core is single-threaded) and return what it returns;
        what it raises is raised here. Raises Draining once the front is shutting down."""
        if self.draining or self._stop:
            raise Draining("the server is shutting down")
        done = self._loop.create_future()
        self._send(("call", done, fn))
        return await done

    def _closed(self, stream: _Stream) -> None:
        if not stream.done:
            stream.done = True
            self._send(("abort", stream))
        self._open -= 1
        if self._open == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> int:
        """Refuse new requests, wait up to `timeout` seconds for the open ones, abort the rest, stop the core
        thread. Returns how many were aborted."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            aborted = 0
        except asyncio.TimeoutError:
            aborted = self._open
        self.close()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        return aborted

    def close(self) -> None:
        """Stop the core thread; requests still open end with finish_reason "abort"."""
        self._stop = True
        self._wake.set()

    def join(self, timeout: float) -> bool:
        """Wait (from a thread outside the event loop) for the core thread to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _deliver(self, batch: list[tuple[_Stream, Delta | BaseException]], adds_taken: int, snap: Snapshot) -> None:
        self._pending_adds -= adds_taken
        self.snapshot = snap
        for stream, item in batch:
            if isinstance(item, BaseException) or item.finish_reason is not None:
                stream.done = True
            stream.deltas.put_nowait(item)

    def _snapshot(self) -> Snapshot:
        """Taken on the core thread, between steps."""
        core, pool = self.core, self.core.tables.pool
        used = pool.num_blocks - pool.num_free
        return Snapshot(core.num_running, core.num_waiting, used, pool.num_free, core.counters())

    # ---- core thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch, adds = self._take_inbox()
            if self._stop:
                for rid in list(self._streams):
                    self.core.abort(rid)
            stepped = self.core.has_work
            if stepped:
                try:
                    deltas = self.core.step()
                except Exception as exc:  # the step failed: every request in the core ends with the error
                    self.error = exc
                    deltas = []
                    batch.extend((s, OffloadError(f"the engine failed: {exc}")) for s in self._streams.values())
                    self._streams.clear()
                    self.core.abort_all()  # their final deltas, which nobody waits for now
                for delta in deltas:
                    stream = self._streams.get(delta.request_id)
                    if stream is None:
                        continue
                    batch.append((stream, delta))
                    if delta.finish_reason is not None:
                        del self._streams[delta.request_id]
            if batch or adds or stepped:  # an abort's step hands out nothing here, but it freed KV blocks
                self._loop.call_soon_threadsafe(self._deliver, batch, adds, self._snapshot())
            if self._stop and not self.core.has_work:
                return
            if not self.core.has_work:
                self._wake.wait(timeout=1.0)
                self._wake.clear()

    def _take_inbox(self) -> tuple[list, int]:
        batch: list[tuple[_Stream, Delta | BaseException]] = []
        adds = 0
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return batch, adds
            if command[0] == "add":
                _, stream, ids, params, priority = command
                adds += 1
                if stream.done:  # the caller left before the core saw the request
                    continue
                try:
                    stream.request_id = self.core.add_request(ids, params, priority=priority)
                except OffloadError as exc:
                    batch.append((stream, exc))
                    continue
                self._streams[stream.request_id] = stream
            elif command[0] == "call":
                _, done, fn = command
                self._call(done, fn)
            else:
                stream = command[1]
                if stream.request_id is not None and self.core.abort(stream.request_id):
                    self._streams.pop(stream.request_id, None)

    def _call(self, done: asyncio.Future, fn: Callable[[], object]) -> None:
        try:
            result = fn()
        except Exception as exc:
            self._loop.call_soon_threadsafe(_settle, done, None, exc)
        else:
            self._loop.call_soon_threadsafe(_settle, done, result, None)


def _settle(done: asyncio.Future, result: object, error: BaseException | None) -> None:
    """On the event loop: hand a core-thread call's outcome to its awaiting caller (unless it gave up waiting)."""
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)
