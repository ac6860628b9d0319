"""Expert streaming (--expert-cache-memory): routed experts read only when chosen, through a budgeted cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.cli import _placement_table, _summary
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.common.quant import WeightQuant
from offload.convert.quantize import convert
from offload.model.expert_streaming import Gate, model_layouts
from offload.model.loader import load_spec
from offload.planner.routing import exponent, with_measured_routing
from offload.scheduler.cost.moe_cost import sparse_layers
from offload.tiers.device import DeviceTier
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import Checkpoint
from offload.tiers.weights.placement import group_cost

KV_BYTES = 1 << 22
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [[1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in (7, 15)]


def _sizes(model: Path) -> tuple[int, int, int, list[int]]:
    """(one expert's cache cost, all experts' read bytes, the embedding's and head's device cost, each layer's
    without its experts)."""
    spec, family = load_spec(model)
    with BufferedReader() as reader:
        layout, experts = model_layouts(Checkpoint(model, reader), family, spec, split=True)
    tier = DeviceTier(None, torch.device("cpu"))
    fixed = group_cost(layout.embed, torch.float32, tier) + group_cost(layout.head, torch.float32, tier)
    slot = max(tier.footprint(g.slot_bytes) for g in experts.values())
    layers = [group_cost(g, torch.float32, tier) for g in layout.layers]
    return slot, sum(g.read_bytes for g in experts.values()), fixed, layers


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    """(model dir, the resident run's tokens), fp32."""
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(path, request.param)
    with LLM(path, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, device="cpu")) as llm:
        return path, [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)]


def _config(**fields) -> EngineConfig:
    """The direct path: a CPU device, experts read in place (tests/model/test_expert_streaming_staged.py: CUDA's)."""
    return EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, io_backend="pread", device="cpu", **fields)


def test_streamed_experts_give_the_resident_tokens_reading_only_chosen_experts(checkpoint):
    path, resident = checkpoint
    slot, expert_bytes, _, _ = _sizes(path)
    with LLM(path, _config(expert_cache_memory=3 * slot)) as llm:  # fewer than a prefill chooses: fetched in batches
        assert llm.placement.experts.slots == 3
        got = [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)]
        s = llm.last_run
    assert got == resident
    x = s.experts
    assert x.misses > 0 and x.hits + x.misses > 0
    assert 0 < x.bytes_read < expert_bytes * s.steps  # unchosen experts are never read
    assert s.bytes_read >= x.bytes_read and s.bytes_per_token == s.bytes_read / s.generated_tokens
    assert x.prefetches > 0 and x.prefetch_used <= x.prefetches  # the next sparse layer's likely experts
    # how the routing met the cache is kept for the model's later plans (offload/planner/routing.py)
    measured = exponent(x.hits, x.misses, 3 / (sparse_layers(llm.spec) * llm.spec.num_experts))
    priced, said = with_measured_routing(llm.spec, path)
    assert measured is not None and said is not None and priced.expert_hit_exponent > 0


def test_router_prefetch_guesses_with_copies_of_the_next_routers_and_keeps_the_tokens(checkpoint):
    path, resident = checkpoint
    slot, *_ = _sizes(path)
    spec, _ = load_spec(path)
    with LLM(path, _config(expert_cache_memory=6 * slot)) as llm:  # router prefetch: the default
        routed = llm.parts.engine.experts
        sparse = sorted(routed)
        assert [routed[i].next_layer for i in sparse] == sparse[1:] + sparse[:1]
        assert all(routed[i].gate is not None for i in sparse[:-1]) and routed[sparse[-1]].gate is None
        gate_bytes = sum(r.gate.rows.nbytes for r in routed.values() if r.gate is not None)
        assert gate_bytes == (len(sparse) - 1) * (spec.num_experts + 1) * spec.hidden_size * 4
        assert [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)] == resident
        x = llm.last_run.experts
        llm.check_integrity()
    assert x.prefetches > 0 and 0 < x.prefetch_used <= x.prefetches


def test_frequency_prefetch_keeps_no_router_copies_and_the_tokens(checkpoint):
    path, resident = checkpoint
    slot, *_ = _sizes(path)
    with LLM(path, _config(expert_cache_memory=6 * slot, expert_prefetch="frequency")) as llm:
        assert all(r.gate is None for r in llm.parts.engine.experts.values())
        assert [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)] == resident
        assert llm.last_run.experts.prefetches > 0


def test_auto_reads_a_cpu_expert_cache_through_the_pool_where_the_probe_rated_aio_faster(checkpoint, monkeypatch):
    """aio reads directly only into memory its op page-locked: it would lock every slot of the cache at load."""
    from offload import build
    from offload.tiers.io import backends

    path, resident = checkpoint
    slot, *_ = _sizes(path)
    monkeypatch.setattr(build, "saved_read_rates", lambda: {"pread": 1.0e9, "aio": 2.0e9})
    monkeypatch.setattr(backends, "aio_ready", lambda: True)
    config = EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, device="cpu", expert_cache_memory=6 * slot)
    with LLM(path, config) as llm:  # io_backend "auto": the default
        assert llm.placement.io_backend == ("pread", "probe: aio 2.00 vs pread 1.00 GB/s, but aio would lock the "
                                            "expert cache's slots at load")  # fmt: skip
        assert [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)] == resident


def test_a_gate_guesses_each_tokens_first_choice_of_the_normalized_residual():
    g = torch.Generator().manual_seed(3)
    norm, router = torch.rand(16, generator=g) + 0.5, torch.randn(5, 16, generator=g)
    gate = Gate(torch.cat([router, norm[None]]))
    hidden = torch.randn(7, 16, generator=g)
    x = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
    first = (x @ router.T).argmax(-1).tolist()
    counts = {e: first.count(e) for e in set(first)}
    assert gate.choose(hidden, 1e-6) == sorted(counts, key=lambda e: (-counts[e], e))


def test_a_cache_holding_every_expert_reads_each_once(checkpoint):
    path, resident = checkpoint
    slot, expert_bytes, _, _ = _sizes(path)
    spec, _ = load_spec(path)
    experts = sum(spec.sparse(i) for i in range(spec.num_layers)) * spec.num_experts
    with LLM(path, _config(expert_cache_memory=experts * slot)) as llm:
        assert [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)] == resident
        x = llm.last_run.experts
        assert x.bytes_read <= expert_bytes  # nothing is evicted, so nothing is read twice
        assert x.misses + x.prefetches == len(llm.parts.experts.cache.cached())
        assert "experts    " in _summary(llm, []) and "prefetch by router:" in _summary(llm, [])
        assert f"cache of {experts} experts" in _placement_table(llm)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])  # Qwen2-MoE: its shared expert stays in the layer
def test_dense_parts_stream_too_and_the_device_budget_holds(family, tmp_path):
    make_checkpoint(tmp_path, family)
    with LLM(tmp_path, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, device="cpu")) as llm:
        resident = [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)]
    slot, _, fixed, layers = _sizes(tmp_path)
    budget = KV_BYTES + fixed + 2 * max(layers) + min(layers) // 2 + 2 * slot  # a two-slot ring: layers stream
    with LLM(tmp_path, _config(device_memory=budget, expert_cache_memory=2 * slot)) as llm:
        assert "nvme" in llm.placement.layer_tiers
        assert [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)] == resident
        llm.check_integrity()
        assert llm.placement.device_peak <= budget


def test_a_cache_smaller_than_one_expert_names_the_flag(checkpoint):
    path, _ = checkpoint
    slot, *_ = _sizes(path)
    with pytest.raises(OffloadError, match=f"--expert-cache-memory of {slot - 1} bytes holds no expert"):
        LLM(path, _config(expert_cache_memory=slot - 1))


def test_a_dense_model_has_no_experts_to_stream(tiny_llama):
    with pytest.raises(OffloadError, match="--expert-cache-memory streams a mixture's experts"):
        LLM(tiny_llama, _config(expert_cache_memory=1 << 20))


def test_quantized_experts_stream_with_their_scales(tmp_path):
    """int8 experts ("*.qweight" codes and "*.scales") stream as a group each and compute the resident tokens."""
    make_checkpoint(tmp_path / "float", "qwen2_moe")
    convert(tmp_path / "float", tmp_path / "int8", WeightQuant(8, 0, "cpu"))
    model = tmp_path / "int8"
    with LLM(model, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, device="cpu")) as llm:
        resident = [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)]
    with LLM(model, _config(expert_cache_memory=1 << 20)) as llm:
        assert sorted(llm.parts.experts.cache.layouts[(0, 0)].views(torch.zeros(1 << 20, dtype=torch.uint8))) == [
            "down_proj",
            "down_proj.scales",
            "gate_proj",
            "gate_proj.scales",
            "up_proj",
            "up_proj.scales",
        ]
        assert [c.token_ids for c in llm.generate_ids(_prompts(), PARAMS)] == resident
        assert llm.last_run.experts.misses > 0
