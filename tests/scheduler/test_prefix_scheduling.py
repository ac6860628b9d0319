"""The batcher with prefix reuse: chunks start after the cached prefix, a sequence whose prefix is being computed
waits one step to share it, the longest cached prefix is admitted first (with an age bound), and a preempted
sequence comes back to its own cached blocks."""

from __future__ import annotations

from offload.common.config import SamplingParams
from offload.scheduler.batcher import MAX_SKIPS, Batcher, BatchLimits
from offload.scheduler.sequence import SeqState, Sequence
from offload.tiers.kv.blocks import BlockPool, BlockTables
from offload.tiers.kv.prefix import chain_root

SHARED = list(range(10, 22))  # 12 tokens: three blocks of 4


def make_batcher(num_blocks: int, *, max_num_seqs: int = 8, max_step_tokens: int = 1000) -> Batcher:
    tables = BlockTables(BlockPool(num_blocks), 4, chain_root({"model": "test"}))
    limits = BatchLimits(max_num_seqs, max_step_tokens, 1000, num_blocks * 4)
    return Batcher(tables, limits, eos_ids=(2,))


def seq(seq_id: int, tokens: list[int], max_new_tokens: int = 4) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_new_tokens=max_new_tokens))


def run_step(b: Batcher):
    plan = b.schedule()
    b.postprocess(plan, {c.seq_id: 500 + c.seq_id for c in plan.chunks if c.wants_logits})
    b.tables.check_integrity()
    return plan


def test_sequences_sharing_a_prefix_being_computed_wait_a_step_then_skip_it() -> None:
    b = make_batcher(32)
    for i in range(3):
        b.add(seq(i, [*SHARED, 100 + i]))
    first = run_step(b)
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in first.chunks] == [(0, 0, 13)]
    second = run_step(b)
    starts = {c.seq_id: (c.start_pos, len(c.token_ids)) for c in second.chunks}
    assert starts == {0: (13, 1), 1: (12, 1), 2: (12, 1)}  # 0 decodes; 1 and 2 compute only their own token
    table0 = b.tables.table(0)
    assert b.tables.table(1)[:3] == b.tables.table(2)[:3] == table0[:3]
    assert b.tables.counters.hit_tokens == 24


def test_the_longest_cached_prefix_is_admitted_first() -> None:
    b = make_batcher(32, max_num_seqs=2)
    b.add(seq(0, [*SHARED, 7], max_new_tokens=1))
    run_step(b)  # sequence 0 done: its blocks stay cached
    b.add(seq(1, [50, 51, 52, 53, 54]))  # nothing cached
    b.add(seq(2, [*SHARED, 8]))  # 12 tokens cached
    plan = b.schedule()
    assert [c.seq_id for c in plan.chunks] == [2, 1]  # both fit; the cached one first
    b = make_batcher(32, max_num_seqs=1)
    b.add(seq(0, [*SHARED, 7], max_new_tokens=1))
    run_step(b)
    b.add(seq(1, [50, 51, 52, 53, 54]))
    b.add(seq(2, [*SHARED, 8]))
    assert [c.seq_id for c in b.schedule().chunks] == [2]  # one place: it goes to the longer cached prefix
    assert b.waiting[0].seq_id == 1 and b.waiting[0].skipped == 1


def test_a_sequence_passed_over_max_skips_times_goes_next() -> None:
    b = make_batcher(64, max_num_seqs=1)
    b.add(seq(0, [*SHARED, 7], max_new_tokens=1))
    run_step(b)
    starved = seq(1, [50, 51, 52, 53, 54], max_new_tokens=1)
    b.add(starved)
    admitted = []
    for i in range(2, 2 + MAX_SKIPS + 3):
        b.add(seq(i, [*SHARED, i], max_new_tokens=1))  # a stream of requests with a cached prefix
        plan = run_step(b)
        admitted += [c.seq_id for c in plan.chunks]
        if starved.state is not SeqState.WAITING:
            break
    assert starved.seq_id in admitted
    assert admitted.index(starved.seq_id) == MAX_SKIPS  # passed over exactly MAX_SKIPS times, then admitted


def test_a_preempted_sequence_comes_back_to_its_own_cached_blocks() -> None:
    b = make_batcher(6)
    first = seq(0, list(range(100, 109)), max_new_tokens=6)  # 9 tokens: 3 blocks, growing to a 4th
    second = seq(1, list(range(200, 207)), max_new_tokens=6)  # 7 tokens: 2 blocks, growing to a 3rd
    b.add(first)
    b.add(second)
    while not b.num_preemptions:
        run_step(b)
    assert second.state is SeqState.WAITING and second.num_tokens == 11  # 7 prompt + 4 sampled tokens
    before = b.tables.counters.hit_tokens
    while second.state is SeqState.WAITING:
        plan = run_step(b)
    chunk = next(c for c in plan.chunks if c.seq_id == 1)
    assert chunk.start_pos == 8 and b.tables.counters.hit_tokens - before == 8  # its two full blocks, not recomputed
