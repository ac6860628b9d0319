"""The KV prices: moving a running sequence down, and reading a block back from disk, against prefilling the tokens
again, at the rates the KV tiers' counters and the core's prefill steps measure; both pay until measured."""

from __future__ import annotations

import pytest

from offload.scheduler.kv_prices import KVPrices
from offload.tiers.kv.lower_tiers import KVTierCounters

BLOCK = 16  # tokens per block


def test_a_sequence_moves_down_while_copying_its_blocks_beats_recomputing_its_tokens() -> None:
    counters = KVTierCounters()
    prices = KVPrices(BLOCK, counters)
    assert prices.swap_pays(4, 16)  # nothing measured yet: move
    prices.observe_prefill(1000, 1.0)  # tokens per second
    assert prices.swap_pays(4, 16)  # the copy rate is not measured yet
    counters.moved_blocks, counters.move_seconds = 10, 0.010  # a block copied in a millisecond
    assert prices.swap_pays(4, 16)  # 4 ms of copies against 16 ms of prefill
    assert not prices.swap_pays(4, 3)  # against 3 ms: recomputing is cheaper


def test_a_block_is_read_from_disk_while_that_beats_prefilling_its_tokens() -> None:
    counters = KVTierCounters()
    prices = KVPrices(BLOCK, counters)
    counters.promoted_disk, counters.disk_seconds = 4, 0.040  # 10 ms a block
    assert prices.disk_pays()  # the prefill rate is not measured yet
    prices.observe_prefill(1000, 1.0)
    assert prices.disk_pays()  # 10 ms against 16 tokens' 16 ms
    prices.observe_prefill(2000, 1.0)  # the rate moves a fifth of the way: 1200 tokens per second
    assert prices.prefill_rate == pytest.approx(1200.0)
    assert prices.disk_pays()  # 10 ms against 13.3 ms
    counters.promoted_disk, counters.disk_seconds = 4, 0.060  # 15 ms a block
    assert not prices.disk_pays()  # computing the block again is cheaper


def test_the_prefill_rate_is_a_running_average_and_survives_an_instant_step() -> None:
    prices = KVPrices(BLOCK, KVTierCounters())
    assert prices.prefill_rate is None
    prices.observe_prefill(500, 0.5)
    assert prices.prefill_rate == 1000.0
    prices.observe_prefill(100, 0.0)  # too fast to time: a huge but finite rate
    assert prices.prefill_rate == pytest.approx(0.8 * 1000.0 + 0.2 * 100 / 1e-9)
