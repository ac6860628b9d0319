"""Weight streaming: placement from budgets, the prefetch rings (direct and staged), byte accounting, and
failure modes. The staged path (pinned staging + copy engine) is forced on the CPU here; tests marked `gpu`
run it on CUDA."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from conftest import make_checkpoint
from offload import build
from offload.api import LLM
from offload.common.config import EngineConfig, Policy, SamplingParams
from offload.common.errors import OffloadError
from offload.model.llama import FAMILY
from offload.model.loader import load_spec
from offload.model.registry import model_tensors
from offload.tiers.copy import DONE, CopyEngine, CudaCopyEngine, Event
from offload.tiers.io.base import aligned_span
from offload.tiers.weights import weight_store as weights
from offload.tiers.weights.placement import group_cost, place_weights
from offload.tiers.weights.slot import slot_layout
from offload.tiers.weights.weight_store import WeightStore

RING = 3  # ring slots these tests budget for (the default is smaller)
KV = 1 << 20
LAYERS = 6
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 17], [1, 44, 45, 46, 47, 48, 49, 50, 51]]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama", num_hidden_layers=LAYERS)
    return path


@pytest.fixture(scope="module")
def resident(model_dir):
    llm = LLM(model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV))
    return llm, [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)]


@pytest.fixture
def staged(monkeypatch):
    """LLMs built in the test take the staged path on the CPU: pinned staging, the copy engine, packed slots."""
    monkeypatch.setattr(build, "WeightStore", functools.partial(WeightStore, staged=True))
    monkeypatch.setattr(build, "place_weights", functools.partial(place_weights, staged=True))
    return True


@pytest.fixture(params=["direct", "staged"])
def path(request, monkeypatch):
    """Both paths; True when staged."""
    if request.param == "staged":
        return request.getfixturevalue("staged")
    return False


def costs(llm: LLM, staged: bool = False) -> tuple[int, int]:
    """(embed + head, one layer) device bytes for this checkpoint."""
    layout, tier = llm_layout(llm), llm.parts.device_tier
    cost = functools.partial(group_cost, dtype=llm.parts.dtype, tier=tier, staged=staged)
    return cost(layout.embed) + cost(layout.head), cost(layout.layers[0])


def host_cost(llm: LLM, layer: int | None = None) -> int:
    """Host bytes of a layer as read (a host layer, or a staging slot); the largest when `layer` is None."""
    slots = [g.slot_bytes for g in llm_layout(llm).layers]
    return llm.parts.host_tier.footprint(max(slots) if layer is None else slots[layer])


def landed(group) -> int:
    """Bytes one read of `group` transfers: its aligned spans, cut short at the end of the file."""
    spans = [(aligned_span(r.offset, r.nbytes), os.path.getsize(r.path)) for r in group.runs]
    return sum(min(span.start + span.length, size) - span.start for span, size in spans)


def llm_layout(llm: LLM):
    from offload.tiers.io.buffered import BufferedReader
    from offload.tiers.weights.checkpoint import Checkpoint
    from offload.tiers.weights.layout import model_layout

    _, family = load_spec(llm.model_dir)
    with BufferedReader() as reader:
        return model_layout(Checkpoint(llm.model_dir, reader), model_tensors(family, llm.spec))


def budget_for(resident_llm: LLM, resident_layers: int, ring: int = 3, staged: bool = False) -> int:
    fixed, layer = costs(resident_llm, staged)
    return KV + fixed + (ring + resident_layers) * layer


def test_no_budget_keeps_every_layer_resident(resident):
    llm, _ = resident
    assert llm.placement.layer_tiers == ("device",) * LAYERS
    assert llm.placement.ring_slots == 0


@pytest.mark.parametrize("resident_layers", [0, 1])
def test_streamed_layers_give_the_same_tokens(model_dir, resident, resident_layers):
    base, expected = resident
    llm = LLM(
        model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, resident_layers))
    )
    assert llm.placement.layer_tiers == Policy.from_counts(resident_layers, 0, LAYERS - resident_layers, 2).layer_tiers
    got = [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)]
    assert got == expected
    llm.parts.weights.store.close()  # let the reads in flight land, so the byte count is final
    layout = llm_layout(llm)
    tiers = llm.placement.layer_tiers
    held = sum(g.read_bytes for g, t in zip(layout.layers, tiers, strict=True) if t == "device")
    loaded = layout.embed.read_bytes + layout.head.read_bytes + held
    streamed = [g.read_bytes for g, t in zip(layout.layers, tiers, strict=True) if t == "nvme"]
    assert llm.stats().weights.streamed_bytes_per_pass == sum(streamed)
    # every step streams each nvme layer once, and the ring has read its 3 slots ahead into the next step
    expected_bytes = loaded + llm.last_run.steps * sum(streamed) + sum(streamed[:3])
    # aligned spans count in full, except those that reach into the file's last, partial page
    assert 0 <= expected_bytes - llm.stats().weights.bytes_read < 3 * 4096
    assert llm.placement.device_peak <= llm.placement.device_budget
    llm.check_integrity()


def test_resident_layers_are_never_reread(model_dir, resident):
    base, _ = resident
    llm = LLM(
        model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, LAYERS) + 10**6)
    )
    assert llm.placement.ring_slots == 0
    loaded = llm.stats().weights.bytes_read
    llm.generate_ids(PROMPTS, PARAMS)
    assert llm.stats().weights.bytes_read == loaded


def test_host_tier_holds_layers_read_once(model_dir, resident):
    base, expected = resident
    _, layer = costs(base)
    config = EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, 0), host_memory=2 * layer)
    llm = LLM(model_dir, config)
    assert llm.placement.layer_tiers == Policy.from_counts(0, 2, LAYERS - 2, 2).layer_tiers
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    assert llm.placement.host_peak <= 2 * layer


def test_the_kv_host_part_is_taken_out_of_the_host_budget(model_dir, resident):
    """--host-memory is all the host RAM the engine keeps: with a KV host part of one layer's bytes, a budget of
    three layers holds two."""
    base, expected = resident
    _, layer = costs(base)
    budget = dict(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, 0))
    llm = LLM(model_dir, EngineConfig(**budget, host_memory=3 * layer, kv_host_memory=layer))
    assert llm.placement.layer_tiers == Policy.from_counts(0, 2, LAYERS - 2, 2).layer_tiers
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    assert llm.placement.host_peak <= 2 * layer


def test_a_part_larger_than_its_budget_is_refused():
    with pytest.raises(OffloadError, match=r"kv_host_memory \(300\) is part of host_memory \(200\)"):
        EngineConfig(host_memory=200, kv_host_memory=300)
    with pytest.raises(OffloadError, match=r"kv_disk_memory \(300\) is part of disk_memory \(200\)"):
        EngineConfig(offload_dir="/tmp/kv", disk_memory=200, kv_disk_memory=300)
    parts = EngineConfig(offload_dir="/tmp/kv", kv_host_memory=300, kv_disk_memory=300)  # no totals: parts alone
    assert (parts.host_total, parts.host_layer_memory, parts.disk_layer_memory) == (300, None, None)


def test_budget_smaller_than_the_ring_is_a_clear_error(model_dir, resident):
    base, _ = resident
    fixed, layer = costs(base)
    with pytest.raises(OffloadError, match="--device-memory is too small.*3 layer buffers"):
        LLM(model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=KV + fixed + layer))


def test_kv_cache_larger_than_the_device_budget(model_dir):
    with pytest.raises(OffloadError, match="--kv-cache-memory"):
        LLM(model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=KV // 2))


def test_checkpoint_changing_size_during_a_run(tmp_path, resident):
    base, _ = resident
    make_checkpoint(tmp_path, "llama", num_hidden_layers=LAYERS)
    llm = LLM(tmp_path, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, 0)))
    with open(tmp_path / "model.safetensors", "ab") as f:
        f.write(b"\0" * 100)
    with pytest.raises(OffloadError, match="model.safetensors: changed size during the run"):
        for _ in range(3):  # the ring has read ahead; the change shows at the next read
            llm.generate_ids(PROMPTS, PARAMS)


def test_out_of_order_access_restarts_the_ring(model_dir, resident, path):
    base, _ = resident
    llm = LLM(
        model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, 0, staged=path))
    )
    assert llm.parts.weights.store.staged == path
    first = {k: v.clone() for k, v in llm.parts.weights.store.acquire(0).items()}
    llm.parts.weights.store.release(0)
    again = llm.parts.weights.store.acquire(2)  # skips layer 1: the ring drains and restarts at 2
    llm.parts.weights.store.release(2)
    layer0 = llm.parts.weights.store.acquire(0)
    assert all(torch.equal(first[k], layer0[k]) for k in first)
    assert set(again) == set(first)
    llm.parts.weights.store.release(0)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="needs O_DIRECT")
def test_streaming_reads_bypass_the_page_cache(model_dir, resident):
    base, _ = resident
    llm = LLM(model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, 0)))
    path = model_dir / "model.safetensors"
    assert llm.parts.weights.backend.is_direct(path)  # pytest's tmp_path is on the machine's disk (ext4 here)


def test_close_waits_for_reads_in_flight_and_closes_files(model_dir, resident, path):
    base, _ = resident
    with LLM(
        model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, 0, staged=path))
    ) as llm:
        llm.generate_ids(PROMPTS[:1], PARAMS)
    assert not llm.parts.weights.store._ring._reading
    assert not llm.parts.weights.backend._files


# ---- the staged path on the CPU: the same code as on CUDA, with synchronous copies --------------------------


def staged_config(base: LLM, host_layers: int, staging: bool = True, **kw) -> EngineConfig:
    """Nothing resident, `host_layers` in host RAM (after 3 staging slots when `staging`), the rest streamed."""
    host = (host_layers + RING * staging) * host_cost(base)
    return EngineConfig(
        ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, 0, staged=True), host_memory=host, **kw
    )


def assert_same_weights(got: LLM, want: LLM) -> None:
    """The same tensors in every layer, a layer held whole (its projections stacked, LlamaFamily.fuse) compared
    with one streamed by stacking the streamed one's."""
    for layer in range(LAYERS):
        a, b = got.parts.weights.store.acquire(layer), want.parts.weights.store.acquire(layer)
        a, b = FAMILY.fuse(got.spec, a), FAMILY.fuse(want.spec, b)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b), f"layer {layer}"
        got.parts.weights.store.release(layer)
        want.parts.weights.store.release(layer)


@pytest.mark.parametrize("resident_layers", [0, 1])
def test_staged_streaming_is_bit_identical_to_the_direct_path(model_dir, resident, staged, resident_layers):
    base, expected = resident
    config = EngineConfig(
        ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, resident_layers, staged=True)
    )
    llm = LLM(model_dir, config)
    assert llm.parts.weights.store.staged and not base.parts.weights.store.staged
    assert llm.placement.layer_tiers == Policy.from_counts(resident_layers, 0, LAYERS - resident_layers, 2).layer_tiers
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    for got, want in zip(llm.score(PROMPTS), base.score(PROMPTS), strict=True):
        assert torch.equal(got, want)
    assert_same_weights(llm, base)


def test_staged_counts_disk_reads_and_copies_per_pass(model_dir, resident, staged):
    base, expected = resident
    llm = LLM(model_dir, staged_config(base, host_layers=2))
    assert Policy(llm.placement.layer_tiers, ring_slots=RING).counts == (0, 2, LAYERS - 2)
    layout = llm_layout(llm)
    streamed = [g for g, t in zip(layout.layers, llm.placement.layer_tiers, strict=True) if t == "nvme"]
    hosted = [g for g, t in zip(layout.layers, llm.placement.layer_tiers, strict=True) if t == "host"]
    reads = sum(landed(g) for g in streamed)  # streamed layers only: host ones were read once
    copies = sum(g.tensor_bytes for g in layout.layers)  # every layer off the device, each pass
    loaded = landed(layout.embed) + landed(layout.head) + sum(landed(g) for g in hosted)
    read_ahead = sum(landed(g) for g in streamed[:3])  # 3 staging slots
    llm.parts.weights.store.settle()  # reads count when they land
    assert llm.stats().weights.bytes_read == loaded + read_ahead
    fixed = layout.embed.tensor_bytes + layout.head.tensor_bytes
    assert llm.stats().weights.h2d_bytes == fixed + sum(g.tensor_bytes for g in layout.layers[:2])  # 2 copied ahead
    assert llm.stats().weights.streamed_bytes_per_pass == sum(g.read_bytes for g in streamed)
    assert llm.stats().weights.h2d_bytes_per_pass == copies
    before = llm.stats().weights
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    llm.parts.weights.store.settle()
    after = llm.stats().weights
    assert after.bytes_read - before.bytes_read == llm.last_run.steps * reads
    assert after.h2d_bytes - before.h2d_bytes == llm.last_run.steps * copies


def test_staged_memory_is_bounded_and_charged_as_planned(model_dir, resident, staged):
    base, _ = resident
    llm = LLM(model_dir, staged_config(base, host_layers=2))
    fixed, layer = costs(base, staged=True)
    s, p = llm.stats(), llm.placement
    assert s.device_used == p.kv_bytes + fixed + RING * layer  # RING packed ring slots, no resident layer
    staging = max(host_cost(base, i) for i in range(2, LAYERS))
    assert s.host_used == host_cost(base, 0) + host_cost(base, 1) + RING * staging
    assert s.host_used <= llm.parts.host_tier.capacity and s.device_used <= p.device_budget
    peaks, used = (p.device_peak, p.host_peak), (s.device_used, s.host_used)
    for n in (2, 12):  # peaks do not grow with the number of steps
        llm.generate_ids(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True))
        s, p = llm.stats(), llm.placement
        assert (p.device_peak, p.host_peak) == peaks
        assert (s.device_used, s.host_used) == used
    llm.check_integrity()


def test_staged_host_layers_are_read_once_and_copied_every_pass(model_dir, resident, staged):
    base, expected = resident
    llm = LLM(model_dir, staged_config(base, host_layers=LAYERS, staging=False))
    assert llm.placement.layer_tiers == ("host",) * LAYERS and llm.placement.ring_slots == RING
    assert llm.stats().host_used == sum(host_cost(base, i) for i in range(LAYERS))  # nothing streams: no staging
    before = llm.stats().weights
    assert before.streamed_bytes_per_pass == 0
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    after = llm.stats().weights
    assert after.bytes_read == before.bytes_read
    per_pass = sum(g.tensor_bytes for g in llm_layout(llm).layers)
    assert after.h2d_bytes - before.h2d_bytes == llm.last_run.steps * per_pass


def test_staged_host_budget_too_small_for_staging_is_a_clear_error(model_dir, resident, staged):
    base, _ = resident
    config = staged_config(base, host_layers=2, staging=False)  # room for 2 layers, not for 3 staging slots
    with pytest.raises(OffloadError, match=r"--host-memory is too small: .* left for weights.* 3 pinned buffers of"):
        LLM(model_dir, config)


def test_staged_without_host_budget_stages_and_keeps_no_layer(model_dir, resident, staged):
    base, expected = resident
    llm = LLM(
        model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget_for(base, 0, staged=True))
    )
    assert llm.parts.host_tier.capacity is None and llm.placement.layer_tiers == ("nvme",) * LAYERS
    assert llm.stats().host_used == RING * host_cost(base)  # the staging slots and nothing else
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected


def test_staged_host_layers_need_a_ring(model_dir, resident):
    base, _ = resident
    policy = Policy(("device",) * (LAYERS - 1) + ("host",))
    with pytest.raises(OffloadError, match="pass through the device ring, which needs at least 2 slots, got 0"):
        WeightStore(
            llm_layout(base),
            base.parts.weights.backend,
            policy,
            base.parts.device_tier,
            base.parts.host_tier,
            base.parts.dtype,
            staged=True,
        )


class _Late:
    """The event of a copy that lands only when something waits for it."""

    def __init__(self, engine: LateCopyEngine) -> None:
        self.engine, self.done = engine, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.engine.run_until(self)


class LateCopyEngine(CopyEngine):
    """A copy stream that is always behind: copies run, in order, only when one of their events is waited for.
    A missing wait, or a staging slot read into before its copy landed, shows as wrong weights."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: list[tuple[list, _Late]] = []
        self.waited = 0

    def copy(self, pairs, after=None) -> Event:
        event = _Late(self)
        self.pending.append((list(pairs), event))
        return event

    def run_until(self, event: _Late) -> None:
        while not event.done:
            pairs, first = self.pending.pop(0)
            for dst, src in pairs:
                dst.copy_(src)
            first.done = True

    def wait(self, event: Event) -> None:
        self.waited += 1
        event.synchronize()

    def record(self) -> Event:
        return DONE

    def synchronize(self) -> None:
        if self.pending:
            self.run_until(self.pending[-1][1])


def test_staged_orders_late_copies_by_events(model_dir, resident, staged, monkeypatch):
    base, expected = resident
    monkeypatch.setattr(weights, "make_copy_engine", LateCopyEngine)
    llm = LLM(model_dir, staged_config(base, host_layers=2))
    assert (
        isinstance(llm.parts.weights.store.copier, LateCopyEngine) and llm.parts.weights.store.copier.pending
    )  # copies issued ahead
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    assert llm.parts.weights.store.copier.waited == llm.last_run.steps * LAYERS  # acquire waits on every copy's event
    assert_same_weights(llm, base)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-bf16")
    make_checkpoint(path, "llama", dtype=torch.bfloat16, num_hidden_layers=LAYERS)
    return path


def test_staged_converts_dtype_on_the_device_after_the_copy(bf16_dir, staged, monkeypatch):
    monkeypatch.setattr(build, "WeightStore", WeightStore)  # the all-resident reference loads the direct way
    base = LLM(bf16_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, dtype="float32"))
    monkeypatch.setattr(build, "WeightStore", functools.partial(WeightStore, staged=True))
    layout = llm_layout(base)
    scratch = base.parts.device_tier.footprint(max(slot_layout(g, torch.float32).convert_bytes for g in layout.layers))
    config = EngineConfig(
        ring_slots=RING, kv_cache_bytes=KV, dtype="float32", device_memory=budget_for(base, 0, staged=True) + scratch
    )
    llm = LLM(bf16_dir, config)
    assert llm.placement.layer_tiers == ("nvme",) * LAYERS
    fixed, layer = costs(base, staged=True)
    # ring slots hold float32 tensors, and one scratch buffer the bf16 bytes they are converted from
    assert llm.stats().device_used == llm.placement.kv_bytes + fixed + RING * layer + scratch
    assert llm.stats().weights.h2d_bytes_per_pass == sum(g.tensor_bytes for g in layout.layers)  # bf16 bytes
    assert_same_weights(llm, base)
    assert llm.parts.weights.store.acquire(0)["q_proj"].dtype == torch.float32
    llm.parts.weights.store.release(0)
    for got, want in zip(llm.score(PROMPTS), base.score(PROMPTS), strict=True):
        assert torch.equal(got, want)


# ---- the staged path on CUDA ---------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_layers", [0, 1])
def test_cuda_streamed_logits_equal_all_resident(model_dir, host_layers):
    base = LLM(model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device="cuda"))
    assert base.placement.layer_tiers == ("device",) * LAYERS
    host = (host_layers + RING) * host_cost(base) if host_layers else 0  # host layers and RING staging slots
    device = budget_for(base, 1, staged=True)
    llm = LLM(
        model_dir,
        EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device="cuda", device_memory=device, host_memory=host),
    )
    assert llm.placement.layer_tiers == ("device",) + ("host",) * host_layers + ("nvme",) * (LAYERS - 1 - host_layers)
    assert llm.parts.weights.store.staged and isinstance(llm.parts.weights.store.copier, CudaCopyEngine)
    for _ in range(2):  # the second pass reuses every slot
        for got, want in zip(llm.score(PROMPTS), base.score(PROMPTS), strict=True):
            assert torch.equal(got, want)
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == [
        c.token_ids for c in base.generate_ids(PROMPTS, PARAMS)
    ]
    assert llm.placement.device_peak <= llm.placement.device_budget
    assert host == 0 or llm.placement.host_peak <= host
    ring = (
        llm.parts.weights.store._ring
    )  # every staging slot, free or holding a read; copies from pageable memory would block
    staging = [buf for buf, _ in ring._staging] + [r.buf for r in ring._reading if r.layer not in ring._host]
    assert staging and all(buf.is_pinned() for buf in staging)
    llm.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_copies_run_on_their_own_stream_without_host_syncs(model_dir, monkeypatch):
    base = LLM(model_dir, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device="cuda"))
    host = LAYERS * host_cost(base)  # every layer in host RAM: no disk read, so the host never has to wait
    device = budget_for(base, 0, staged=True)
    llm = LLM(
        model_dir,
        EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device="cuda", device_memory=device, host_memory=host),
    )
    assert llm.placement.layer_tiers == ("host",) * LAYERS
    copier = llm.parts.weights.store.copier
    assert copier.stream != torch.cuda.current_stream()
    waits: list[object] = []
    monkeypatch.setattr(copier, "wait", lambda event: (waits.append(event), CudaCopyEngine.wait(copier, event)))

    def forbidden(*args, **kwargs):
        raise AssertionError("a host sync in acquire/release")

    for target in (torch.cuda, torch.cuda.Stream, torch.cuda.Event):
        monkeypatch.setattr(target, "synchronize", forbidden)
    for layer in range(LAYERS):
        w = llm.parts.weights.store.acquire(layer)
        assert isinstance(waits[-1], torch.cuda.Event)  # the compute stream waits on the copy's event
        assert llm.parts.weights.store._ring._copied  # the next layers' copies are already issued
        assert w["q_proj"].device.type == "cuda"
        llm.parts.weights.store.release(layer)
    monkeypatch.undo()
    assert len(waits) == LAYERS
    llm.close()


def test_resident_layers_converted_whole_release_their_read_buffers(tmp_path):
    """A float32 checkpoint run in bfloat16: every tensor is converted, so each read buffer is freed, not left
    charged (a stale charge would also collide with a later buffer at the same address)."""
    path = tmp_path / "m"
    make_checkpoint(path, "llama", dtype=torch.float32)
    llm = LLM(path, EngineConfig(dtype="bfloat16", kv_cache_bytes=1 << 20))
    llm.generate_ids([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    llm.check_integrity()
    checkpoint = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    assert llm.stats().device_used - llm.placement.kv_bytes < 0.75 * checkpoint  # about half: the bf16 copies alone


def test_prepacked_resident_weights_give_identical_logits_in_the_same_bytes(bf16_dir, monkeypatch):
    """On the CPU resident layers' matrices may be packed for the GEMM: the logits stay those of the dense weights
    (up to the GEMM's order of accumulation), the embedding stays a plain table and the head dense (its logits
    float32, which a packed GEMM would round to bfloat16), and the tier is charged the tensors' own bytes in place
    of the read buffers."""
    from offload.kernels import choice
    from offload.kernels.linear import pack_weight

    try:
        pack_weight(torch.ones(4, 4, dtype=torch.bfloat16))
    except RuntimeError:
        pytest.skip("this CPU's oneDNN does not pack bfloat16")
    config = EngineConfig(ring_slots=RING, kv_cache_bytes=KV, dtype="bfloat16")
    monkeypatch.setattr(build, "WeightStore", functools.partial(WeightStore, prepack=False))
    dense = LLM(bf16_dir, config)
    monkeypatch.setattr(build, "WeightStore", functools.partial(WeightStore, prepack=True))
    packed = LLM(bf16_dir, config)
    layer = packed.parts.weights.store.acquire(0)
    assert layer["qkv_proj"].is_mkldnn and not layer["input_norm"].is_mkldnn
    head, embed = packed.parts.weights.store.head["lm_head"], packed.parts.weights.store.embed["embed"]
    assert not head.is_mkldnn and not embed.is_mkldnn
    assert not dense.parts.weights.store.acquire(0)["qkv_proj"].is_mkldnn
    with choice.forcing("torch"):  # the dense weights through oneDNN too, not a native kernel's order of sums
        for got, want in zip(packed.score(PROMPTS), dense.score(PROMPTS), strict=True):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    packed.check_integrity()
    # each packed group is charged its tensors' bytes instead of its read buffer's: the layers either way (their
    # stacked projections are new tensors too, LlamaFamily.fuse); the head, never packed, the same in both
    assert packed.stats().device_used == dense.stats().device_used


def test_a_group_converted_whole_is_read_a_piece_at_a_time(model_dir, monkeypatch):
    """float32 weights run in bfloat16: a group whose every tensor converts is read through a buffer of one piece,
    each piece converted before the next is read, so loading never holds the float32 copy beside the bfloat16 one.
    The weights are the ones the whole-slot read gives, and the device's peak is lower by what the buffer saves."""
    from offload.tiers.weights import layout as layout_module

    config = EngineConfig(ring_slots=RING, kv_cache_bytes=KV, dtype="bfloat16")
    whole = LLM(model_dir, config)
    piece = 2 * 4096  # smaller than every group here: the embedding and each layer
    monkeypatch.setattr(layout_module, "CONVERT_PIECE", piece)
    monkeypatch.setattr(weights, "CONVERT_PIECE", piece)
    pieces = LLM(model_dir, config)
    layout = llm_layout(pieces)
    assert all(g.slot_bytes > piece + 2 * 4096 for g in (layout.embed, *layout.layers))
    assert layout_module.load_buffer_bytes(layout.embed, torch.bfloat16) == piece + 2 * 4096
    assert torch.equal(pieces.parts.weights.store.embed["embed"], whole.parts.weights.store.embed["embed"])
    assert torch.equal(
        pieces.parts.weights.store.acquire(0)["input_norm"], whole.parts.weights.store.acquire(0)["input_norm"]
    )
    for got, want in zip(pieces.score(PROMPTS), whole.score(PROMPTS), strict=True):
        assert torch.equal(got, want)
    assert pieces.stats().device_used == whole.stats().device_used  # the same tensors, once loaded
    saved = layout.embed.slot_bytes - (piece + 2 * 4096)  # the largest group's buffer, not its slot
    assert pieces.parts.device_tier.peak <= whole.parts.device_tier.peak - saved
