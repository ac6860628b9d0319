"""Continuous batching: which sequences run in the next step, admitted by KV capacity.

A step either prefills newly admitted sequences or decodes one token for every running one.
Finished sequences leave after their step and free their blocks; waiting ones join at the next
step. When a decode step cannot get a block, the most recently admitted sequence is preempted: its
blocks are freed and it waits at the front of the queue, to be recomputed from its tokens so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.plan import SeqChunk, StepPlan, pack_micro_batches
from scheduler.sequence import SeqState, Sequence
from tiers.kv import BlockTables


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_num_seqs: int  # sequences per step
    max_step_tokens: int  # prefill tokens per step (a longer prompt runs alone)
    micro_batch_tokens: int  # tokens per micro-batch
    max_model_len: int  # prompt + output tokens of one sequence; must fit the KV cache alone


class Batcher:
    def __init__(self, tables: BlockTables, limits: BatchLimits, eos_ids: tuple[int, ...] = ()) -> None:
        if tables.blocks_for(limits.max_model_len) > tables.pool.num_blocks:
            raise ValueError(f"max_model_len {limits.max_model_len} does not fit the KV cache")
        self.tables = tables
        self.limits = limits
        self.eos_ids = frozenset(eos_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.limits.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens, max_model_len is {self.limits.max_model_len}"
            )
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = self._schedule_prefill()
        return plan if plan is not None else self._schedule_decode()

    def _schedule_prefill(self) -> StepPlan | None:
        chunks: list[SeqChunk] = []
        tokens = 0
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            if chunks and tokens + seq.num_tokens > self.limits.max_step_tokens:
                break
            table = self.tables.grow(seq.seq_id, seq.num_tokens)
            if table is None:
                break
            self.waiting.popleft()
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            chunks.append(SeqChunk(seq.seq_id, tuple(seq.token_ids), 0, tuple(table)))
            tokens += seq.num_tokens
        if not chunks:
            return None
        return StepPlan(pack_micro_batches(chunks, self.limits.micro_batch_tokens), is_prefill=True)

    def _schedule_decode(self) -> StepPlan:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.tables.can_grow(seq.seq_id, seq.num_tokens):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.tables.grow(seq.seq_id, seq.num_tokens)
                scheduled.append(seq)
        self.running.extend(scheduled)
        chunks = [
            SeqChunk(s.seq_id, (s.token_ids[-1],), s.num_tokens - 1, tuple(self.tables.table(s.seq_id)))
            for s in scheduled
        ]
        return StepPlan(pack_micro_batches(chunks, self.limits.micro_batch_tokens), is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        self.tables.free(seq.seq_id)
        seq.state = SeqState.WAITING
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, plan: StepPlan, next_tokens: dict[int, int]) -> list[Sequence]:
        """Record each sequence's sampled token; return the sequences that finished this step."""
        by_id = {s.seq_id: s for s in self.running}
        finished = []
        for chunk in plan.chunks:
            seq = by_id[chunk.seq_id]
            seq.num_cached = chunk.context_len
            seq.output_ids.append(next_tokens[chunk.seq_id])
            reason = self._finish_reason(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence) -> str | None:
        if not seq.params.ignore_eos and seq.output_ids[-1] in self.eos_ids:
            return "stop"
        if len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.limits.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` now (eos, length, or a stop string the caller found) and free its blocks."""
        self.tables.free(seq.seq_id)
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
