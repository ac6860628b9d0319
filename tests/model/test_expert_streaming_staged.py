"""Expert streaming on the staged path (a CUDA device's): an expert cache in pinned host RAM, device slots filled
from it by the copy engine, and cold experts run on the CPU where they are. Forced on the CPU here (synchronous
copies, the same code); the `gpu`-marked test runs it on CUDA."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import make_checkpoint, toy_spec
from offload import build
from offload.api import LLM
from offload.cli import _placement_table, _summary
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.common.hardware import ComputeUnit
from offload.model.expert_streaming import ColdExperts, expert_caches, model_layouts
from offload.model.loader import load_spec
from offload.planner.cold_experts import cold_experts
from offload.scheduler.cost.moe_cost import cold_expert_seconds, copied_expert_seconds
from offload.tiers.copy import CpuCopyEngine
from offload.tiers.device import DeviceTier
from offload.tiers.experts.expert_slots import DeviceExperts
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import Checkpoint
from offload.tiers.weights.slot import slot_layout

KV_BYTES = 1 << 22
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)
CPU = torch.device("cpu")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [[1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in (7, 15)]


def _config(**fields) -> EngineConfig:
    return EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, io_backend="pread", **{"device": "cpu"} | fields)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    """(model dir, the resident run's tokens, one expert's device slot cost), fp32."""
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(path, request.param)
    with LLM(path, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, device="cpu")) as llm:
        resident = [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)]
    spec, family = load_spec(path)
    with BufferedReader() as reader:
        _, experts = model_layouts(Checkpoint(path, reader), family, spec, split=True)
    slot = DeviceTier(None, CPU).footprint(max(slot_layout(g, torch.float32).nbytes for g in experts.values()))
    return path, resident, slot


@pytest.fixture
def staged(monkeypatch):
    """LLMs built in the test stream their experts as on CUDA: host cache, device slots, the copy engine."""
    monkeypatch.setattr(build, "expert_caches", functools.partial(expert_caches, staged=True))


def _run(path, **fields):
    with LLM(path, _config(**fields)) as llm:
        tokens = [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)]
        llm.check_integrity()
        return tokens, llm.last_run.experts, llm


def test_copied_to_device_slots_the_tokens_are_the_resident_ones(checkpoint, staged):
    path, resident, slot = checkpoint
    tokens, x, llm = _run(path, expert_cache_memory=3 * slot, cold_experts="device")
    assert tokens == resident
    assert (
        llm.parts.experts.slots.slots == 3 and llm.parts.experts.cache.tier is llm.parts.host_tier
    )  # the cache of experts as read
    assert llm.placement.experts.slots == 3  # --expert-host-memory 0: as many as the device slots
    assert x.misses > 0 and x.cpu_runs == 0 and x.h2d_bytes > 0
    assert x.device_hits <= x.hits
    assert "in pinned host RAM" in _placement_table(llm) and "and 3 expert slots on cpu" in _placement_table(llm)
    assert f"{x.device_hits} hits in its expert slots" in _summary(llm, [])


def test_cold_experts_on_the_cpu_give_the_resident_tokens_and_copy_nothing(checkpoint, staged):
    path, resident, slot = checkpoint
    tokens, x, _ = _run(path, expert_cache_memory=3 * slot, cold_experts="cpu")
    assert tokens == resident
    assert x.cpu_runs == x.hits + x.misses and x.h2d_bytes == 0 and x.device_hits == 0


def test_auto_runs_each_cold_expert_where_it_is_priced_cheaper(checkpoint, staged, monkeypatch):
    """Priced so that an expert over one token runs on the CPU and one over more is copied: both happen, and the
    tokens stay the resident ones."""
    path, resident, slot = checkpoint
    prices = ColdExperts("auto", cpu_seconds=lambda rows: float(rows), device_seconds=lambda rows: 1.5)
    monkeypatch.setattr(build, "cold_experts", lambda *args: prices)
    tokens, x, llm = _run(path, expert_cache_memory=4 * slot)
    assert tokens == resident
    assert x.cpu_runs > 0 and x.h2d_bytes > 0
    assert all(r.cold is prices for r in llm.parts.engine.experts.values())


def test_a_larger_host_cache_reads_less_from_disk(checkpoint, staged):
    path, resident, slot = checkpoint
    _, small, _ = _run(path, expert_cache_memory=2 * slot, cold_experts="device")
    spec, _ = load_spec(path)
    every = sum(spec.sparse(i) for i in range(spec.num_layers)) * spec.num_experts
    tokens, big, llm = _run(path, expert_cache_memory=2 * slot, expert_host_memory=every * llm_slot_cost(path))
    assert tokens == resident
    assert big.bytes_read < small.bytes_read
    assert llm.placement.experts.slots == every and llm.placement.experts.device_slots == 2


def llm_slot_cost(path) -> int:
    """One host cache slot's bytes for the model at `path` (fp32: its experts as read, aligned)."""
    spec, family = load_spec(path)
    with BufferedReader() as reader:
        _, experts = model_layouts(Checkpoint(path, reader), family, spec, split=True)
    from offload.tiers.experts.expert_cache import slot_cost
    from offload.tiers.host import HostTier

    return slot_cost(experts, HostTier(None), torch.float32)


def test_budgets_too_small_name_their_flags(checkpoint, staged):
    path, _, slot = checkpoint
    with pytest.raises(OffloadError, match=f"--expert-cache-memory of {slot - 1} bytes holds no expert on cpu"):
        LLM(path, _config(expert_cache_memory=slot - 1))
    with pytest.raises(OffloadError, match="--expert-host-memory of 100 bytes holds no expert"):
        LLM(path, _config(expert_cache_memory=2 * slot, expert_host_memory=100))


def test_auto_on_a_cpu_device_copies(checkpoint):
    """There is no link to price on a CPU device: "auto" takes the copy (a memory copy there)."""
    spec, _ = load_spec(checkpoint[0])
    assert cold_experts("auto", spec, torch.float32, CPU, 1 << 20).mode == "device"
    assert cold_experts("cpu", spec, torch.float32, CPU, 1 << 20).on_cpu(1000)
    assert not cold_experts("device", spec, torch.float32, CPU, 1 << 20).on_cpu(1)


def test_the_prices_favour_the_cpu_for_few_tokens_over_a_slow_link():
    """An expert of 3 x 4096 x 14336 bf16 weights (Mixtral 8x7B's, 352 MB) over a 25 GB/s link, a host of 100 GB/s
    and 2 TFLOP/s, a device of 3 TB/s and 700 TFLOP/s: one token reads the weights once on the host (3.5 ms)
    against a 14 ms copy; 512 tokens take 3 x 2 x 4096 x 14336 x 512 / 2e12 = 90 ms on the host."""
    spec = toy_spec(
        0,
        0,
        0,
        hidden_size=4096,
        num_heads=32,
        head_dim=128,
        moe_intermediate_size=14336,
        num_experts=8,
        experts_per_token=2,
    )
    host = ComputeUnit(memory=0, memory_bandwidth=100e9, matmul_flops={"bfloat16": 2e12})
    device = ComputeUnit(memory=0, memory_bandwidth=3e12, matmul_flops={"bfloat16": 700e12})
    nbytes = 3 * 4096 * 14336 * 2
    cpu = functools.partial(cold_expert_seconds, spec, host, "bfloat16", nbytes, link=25e9)
    copy = functools.partial(copied_expert_seconds, spec, device, "bfloat16", nbytes, link=25e9)
    assert cpu(rows=1) == pytest.approx(nbytes / 100e9 + 2 * 4096 * 2 / 25e9)
    assert copy(rows=1) == pytest.approx(nbytes / 25e9 + nbytes / 3e12)
    assert cpu(rows=1) < copy(rows=1) and cpu(rows=512) > copy(rows=512)


class _Event:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(("sync", self.name))


class _Copier(CpuCopyEngine):
    """Synchronous copies that log what they were ordered after, and hand out named events."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.log: list = []
        self.n = 0

    def copy(self, pairs, after=None):
        super().copy(pairs)
        self.n += 1
        self.log.append(("copy", getattr(after, "name", None)))
        return _Event(self.log, f"copy{self.n}")

    def wait(self, event):
        self.log.append(("wait", event.name))

    def record(self):
        self.n += 1
        return _Event(self.log, f"compute{self.n}")


def test_device_slots_copy_in_order_of_events_and_evict_only_what_the_fetch_does_not_use(tmp_path):
    from safetensors.torch import save_file

    from offload.tiers.weights.layout import group_layout

    save_file({f"e{i}": torch.full((64,), float(i)) for i in range(4)}, tmp_path / "model.safetensors")
    with BufferedReader() as reader:
        ckpt = Checkpoint(tmp_path, reader)
        layouts = {(0, i): group_layout({"w": ckpt.extent(f"e{i}")}) for i in range(4)}
    copier, tier = _Copier(), DeviceTier(None, CPU)
    slots = DeviceExperts(layouts, copier, tier, 2 * tier.footprint(256), torch.float32)
    assert slots.slots == 2 and tier.used == 2 * tier.footprint(256)
    raw = {k: torch.zeros(layouts[k].slot_bytes, dtype=torch.uint8) for k in layouts}
    for (_, i), buf in raw.items():
        at = layouts[(0, i)].tensors[0].slot_offset
        buf[at : at + 256].view(torch.float32)[:] = float(i)
    rank = lambda key: (key[1],)  # noqa: E731  lowest expert number goes first
    slots.begin()
    slots.copy_in((0, 0), raw[(0, 0)], rank)
    slots.copy_in((0, 1), raw[(0, 1)], rank)
    assert torch.equal(slots.weights((0, 1))["w"], torch.full((64,), 1.0))
    with pytest.raises(OffloadError, match="all 2 device slots for experts are in use by one fetch"):
        slots.copy_in((0, 2), raw[(0, 2)], rank)
    slots.begin()  # the last fetch's compute is recorded; its slots are overwritten only after it
    slots.use((0, 1))
    slots.copy_in((0, 3), raw[(0, 3)], rank)  # evicts (0, 0): (0, 1) is in use
    assert slots.cached() == [(0, 1), (0, 3)]
    assert copier.log[-1] == ("copy", "compute3")  # after the compute that read the evicted expert
    assert torch.equal(slots.weights((0, 3))["w"], torch.full((64,), 3.0))
    assert ("wait", "copy4") in copier.log  # compute waits for a copy when it first looks the expert up


def test_a_host_buffer_takes_no_read_before_its_copy_to_the_device_landed(checkpoint, staged):
    path, _, slot = checkpoint
    with LLM(path, _config(expert_cache_memory=2 * slot, cold_experts="device")) as llm:
        log: list = []
        entries = llm.parts.experts.cache._entries
        llm.generate_ids(_prompts()[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
        for key, entry in entries.items():
            if entry.copied is not None:
                entry.copied = _Event(log, str(key))
        evictable = [k for k, e in entries.items() if e.copied is not None]
        llm.generate_ids(_prompts()[1:], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert evictable and any(("sync", str(k)) in log for k in evictable)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cold", ["device", "cpu", "auto"])
def test_on_cuda_streamed_experts_give_the_resident_tokens(checkpoint, cold):
    """The staged path as CUDA runs it: reads into pinned host RAM, copies on the copy stream ordered by events,
    cold experts on the CPU (their tokens' rows moved there and back); float32, so the tokens match the CPU's."""
    path, resident, slot = checkpoint
    tokens, x, llm = _run(path, device="cuda", expert_cache_memory=3 * slot, cold_experts=cold)
    assert tokens == resident
    assert llm.parts.experts.slots is not None and llm.parts.experts.cache.tier is llm.parts.host_tier
    assert x.misses > 0
    if cold == "cpu":
        assert x.cpu_runs == x.hits + x.misses and x.h2d_bytes == 0
    if cold == "device":
        assert x.cpu_runs == 0 and x.h2d_bytes > 0
