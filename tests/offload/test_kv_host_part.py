"""KV of running sequences in host RAM: sequences admitted when the device part of the pool is full keep their KV in
the host part and attend there; their tokens equal an all-device run's, and neither part exceeds its budget."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import offload.planner.host_attention_prices as planner_host_attention
from offload.api import LLM
from offload.cli import _summary
from offload.common.config import EngineConfig, SamplingParams
from offload.kernels.kv_quant import KVQuantFormat
from offload.kernels.paged_batch import PagedBatch
from offload.model.host_attention import HostAttention, staging
from offload.model.loader import load_spec
from offload.planner.host_attention_prices import choose_host_attention
from offload.scheduler.kv_prices import KVPrices
from offload.tiers.kv.kv_cache import QuantizedKV

HARDWARE = Path(__file__).resolve().parents[2] / "configs" / "hardware"

PROMPTS = [[3 + (7 * i + j) % 250 for j in range(10 + 3 * i)] for i in range(8)]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def per_block(tiny_llama) -> int:
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 20)) as llm:
        return llm.placement.kv_block_bytes


@pytest.fixture(scope="module")
def all_device(tiny_llama):
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, prefix_cache=False)) as llm:
        return [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_sequences_past_the_device_budget_run_from_host_ram(
    tiny_llama, per_block, all_device, kv_dtype, monkeypatch
) -> None:
    # moving pays: the tiny checkpoint prefills so fast that, at the rates measured as it runs, recomputing a
    # sequence can price out its move on one run and not on the next (scheduler/kv_prices.py has its own tests)
    monkeypatch.setattr(KVPrices, "swap_pays", lambda self, blocks, tokens: True)
    device_blocks = 12  # the whole batch needs about 90 blocks at its peak
    config = EngineConfig(
        block_size=4, kv_cache_bytes=device_blocks * per_block, kv_host_memory=200 * per_block, kv_dtype=kv_dtype
    )
    with LLM(tiny_llama, config) as llm:
        out = llm.generate_ids(PROMPTS, GREEDY)
        host = llm.stats().kv_host
        llm.check_integrity()  # the host part's tables too
        assert host.blocks_used == 0  # every host block back (or cached)
        stats = llm.last_run
    assert stats.preemptions == 0  # the host part held what the device part could not
    assert host.peak <= host.budget
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
        stats, counters = llm.last_run, llm.stats().kv_tiers
        llm.check_integrity()  # the host part's tables too
        host = llm.stats().kv_host
        assert host.peak <= host.budget
    assert stats.moved_up > 0 and counters.bytes_up > 0 and stats.preemptions == 0
    assert got == want


@pytest.mark.parametrize("copying_pays", [True, False])
def test_a_sequence_that_cannot_grow_moves_down_or_is_recomputed_by_price(
    tiny_llama, per_block, all_device, monkeypatch, copying_pays
) -> None:
    """A device sequence that cannot grow moves to host RAM while copying its blocks is priced below computing its
    tokens again (KVPrices.swap_pays), and is preempted otherwise; the tokens are the all-device run's either way."""
    from offload.scheduler.kv_prices import KVPrices

    monkeypatch.setattr(KVPrices, "swap_pays", lambda self, blocks, tokens: copying_pays)
    config = EngineConfig(block_size=4, kv_cache_bytes=40 * per_block, kv_host_memory=200 * per_block)
    with LLM(tiny_llama, config) as llm:
        got = [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]
        stats, priced_out = llm.last_run, llm.core.batcher.num_priced_out
    assert got == all_device
    if copying_pays:
        assert stats.moved_down > 0 and stats.preemptions == 0 and priced_out == 0
    else:
        assert stats.moved_down == 0 and stats.preemptions == priced_out > 0


def test_without_a_host_part_the_same_budget_preempts(tiny_llama, per_block, all_device) -> None:
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=12 * per_block)) as llm:
        out = llm.generate_ids(PROMPTS, GREEDY)
        assert llm.last_run.preemptions > 0
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
        hits = llm.stats().kv_host.hit_tokens
        # the run's statistics count both parts' admissions
        assert llm.last_run.preemptions == 0 and llm.last_run.prefix_lookup_tokens == sum(map(len, prompts))
        assert llm.last_run.prefix_hit_tokens >= hits
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
        assert llm.stats().kv_host.pinned and llm.placement.device.startswith("cuda")
        assert llm.last_run.preemptions == 0
    assert got == want


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_host_micro_batches_staged_to_the_device_give_the_same_tokens(
    tiny_llama, per_block, kv_dtype, monkeypatch
) -> None:
    """--host-kv-attention device: the host part's micro-batches attend over their blocks gathered into a compact
    cache (a quantized cache's records as stored), renumbered; forced here on the CPU, where the copy is in RAM."""
    # moving pays, as in the test above: at the tiny checkpoint's measured rates a move can price out on one run
    monkeypatch.setattr(KVPrices, "swap_pays", lambda self, blocks, tokens: True)
    want_config = EngineConfig(block_size=4, kv_cache_bytes=1 << 22, prefix_cache=False, kv_dtype=kv_dtype)
    with LLM(tiny_llama, want_config) as llm:
        want = [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]
    config = EngineConfig(
        block_size=4,
        kv_cache_bytes=12 * per_block,
        kv_host_memory=200 * per_block,
        kv_dtype=kv_dtype,
        host_kv_attention="device",
    )
    with LLM(tiny_llama, config) as llm:
        got = [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]
        staged = llm.stats().kv_host.staged_micro_batches
        assert staged > 0 and llm.last_run.preemptions == 0
        assert f"attended on cpu {staged} times (--host-kv-attention device)" in _summary(llm, [])
    assert got == want
    with LLM(tiny_llama, dataclasses.replace(config, host_kv_attention="auto")) as llm:
        assert llm.placement.host_kv_attention is None  # a CPU device: the host part is where the compute is


def test_staging_renumbers_the_blocks_each_sequence_reads_once_each() -> None:
    cache = torch.arange(10 * 2 * 1 * 3, dtype=torch.float32).view(10, 2, 1, 3)  # 10 blocks of 2 tokens
    tables = [[7, 2, 5], [7, 4]]  # a shared first block; the first sequence's context ends in block 2
    batch = PagedBatch((0, 1, 3), (5, 3), torch.tensor([[7, 2, 5], [7, 4, 0]]), torch.tensor([9, 8, 9]))
    s = staging(tables, (5, 3), batch, 2, torch.device("cpu"), torch.device("cpu"))
    assert s.blocks.tolist() == [7, 2, 5, 4]
    assert s.batch.block_tables.tolist() == [[0, 1, 2], [0, 3, 0]]
    assert torch.equal(s.gather(cache, torch.device("cpu")), cache[[7, 2, 5, 4]])
    fmt = KVQuantFormat("int8", 3, 32)
    quantized = QuantizedKV(
        torch.arange(10 * 2 * 1 * fmt.record_bytes).to(torch.uint8).view(10, 2, 1, -1), fmt, torch.float32
    )
    staged = s.gather(quantized, torch.device("cpu"))
    assert isinstance(staged, QuantizedKV) and torch.equal(staged.records, quantized.records[[7, 2, 5, 4]])


def test_auto_stages_prompt_chunks_and_keeps_decode_on_the_cpu_by_price_or_by_rule(tmp_path, monkeypatch) -> None:
    rule = HostAttention("auto")
    assert rule.stage(queries=64, seqs=2, context=200) and not rule.stage(queries=2, seqs=2, context=4000)
    assert HostAttention("device").stage(1, 1, 10) and not HostAttention("cpu").stage(512, 1, 512)
    priced = HostAttention("auto", cpu_seconds=lambda q, s, c: 1.0, device_seconds=lambda q, s, c: q / 100)
    assert priced.stage(50, 1, 50) and not priced.stage(200, 1, 200)


def test_the_prices_from_a_saved_cuda_profile(tiny_llama, tmp_path, monkeypatch) -> None:
    """With an A100 profile saved as this machine's, a whole 2,048-token prompt attends on the GPU (compute: 0.6
    TFLOP/s on its host); a decode query over a long context crosses the 24 GB/s link faster than the host's 30 GB/s
    memory reads it three times, so it is staged too, but not over a 3 GB/s link."""
    spec, _ = load_spec(tiny_llama)
    spec = dataclasses.replace(spec, num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096)
    cuda = torch.device("cuda")  # only priced: nothing is allocated there
    saved = tmp_path / "local.json"
    monkeypatch.setattr(planner_host_attention, "local_profile_path", lambda: saved)
    assert choose_host_attention("auto", spec, torch.bfloat16, cuda, "auto", 16) == HostAttention("auto")
    assert choose_host_attention("cpu", spec, torch.bfloat16, torch.device("cpu"), "auto", 16) is None
    profile = json.loads((HARDWARE / "a100-80gb.json").read_text())
    for link, decode_staged in ((24, True), (3, False)):
        profile["links"]["host_to_device_gbps"] = link
        saved.write_text(json.dumps(profile))
        priced = choose_host_attention("auto", spec, torch.bfloat16, cuda, "auto", 16)
        assert priced.mode == "auto" and priced.cpu_seconds is not None
        assert priced.stage(queries=2048, seqs=1, context=2048)
        assert priced.stage(queries=8, seqs=8, context=8 * 4096) == decode_staged


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("where", ["device", "auto"])
def test_cuda_host_micro_batches_staged_to_the_gpu_match_the_device(tiny_llama, per_block, where) -> None:
    """On CUDA with --host-kv-attention device (every host micro-batch) or auto (its prompt chunks, without a saved
    profile): the blocks copied to the GPU each layer give the tokens of a run with every sequence's KV there."""
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, device="cuda", prefix_cache=False)) as llm:
        want = [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]
    config = EngineConfig(
        block_size=4,
        kv_cache_bytes=12 * per_block,
        kv_host_memory=200 * per_block,
        device="cuda",
        host_kv_attention=where,
    )
    with LLM(tiny_llama, config) as llm:
        got = [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]
        assert llm.stats().kv_host.staged_micro_batches > 0
    assert got == want
