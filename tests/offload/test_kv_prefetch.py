"""Cached KV blocks read from disk while a step computes, ahead of the admission that takes them (--no-kv-prefetch
turns it off): the tokens are those of a run that computes everything, the blocks come from the read-ahead, and a
damaged block read ahead is recomputed, never used."""

from __future__ import annotations

import pytest

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.tiers.kv.disk_threads import ReadAhead

SYSTEMS = [list(range(3 + 50 * s, 3 + 50 * s + 45)) for s in range(3)]  # three 45-token prefixes: 11 full blocks each
PROMPTS = [system + [200 + s, 7] for s, system in enumerate(SYSTEMS)]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefetch")
    make_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def expected(model_dir):
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, prefix_cache=False)) as llm:
        return [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]


@pytest.fixture
def synchronous_reads(monkeypatch):
    """Each read-ahead finishes before the scheduler goes on, so what lands when does not depend on timing."""
    ask = ReadAhead.ask

    def ask_and_wait(self, keys):
        ask(self, keys)
        self.wait()

    monkeypatch.setattr(ReadAhead, "ask", ask_and_wait)


def warm_disk(model_dir, folder) -> dict:
    """A --kv-disk-memory in `folder` holding every full block of PROMPTS (written by an engine that then exits)."""
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        per_block = probe.placement.kv_block_bytes
    config = dict(offload_dir=str(folder), kv_disk_memory=64 * (4096 + -(-per_block // 4096) * 4096))
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, **config)) as llm:
        llm.generate_ids(PROMPTS, GREEDY)
    return config


def run_one_at_a_time(model_dir, config, **more):
    """PROMPTS in one call, one request running at a time: the others wait while its steps compute."""
    engine = EngineConfig(block_size=4, kv_cache_bytes=1 << 22, max_num_seqs=1, **config, **more)
    with LLM(model_dir, engine) as llm:
        got = [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]
        return got, llm.last_run, llm.stats().kv_tiers


def test_waiting_requests_find_their_blocks_read_ahead(model_dir, tmp_path, expected, synchronous_reads) -> None:
    config = warm_disk(model_dir, tmp_path)
    got, stats, moved = run_one_at_a_time(model_dir, config)
    assert got == expected
    assert stats.prefix_hit_tokens == 3 * 44 and stats.prefill_tokens == 3 * 3
    # the first request is admitted before any step (read at admission); the two waiting behind it, ahead
    assert stats.kv_blocks_prefetched == moved.prefetched == 22 and moved.promoted_disk == 33
    assert moved.prefetch_dropped == 0


def test_without_prefetch_every_block_is_read_at_admission(model_dir, tmp_path, expected, synchronous_reads) -> None:
    config = warm_disk(model_dir, tmp_path)
    got, stats, moved = run_one_at_a_time(model_dir, config, kv_prefetch=False)
    assert got == expected
    assert stats.prefix_hit_tokens == 3 * 44 and stats.kv_blocks_prefetched == 0 and moved.promoted_disk == 33


def test_read_ahead_into_host_ram_gives_the_same_tokens(model_dir, tmp_path, expected, synchronous_reads) -> None:
    config = warm_disk(model_dir, tmp_path)
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        host = 64 * probe.placement.kv_block_bytes
    got, stats, moved = run_one_at_a_time(model_dir, config, kv_host_memory=host)
    assert got == expected
    assert stats.prefix_hit_tokens == 3 * 44
    assert moved.prefetched == 22 and moved.promoted_host == 22  # landed in host RAM, copied up at admission


def test_read_ahead_on_its_own_clock_gives_the_same_tokens(model_dir, tmp_path, expected) -> None:
    config = warm_disk(model_dir, tmp_path)
    got, stats, moved = run_one_at_a_time(model_dir, config)
    assert got == expected
    assert stats.prefix_hit_tokens == 3 * 44  # each block either read ahead or read at admission, never both
    assert moved.promoted_disk == 33 and stats.kv_blocks_prefetched <= 22


def test_a_damaged_block_read_ahead_is_recomputed(model_dir, tmp_path, expected, synchronous_reads) -> None:
    config = warm_disk(model_dir, tmp_path)
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as probe:
        keys = probe.prefix_keys(PROMPTS[1])
    victim = next((tmp_path / "kv").glob(f"{keys[3].hex()}.*.kv"))  # the second request's fourth block
    data = bytearray(victim.read_bytes())
    data[4096 + 100] ^= 0x40
    victim.write_bytes(bytes(data))
    got, stats, moved = run_one_at_a_time(model_dir, config)
    assert got == expected  # never a wrong token from a bad block
    assert stats.prefix_hit_tokens == 44 + 3 * 4 + 44  # the second request reuses the three blocks before the bad one
    # read ahead: the second request's blocks but the bad one (those after it landed, and were left unused); then,
    # its cached prefix now the shorter, the third's, admitted before it
    assert moved.prefetched == 10 + 11 and moved.promoted_disk == 11 + 21
