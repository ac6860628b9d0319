"""ExpertCache: exact hits, misses, eviction order (least frequently selected, then by the layer cycle), prefetch
and guesses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from offload.common.errors import OffloadError
from offload.tiers.device import DeviceTier
from offload.tiers.experts.expert_cache import ExpertCache
from offload.tiers.io.backends import make_backend
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import Checkpoint
from offload.tiers.weights.layout import group_layout

LAYERS, EXPERTS = 2, 4
SHAPES = {"gate_proj": (8, 128), "up_proj": (8, 128), "down_proj": (128, 8)}  # 4 KiB each in float32


def _value(layer: int, expert: int, m: str, dtype: torch.dtype) -> torch.Tensor:
    base = 100 * layer + 10 * expert + list(SHAPES).index(m)
    return (torch.arange(1024, dtype=torch.float32).reshape(SHAPES[m]) / 1024 + base).to(dtype)


def _layouts(path: Path, dtype: torch.dtype = torch.float32):
    tensors = {
        f"layers.{i}.experts.{e}.{m}": _value(i, e, m, dtype)
        for i in range(LAYERS)
        for e in range(EXPERTS)
        for m in SHAPES
    }
    save_file(tensors, path / "model.safetensors")
    with BufferedReader() as reader:
        ckpt = Checkpoint(path, reader)
        return {
            (i, e): group_layout({m: ckpt.extent(f"layers.{i}.experts.{e}.{m}") for m in SHAPES})
            for i in range(LAYERS)
            for e in range(EXPERTS)
        }


@pytest.fixture
def make_cache(tmp_path):
    backend = make_backend("pread", threads=2)
    layouts = _layouts(tmp_path)
    slot = DeviceTier(None, torch.device("cpu")).footprint(max(g.slot_bytes for g in layouts.values()))

    def make(slots: int, spare: int = 0) -> ExpertCache:
        tier = DeviceTier(slots * slot + spare, torch.device("cpu"))
        return ExpertCache(layouts, backend, tier, slots * slot + spare, torch.float32)

    yield make
    backend.close()


def _check(cache: ExpertCache, layer: int, got: dict) -> None:
    for e, w in got.items():
        for m in SHAPES:
            torch.testing.assert_close(w[m], _value(layer, e, m, torch.float32), rtol=0, atol=0)


def test_eviction_is_least_frequently_selected_then_the_layer_that_comes_back_last(make_cache):
    cache = make_cache(3)
    assert cache.slots == 3
    _check(cache, 0, cache.fetch(0, [0, 1]))  # misses 0, 1
    _check(cache, 0, cache.fetch(0, [1, 2]))  # hit 1, miss 2; selected: 0 once, 1 twice, 2 once
    assert cache.cached() == [(0, 0), (0, 1), (0, 2)]
    _check(cache, 0, cache.fetch(0, [3]))  # 0 and 2 were selected once, in the same layer: the lower goes
    assert cache.cached() == [(0, 1), (0, 2), (0, 3)]
    _check(cache, 0, cache.fetch(0, [0, 3]))  # 2 (once) goes before 1 (twice)
    assert cache.cached() == [(0, 0), (0, 1), (0, 3)]
    _check(cache, 0, cache.fetch(0, [0, 1, 2]))  # 3 is the only expert this call does not ask for
    assert cache.cached() == [(0, 0), (0, 1), (0, 2)]
    stats = cache.stats
    assert (stats.hits, stats.misses) == (4, 6)
    assert stats.bytes_read == sum(cache.layouts[(0, e)].read_bytes for e in (0, 1, 2, 3, 0, 2))
    assert stats.prefetches == stats.prefetch_used == 0
    cache.tier.check_integrity()
    assert cache.tier.peak <= cache.tier.capacity


def test_among_experts_selected_as_often_the_layer_needed_last_goes(make_cache):
    """Layers come in a cycle (0, 1, 0, 1, ...): after a fetch from layer 0, layer 1 is needed next and layer 0
    last, so layer 0's other expert goes; a recency order would evict layer 1's, needed next."""
    cache = make_cache(3)
    cache.fetch(0, [0])
    cache.fetch(1, [0])
    cache.fetch(0, [1])  # a free slot
    cache.fetch(0, [2])  # full: (0, 0), (1, 0), (0, 1) each selected once; (1, 0) is the least recently used
    assert cache.cached() == [(0, 1), (0, 2), (1, 0)]
    cache.fetch(1, [1])  # now layer 0 comes next: layer 1's other expert goes
    assert cache.cached() == [(0, 1), (0, 2), (1, 1)]


def test_a_fetch_never_evicts_what_it_returns(make_cache):
    cache = make_cache(2)
    first = cache.fetch(1, [0, 1])
    _check(cache, 1, first)
    with pytest.raises(ValueError, match="3 experts from a cache of 2 slots"):
        cache.fetch(1, [0, 1, 2])


def test_prefetch_uses_free_slots_or_less_selected_ones_and_counts_accuracy(make_cache):
    cache = make_cache(3)
    cache.fetch(0, [0, 1])
    cache.fetch(0, [0, 1])
    assert cache.predict(0, 3) == [0, 1]  # never-selected experts are not predicted
    cache.prefetch(1, [2, 3])  # (1, 2) takes the free slot; (1, 3), selected never, evicts nothing
    assert cache.cached() == [(0, 0), (0, 1), (1, 2)]
    assert cache.stats.prefetches == 1 and cache.stats.bytes_read == 3 * cache.layouts[(0, 0)].read_bytes
    _check(cache, 1, cache.fetch(1, [2]))  # waits for the prefetch's reads
    assert (cache.stats.hits, cache.stats.misses, cache.stats.prefetch_used) == (3, 2, 1)
    assert cache.stats.prefetch_accuracy == 1.0
    cache.fetch(1, [2])
    assert cache.stats.prefetch_used == 1  # a prefetch is used once


def test_an_evicted_prefetch_is_not_counted_as_used(make_cache):
    cache = make_cache(1)
    cache.prefetch(0, [3])
    _check(cache, 1, cache.fetch(1, [1]))  # evicts the prefetch (waiting for its read first)
    assert cache.cached() == [(1, 1)]
    cache.prefetch(1, [0])  # (1, 1) is what the last fetch returned: never evicted by a prefetch
    assert cache.cached() == [(1, 1)]
    assert (cache.stats.prefetches, cache.stats.prefetch_used, cache.stats.prefetch_accuracy) == (1, 0, 0.0)
    cache.close()


def test_guesses_displace_any_unused_expert_and_are_kept_from_misses_until_their_layer(make_cache):
    cache = make_cache(3)
    for _ in range(3):
        cache.fetch(0, [0, 1])  # selected three times each
    cache.start(0, [2])  # a miss takes the free slot; 0 and 1 are not in use now
    cache.prefetch(1, [3], guess=True)  # a guess displaces an expert selected more often than it (never, so far)
    assert len(cache.cached()) == 3 and (1, 3) in cache.cached() and (0, 2) in cache.cached()
    kept = next(k for k in cache.cached() if k[0] == 0 and k[1] != 2)
    cache.prefetch(1, [2])  # a frequency prefetch never displaces a guess (nor anything selected as often)
    assert (1, 2) not in cache.cached()
    cache.land(0, [2])
    _check(cache, 0, cache.fetch(0, [3]))  # a miss: the guess stays, (0, 2) (selected once) goes
    assert cache.cached() == sorted([kept, (0, 3), (1, 3)])
    _check(cache, 1, cache.fetch(1, [3]))
    stats = cache.stats
    assert (stats.prefetches, stats.prefetch_used) == (1, 1)


def test_a_budget_below_one_expert_names_the_flag(make_cache, tmp_path):
    with pytest.raises(OffloadError, match="--expert-cache-memory of 4096 bytes holds no expert"):
        make_cache(0, spare=4096)


def test_experts_stored_in_another_dtype_are_converted_inside_the_budget(tmp_path):
    layouts = _layouts(tmp_path, torch.bfloat16)
    backend = make_backend("pread", threads=2)
    probe = ExpertCache(layouts, backend, DeviceTier(None, torch.device("cpu")), 1 << 30, torch.float32)
    tier = DeviceTier(2 * probe.slot_cost, torch.device("cpu"))
    cache = ExpertCache(layouts, backend, tier, 2 * probe.slot_cost, torch.float32)
    for e in range(EXPERTS):
        w = cache.fetch(0, [e])[e]
        for m in SHAPES:
            assert w[m].dtype == torch.float32
            torch.testing.assert_close(w[m], _value(0, e, m, torch.bfloat16).float(), rtol=0, atol=0)
    tier.check_integrity()
    assert tier.peak == tier.used <= tier.capacity
    backend.close()


def test_a_fetch_hands_landed_experts_first_then_by_when_their_reads_started(make_cache):
    cache = make_cache(4)
    _check(cache, 0, cache.fetch(0, [0, 1]))  # both landed
    cache.prefetch(0, [3])  # reading (or read, not yet looked up)
    cache.start(0, [1, 2, 3])  # 1 landed, 3 prefetched before, 2 a miss started now
    got = cache.land(0, [1, 2, 3])
    assert list(got) == [1, 3, 2] and len(got) == 3
    _check(cache, 0, got)  # each looked up lands its reads
    with pytest.raises(KeyError):
        got[0]  # in the cache, but not asked for by this fetch


def test_the_indexed_victim_is_the_lowest_ranked_expert(make_cache, monkeypatch):
    """Eviction looks the victim up by selection count and layer instead of ranking every cached expert: over a
    random run of fetches, frequency prefetches and guesses, each lookup returns what the full ranking would."""
    cache = make_cache(3)
    lowest = ExpertCache._lowest
    looked = []

    def checked(self, excluded, below):
        got = lowest(self, excluded, below)
        candidates = [k for k in self._entries if k not in excluded]
        want = min(candidates, key=self.rank) if candidates else None
        if want is not None and below is not None and self.selections[want] >= below:
            want = None
        assert got == want
        looked.append(got)
        return got

    monkeypatch.setattr(ExpertCache, "_lowest", checked)
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        layer = step % LAYERS
        experts = sorted(set(torch.randint(0, EXPERTS, (2,), generator=g).tolist()))
        cache.fetch(layer, experts)
        nxt = (layer + 1) % LAYERS
        cache.prefetch(nxt, torch.randint(0, EXPERTS, (1,), generator=g).tolist(), guess=bool(step % 3))
    assert len(looked) > 30 and any(v is None for v in looked) and any(v is not None for v in looked)
