"""Prefix reuse end to end: hits give the tokens misses give (greedy and seeded sampling), compute fewer prefill
tokens, and survive the trip through host RAM under a budget that evicts them from the device."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams

SYSTEM = list(range(3, 3 + 45))  # a shared "system prompt" of 45 token ids (11 blocks of 4, and one token)
QUESTIONS = [[100 + i, 50 + 3 * i, 7 + i] for i in range(6)]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix")
    make_checkpoint(path, "llama", dtype=request.param)
    return path


def run(model_dir, prompts, params, **config):
    with LLM(model_dir, EngineConfig(block_size=4, **{"kv_cache_bytes": 1 << 22} | config)) as llm:
        out = [c.token_ids for c in llm.generate_ids(prompts, params)]
        return out, llm.last_run


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_hits_give_the_tokens_misses_give(model_dir, params) -> None:
    prompts = [SYSTEM + q for q in QUESTIONS]
    cold, cold_stats = run(model_dir, prompts, params, prefix_cache=False)
    warm, warm_stats = run(model_dir, prompts, params)
    assert warm == cold
    assert cold_stats.prefix_hit_tokens == 0 and cold_stats.prefill_tokens == sum(map(len, prompts))
    # the first prompt computes the system prompt; the five others share its 11 full blocks
    assert warm_stats.prefix_hit_tokens == 5 * 44
    assert warm_stats.prefill_tokens == cold_stats.prefill_tokens - 5 * 44
    assert warm_stats.prefix_hit_rate == pytest.approx(5 * 44 / sum(map(len, prompts)))


def test_a_second_call_reuses_the_first_calls_blocks(model_dir) -> None:
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as llm:
        first = llm.generate_ids([SYSTEM + QUESTIONS[0]], GREEDY)
        again = llm.generate_ids([SYSTEM + QUESTIONS[0]], GREEDY)
        assert again[0].token_ids == first[0].token_ids
        assert llm.last_run.prefix_hit_tokens == 44 and llm.last_run.prefill_tokens == 4
        llm.reset_prefix_cache()
        third = llm.generate_ids([SYSTEM + QUESTIONS[0]], GREEDY)
        assert third[0].token_ids == first[0].token_ids and llm.last_run.prefix_hit_tokens == 0


def test_evicted_prefixes_come_back_from_host_ram(model_dir) -> None:
    # a device cache of 20 blocks: the 16 distinct prompts below push the system prompt's blocks out of it
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        per_block = probe.placement.kv_block_bytes
    small = dict(kv_cache_bytes=20 * per_block, max_num_seqs=2)
    fillers = [[200 + 5 * i + j for j in range(30)] for i in range(8)]
    prompts = [SYSTEM + QUESTIONS[0], *fillers, SYSTEM + QUESTIONS[1]]
    with LLM(model_dir, EngineConfig(block_size=4, prefix_cache=False, **small)) as llm:
        expected = [llm.generate_ids([p], GREEDY)[0].token_ids for p in prompts]
    host = 128 * per_block  # room for every full block of the run
    with LLM(model_dir, EngineConfig(block_size=4, kv_host_memory=host, **small)) as llm:
        got = [llm.generate_ids([p], GREEDY)[0].token_ids for p in prompts]  # one at a time: the order is fixed
        last = llm.last_run
        moved = llm.stats().kv_tiers
        assert llm.stats().kv_host.peak <= host
    assert got == expected
    assert last.prefix_hit_tokens == 44 and last.kv_bytes_up == 11 * per_block  # all 11 blocks from host RAM
    assert moved.promoted_host == 11 and moved.demoted_host >= 11 and moved.dropped == 0


def test_without_host_ram_evicted_prefixes_are_recomputed(model_dir) -> None:
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        per_block = probe.placement.kv_block_bytes
    small = dict(kv_cache_bytes=20 * per_block, max_num_seqs=2)
    fillers = [[200 + 5 * i + j for j in range(30)] for i in range(8)]
    with LLM(model_dir, EngineConfig(block_size=4, **small)) as llm:
        for p in [SYSTEM + QUESTIONS[0], *fillers]:
            llm.generate_ids([p], GREEDY)
        llm.generate_ids([SYSTEM + QUESTIONS[1]], GREEDY)
        assert llm.last_run.prefix_hit_tokens == 0 and llm.last_run.prefill_tokens == 48


def disk_config(tmp_path, per_block: int, blocks: int = 64) -> dict:
    """--offload-dir and a --kv-disk-memory of `blocks` block files (a 4 KiB header, the row padded to 4 KiB)."""
    return dict(offload_dir=str(tmp_path), kv_disk_memory=blocks * (4096 + -(-per_block // 4096) * 4096))


def test_a_restarted_engine_starts_warm_from_disk(model_dir, tmp_path) -> None:
    prompts = [SYSTEM + QUESTIONS[0]]
    expected, _ = run(model_dir, prompts, GREEDY, prefix_cache=False)
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        per_block = probe.placement.kv_block_bytes
    config = disk_config(tmp_path, per_block)
    first, first_stats = run(model_dir, prompts, GREEDY, **config)  # writes its blocks through to disk, then exits
    again, stats = run(model_dir, [SYSTEM + QUESTIONS[0]], GREEDY, **config)
    assert first == again == expected
    assert first_stats.prefix_hit_tokens == 0
    assert stats.prefix_hit_tokens == 44 and stats.prefill_tokens == 4 and stats.kv_bytes_up == 11 * per_block
    files = list((tmp_path / "kv").glob("*.kv"))
    assert len(files) >= 11


def test_the_last_steps_blocks_reach_the_disk_at_close(model_dir, tmp_path) -> None:
    """A request that finishes in its prompt's step: its blocks are registered after the step and written through
    when the engine closes, not only at a next step that never comes."""
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        per_block = probe.placement.kv_block_bytes
    config = disk_config(tmp_path, per_block)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    run(model_dir, [SYSTEM + QUESTIONS[0]], one, **config)
    _, stats = run(model_dir, [SYSTEM + QUESTIONS[1]], one, **config)
    assert stats.prefix_hit_tokens == 44 and stats.kv_bytes_up == 11 * per_block


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "foreign"])
def test_a_damaged_disk_block_is_dropped_and_recomputed(model_dir, tmp_path, damage) -> None:
    prompts = [SYSTEM + QUESTIONS[0]]
    expected, _ = run(model_dir, prompts, GREEDY, prefix_cache=False)
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        per_block = probe.placement.kv_block_bytes
        keys = probe.prefix_keys(SYSTEM + QUESTIONS[0])
    config = disk_config(tmp_path, per_block)
    run(model_dir, prompts, GREEDY, **config)
    folder = tmp_path / "kv"
    victim = next(folder.glob(f"{keys[3].hex()}.*.kv"))  # the fourth block of the system prompt
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[4096 + 100] ^= 0x40
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:5000])
    elif damage == "swap":  # another block's file under this block's name
        other = next(folder.glob(f"{keys[5].hex()}.*.kv"))
        victim.write_bytes(other.read_bytes())
    else:  # a block of another model (other weights: another key) copied in under this name
        other_dir = tmp_path / "other"
        make_checkpoint(other_dir, "llama", seed=1)
        other_run = tmp_path / "other-run"
        run(other_dir, prompts, GREEDY, **disk_config(other_run, per_block))
        victim.write_bytes(next((other_run / "kv").glob("*.kv")).read_bytes())
    got, stats = run(model_dir, prompts, GREEDY, **config)
    assert got == expected  # never a wrong token from a bad block
    assert stats.prefix_hit_tokens == 3 * 4  # the three blocks before the damaged one still serve
    assert stats.prefill_tokens == len(prompts[0]) - 12


def test_the_disk_budget_holds(model_dir, tmp_path) -> None:
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        per_block = probe.placement.kv_block_bytes
    config = disk_config(tmp_path, per_block, blocks=6)
    prompts = [[200 + 7 * i + j for j in range(30)] for i in range(4)]
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, **config)) as llm:
        llm.generate_ids(prompts, GREEDY)
        assert llm.stats().kv_disk.peak <= config["kv_disk_memory"]
    files = list((tmp_path / "kv").glob("*.kv"))  # closed: every block written through has landed
    assert 0 < len(files) <= 6 and sum(f.stat().st_size for f in files) <= config["kv_disk_memory"]
