"""What moving KV blocks between tiers costs against computing their tokens again: the prices the batcher consults.

Reading a block back is not always cheaper than computing it: from host RAM it always is (a copy); from disk, when a
block's bytes read faster than its tokens prefill (`disk_pays`). A running sequence that cannot grow on the device
moves down to host RAM rather than being preempted when copying its blocks is faster than prefilling its cached
tokens again (`swap_pays`). The rates are measured as the engine runs: the KV tiers time their moves and disk reads
(their counters, read when a price is asked), the core its prefill steps (`observe_prefill`). Until both rates of a
price are measured, moving pays: the first moves and reads are what measure it.
"""

from __future__ import annotations

from typing import Protocol

PREFILL_WEIGHT = 0.2  # of the newest prefill step in the running prefill rate (the rest: the rate before it)


class MovedRates(Protocol):
    """What the KV tiers measured so far (tiers/kv/lower_tiers.py's KVTierCounters); None until measured."""

    @property
    def seconds_per_block_moved(self) -> float | None: ...

    @property
    def seconds_per_block_read(self) -> float | None: ...


class KVPrices:
    """Move or recompute, at the measured rates: `block_size` tokens per block, `measured` the tiers' timings."""

    __slots__ = ("block_size", "measured", "prefill_rate")

    def __init__(self, block_size: int, measured: MovedRates) -> None:
        self.block_size = block_size
        self.measured = measured
        self.prefill_rate: float | None = None  # prefill tokens per second, a running average of the core's steps

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` prefill tokens in `seconds`: folded into the running prefill rate."""
        rate = tokens / max(seconds, 1e-9)
        last = self.prefill_rate
        self.prefill_rate = rate if last is None else (1 - PREFILL_WEIGHT) * last + PREFILL_WEIGHT * rate

    def swap_pays(self, blocks: int, tokens: int) -> bool:
        """Whether moving a running sequence's `blocks` down to host RAM is predicted cheaper than computing its
        `tokens` again after a preemption (True until both rates are measured)."""
        move = self.measured.seconds_per_block_moved
        if self.prefill_rate is None or move is None:
            return True
        return blocks * move < tokens / self.prefill_rate

    def disk_pays(self) -> bool:
        """Whether reading a block back from disk is predicted faster than prefilling its tokens (True until both
        rates are measured)."""
        read = self.measured.seconds_per_block_read
        if self.prefill_rate is None or read is None:
            return True
        return read < self.block_size / self.prefill_rate
