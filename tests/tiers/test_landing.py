"""The buffers a ring's reads land in (tiers/weights/landing.py): on a CPU device the aio backend's reads land in
buffers its op page-locked, charged exactly to the tier and given back on close; where RLIMIT_MEMLOCK cannot hold them,
plain buffers, said once; the backend counts as bounced only reads into memory the op has not locked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.cli import _summary
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.model.loader import load_spec
from offload.model.registry import model_tensors
from offload.tiers.copy import make_copy_engine
from offload.tiers.io import aio as aio_mod
from offload.tiers.io.aio import AioBackend, aio_unavailable
from offload.tiers.io.base import aligned_buffer, aligned_span, evict_page_cache
from offload.tiers.io.direct import PreadBackend
from offload.tiers.memory import MemoryTier
from offload.tiers.weights.layout import GroupLayout, Run, TensorAt
from offload.tiers.weights.placement import group_cost
from offload.tiers.weights.ring import DirectRing, StagedRing

CPU = torch.device("cpu")
LAYERS = 4
SIZE = 4 << 20  # bytes; every layer ends well before the file does, so the op reads each in full (no pool tail)
KiB = 1 << 10


def extent(layer: int) -> tuple[int, int]:
    """(offset, nbytes) of a layer's one tensor: odd offsets and sizes, none aligned."""
    return 1000 + layer * 700_001, 500_000 + layer


SLOT = aligned_span(0, max(aligned_span(*extent(i)).length for i in range(LAYERS))).length  # bytes per ring slot


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("landing") / "layers.bin"
    payload = random.Random(0).randbytes(SIZE)
    path.write_bytes(payload)
    evict_page_cache(path)
    return path, payload


def layouts(path: Path) -> dict[int, GroupLayout]:
    out = {}
    for i in range(LAYERS):
        offset, nbytes = extent(i)
        span = aligned_span(offset, nbytes)
        tensor = TensorAt("w", offset - span.start, "U8", (nbytes,), nbytes)
        out[i] = GroupLayout((Run(path, offset, nbytes, 0),), (tensor,), span.length)
    return out


def aio_backend() -> AioBackend:
    if reason := aio_unavailable():
        pytest.skip(f"aio backend unavailable here: {reason}")
    return AioBackend(aio_threads=1, threads=2)


def stream(ring, payload: bytes, passes: int = 2) -> None:
    """Acquire every layer `passes` times in the engine's order; each holds its bytes of the file exactly."""
    for _ in range(passes):
        for i in range(LAYERS):
            offset, nbytes = extent(i)
            assert ring.acquire(i)["w"].numpy().tobytes() == payload[offset : offset + nbytes], i
            ring.release(i)


def test_direct_ring_reads_into_op_locked_buffers_and_gives_them_back_on_close(data):
    path, payload = data
    backend = aio_backend()
    tier = MemoryTier("device", 4 * SLOT, CPU)
    ring = DirectRing(layouts(path), backend, tier, torch.float32, slots=2)
    assert backend.locked_bytes == 2 * SLOT and tier.used == tier.peak == 2 * SLOT  # exact: no alignment padding
    tier.check_integrity()
    stream(ring, payload)
    assert backend.bytes_read >= 2 * LAYERS * 500_000 and backend.bounced_bytes == 0  # no read went through a copy
    ring.close()
    assert backend.locked_bytes == 0 and tier.used == 0 and tier.peak == 2 * SLOT
    tier.check_integrity()
    ring.close()  # closing again does nothing
    assert backend.locked_bytes == 0 and tier.used == 0
    with pytest.raises(OffloadError, match="the weight ring is closed"):
        ring.acquire(0)
    backend.close()


def test_pread_ring_takes_the_tiers_own_buffers_and_gives_them_back_on_close(data):
    path, payload = data
    tier = MemoryTier("device", None, CPU)
    with PreadBackend(threads=2) as backend:
        ring = DirectRing(layouts(path), backend, tier, torch.float32, slots=2)
        assert backend.locked_buffer(SLOT) is None and tier.used == 2 * tier.footprint(SLOT)
        stream(ring, payload, passes=1)
        ring.close()
    assert tier.used == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="where CUDA is present torch pins the staging slots")
def test_staged_ring_stages_through_op_locked_slots_where_torch_pins_nothing(data):
    path, payload = data
    backend = aio_backend()
    host = MemoryTier("host", None, CPU, pin=True)  # asked pinned; without CUDA torch cannot
    device = MemoryTier("device", None, CPU)
    streamed = dict.fromkeys(range(LAYERS), "nvme")
    ring = StagedRing(layouts(path), streamed, backend, make_copy_engine(CPU), device, host, torch.float32, slots=2)
    assert not host.pins and backend.locked_bytes == host.used == 2 * SLOT
    stream(ring, payload)
    assert backend.bounced_bytes == 0
    ring.close()
    assert backend.locked_bytes == 0 and host.used == 0
    backend.close()


def test_ring_falls_back_to_plain_buffers_beyond_the_mlock_limit_and_says_so_once(data, monkeypatch):
    path, payload = data
    monkeypatch.setattr(aio_mod, "_memlock_limit", lambda: 3 * SLOT)  # half of it locks one slot, not two
    backend = aio_backend()
    tier = MemoryTier("device", None, CPU)
    ring = DirectRing(layouts(path), backend, tier, torch.float32, slots=2)
    assert backend.locked_bytes == 0  # the one slot it locked went back: all of a ring's slots, or none
    assert tier.used == 2 * tier.footprint(SLOT)
    tier.check_integrity()
    note = backend.lock_note
    assert note.startswith("aio read buffers not page-locked:") and f"RLIMIT_MEMLOCK ({3 * SLOT} bytes" in note
    assert backend.locked_buffer(10 * SLOT) is None and backend.lock_note == note  # said once
    stream(ring, payload)  # every read bounces through the op's copy, within the limit
    ring.close()  # the reads ahead land: every byte read is counted
    assert backend.bounced_bytes == backend.bytes_read > 0
    assert tier.used == 0 and backend.locked_bytes == 0
    backend.close()


def test_reads_into_locked_buffers_are_not_bounced(data, monkeypatch):
    path, payload = data
    monkeypatch.setattr(aio_mod, "_memlock_limit", lambda: 512 * KiB)
    backend = aio_backend()
    locked = backend.locked_buffer(256 * KiB - 5)
    assert locked is not None and locked.numel() == 256 * KiB and backend.locked_bytes == 256 * KiB
    assert backend.locked_buffer(1) is None  # past half of the limit
    plain = aligned_buffer(256 * KiB)
    # the plain read's bounce buffer and the locked one take the whole limit; a read into a view inside the locked
    # buffer needs none, so it is not refused
    into_plain = backend.submit(path, 0, 256 * KiB, plain)
    into_locked = backend.submit(path, 300 * KiB, 252 * KiB, locked[4 * KiB :])
    assert into_plain.wait().numpy().tobytes() == payload[: 256 * KiB]
    assert into_locked.wait().numpy().tobytes() == payload[300 * KiB : 552 * KiB]
    assert backend.bounced_bytes == 256 * KiB  # the plain read alone
    with pytest.raises(OffloadError, match=r"aio read of 266240 bytes into an unpinned .*\(524288 bytes, 262144 in"):
        backend.submit(path, 0, 256 * KiB + 1, aligned_buffer(260 * KiB))  # 256 KiB locked + 260 KiB of bounce
    backend.free_locked(locked)
    assert backend.locked_bytes == 0
    with pytest.raises(ValueError, match="was not locked here"):
        backend.free_locked(locked)
    backend.close()


@pytest.mark.parametrize("kind", ["locked", "plain"])
def test_waiting_for_one_buffers_read_does_not_wait_for_anothers(data, kind):
    """The op's wait() reaps every read on its handle: reads into different buffers (a ring's slots) go to different
    handles, so waiting for one slot's layer leaves the next slot's read in flight while that layer computes."""
    path, payload = data
    backend = aio_backend()
    if kind == "locked":
        a, b = backend.locked_buffer(256 * KiB), backend.locked_buffer(256 * KiB)
    else:
        a, b = aligned_buffer(256 * KiB), aligned_buffer(256 * KiB)
    first = backend.submit(path, 0, 256 * KiB, a)
    second = backend.submit(path, 256 * KiB, 256 * KiB, b)
    assert first.wait().numpy().tobytes() == payload[: 256 * KiB]
    in_flight = [op.target.data_ptr() for lane in backend._lanes for op in lane.pending]
    assert in_flight == [b.data_ptr()]  # the second read was not reaped with the first
    assert second.wait().numpy().tobytes() == payload[256 * KiB : 512 * KiB]
    assert backend.bounced_bytes == (0 if kind == "locked" else 512 * KiB)
    if kind == "locked":
        backend.free_locked(a)
        backend.free_locked(b)
    backend.close()


# ---- the engine ----------------------------------------------------------------------------------------------

KV = 1 << 20
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 17], [1, 44, 45, 46]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama", num_hidden_layers=4)
    return path


@pytest.fixture(scope="module")
def streaming(model_dir) -> tuple[int, int, list[list[int]]]:
    """(a device budget that streams every layer through a 2-slot ring, a ring slot's bytes, the resident tokens)."""
    from offload.tiers.io.buffered import BufferedReader
    from offload.tiers.weights.checkpoint import Checkpoint
    from offload.tiers.weights.layout import model_layout

    base = LLM(model_dir, EngineConfig(kv_cache_bytes=KV))
    spec, family = load_spec(model_dir)
    with BufferedReader() as reader:
        layout = model_layout(Checkpoint(model_dir, reader), model_tensors(family, spec))
    tokens = [c.token_ids for c in base.generate_ids(PROMPTS, PARAMS)]
    base.close()

    def cost(g):
        return group_cost(g, dtype=base.parts.dtype, tier=base.parts.device_tier, staged=False)

    budget = KV + cost(layout.embed) + cost(layout.head) + 2 * cost(layout.layers[0])
    return budget, max(aligned_span(0, g.slot_bytes).length for g in layout.layers), tokens


def test_engine_streams_through_op_locked_slots_on_a_cpu_device(model_dir, streaming):
    if reason := aio_unavailable():
        pytest.skip(f"aio backend unavailable here: {reason}")
    budget, slot, expected = streaming
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=budget, ring_slots=2, io_backend="aio"))
    assert set(llm.placement.layer_tiers) == {"nvme"}
    assert llm.parts.weights.backend.locked_bytes == 2 * slot
    loading = llm.parts.weights.backend.bounced_bytes  # resident weights load once, through the op's copy
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    assert llm.parts.weights.backend.bounced_bytes == loading  # streaming bounced nothing
    assert "not page-locked" not in _summary(llm, [])
    llm.close()
    assert llm.parts.weights.backend.locked_bytes == 0
    llm.check_integrity()


def test_engine_says_once_in_its_summary_that_the_mlock_limit_left_its_ring_unlocked(model_dir, streaming, monkeypatch):
    if reason := aio_unavailable():
        pytest.skip(f"aio backend unavailable here: {reason}")
    budget, slot, expected = streaming
    monkeypatch.setattr(aio_mod, "_memlock_limit", lambda: 3 * slot)  # locks one slot, not two; bounces fit
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=budget, ring_slots=2, io_backend="aio"))
    assert llm.parts.weights.backend.locked_bytes == 0
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    summary = _summary(llm, [])
    assert summary.count("aio read buffers not page-locked") == 1
    assert "\ni/o        backend aio (asked); " in summary
    llm.close()
