"""Weight streaming: placement from budgets, the prefetch ring, byte accounting, and failure modes."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.config import EngineConfig, SamplingParams
from offload.errors import OffloadError
from tiers.weights import group_cost

KV = 1 << 20
LAYERS = 6
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 17], [1, 44, 45, 46, 47, 48, 49, 50, 51]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama", num_hidden_layers=LAYERS)
    return path


@pytest.fixture(scope="module")
def resident(model_dir):
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV))
    return llm, [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)]


def costs(llm: LLM) -> tuple[int, int]:
    """(embed + head, one layer) device bytes for this checkpoint."""
    layout, tier = llm_layout(llm), llm.device_tier
    fixed = group_cost(layout.embed, llm.dtype, tier) + group_cost(layout.head, llm.dtype, tier)
    return fixed, group_cost(layout.layers[0], llm.dtype, tier)


def llm_layout(llm: LLM):
    from offload.model.checkpoint import Checkpoint
    from tiers.io.pread import PreadReader
    from tiers.weights import model_layout

    with PreadReader() as reader:
        return model_layout(Checkpoint(llm.model_dir, reader), llm.family, llm.spec)


def budget_for(resident_llm: LLM, resident_layers: int, ring: int = 3) -> int:
    fixed, layer = costs(resident_llm)
    return KV + fixed + (ring + resident_layers) * layer


def test_no_budget_keeps_every_layer_resident(resident):
    llm, _ = resident
    assert llm.policy.layer_tiers == ("device",) * LAYERS
    assert llm.policy.ring_slots == 0


@pytest.mark.parametrize("resident_layers", [0, 1])
def test_streamed_layers_give_the_same_tokens(model_dir, resident, resident_layers):
    base, expected = resident
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=budget_for(base, resident_layers)))
    assert llm.policy.layer_tiers == ("device",) * resident_layers + ("nvme",) * (LAYERS - resident_layers)
    got = [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)]
    assert got == expected
    llm.weights.close()  # let the reads in flight land, so the byte count is final
    layout = llm_layout(llm)
    loaded = (
        layout.embed.read_bytes + layout.head.read_bytes + sum(g.read_bytes for g in layout.layers[:resident_layers])
    )
    streamed = [g.read_bytes for g in layout.layers[resident_layers:]]
    assert llm.weights.stats.streamed_bytes_per_pass == sum(streamed)
    # every step streams each nvme layer once, and the ring has read its 3 slots ahead into the next step
    expected_bytes = loaded + llm.stats.steps * sum(streamed) + sum(streamed[:3])
    # aligned spans count in full, except those that reach into the file's last, partial page
    assert 0 <= expected_bytes - llm.weights.stats.bytes_read < 3 * 4096
    assert llm.device_tier.peak <= llm.device_tier.capacity
    llm.device_tier.check_integrity()


def test_resident_layers_are_never_reread(model_dir, resident):
    base, _ = resident
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=budget_for(base, LAYERS) + 10**6))
    assert llm.policy.ring_slots == 0
    loaded = llm.weights.stats.bytes_read
    llm.generate_ids(PROMPTS, PARAMS)
    assert llm.weights.stats.bytes_read == loaded


def test_host_tier_holds_layers_read_once(model_dir, resident):
    base, expected = resident
    _, layer = costs(base)
    config = EngineConfig(kv_cache_bytes=KV, device_memory=budget_for(base, 0), host_memory=2 * layer)
    llm = LLM(model_dir, config)
    assert llm.policy.layer_tiers == ("host", "host") + ("nvme",) * (LAYERS - 2)
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    assert llm.host_tier.peak <= 2 * layer


def test_budget_smaller_than_the_ring_is_a_clear_error(model_dir, resident):
    base, _ = resident
    fixed, layer = costs(base)
    with pytest.raises(OffloadError, match="--device-memory is too small.*3 layer buffers"):
        LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=KV + fixed + layer))


def test_kv_cache_larger_than_the_device_budget(model_dir):
    with pytest.raises(OffloadError, match="--kv-cache-memory"):
        LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=KV // 2))


def test_checkpoint_changing_size_during_a_run(tmp_path, resident):
    base, _ = resident
    make_checkpoint(tmp_path, "llama", num_hidden_layers=LAYERS)
    llm = LLM(tmp_path, EngineConfig(kv_cache_bytes=KV, device_memory=budget_for(base, 0)))
    with open(tmp_path / "model.safetensors", "ab") as f:
        f.write(b"\0" * 100)
    with pytest.raises(OffloadError, match="model.safetensors: changed size during the run"):
        for _ in range(3):  # the ring has read ahead; the change shows at the next read
            llm.generate_ids(PROMPTS, PARAMS)


def test_out_of_order_access_restarts_the_ring(model_dir, resident):
    base, _ = resident
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=budget_for(base, 0)))
    first = {k: v.clone() for k, v in llm.weights.acquire(0).items()}
    llm.weights.release(0)
    again = llm.weights.acquire(2)  # skips layer 1: the ring drains and restarts at 2
    llm.weights.release(2)
    layer0 = llm.weights.acquire(0)
    assert all(torch.equal(first[k], layer0[k]) for k in first)
    assert set(again) == set(first)
    llm.weights.release(0)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="needs O_DIRECT")
def test_streaming_reads_bypass_the_page_cache(model_dir, resident):
    base, _ = resident
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=budget_for(base, 0)))
    path = model_dir / "model.safetensors"
    assert llm.backend.is_direct(path)  # pytest's tmp_path is on the machine's disk (ext4 here)


def test_close_waits_for_reads_in_flight_and_closes_files(model_dir, resident):
    base, _ = resident
    with LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device_memory=budget_for(base, 0))) as llm:
        llm.generate_ids(PROMPTS[:1], PARAMS)
    assert not llm.weights._in_flight
    assert not llm.backend._files
