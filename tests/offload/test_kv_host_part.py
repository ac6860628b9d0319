"""KV of running sequences in host RAM: sequences admitted when the device part of the pool is full keep their KV in
the host part and attend there; their tokens equal an all-device run's, and neither part exceeds its budget."""

from __future__ import annotations

import pytest
import torch

from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams

PROMPTS = [[3 + (7 * i + j) % 250 for j in range(10 + 3 * i)] for i in range(8)]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def per_block(tiny_llama) -> int:
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 20)) as llm:
        return llm.kv.bytes_per_block


@pytest.fixture(scope="module")
def all_device(tiny_llama):
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, prefix_cache=False)) as llm:
        return [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_sequences_past_the_device_budget_run_from_host_ram(tiny_llama, per_block, all_device, kv_dtype) -> None:
    device_blocks = 12  # the whole batch needs about 90 blocks at its peak
    config = EngineConfig(
        block_size=4, kv_cache_bytes=device_blocks * per_block, kv_host_memory=200 * per_block, kv_dtype=kv_dtype
    )
    with LLM(tiny_llama, config) as llm:
        out = llm.generate_ids(PROMPTS, GREEDY)
        host_peak, host_budget = llm.kv_tiers.host.peak, llm.kv_tiers.host.capacity
        llm.tables.check_integrity()
        llm.host_tables.check_integrity()
        assert llm.host_tables.pool.num_free == llm.kv_tiers.host_slots  # every host block back (or cached)
        stats = llm.stats
    assert stats.preemptions == 0  # the host part held what the device part could not
    assert host_peak <= host_budget
    if kv_dtype == "auto":
        assert [c.token_ids for c in out] == all_device
    else:  # int8: the same tokens as int8 on the device alone (the tiny checkpoint's near-ties are int8's, not host's)
        with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, kv_dtype="int8")) as llm:
            assert [c.token_ids for c in out] == [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]


def test_host_sequences_move_back_up_when_the_device_part_frees(tiny_llama, per_block) -> None:
    """Short requests finish early and free the device part; the sequences that ran from host RAM move back up
    (their blocks copied before the next step) and give the all-device tokens."""
    params = [SamplingParams(max_new_tokens=4 if i < 4 else 24, ignore_eos=True) for i in range(len(PROMPTS))]
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, prefix_cache=False)) as llm:
        want = [c.token_ids for c in llm.generate_ids(PROMPTS, params)]
    config = EngineConfig(block_size=4, kv_cache_bytes=40 * per_block, kv_host_memory=200 * per_block)
    with LLM(tiny_llama, config) as llm:
        got = [c.token_ids for c in llm.generate_ids(PROMPTS, params)]
        stats, counters = llm.stats, llm.kv_tiers.counters
        llm.tables.check_integrity()
        llm.host_tables.check_integrity()
        assert llm.kv_tiers.host.peak <= llm.kv_tiers.host.capacity
    assert stats.moved_up > 0 and counters.bytes_up > 0 and stats.preemptions == 0
    assert got == want


def test_without_a_host_part_the_same_budget_preempts(tiny_llama, per_block, all_device) -> None:
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=12 * per_block)) as llm:
        out = llm.generate_ids(PROMPTS, GREEDY)
        assert llm.stats.preemptions > 0
    assert [c.token_ids for c in out] == all_device


def test_host_resident_sequences_share_prefixes_in_host_ram(tiny_llama, per_block) -> None:
    shared = list(range(3, 3 + 24))  # six full blocks
    prompts = [shared + [200 + i, 201 + i] for i in range(6)]
    # the device part holds one sequence; a step admits one prompt (32 tokens), so each later one finds the
    # prefix its predecessors left in the host part
    config = EngineConfig(
        block_size=4, kv_cache_bytes=8 * per_block, kv_host_memory=200 * per_block, max_step_tokens=32
    )
    with LLM(tiny_llama, config) as llm:
        out = llm.generate_ids(prompts, GREEDY)
        hits = llm.host_tables.counters.hit_tokens
        # the run's statistics count both parts' admissions
        assert llm.stats.preemptions == 0 and llm.stats.prefix_lookup_tokens == sum(map(len, prompts))
        assert llm.stats.prefix_hit_tokens >= hits
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, prefix_cache=False)) as llm:
        assert [c.token_ids for c in out] == [c.token_ids for c in llm.generate_ids(prompts, GREEDY)]
    assert hits >= 2 * 24  # host-resident sequences admitted after the first share its six blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sequences_in_host_ram_attend_on_the_cpu_and_match_the_device(tiny_llama, per_block) -> None:
    """On CUDA the host part's sequences attend on the CPU (the query moves, not the cache): same greedy tokens as a
    run with every sequence's KV on the GPU, and the host cache is pinned."""
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, device="cuda", prefix_cache=False)) as llm:
        want = [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]
    config = EngineConfig(block_size=4, kv_cache_bytes=12 * per_block, kv_host_memory=200 * per_block, device="cuda")
    with LLM(tiny_llama, config) as llm:
        got = [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]
        assert llm.kv_tiers.host_kv.storage.is_pinned() and llm.kv.storage.is_cuda
        assert llm.stats.preemptions == 0
    assert got == want
