"""Continuous batching with chunked prefill over real BlockTables: admission, chunks, decode, finishing,
preemption, micro-batches, random workloads; and the same greedy tokens through the engine, chunked or not.
"""

from __future__ import annotations

import itertools

import pytest

from offload.common.config import SamplingParams
from offload.common.tier import Tier
from offload.scheduler.batcher import Batcher, BatchLimits, Verdict
from offload.scheduler.plan import MicroBatch, SeqChunk, StepPlan, split_micro_batches
from offload.scheduler.sequence import SeqState, Sequence
from offload.tiers.kv.blocks import BlockPool, BlockTables
from offload.tiers.kv.events import MovedUp
from offload.tiers.kv.prefix import chain_root, extend_chain

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


def token_for(seq_id: int, position: int) -> int:
    """A deterministic 'model': the token sampled at `position` depends only on the sequence and position."""
    return 1000 + 37 * seq_id + position


def dec(seq_id: int, token: int, pos: int, table: tuple[int, ...]) -> SeqChunk:
    """The decode chunk of `seq_id`: its last sampled token at position `pos`."""
    return SeqChunk(seq_id, (token,), pos, table, is_decode=True)


def shape(plan: StepPlan) -> list[tuple[int, int, int, bool, bool]]:
    """(seq id, start_pos, tokens, wants_logits, is_decode) of each chunk, in plan order."""
    return [(c.seq_id, c.start_pos, len(c.token_ids), c.wants_logits, c.is_decode) for c in plan.chunks]


# --- admission ---------------------------------------------------------------------------------


def test_prefill_admits_fifo_up_to_max_num_seqs() -> None:
    b = make_batcher(16, 4, max_num_seqs=2)
    a, bb, c = make_seq(0, 5), make_seq(1, 3), make_seq(2, 4)
    for s in (a, bb, c):
        b.add(s)
    plan = b.schedule()
    b.tables.check_integrity()
    assert plan.is_prefill and plan.num_prefill_tokens == 8 and plan.num_decode_tokens == 0
    assert plan.chunks == (
        SeqChunk(0, (100, 101, 102, 103, 104), 0, (0, 1)),
        SeqChunk(1, (200, 201, 202), 0, (2,)),
    )
    assert ids(b.running) == [0, 1]
    assert ids(b.waiting) == [2]
    assert a.state is bb.state is SeqState.PREFILLING
    assert c.state is SeqState.WAITING
    step(b, plan, {0: 10, 1: 11})
    assert a.state is bb.state is SeqState.DECODING
    assert (a.num_cached, bb.num_cached, c.num_cached) == (5, 3, 0)


def test_a_lower_priority_class_waits_behind_every_higher_one() -> None:
    b = make_batcher(16, 4, max_num_seqs=1)
    background = [make_seq(i, 2) for i in range(3)]
    for s in background:
        s.priority = 1
        b.add(s)
    first, second = make_seq(7, 2), make_seq(8, 2)
    b.add(first)
    b.add(second)
    assert ids(b.waiting) == [7, 8, 0, 1, 2]  # FIFO within a class
    plan = b.schedule()
    assert [c.seq_id for c in plan.chunks] == [7]


def test_max_step_tokens_caps_the_running_set() -> None:
    # every running sequence may decode in the same step, so no more run than a step has tokens
    b = make_batcher(16, 4, max_num_seqs=8, max_step_tokens=3)
    for i in range(5):
        b.add(make_seq(i, 1))
    plan = b.schedule()
    assert ids(plan.chunks) == [0, 1, 2]
    step(b, plan, {0: 10, 1: 11, 2: 12})
    plan = b.schedule()
    assert plan.chunks == (dec(0, 10, 1, (0,)), dec(1, 11, 1, (1,)), dec(2, 12, 1, (2,)))
    assert ids(b.waiting) == [3, 4]


def test_decode_comes_first_then_prefill_fills_the_budget() -> None:
    b = make_batcher(16, 4, max_step_tokens=8)
    for s in (make_seq(0, 5), make_seq(1, 3), make_seq(2, 4)):
        b.add(s)
    plan = b.schedule()
    assert ids(plan.chunks) == [0, 1]  # 5 + 3 = 8 fills the budget; seq 2 waits
    assert [c.block_table for c in plan.chunks] == [(0, 1), (2,)]
    assert ids(b.waiting) == [2]
    step(b, plan, {0: 10, 1: 11})
    plan = b.schedule()  # one token each for the decoders, then 6 left for seq 2's whole prompt
    assert plan.chunks == (
        dec(0, 10, 5, (0, 1)),
        dec(1, 11, 3, (2,)),
        SeqChunk(2, (300, 301, 302, 303), 0, (3,)),
    )
    assert (plan.num_decode_tokens, plan.num_prefill_tokens) == (2, 4)
    assert plan.is_prefill


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
    assert plan.chunks == (dec(0, 50, 9, (0, 1, 2)),)


def test_schedule_with_nothing_to_do_is_an_empty_plan() -> None:
    b = make_batcher(4, 4)
    assert not b.has_work
    plan = b.schedule()
    assert plan == StepPlan(())
    assert plan.num_tokens == plan.num_prefill_tokens == plan.num_decode_tokens == 0


# --- chunked prefill ---------------------------------------------------------------------------


def run_shapes(b: Batcher, seqs: list[Sequence]) -> list[list[tuple[int, int, int, bool, bool]]]:
    """Run `b` to the end with token_for as the model; the shape of every step's plan."""
    shapes = []
    while b.has_work:
        plan = b.schedule()
        shapes.append(shape(plan))
        step(b, plan, {c.seq_id: token_for(c.seq_id, c.context_len) for c in plan.chunks if c.wants_logits})
    assert all(s.finish_reason == "length" for s in seqs)
    return shapes


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget() -> None:
    b = make_batcher(16, 4, max_step_tokens=8)
    seqs = [make_seq(0, 20, max_new_tokens=2), make_seq(1, 3, max_new_tokens=2)]
    for s in seqs:
        b.add(s)
    assert run_shapes(b, seqs) == [
        [(0, 0, 8, False, False)],
        [(0, 8, 8, False, False)],
        [(0, 16, 4, True, False), (1, 0, 3, True, False)],  # seq 0's last chunk samples; seq 1 joins
        [(0, 20, 1, True, True), (1, 3, 1, True, True)],
    ]
    assert seqs[0].output_ids == [token_for(0, 20), token_for(0, 21)]
    assert seqs[1].output_ids == [token_for(1, 3), token_for(1, 4)]
    assert b.tables.pool.num_free == 16


def test_decode_interleaves_with_the_chunks_of_a_later_prompt() -> None:
    b = make_batcher(16, 4, max_step_tokens=8)
    seqs = [make_seq(0, 3, max_new_tokens=2), make_seq(1, 20, max_new_tokens=2)]
    for s in seqs:
        b.add(s)
    assert run_shapes(b, seqs) == [
        [(0, 0, 3, True, False), (1, 0, 5, False, False)],
        [(0, 3, 1, True, True), (1, 5, 7, False, False)],  # seq 0 finishes here
        [(1, 12, 8, True, False)],
        [(1, 20, 1, True, True)],
    ]


def test_a_decoding_sequence_gets_a_token_every_step_while_a_long_prompt_prefills() -> None:
    b = make_batcher(64, 4, max_step_tokens=8)
    short = make_seq(0, 2, max_new_tokens=30, ignore_eos=True)
    b.add(short)
    step(b, b.schedule(), {0: 7})
    long = make_seq(1, 50, max_new_tokens=1)
    b.add(long)
    sizes = []
    while not long.is_finished:
        outputs = len(short.output_ids)
        plan = b.schedule()
        assert plan.chunks[0] == dec(0, short.token_ids[-1], short.num_tokens - 1, tuple(b.tables.table(0)))
        (chunk,) = plan.chunks[1:]
        assert chunk.seq_id == 1 and chunk.start_pos == long.num_cached
        assert len(chunk.block_table) == -(-chunk.context_len // 4)  # blocks for this chunk, not the prompt
        assert chunk.wants_logits == (chunk.context_len == 50)
        sizes.append(len(chunk.token_ids))
        step(b, plan, {0: 7, 1: 9} if chunk.wants_logits else {0: 7})
        assert len(short.output_ids) == outputs + 1
    assert sizes == [7] * 7 + [1]
    assert long.output_ids == [9] and long.finish_reason == "length"
    assert short.state is SeqState.DECODING and len(short.output_ids) == 9


def test_a_sequence_is_prefilling_until_its_last_chunk() -> None:
    b = make_batcher(16, 4, max_step_tokens=4)
    s = make_seq(0, 10, max_new_tokens=3)
    b.add(s)
    states = []
    for _ in range(5):
        plan = b.schedule()
        step(b, plan, {0: 9} if plan.chunks[-1].wants_logits else {})
        states.append((s.state, s.num_cached, len(b.tables.table(0))))
    assert states == [
        (SeqState.PREFILLING, 4, 1),
        (SeqState.PREFILLING, 8, 2),
        (SeqState.DECODING, 10, 3),
        (SeqState.DECODING, 11, 3),
        (SeqState.FINISHED, 0, 0),
    ]


def test_preempting_a_partly_prefilled_sequence_frees_its_blocks_and_restarts_it() -> None:
    b = make_batcher(4, 2, max_step_tokens=4)
    a = make_seq(0, 3, max_new_tokens=4)
    late = make_seq(1, 6, max_new_tokens=1)
    b.add(a)
    b.add(late)
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(0, (100, 101, 102), 0, (0, 1)), SeqChunk(1, (200,), 0, (2,), wants_logits=False))
    step(b, plan, {0: 10})
    plan = b.schedule()
    assert plan.chunks == (dec(0, 10, 3, (0, 1)), SeqChunk(1, (201, 202, 203), 1, (2, 3), wants_logits=False))
    step(b, plan, {0: 11})
    assert late.state is SeqState.PREFILLING and late.num_cached == 4

    plan = b.schedule()  # seq 0 needs a third block: seq 1, admitted later, goes with its 4 cached tokens
    assert plan.chunks == (dec(0, 11, 4, (0, 1, 2)),)
    assert late.state is SeqState.WAITING and late.num_cached == 0
    assert b.tables.table(1) == [] and b.num_preemptions == 1
    assert ids(b.waiting) == [1]
    step(b, plan, {0: 12})
    plan = b.schedule()  # its first chunk needs 2 blocks, 1 is free
    assert plan.chunks == (dec(0, 12, 5, (0, 1, 2)),)
    assert step(b, plan, {0: 13}) == [a]

    plan = b.schedule()  # from scratch
    assert plan.chunks == (SeqChunk(1, (200, 201, 202, 203), 0, (3, 0), wants_logits=False),)
    step(b, plan, {})
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(1, (204, 205), 4, (3, 0, 1)),)
    assert step(b, plan, {1: 14}) == [late]
    assert late.output_ids == [14] and b.num_preemptions == 1
    assert b.tables.pool.num_free == 4


def test_a_prefilling_sequence_that_cannot_grow_after_the_decoders_steps_aside() -> None:
    b = make_batcher(5, 2, max_step_tokens=4)
    a, late = make_seq(0, 3, max_new_tokens=3), make_seq(1, 9, max_new_tokens=1)
    b.add(a)
    b.add(late)
    step(b, b.schedule(), {0: 10})
    plan = b.schedule()
    assert shape(plan) == [(0, 3, 1, True, True), (1, 1, 3, False, False)]
    step(b, plan, {0: 11})
    assert b.tables.pool.num_free == 1
    plan = b.schedule()  # seq 0 takes the last block; seq 1 needs 2 more, and no one after it can give them
    assert plan.chunks == (dec(0, 11, 4, (0, 1, 4)),)
    assert late.state is SeqState.WAITING and late.num_cached == 0 and b.tables.table(1) == []
    assert b.num_preemptions == 1
    assert step(b, plan, {0: 12}) == [a]
    plan = b.schedule()
    assert plan.chunks == (SeqChunk(1, (200, 201, 202, 203), 0, (2, 3), wants_logits=False),)


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
    assert plan.chunks == (dec(0, 50, 5, (0, 1)), dec(1, 51, 3, (2,)))
    assert [c.context_len for c in plan.chunks] == [6, 4]
    step(b, plan, {0: 60, 1: 61})
    assert a.num_cached == 6 and bb.num_cached == 4

    plan = b.schedule()  # seq 1 reaches position 4 and needs a second block
    assert plan.chunks == (dec(0, 60, 6, (0, 1)), dec(1, 61, 4, (2, 3)))
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
            assert chunk.token_ids == (seq.token_ids[-1],) and chunk.is_decode
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
    assert a.state is SeqState.FINISHED and a.is_finished and a.num_cached == 0
    assert a.finish_reason == "stop"
    assert a.output_ids == [EOS]
    assert b.tables.table(0) == []
    assert b.tables.pool.num_free == 8 - 1
    assert ids(b.running) == [1]
    assert bb.finish_reason is None and bb.state is SeqState.DECODING


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
    assert plan.chunks == (dec(0, 9, 6, (0, 1)),)
    assert step(b, plan, {0: 9}) == [a]
    assert a.num_tokens == 8
    assert a.finish_reason == "length"
    assert b.tables.pool.num_free == 8


def test_the_callers_verdicts_end_sequences_in_postprocess() -> None:
    """A stop string ends a sequence with "stop" even at its length limit; a complete grammar does too, unless the
    limit ended it first; a sequence without a verdict goes on."""
    b = make_batcher(16, 4)
    seqs = [make_seq(i, 3, max_new_tokens=1 if i in (2, 3) else 8) for i in range(5)]
    for seq in seqs:
        b.add(seq)
    verdicts = {
        0: Verdict(stop_string=True),
        1: Verdict(grammar_done=True),
        2: Verdict(stop_string=True),
        3: Verdict(grammar_done=True),
    }
    finished = b.postprocess(b.schedule(), {i: 7 for i in range(5)}, verdicts)
    b.tables.check_integrity()
    assert ids(finished) == [0, 1, 2, 3] and ids(b.running) == [4]
    assert [s.finish_reason for s in seqs] == ["stop", "stop", "stop", "length", None]
    assert b.tables.pool.num_free == 15


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

    plan = b.schedule()  # seq 1 decodes and seq 0's slot goes to seq 2; blocks 3.. were never used
    assert plan.chunks == (dec(1, 42, 4, (2, 3)), SeqChunk(2, (300, 301, 302, 303), 0, (4,)))
    assert ids(b.running) == [1, 2]
    step(b, plan, {1: 44, 2: 43})

    plan = b.schedule()
    assert plan.chunks == (dec(1, 44, 5, (2, 3)), dec(2, 43, 4, (4, 5)))


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
    assert plan.chunks == (dec(0, 10, 3, (0, 1)), dec(1, 11, 3, (2, 3)))
    step(b, plan, {0: 12, 1: 13})

    plan = b.schedule()  # both need a third block and none is free: seq 1 goes
    assert plan.chunks == (dec(0, 12, 4, (0, 1, 2)),)
    assert bb.state is SeqState.WAITING
    assert bb.num_cached == 0
    assert b.tables.table(1) == []
    assert ids(b.waiting) == [1, 2]  # in front of the sequence that never ran
    assert ids(b.running) == [0]
    assert b.num_preemptions == 1
    b.tables.check_integrity()
    step(b, plan, {0: 14})

    plan = b.schedule()  # seq 1 needs 3 blocks, 1 is free: seq 0 decodes on
    assert plan.chunks == (dec(0, 14, 5, (0, 1, 2)),)
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
    assert plan.chunks == (dec(0, 10, 4, (0, 1, 4)), dec(1, 11, 4, (2, 3, 5)))
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
    assert plan.chunks == (dec(0, 10, 4, (0, 1, 4)),)
    assert ids(b.waiting) == [1, 2, 3]
    assert ids(b.running) == [0]
    assert b.num_preemptions == 2
    assert [s.state for s in seqs] == [SeqState.DECODING, SeqState.WAITING, SeqState.WAITING]
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
    assert plan.chunks == (dec(0, 12, 4, (0, 1, 4)),)
    assert bb.state is SeqState.WAITING
    assert ids(b.waiting) == [1] and ids(b.running) == [0]
    assert b.tables.table(1) == []
    assert b.num_preemptions == 1
    b.tables.check_integrity()


# --- micro-batches -----------------------------------------------------------------------------


def chunk(seq_id: int, n: int) -> SeqChunk:
    return SeqChunk(seq_id, tuple(range(n)), 0, ())


def test_pack_micro_batches_fills_each_micro_batch_cutting_chunks() -> None:
    chunks = [chunk(i, n) for i, n in enumerate((3, 4, 2, 6, 1))]
    batches = split_micro_batches(chunks, max_tokens=7)
    assert [[(c.seq_id, c.start_pos, len(c.token_ids)) for c in mb.chunks] for mb in batches] == [
        [(0, 0, 3), (1, 0, 4)],
        [(2, 0, 2), (3, 0, 5)],
        [(3, 5, 1), (4, 0, 1)],
    ]
    assert [mb.num_tokens for mb in batches] == [7, 7, 2]


def test_pack_micro_batches_cuts_a_long_chunk_into_exact_pieces() -> None:
    long = SeqChunk(1, tuple(range(10)), 4, (7, 8, 9), wants_logits=True)
    chunks = [chunk(0, 2), long, chunk(2, 2), chunk(3, 3)]
    batches = split_micro_batches(chunks, max_tokens=5)
    assert batches == (
        MicroBatch((chunks[0], SeqChunk(1, (0, 1, 2), 4, (7, 8, 9), wants_logits=False))),
        MicroBatch((SeqChunk(1, (3, 4, 5, 6, 7), 7, (7, 8, 9), wants_logits=False),)),
        MicroBatch((SeqChunk(1, (8, 9), 12, (7, 8, 9)), chunks[2], SeqChunk(3, (0,), 0, (), wants_logits=False))),
        MicroBatch((SeqChunk(3, (1, 2), 1, ()),)),
    )
    # the pieces of a chunk cover its tokens once, in order, and only the last asks for logits
    pieces = [c for mb in batches for c in mb.chunks if c.seq_id == 1]
    assert sum((c.token_ids for c in pieces), ()) == long.token_ids
    assert [c.wants_logits for c in pieces] == [False, False, True]


def test_pack_micro_batches_edge_cases() -> None:
    assert split_micro_batches([], max_tokens=4) == ()
    one = [chunk(0, 1) for _ in range(5)]
    assert [len(mb.chunks) for mb in split_micro_batches(one, 2)] == [2, 2, 1]
    assert [len(mb.chunks) for mb in split_micro_batches(one, 1)] == [1, 1, 1, 1, 1]
    assert split_micro_batches([chunk(0, 4)], 4) == (MicroBatch((chunk(0, 4),)),)  # fits exactly: no cut


def test_step_plan_totals() -> None:
    decodes = [SeqChunk(1, (5,), 9, (), is_decode=True), SeqChunk(3, (6,), 4, (), is_decode=True)]
    chunks = [chunk(0, 3), decodes[0], chunk(2, 2), decodes[1]]
    plan = StepPlan(split_micro_batches(chunks, 5))
    assert plan.num_tokens == 7
    assert (plan.num_prefill_tokens, plan.num_decode_tokens) == (5, 2)
    assert plan.is_prefill
    assert [c.seq_id for c in plan.chunks] == [0, 1, 2, 2, 3]  # seq 2's chunk is cut across micro-batches
    assert not plan.all_logits
    decode_only = StepPlan(split_micro_batches(decodes, 5))
    assert (decode_only.num_prefill_tokens, decode_only.num_decode_tokens, decode_only.is_prefill) == (0, 2, False)


def test_batcher_packs_prefill_and_decode_into_micro_batches() -> None:
    b = make_batcher(32, 4, micro_batch_tokens=4)
    for i, n in enumerate((3, 2, 2, 5, 1)):
        b.add(make_seq(i, n))
    plan = b.schedule()
    assert [[(c.seq_id, len(c.token_ids)) for c in mb.chunks] for mb in plan.micro_batches] == [
        [(0, 3), (1, 1)],
        [(1, 1), (2, 2), (3, 1)],
        [(3, 4)],
        [(4, 1)],
    ]
    step(b, plan, {i: 9 for i in range(5)})
    assert [s.num_cached for s in b.running] == [3, 2, 2, 5, 1]
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


def check_plan(b: Batcher, plan: StepPlan) -> None:
    """What every plan must satisfy, checked against the sequences before postprocess."""
    lim = b.limits
    assert plan.num_tokens <= lim.max_step_tokens
    assert all(0 < mb.num_tokens <= lim.micro_batch_tokens for mb in plan.micro_batches)
    by_id = {s.seq_id: s for s in b.running}
    pieces: dict[int, list[SeqChunk]] = {}
    for c in plan.chunks:
        pieces.setdefault(c.seq_id, []).append(c)
    assert len(pieces) <= lim.max_running
    for seq_id, cs in pieces.items():
        seq = by_id[seq_id]
        assert seq.state in (SeqState.PREFILLING, SeqState.DECODING)
        start, end = seq.num_cached, cs[-1].context_len
        assert [c.start_pos for c in cs] == [start] + [c.context_len for c in cs[:-1]]  # contiguous pieces
        assert sum((c.token_ids for c in cs), ()) == tuple(seq.token_ids[start:end])
        assert [c.wants_logits for c in cs] == [False] * (len(cs) - 1) + [end == seq.num_tokens]
        assert all(c.is_decode == (seq.state is SeqState.DECODING) for c in cs)
        if seq.state is SeqState.DECODING:
            assert (start, end) == (seq.num_tokens - 1, seq.num_tokens)
        # blocks for the chunk's tokens only
        assert all(c.block_table == tuple(b.tables.table(seq_id)) for c in cs)
        assert len(cs[-1].block_table) == b.tables.blocks_for(end)


def check_state(b: Batcher) -> None:
    """Between steps: running sequences hold blocks for exactly their cached tokens, waiting ones none."""
    b.tables.check_integrity()
    for s in b.running:
        assert s.state in (SeqState.PREFILLING, SeqState.DECODING)
        assert len(b.tables.table(s.seq_id)) == b.tables.blocks_for(s.num_cached)
        assert s.num_uncached >= 1 and (s.state is SeqState.PREFILLING or s.num_uncached == 1)
    for s in b.waiting:
        assert s.state is SeqState.WAITING and s.num_cached == 0 and b.tables.table(s.seq_id) == []


def drive(b: Batcher, arrivals: dict[int, list[Sequence]], model, max_steps: int = 10_000) -> tuple[int, int]:
    """Run to completion with `model(seq_id, position) -> token`, adding arrivals[step] before that step.

    Checks every plan and the state after every step; returns (steps, preemptions of partly prefilled).
    """
    partial_preemptions = 0
    for n in range(max_steps):
        for seq in arrivals.get(n, []):
            b.add(seq)
        if not b.has_work and n > max(arrivals):
            return n, partial_preemptions
        partly_prefilled = [s for s in b.running if s.state is SeqState.PREFILLING and s.num_cached > 0]
        plan = b.schedule()
        b.tables.check_integrity()
        if b.has_work:
            assert plan.chunks, "a step with work left planned nothing"
        check_plan(b, plan)
        partial_preemptions += sum(s.state is SeqState.WAITING for s in partly_prefilled)
        b.postprocess(plan, {c.seq_id: model(c.seq_id, c.context_len) for c in plan.chunks if c.wants_logits})
        check_state(b)
    raise AssertionError("the run did not finish")


def expected_output(seq: Sequence, model, max_model_len: int) -> list[int]:
    out: list[int] = []
    n = len(seq.prompt_ids)
    while len(out) < seq.params.max_new_tokens and n + len(out) < max_model_len:
        out.append(model(seq.seq_id, n + len(out)))
        if out[-1] == EOS and not seq.params.ignore_eos:
            break
    return out


def test_full_run_under_pressure_completes_every_sequence() -> None:
    b = make_batcher(10, 2, max_num_seqs=4, max_step_tokens=12, micro_batch_tokens=5, max_model_len=20)
    prompts = (3, 7, 1, 5, 2, 9, 4, 6)
    max_new = (6, 4, 9, 3, 12, 2, 7, 5)
    seqs = [make_seq(i, prompts[i], max_new_tokens=max_new[i], ignore_eos=True) for i in range(8)]
    drive(b, {0: seqs}, token_for)
    assert b.num_preemptions > 0
    assert b.tables.pool.num_free == 10
    for s in seqs:
        assert s.finish_reason == "length"
        assert s.output_ids == expected_output(s, token_for, 20)


def test_random_workloads_respect_every_limit_and_lose_nothing() -> None:
    import random

    def model(seq_id: int, position: int) -> int:  # eos now and then
        return EOS if (seq_id * 7 + position) % 29 == 0 else token_for(seq_id, position)

    total_preemptions = total_partial = 0
    for seed in range(40):
        rng = random.Random(seed)
        block_size = rng.choice((1, 2, 3, 4, 8))
        max_model_len = rng.randint(8, 48)
        num_blocks = -(-max_model_len // block_size) + rng.randint(0, 12)
        b = make_batcher(
            num_blocks,
            block_size,
            max_num_seqs=rng.randint(1, 8),
            max_step_tokens=rng.randint(1, 24),
            micro_batch_tokens=rng.randint(1, 10),
            max_model_len=max_model_len,
        )
        arrivals: dict[int, list[Sequence]] = {}
        seqs = []
        for i in range(rng.randint(1, 12)):
            params = dict(max_new_tokens=rng.randint(1, 16), ignore_eos=rng.random() < 0.5)
            seq = make_seq(i, rng.randint(1, max_model_len - 1), **params)
            seqs.append(seq)
            arrivals.setdefault(rng.randint(0, 20), []).append(seq)
        _, partial = drive(b, arrivals, model)
        assert b.tables.pool.num_free == num_blocks, seed
        for s in seqs:
            assert s.is_finished and s.output_ids == expected_output(s, model, max_model_len), seed
        total_preemptions += b.num_preemptions
        total_partial += partial
    assert total_partial > 0 and total_preemptions > total_partial  # both kinds of preemption were exercised


def test_finish_by_caller_removes_a_waiting_sequence() -> None:
    batcher = make_batcher(num_blocks=4, block_size=4)
    seq = make_seq(0, 3)
    batcher.add(seq)
    batcher.finish(seq, "stop")
    assert not batcher.waiting and not batcher.has_work
    assert seq.state is SeqState.FINISHED and seq.finish_reason == "stop"
    batcher.tables.check_integrity()


# --- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import make_checkpoint

    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama")
    return path


def prompt_ids(lengths: tuple[int, ...]) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths]


PROMPT_LENGTHS = (37, 4, 19, 1, 26)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def unchunked(model_dir) -> list[tuple[int, ...]]:
    from offload.api import LLM
    from offload.common.config import EngineConfig

    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22, block_size=4))
    got = llm.generate_ids(prompt_ids(PROMPT_LENGTHS), GREEDY)
    assert llm.last_run.steps == 12 and llm.last_run.preemptions == 0  # one prefill step, then 11 decode steps
    return [c.token_ids for c in got]


@pytest.mark.parametrize(("max_step_tokens", "micro_batch_tokens"), [(5, 2048), (8, 3), (2, 1)])
def test_chunked_prefill_gives_the_same_greedy_tokens(model_dir, unchunked, max_step_tokens, micro_batch_tokens):
    from offload.api import LLM
    from offload.common.config import EngineConfig

    config = EngineConfig(
        kv_cache_bytes=1 << 22, block_size=4, max_step_tokens=max_step_tokens, micro_batch_tokens=micro_batch_tokens
    )
    llm = LLM(model_dir, config)
    got = llm.generate_ids(prompt_ids(PROMPT_LENGTHS), GREEDY)
    assert [c.token_ids for c in got] == unchunked
    run = llm.last_run
    assert run.steps > 12 and run.preemptions == 0
    assert run.prefill_seconds > 0 and run.decode_seconds > 0
    llm.check_integrity()
    assert llm.stats().kv_blocks_used == 0


def test_preempting_partly_prefilled_sequences_in_a_tiny_cache_loses_nothing(model_dir, unchunked, monkeypatch):
    from offload.api import LLM
    from offload.common.config import EngineConfig

    victims: list[tuple[SeqState, int]] = []
    preempt = Batcher._preempt

    def spy(self: Batcher, seq: Sequence) -> None:
        victims.append((seq.state, seq.num_cached))
        preempt(self, seq)

    monkeypatch.setattr(Batcher, "_preempt", spy)
    # 768 bytes per token (3 layers, K and V, 2 heads of 16 fp32): 13 blocks of 4 hold the longest request
    # (37 + 12 tokens) alone, a quarter of all five
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=768 * 52, block_size=4, max_step_tokens=6))
    assert llm.placement.kv_blocks == 13
    got = llm.generate_ids(prompt_ids(PROMPT_LENGTHS), GREEDY)
    assert [c.token_ids for c in got] == unchunked
    assert llm.last_run.preemptions == len(victims)
    assert any(state is SeqState.PREFILLING and cached > 0 for state, cached in victims), victims
    assert llm.last_run.peak_kv_blocks <= 13
    llm.check_integrity()
    assert llm.stats().kv_blocks_used == 0


def test_a_host_sequence_moves_up_only_when_every_device_sequence_can_grow_this_step_too() -> None:
    """Moving up must never force the same step to move a sequence down or preempt one (its blocks would be copied
    down before the copy up landed): the device part must hold the host sequence's blocks and this step's growth of
    it and of every device sequence."""
    block = 4
    tables = BlockTables(BlockPool(6, record=True), block)
    host = BlockTables(BlockPool(10, record=True), block)
    limits = BatchLimits(max_num_seqs=8, max_step_tokens=64, micro_batch_tokens=1000, max_model_len=24)
    b = Batcher(tables, limits, (EOS,), host_tables=host)
    decoding = make_seq(0, 9)  # 8 tokens cached in 2 blocks; its 9th needs a third block this step
    decoding.state, decoding.num_cached = SeqState.DECODING, 8
    tables.grow(0, 8)
    in_host = make_seq(1, 20)  # 12 of 20 tokens cached in 3 host blocks; this step may prefill the other 8 (2 blocks)
    in_host.state, in_host.num_cached, in_host.kv_tier = SeqState.PREFILLING, 12, Tier.HOST
    old = list(host.grow(1, 12))
    b.running.extend([decoding, in_host])
    b._move_up()  # 4 device blocks free, 3 + 2 + 1 needed
    assert in_host.kv_tier == Tier.HOST and b.num_moved_up == 0 and not tables.pool.events
    b.finish(decoding, "stop")  # its 2 blocks come back: 6 free
    b._move_up()
    assert in_host.kv_tier is Tier.DEVICE and b.num_moved_up == 1
    new = list(tables.table(1))
    assert tables.pool.events == tuple(MovedUp(dst, src) for dst, src in zip(new, old, strict=True))
    assert host.table(1) == [] and host.pool.num_free == 10
    plan = b.schedule()  # its chunk now runs over the device blocks: the copies are made before this step
    (chunk,) = plan.chunks
    assert chunk.kv_tier == "device" and chunk.block_table[:3] == tuple(new) and b.num_moved_down == 0
    tables.check_integrity()
    host.check_integrity()


class FixedPrices:
    """KVPrices with fixed answers, recording what `swap_pays` was asked."""

    def __init__(self, swap: bool = True, disk: bool = True) -> None:
        self.swap, self.disk = swap, disk
        self.asked: list[tuple[int, int]] = []

    def swap_pays(self, blocks: int, tokens: int) -> bool:
        self.asked.append((blocks, tokens))
        return self.swap

    def disk_pays(self) -> bool:
        return self.disk


@pytest.mark.parametrize("pays", [True, False])
def test_a_sequence_that_cannot_grow_moves_down_only_where_copying_pays(pays) -> None:
    """With room in the host part, a device sequence that cannot grow moves there when the prices say copying its
    blocks beats recomputing its tokens; otherwise it is preempted, and the refusal is counted."""
    block = 4
    tables = BlockTables(BlockPool(4, record=True), block)
    host = BlockTables(BlockPool(8, record=True), block)
    limits = BatchLimits(max_num_seqs=8, max_step_tokens=64, micro_batch_tokens=1000, max_model_len=24)
    prices = FixedPrices(swap=pays)
    asked = prices.asked
    b = Batcher(tables, limits, (EOS,), host_tables=host, prices=prices)
    old, new = make_seq(0, 9), make_seq(1, 9)
    for seq in (old, new):  # 8 tokens cached in 2 blocks each: the device part is full, and each needs a third
        seq.state, seq.num_cached = SeqState.DECODING, 8
        tables.grow(seq.seq_id, 8)
        b.running.append(seq)
    plan = b.schedule()
    assert asked == [(2, 8)]  # the latest admitted, with its 2 blocks and 8 cached tokens
    if pays:
        assert new.kv_tier is Tier.HOST and b.num_moved_down == 1 and b.num_preemptions == 0
        assert [e.source for e in host.pool.events] == [2, 3]  # its device blocks, copied before the next step
        assert {c.seq_id for c in plan.chunks} == {0, 1}
    else:
        assert new.state is SeqState.WAITING and b.num_preemptions == 1 and b.num_priced_out == 1
        assert b.num_moved_down == 0 and [c.seq_id for c in plan.chunks] == [0] and host.pool.num_free == 8
    tables.check_integrity()
    host.check_integrity()


class DiskOnlyLower:
    """Lower tiers holding every block of `held` on disk only, recording what they are asked to read ahead."""

    reads_ahead = True

    def __init__(self, held: dict[bytes, object]) -> None:
        self.held = held
        self.asked: list[list[bytes]] = []

    def count(self, keys, disk: bool = True) -> int:
        return sum(1 for _ in itertools.takewhile(self.held.__contains__, keys)) if disk else 0

    def fetch(self, keys) -> list[object]:
        return [self.held[k] for k in keys[: self.count(keys)]]

    def prefetch(self, keys, pool) -> None:
        self.asked.append(list(keys))

    def land(self, pool) -> None:
        pass


@pytest.mark.parametrize("disk_pays", [True, False])
def test_blocks_only_the_disk_holds_are_read_back_or_computed_as_the_prices_say(disk_pays) -> None:
    """Where reading a block from disk is priced above prefilling its tokens, a waiting sequence's prefix held only
    on disk counts as not cached (it is computed), and nothing is read ahead for those next in line."""
    root = chain_root({"model": "test"})
    first, second = list(range(10, 23)), list(range(30, 43))  # 13 tokens each: three full blocks, then one token
    keys = {tuple(t): extend_chain([], root, t, 4) for t in (first, second)}
    lower = DiskOnlyLower({k: "row" for ks in keys.values() for k in ks})
    tables = BlockTables(BlockPool(32, record=True), 4, root, lower)
    limits = BatchLimits(max_num_seqs=1, max_step_tokens=1000, micro_batch_tokens=1000, max_model_len=64)
    b = Batcher(tables, limits, (EOS,), prices=FixedPrices(disk=disk_pays))
    b.add(Sequence(0, first, SamplingParams()))
    b.add(Sequence(1, second, SamplingParams()))
    (chunk,) = b.schedule().chunks
    assert (chunk.seq_id, chunk.start_pos) == (0, 12 if disk_pays else 0)
    assert lower.asked == ([keys[tuple(second)]] if disk_pays else [])  # the one next in line
    assert tables.counters.promoted_blocks == (3 if disk_pays else 0)
    tables.check_integrity()
