"""Continuous batching over real BlockTables: admission, decode plans, finishing, preemption, packing."""

from __future__ import annotations

import pytest

from offload.config import SamplingParams
from scheduler.batcher import Batcher, BatchLimits
from scheduler.plan import MicroBatch, SeqChunk, StepPlan, pack_micro_batches
from scheduler.sequence import SeqState, Sequence
from tiers.kv import BlockPool, BlockTables

EOS = 2


def make_batcher(
    num_blocks: int,
    block_size: int,
    *,
    max_num_seqs: int = 8,
    max_step_tokens: int = 1000,
    micro_batch_tokens: int = 1000,
    max_model_len: int | None = None,
) -> Batcher:
    tables = BlockTables(BlockPool(num_blocks), block_size)
    limits = BatchLimits(
        max_num_seqs=max_num_seqs,
        max_step_tokens=max_step_tokens,
        micro_batch_tokens=micro_batch_tokens,
        max_model_len=max_model_len if max_model_len is not None else num_blocks * block_size,
    )
    return Batcher(tables, limits, eos_ids=(EOS,))


def make_seq(seq_id: int, prompt_len: int, **params) -> Sequence:
    prompt = [100 * (seq_id + 1) + i for i in range(prompt_len)]  # never EOS
    return Sequence(seq_id, prompt, SamplingParams(**params))


def step(batcher: Batcher, plan: StepPlan, tokens: dict[int, int]) -> list[Sequence]:
    finished = batcher.postprocess(plan, tokens)
    batcher.tables.check_integrity()
    return finished


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


# --- prefill admission -------------------------------------------------------------------------


def test_prefill_admits_fifo_up_to_max_num_seqs() -> None:
    b = make_batcher(16, 4, max_num_seqs=2)
    a, bb, c = make_seq(0, 5), make_seq(1, 3), make_seq(2, 4)
    for s in (a, bb, c):
        b.add(s)
    plan = b.schedule()
    b.tables.check_integrity()
    assert plan.is_prefill
    assert plan.chunks == (
        SeqChunk(0, (100, 101, 102, 103, 104), 0, (0, 1)),
        SeqChunk(1, (200, 201, 202), 0, (2,)),
    )
    assert ids(b.running) == [0, 1]
    assert ids(b.waiting) == [2]
    assert a.state is bb.state is SeqState.RUNNING
    assert c.state is SeqState.WAITING


def test_prefill_stops_at_max_step_tokens() -> None:
    b = make_batcher(16, 4, max_step_tokens=8)
    for s in (make_seq(0, 5), make_seq(1, 3), make_seq(2, 4)):
        b.add(s)
    plan = b.schedule()
    assert ids(plan.chunks) == [0, 1]  # 5 + 3 = 8 fits exactly; 4 more would not
    assert [c.block_table for c in plan.chunks] == [(0, 1), (2,)]
    assert ids(b.waiting) == [2]
    # waiting sequences prefill before running ones decode
    plan = b.schedule()
    assert plan.is_prefill
    assert plan.chunks == (SeqChunk(2, (300, 301, 302, 303), 0, (3,)),)


def test_prefill_stops_at_kv_capacity_without_skipping_ahead() -> None:
    b = make_batcher(4, 4)
    for s in (make_seq(0, 9), make_seq(1, 6), make_seq(2, 2)):
        b.add(s)
    plan = b.schedule()
    # seq 1 needs 2 blocks and 1 is free; seq 2 would fit but admission is FIFO
    assert plan.chunks == (SeqChunk(0, tuple(range(100, 109)), 0, (0, 1, 2)),)
    assert ids(b.waiting) == [1, 2]
    assert b.tables.table(1) == []
    assert b.tables.pool.num_free == 1
    b.tables.check_integrity()
    step(b, plan, {0: 50})
    plan = b.schedule()  # seq 1 still does not fit: decode seq 0
    assert not plan.is_prefill
    assert plan.chunks == (SeqChunk(0, (50,), 9, (0, 1, 2)),)


def test_prompt_longer_than_max_step_tokens_runs_alone() -> None:
    b = make_batcher(16, 4, max_step_tokens=8)
    b.add(make_seq(0, 3))
    b.add(make_seq(1, 12))
    b.add(make_seq(2, 1))
    plan = b.schedule()
    assert ids(plan.chunks) == [0]
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(1, tuple(range(200, 212)), 0, (1, 2, 3)),)
    assert ids(b.waiting) == [2]
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(2, (300,), 0, (4,)),)


def test_schedule_with_nothing_to_do_is_an_empty_decode() -> None:
    b = make_batcher(4, 4)
    assert not b.has_work
    plan = b.schedule()
    assert plan == StepPlan((), is_prefill=False)


# --- decode ------------------------------------------------------------------------------------


def test_decode_plans_one_token_per_running_sequence() -> None:
    b = make_batcher(16, 4)
    a, bb = make_seq(0, 5), make_seq(1, 3)
    b.add(a)
    b.add(bb)
    step(b, b.schedule(), {0: 50, 1: 51})
    assert a.output_ids == [50] and bb.output_ids == [51]
    assert a.num_cached == 5 and bb.num_cached == 3

    plan = b.schedule()
    assert not plan.is_prefill
    assert plan.chunks == (SeqChunk(0, (50,), 5, (0, 1)), SeqChunk(1, (51,), 3, (2,)))
    assert [c.context_len for c in plan.chunks] == [6, 4]
    step(b, plan, {0: 60, 1: 61})
    assert a.num_cached == 6 and bb.num_cached == 4

    plan = b.schedule()  # seq 1 reaches position 4 and needs a second block
    assert plan.chunks == (SeqChunk(0, (60,), 6, (0, 1)), SeqChunk(1, (61,), 4, (2, 3)))
    step(b, plan, {0: 70, 1: 71})
    assert a.token_ids == [100, 101, 102, 103, 104, 50, 60, 70]
    assert bb.token_ids == [200, 201, 202, 51, 61, 71]


def test_decode_start_pos_is_last_token_position() -> None:
    b = make_batcher(32, 3)
    seqs = [make_seq(i, n) for i, n in enumerate((1, 4, 7))]
    for s in seqs:
        b.add(s)
    step(b, b.schedule(), {0: 10, 1: 11, 2: 12})
    for t in range(5):
        plan = b.schedule()
        assert not plan.is_prefill
        for chunk, seq in zip(plan.chunks, seqs, strict=True):
            assert chunk.seq_id == seq.seq_id
            assert chunk.token_ids == (seq.token_ids[-1],)
            assert chunk.start_pos == seq.num_tokens - 1
            assert list(chunk.block_table) == b.tables.table(seq.seq_id)
            assert len(chunk.block_table) == -(-seq.num_tokens // 3)
        step(b, plan, {s.seq_id: 20 + t for s in seqs})


# --- finishing ---------------------------------------------------------------------------------


def test_eos_finishes_and_frees_blocks() -> None:
    b = make_batcher(8, 4)
    a, bb = make_seq(0, 5), make_seq(1, 2)
    b.add(a)
    b.add(bb)
    plan = b.schedule()
    finished = step(b, plan, {0: EOS, 1: 7})
    assert finished == [a]
    assert a.state is SeqState.FINISHED and a.is_finished
    assert a.finish_reason == "stop"
    assert a.output_ids == [EOS]
    assert b.tables.table(0) == []
    assert b.tables.pool.num_free == 8 - 1
    assert ids(b.running) == [1]
    assert bb.finish_reason is None and bb.state is SeqState.RUNNING


def test_ignore_eos_keeps_going() -> None:
    b = make_batcher(8, 4)
    a = make_seq(0, 5, ignore_eos=True, max_new_tokens=3)
    b.add(a)
    assert step(b, b.schedule(), {0: EOS}) == []
    assert step(b, b.schedule(), {0: EOS}) == []
    assert step(b, b.schedule(), {0: EOS}) == [a]
    assert a.finish_reason == "length"
    assert a.output_ids == [EOS, EOS, EOS]


def test_max_new_tokens_finishes_with_length() -> None:
    b = make_batcher(8, 4)
    a = make_seq(0, 3, max_new_tokens=2)
    b.add(a)
    assert step(b, b.schedule(), {0: 9}) == []
    assert step(b, b.schedule(), {0: 9}) == [a]
    assert a.finish_reason == "length"
    assert a.output_ids == [9, 9]
    assert b.tables.pool.num_free == 8
    assert not b.has_work


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    b = make_batcher(8, 4)
    a = make_seq(0, 3, max_new_tokens=1)
    b.add(a)
    assert step(b, b.schedule(), {0: EOS}) == [a]
    assert a.finish_reason == "stop"


def test_max_model_len_finishes_with_length() -> None:
    b = make_batcher(8, 4, max_model_len=8)
    a = make_seq(0, 6, max_new_tokens=64)
    b.add(a)
    assert step(b, b.schedule(), {0: 9}) == []
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(0, (9,), 6, (0, 1)),)
    assert step(b, plan, {0: 9}) == [a]
    assert a.num_tokens == 8
    assert a.finish_reason == "length"
    assert b.tables.pool.num_free == 8


def test_finish_by_caller_frees_a_running_sequence() -> None:
    b = make_batcher(8, 4)
    a, bb = make_seq(0, 5), make_seq(1, 2)
    b.add(a)
    b.add(bb)
    step(b, b.schedule(), {0: 7, 1: 7})
    b.finish(a, "stop")  # e.g. a stop string the caller found
    b.tables.check_integrity()
    assert a.state is SeqState.FINISHED and a.finish_reason == "stop"
    assert ids(b.running) == [1]
    assert b.tables.pool.num_free == 7
    assert ids(b.schedule().chunks) == [1]


# --- continuous batching -----------------------------------------------------------------------


def test_finished_leave_and_waiting_join_on_the_next_step() -> None:
    b = make_batcher(16, 4, max_num_seqs=2)
    a, bb, c = make_seq(0, 5), make_seq(1, 3), make_seq(2, 4)
    for s in (a, bb, c):
        b.add(s)
    plan = b.schedule()
    assert ids(plan.chunks) == [0, 1]
    assert step(b, plan, {0: 40, 1: 41}) == []

    plan = b.schedule()  # full: seq 2 waits, both decode
    assert not plan.is_prefill and ids(plan.chunks) == [0, 1]
    assert step(b, plan, {0: EOS, 1: 42}) == [a]

    plan = b.schedule()  # seq 0's slot goes to seq 2; blocks 3.. were never used, 0 and 1 come after
    assert plan.is_prefill
    assert plan.chunks == (SeqChunk(2, (300, 301, 302, 303), 0, (3,)),)
    assert ids(b.running) == [1, 2]
    step(b, plan, {2: 43})

    plan = b.schedule()
    assert plan.chunks == (SeqChunk(1, (42,), 4, (2, 4)), SeqChunk(2, (43,), 4, (3, 5)))


def test_freed_blocks_are_reused_in_the_order_freed() -> None:
    b = make_batcher(4, 2, max_num_seqs=1)
    a, bb = make_seq(0, 3), make_seq(1, 5)
    b.add(a)
    b.add(bb)
    plan = b.schedule()
    assert plan.chunks[0].block_table == (0, 1)
    step(b, plan, {0: EOS})
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(1, (200, 201, 202, 203, 204), 0, (2, 3, 0)),)


# --- preemption --------------------------------------------------------------------------------


def test_decode_out_of_blocks_preempts_the_most_recent_and_readmits_it() -> None:
    b = make_batcher(4, 2, max_num_seqs=2)
    a, bb, c = make_seq(0, 3, max_new_tokens=4), make_seq(1, 3), make_seq(2, 1)
    for s in (a, bb, c):
        b.add(s)
    plan = b.schedule()
    assert [(ch.seq_id, ch.block_table) for ch in plan.chunks] == [(0, (0, 1)), (1, (2, 3))]
    step(b, plan, {0: 10, 1: 11})
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(0, (10,), 3, (0, 1)), SeqChunk(1, (11,), 3, (2, 3)))
    step(b, plan, {0: 12, 1: 13})

    plan = b.schedule()  # both need a third block and none is free: seq 1 goes
    assert plan.chunks == (SeqChunk(0, (12,), 4, (0, 1, 2)),)
    assert bb.state is SeqState.WAITING
    assert bb.num_cached == 0
    assert b.tables.table(1) == []
    assert ids(b.waiting) == [1, 2]  # in front of the sequence that never ran
    assert ids(b.running) == [0]
    assert b.num_preemptions == 1
    b.tables.check_integrity()
    step(b, plan, {0: 14})

    plan = b.schedule()  # seq 1 needs 3 blocks, 1 is free: seq 0 decodes on
    assert plan.chunks == (SeqChunk(0, (14,), 5, (0, 1, 2)),)
    assert step(b, plan, {0: 15}) == [a]

    plan = b.schedule()  # recomputed from prompt + outputs so far; seq 2 fits beside it
    assert plan.is_prefill
    assert plan.chunks == (
        SeqChunk(1, (200, 201, 202, 11, 13), 0, (3, 0, 1)),
        SeqChunk(2, (300,), 0, (2,)),
    )
    step(b, plan, {1: 16, 2: 17})
    assert bb.output_ids == [11, 13, 16]
    assert bb.num_cached == 5
    assert b.num_preemptions == 1


def test_preemption_takes_the_last_admitted_not_the_next_in_line() -> None:
    b = make_batcher(6, 2)
    seqs = [make_seq(i, 4) for i in range(3)]
    for s in seqs:
        b.add(s)
    step(b, b.schedule(), {0: 10, 1: 11, 2: 12})  # 5 tokens each, 2 blocks each, none free
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(0, (10,), 4, (0, 1, 4)), SeqChunk(1, (11,), 4, (2, 3, 5)))
    assert ids(b.waiting) == [2] and ids(b.running) == [0, 1]
    assert seqs[2].state is SeqState.WAITING
    assert b.num_preemptions == 1


def test_several_preemptions_keep_admission_order_in_the_queue() -> None:
    b = make_batcher(5, 2)
    seqs = [make_seq(0, 4), make_seq(1, 4), make_seq(2, 2)]
    for s in seqs:
        b.add(s)
    b.add(make_seq(3, 1))  # no block left for it
    step(b, b.schedule(), {0: 10, 1: 11, 2: 12})  # [0, 1], [2, 3], [4]; none free
    plan = b.schedule()
    # seq 0 needs a third block: seq 2 goes; seq 1 then needs one, has no one behind it, and goes too
    assert plan.chunks == (SeqChunk(0, (10,), 4, (0, 1, 4)),)
    assert ids(b.waiting) == [1, 2, 3]
    assert ids(b.running) == [0]
    assert b.num_preemptions == 2
    assert [s.state for s in seqs] == [SeqState.RUNNING, SeqState.WAITING, SeqState.WAITING]
    b.tables.check_integrity()


def test_a_sequence_with_no_one_behind_it_preempts_itself() -> None:
    b = make_batcher(5, 2)
    a, bb = make_seq(0, 3), make_seq(1, 3)
    b.add(a)
    b.add(bb)
    step(b, b.schedule(), {0: 10, 1: 11})  # 4 tokens each: [0, 1] and [2, 3], 1 free
    step(b, b.schedule(), {0: 12, 1: 13})  # 5 tokens each: both need a third block
    plan = b.schedule()
    # seq 0 takes block 4; seq 1 cannot grow, has no one after it to evict, and steps aside
    assert plan.chunks == (SeqChunk(0, (12,), 4, (0, 1, 4)),)
    assert bb.state is SeqState.WAITING
    assert ids(b.waiting) == [1] and ids(b.running) == [0]
    assert b.tables.table(1) == []
    assert b.num_preemptions == 1
    b.tables.check_integrity()


# --- micro-batches -----------------------------------------------------------------------------


def chunk(seq_id: int, n: int) -> SeqChunk:
    return SeqChunk(seq_id, tuple(range(n)), 0, ())


def test_pack_micro_batches_exact_grouping() -> None:
    chunks = [chunk(i, n) for i, n in enumerate((3, 4, 2, 6, 1))]
    batches = pack_micro_batches(chunks, max_tokens=7)
    assert [[c.seq_id for c in mb.chunks] for mb in batches] == [[0, 1], [2], [3, 4]]
    assert [mb.num_tokens for mb in batches] == [7, 2, 7]


def test_pack_micro_batches_large_chunk_goes_alone() -> None:
    chunks = [chunk(0, 2), chunk(1, 10), chunk(2, 2), chunk(3, 3)]
    batches = pack_micro_batches(chunks, max_tokens=5)
    assert batches == (
        MicroBatch((chunks[0],)),
        MicroBatch((chunks[1],)),
        MicroBatch((chunks[2], chunks[3])),
    )


def test_pack_micro_batches_edge_cases() -> None:
    assert pack_micro_batches([], max_tokens=4) == ()
    one = [chunk(0, 1) for _ in range(5)]
    assert [len(mb.chunks) for mb in pack_micro_batches(one, 2)] == [2, 2, 1]
    assert [len(mb.chunks) for mb in pack_micro_batches(one, 1)] == [1, 1, 1, 1, 1]


def test_step_plan_totals() -> None:
    plan = StepPlan(pack_micro_batches([chunk(0, 3), chunk(1, 4), chunk(2, 2)], 5), is_prefill=True)
    assert plan.num_tokens == 9
    assert [c.seq_id for c in plan.chunks] == [0, 1, 2]
    assert not plan.all_logits


def test_batcher_packs_prefill_and_decode_into_micro_batches() -> None:
    b = make_batcher(32, 4, micro_batch_tokens=4)
    for i, n in enumerate((3, 2, 2, 5, 1)):
        b.add(make_seq(i, n))
    plan = b.schedule()
    assert [[c.seq_id for c in mb.chunks] for mb in plan.micro_batches] == [[0], [1, 2], [3], [4]]
    step(b, plan, {i: 9 for i in range(5)})
    plan = b.schedule()
    assert [[c.seq_id for c in mb.chunks] for mb in plan.micro_batches] == [[0, 1, 2, 3], [4]]


# --- limits ------------------------------------------------------------------------------------


def test_add_rejects_a_sequence_already_at_max_model_len() -> None:
    b = make_batcher(8, 4, max_model_len=8)
    with pytest.raises(ValueError, match="sequence 3 has 8 tokens, max_model_len is 8"):
        b.add(make_seq(3, 8))
    with pytest.raises(ValueError):
        b.add(make_seq(4, 9))
    assert not b.has_work
    b.add(make_seq(5, 7))
    assert ids(b.waiting) == [5]


def test_max_model_len_must_fit_the_pool() -> None:
    tables = BlockTables(BlockPool(4), 4)
    Batcher(tables, BatchLimits(8, 100, 100, max_model_len=16))
    with pytest.raises(ValueError, match="max_model_len 17 does not fit the KV cache"):
        Batcher(tables, BatchLimits(8, 100, 100, max_model_len=17))


# --- a whole run -------------------------------------------------------------------------------


def token_for(seq_id: int, position: int) -> int:
    """A deterministic 'model': the token sampled at `position` depends only on the sequence and position."""
    return 1000 + 37 * seq_id + position


def test_full_run_under_pressure_completes_every_sequence() -> None:
    b = make_batcher(10, 2, max_num_seqs=4, max_step_tokens=12, micro_batch_tokens=5, max_model_len=20)
    prompts = (3, 7, 1, 5, 2, 9, 4, 6)
    max_new = (6, 4, 9, 3, 12, 2, 7, 5)
    seqs = [make_seq(i, prompts[i], max_new_tokens=max_new[i], ignore_eos=True) for i in range(8)]
    for s in seqs:
        b.add(s)
    done: list[Sequence] = []
    for _ in range(200):
        if not b.has_work:
            break
        plan = b.schedule()
        b.tables.check_integrity()
        assert plan.chunks, "a step with work left planned nothing"
        assert all(mb.num_tokens <= 5 or len(mb.chunks) == 1 for mb in plan.micro_batches)
        assert len(plan.chunks) <= 4
        for c in plan.chunks:
            seq = seqs[c.seq_id]
            assert seq.state is SeqState.RUNNING
            assert len(c.block_table) == -(-c.context_len // 2)
            if plan.is_prefill:
                assert c.start_pos == 0 and list(c.token_ids) == seq.token_ids
            else:
                assert c.start_pos == seq.num_tokens - 1 == seq.num_cached
        done += step(b, plan, {c.seq_id: token_for(c.seq_id, c.context_len) for c in plan.chunks})
    assert not b.has_work
    assert sorted(ids(done)) == list(range(8))
    assert b.num_preemptions > 0
    assert b.tables.pool.num_free == 10
    for s in seqs:
        assert s.finish_reason == "length"
        n = len(s.prompt_ids)
        expected = min(s.params.max_new_tokens, 20 - n)
        assert s.output_ids == [token_for(s.seq_id, n + i) for i in range(expected)]


def test_finish_by_caller_removes_a_waiting_sequence() -> None:
    batcher = make_batcher(num_blocks=4, block_size=4)
    seq = make_seq(0, 3)
    batcher.add(seq)
    batcher.finish(seq, "stop")
    assert not batcher.waiting and not batcher.has_work
    assert seq.state is SeqState.FINISHED and seq.finish_reason == "stop"
    batcher.tables.check_integrity()
