"""The asyncio front in-process: requests from many tasks share the core's loop, leave it cleanly, and drain.

A test waits for a state the core thread reaches (blocks freed, the model loaded) with `settled`, bounded
generously, never for a length of time: on a loaded machine that thread may get the CPU seconds later."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.server.app import Server, ServeSettings
from offload.server.front import AsyncFront, Draining, QueueFull

LONG = SamplingParams(max_new_tokens=200, ignore_eos=True)
BOUND = 600.0  # seconds: the longest a wait for a state lasts (tests/server/serving.py's, for this process)


async def settled(check: Callable[[], bool], what: str) -> None:
    """Return once `check()` holds, polling between the event loop's other work; fail after BOUND seconds."""
    deadline = time.monotonic() + BOUND
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {BOUND} s: {what}")
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, EngineConfig(kv_cache_bytes=1 << 22, block_size=4, max_num_seqs=2))


async def consume(stream) -> list:
    try:
        return [d async for d in stream]
    finally:
        stream.close()


def test_concurrent_callers_get_what_generate_gives(llm):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    want = [c.token_ids for c in llm.generate_ids(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))]

    async def run() -> list:
        front = AsyncFront(llm.core)
        front.start()
        streams = [front.submit(p, SamplingParams(max_new_tokens=10, ignore_eos=True)) for p in prompts]
        results = await asyncio.gather(*(consume(s) for s in streams))
        assert await front.drain(BOUND) == 0
        return results

    results = asyncio.run(run())
    assert [tuple(t for d in r for t in d.token_ids) for r in results] == want
    assert all(r[-1].finish_reason == "length" for r in results)


def test_a_caller_that_leaves_aborts_its_request(llm):
    async def run() -> None:
        front = AsyncFront(llm.core)
        front.start()
        stream = front.submit([5, 6, 7], LONG)
        async for _ in stream:
            break
        stream.close()
        await settled(lambda: front.snapshot.kv_blocks_used == 0 and front.snapshot.running == 0, "the blocks free")
        assert front.snapshot.counters.requests_aborted >= 1
        await front.drain(BOUND)

    asyncio.run(run())
    llm.check_integrity()


def test_queue_limit_and_drain_refuse_at_once(llm):
    async def run() -> None:
        front = AsyncFront(llm.core, max_waiting=1)
        front.start()
        # two places in the batch, one more may wait: the fourth is refused before anything is queued
        streams = [front.submit([5 + i], LONG) for i in range(3)]
        with pytest.raises(QueueFull, match="the limit \\(--max-waiting\\) is 1"):
            front.submit([9], LONG)
        drain = asyncio.ensure_future(front.drain(0.0))
        await asyncio.sleep(0)
        with pytest.raises(Draining):
            front.submit([9], LONG)
        assert await drain == 3  # no time to finish: each is aborted
        results = await asyncio.gather(*(consume(s) for s in streams))
        assert all(r[-1].finish_reason == "abort" for r in results)

    asyncio.run(run())
    assert llm.stats().kv_blocks_used == 0


def test_a_failing_step_fails_its_requests_and_the_front_goes_on(llm, monkeypatch):
    async def run() -> None:
        front = AsyncFront(llm.core)
        front.start()
        real = llm.core.step
        calls = iter([RuntimeError("disk gone")])

        def flaky():
            for exc in calls:
                raise exc
            return real()

        monkeypatch.setattr(llm.core, "step", flaky)
        with pytest.raises(OffloadError, match="the engine failed: disk gone"):
            await consume(front.submit([5, 6], LONG))
        ok = await consume(front.submit([5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True)))
        assert ok[-1].finish_reason == "length"
        await front.drain(BOUND)

    asyncio.run(run())
    assert llm.stats().kv_blocks_used == 0


def test_health_says_loading_until_the_weights_are_placed(llm):
    release = threading.Event()

    def load():
        release.wait(BOUND)
        return llm

    async def run() -> None:
        server = Server(load, ServeSettings(model_name="m"))
        server.start_loading()
        await asyncio.sleep(0.05)
        assert server.status == "loading"
        release.set()
        await settled(lambda: server.status == "ok", "the server ready")
        await server.drain()
        assert server.status == "draining"

    asyncio.run(run())
