"""The engine core: the one step loop that `LLM.generate`, the server and batch jobs all drive.

    core = EngineCore(engine, tables, limits, eos_ids, tokenizer)
    ids = core.check_prompt(prompt_ids)                        # the one check of a prompt, before it is added
    rid = core.add_request(ids, SamplingParams(...))           # joins the batch at the next step
    for delta in core.step(): ...                              # new tokens and text of every request it advanced
    core.abort(rid)                                            # its KV blocks go back to the pool now
    core.abort_all()                                           # every request ends; their final deltas
    logits = core.score([ids])                                 # a prompt's logits, through the same engine step

Request ids are unique for the life of the core and double as the scheduler's sequence ids. The core is
single-threaded: whoever drives it from several threads (the server's front) serializes the calls. It keeps run
statistics over its lifetime (`counters()`) and per request (`RequestMetrics`, on each request's last delta).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.common.config import SamplingParams
from offload.common.errors import OffloadError
from offload.common.outputs import CoreCounters, Delta, RequestMetrics, TokenLogprob
from offload.model.detokenize import TextStream
from offload.model.engine import Engine, StepOutput
from offload.model.sampling import sample
from offload.model.speculation.acceptance import accept
from offload.model.speculation.drafters import Drafter
from offload.model.speculation.tree import as_draft
from offload.model.structured import Grammars
from offload.scheduler.batcher import Batcher, BatchLimits, Verdict
from offload.scheduler.kv_prices import KVPrices
from offload.scheduler.plan import SeqChunk, StepPlan, split_micro_batches
from offload.scheduler.sequence import SeqState, Sequence
from offload.tiers.kv.blocks import BlockTables
from offload.tiers.kv.lower_tiers import KVTiers
from offload.tiers.weights.weight_store import WeightStore

PREFILL_SAMPLE = 64  # prefill tokens a step must compute to measure the prefill rate (below, decode dominates)


@dataclass(slots=True, eq=False)
class _Request:
    seq: Sequence
    generator: torch.Generator | None
    text: TextStream | None
    arrival: float
    first_token: float | None = None
    matcher: object | None = None  # llguidance.LLMatcher: a constrained request's grammar state
    prompt_logprobs: dict[int, TokenLogprob] | None = None  # by position, as the steps compute them; None once given


class EngineCore:
    def __init__(
        self,
        engine: Engine,
        tables: BlockTables,
        limits: BatchLimits,
        eos_ids: tuple[int, ...],
        weights: WeightStore,
        tokenizer: Callable[[], object] | None,
        kv_tiers: KVTiers | None = None,
        host_tables: BlockTables | None = None,
        drafter: Drafter | None = None,
        num_draft: int = 4,
    ) -> None:
        """`tokenizer` returns the model's tokenizer; None: token ids in, token ids out.
        `kv_tiers`: the host and disk parts of the KV pool, settled before every step (None: the device part only);
        `host_tables`: its host part's tables, for sequences admitted when the device part is full."""
        self.engine, self.tables, self.limits, self.weights = engine, tables, limits, weights
        self.kv_tiers = kv_tiers
        # KV moves against recomputing, priced at the rates the KV tiers and the prefill steps measure
        self.kv_prices = KVPrices(tables.block_size, kv_tiers.counters) if kv_tiers is not None else None
        self.batcher = Batcher(tables, limits, eos_ids, host_tables, self.kv_prices)
        self._tokenizer = tokenizer
        self.drafter, self.num_draft = drafter, num_draft  # speculative decoding: up to num_draft tokens a step
        self.grammars = Grammars(tokenizer, engine.spec.vocab_size, eos_ids)
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self._aborted: list[Delta] = []  # final deltas of aborted requests, handed out by the next step
        # the CoreCounters the core keeps (the others the weight store, the batcher and the KV pool keep): name -> total
        self._totals: defaultdict[str, float] = defaultdict(int)
        self.peak_kv_blocks = 0

    # ---- requests -------------------------------------------------------------------------------

    def check_prompt(self, ids: list[int], index: int | str = 0) -> list[int]:
        """`ids` if a request may start from them, else OffloadError naming prompt `index`: the one check a prompt
        passes on its way in, made by the face that takes it (`add_request` trusts it was)."""
        if not ids:
            raise OffloadError(f"prompt {index} encodes to no tokens")
        if len(ids) >= self.limits.max_model_len:
            spec, kv = self.engine.spec, self.engine.kv
            blocks = max(c.num_blocks for c in self.engine.caches.values())
            raise OffloadError(
                f"prompt {index} has {len(ids)} tokens; the context window is {self.limits.max_model_len} tokens "
                f"(max_position_embeddings {spec.max_position}, KV cache {blocks * kv.block_size} tokens) "
                "and must leave room for one new token"
            )
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.engine.spec.vocab_size)]
        if bad:
            raise OffloadError(
                f"prompt {index}: token id {bad[0]!r} is outside the vocabulary of {self.engine.spec.vocab_size}"
            )
        return ids

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        stream_text: bool = True,
        priority: int = 0,
    ) -> int:
        """Queue a request for `prompt_ids` (passed by `check_prompt`); it joins the batch at the next step.
        `stream_text`: hand out its text token by token (else all of it on the last delta, decoded once). `priority`:
        its admission class, a lower one first. Returns its id."""
        params = params or SamplingParams()
        rid = self._next_id
        ids = list(prompt_ids)
        if params.stop and self._tokenizer is None:
            raise OffloadError("stop strings need a tokenizer, and this model has none")
        if params.prompt_logprobs is not None and params.prompt_logprobs_start >= len(ids):
            raise OffloadError(
                f"prompt_logprobs_start {params.prompt_logprobs_start} is past the prompt's last token "
                f"(it has {len(ids)})"
            )
        matcher = self.grammars.matcher(params)  # OffloadError naming the field if the constraint does not compile
        text = None if self._tokenizer is None else TextStream(self._tokenizer(), params.stop, stream_text)
        seeded = params.seed is not None
        generator = torch.Generator(device=self.engine.device).manual_seed(params.seed) if seeded else None
        self._next_id += 1
        seq = Sequence(rid, ids, params, priority=priority)
        self._requests[rid] = _Request(seq, generator, text, time.perf_counter(), matcher=matcher)
        if params.prompt_logprobs is not None:
            self._requests[rid].prompt_logprobs = {}
        self.batcher.add(self._requests[rid].seq)
        self._totals["requests_added"] += 1
        self._totals["prompt_tokens"] += len(ids)
        return rid

    def abort(self, request_id: int) -> bool:
        """End a request now: its blocks return to the pool and the next step hands out its final delta
        (finish_reason "abort"). False if it is not running or waiting (finished, aborted or unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.batcher.finish(req.seq, "abort")
        self._totals["requests_aborted"] += 1
        self._aborted.append(self._final(req, (), "", time.perf_counter(), ()))
        return True

    def abort_all(self) -> list[Delta]:
        """End every request now (finish_reason "abort"); the final deltas not handed out yet, theirs included."""
        for request_id in list(self._requests):
            self.abort(request_id)
        return self.step()  # nothing left to run: it only hands out the final deltas

    @property
    def has_work(self) -> bool:
        return self.batcher.has_work or bool(self._aborted)

    @property
    def num_running(self) -> int:
        return len(self.batcher.running)

    @property
    def num_waiting(self) -> int:
        return len(self.batcher.waiting)

    def counters(self) -> CoreCounters:
        io = self.weights.stats
        parts = [t.counters for t in (self.tables, self.batcher.host_tables) if t is not None]  # device, host
        moved = self.kv_tiers.counters if self.kv_tiers is not None else None
        return CoreCounters(
            **{
                **self._totals,
                "preemptions": self.batcher.num_preemptions,
                "moved_down": self.batcher.num_moved_down,
                "moved_up": self.batcher.num_moved_up,
            },
            bytes_read=io.bytes_read,
            h2d_bytes=io.h2d_bytes,
            read_seconds=io.read_seconds,
            stall_seconds=io.stall_seconds,
            prefix_lookup_tokens=sum(c.lookup_tokens for c in parts),
            prefix_hit_tokens=sum(c.hit_tokens for c in parts),
            kv_bytes_down=moved.bytes_down if moved else 0,
            kv_bytes_up=moved.bytes_up if moved else 0,
            kv_blocks_prefetched=moved.prefetched if moved else 0,
        )

    # ---- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[Delta]:
        """Advance every scheduled request by one step; a delta for each request that got a token (or finished).
        Nothing to do: returns the final deltas of requests aborted since the last step, if any."""
        deltas, self._aborted = self._aborted, []
        if not self.batcher.has_work:
            return deltas
        drafting = self._draft()  # seconds, in the step's time: a speculating run's rates are what its user waits
        plan = self.batcher.schedule()
        start = time.perf_counter()
        sampled = [self._requests[c.seq_id] for c in plan.chunks if c.wants_logits]
        masks = self.grammars.start_masks([r.matcher for r in sampled])  # computed while the layers run
        out = self._run(plan)
        drafted = {c.seq_id: c.drafted for c in plan.chunks if c.wants_logits and c.drafted}
        verify = self._score_prompts(out.scored, drafted)
        reqs = [self._requests[i] for i in out.seq_ids]
        logits = out.logits if masks is None else masks.apply(out.logits)
        sampled = sample(logits, [r.seq.params for r in reqs], [r.generator for r in reqs])
        # a prompt-only request (max_new_tokens 0) ends with its prefill: its row's token is not taken
        taken = [r.seq.params.max_new_tokens > 0 for r in reqs]
        tokens, logprobs, verdicts = [], [], {}
        for i, (r, token) in enumerate(zip(reqs, sampled, strict=True)):
            rows = out.logits[i : i + 1]
            path = None  # the rows that chose a tree's tokens
            if r.seq.seq_id in verify:  # the drafted positions' logits, then its last one's
                rows = torch.cat([verify[r.seq.seq_id], rows])
                token, path = accept(rows, r.seq.draft, r.seq.draft_parents, token, r.seq.params, r.generator)
                self._totals["drafted_tokens"] += rows.shape[0] - 1
                self._totals["verify_passes"] += 1
                self._totals["draft_depth"] += r.seq.draft_depth
            kept, verdicts[r.seq.seq_id] = self._walk(r, (token,) if isinstance(token, int) else token, taken[i])
            self._totals["accepted_tokens"] += len(kept) - 1
            tokens.append(kept)
            chose = rows[: len(kept)] if path is None else rows[path[: len(kept)]]
            logprobs.append(tuple(_logprobs(chose, list(kept), [r.seq.params.logprobs] * len(kept))))
        now = time.perf_counter()
        if self.kv_prices is not None and plan.num_prefill_tokens >= PREFILL_SAMPLE:  # the cost of recomputing KV
            self.kv_prices.observe_prefill(plan.num_prefill_tokens, now - start)
        kind = "prefill_seconds" if plan.num_prefill_tokens else "decode_seconds"
        self._totals[kind] += now - start + drafting
        emitted = sum(len(t) for t, k in zip(tokens, taken, strict=True) if k)
        if not plan.num_prefill_tokens:
            self._totals["decode_tokens"] += emitted
        self._totals["prefill_tokens"] += plan.num_prefill_tokens
        self._totals["steps"] += 1
        self.peak_kv_blocks = max(self.peak_kv_blocks, self.tables.num_used)
        self._totals["generated_tokens"] += emitted
        self.batcher.postprocess(plan, dict(zip(out.seq_ids, tokens, strict=True)), verdicts)
        for req, token, lp, k in zip(reqs, tokens, logprobs, taken, strict=True):
            if k:
                deltas.append(self._advance(req, token, lp, now))
            else:
                del self._requests[req.seq.seq_id]
                deltas.append(self._final(req, (), "", now, ()))
        return deltas

    def _draft(self) -> float:
        """Each decoding request's draft for the next step (none for a request held to a grammar), all of them
        proposed in one call: a draft model drafts them as one batch. Returns the seconds it took."""
        if self.drafter is None:
            return 0.0
        start, reqs = time.perf_counter(), self._requests
        seqs = [s for s in self.batcher.running if s.state is SeqState.DECODING and reqs[s.seq_id].matcher is None]
        for seq, draft in zip(seqs, self.drafter.propose([s.token_ids for s in seqs], self.num_draft), strict=True):
            seq.draft, seq.draft_parents = as_draft(draft, self.engine.family.tree_attention)
        return time.perf_counter() - start

    def _walk(self, req: _Request, tokens: tuple[int, ...], taken: bool) -> tuple[tuple[int, ...], Verdict]:
        """The tokens a request keeps of those a step gave it: up to the first that ends it (fed to its grammar and
        text on the way), and what the last one's verdict is."""
        if not taken:
            return tokens[:1], Verdict()
        for n, token in enumerate(tokens, 1):
            verdict = self._verdict(req, token)
            if n == len(tokens) or self.batcher.finish_reason(req.seq, verdict, tokens[:n]):
                return tokens[:n], verdict
        raise AssertionError("unreachable: the last token returns")

    def _score_prompts(
        self, scored: tuple[tuple[int, int, torch.Tensor], ...], drafted: dict[int, int]
    ) -> dict[int, torch.Tensor]:
        """Keep the logprobs of the prompt tokens the step's scored positions predict (position p's logits give
        token p + 1's), with the top alternatives each request asked for; the logits of drafted positions (a chunk
        cut across micro-batches has them in pieces) are returned by request id instead."""
        verify: dict[int, list[torch.Tensor]] = {}
        for seq_id, first, logits in scored:
            if seq_id in drafted:
                verify.setdefault(seq_id, []).append(logits)
                continue
            req = self._requests[seq_id]
            prompt = req.seq.prompt_ids
            targets = prompt[first + 1 : first + 1 + logits.shape[0]]
            wanted = [req.seq.params.prompt_logprobs] * len(targets)
            for k, lp in enumerate(_logprobs(logits, targets, wanted)):
                req.prompt_logprobs[first + 1 + k] = lp
        return {seq_id: torch.cat(parts) for seq_id, parts in verify.items()}

    def _given_prompt_logprobs(self, req: _Request) -> tuple[TokenLogprob | None, ...]:
        """The prompt's logprobs, on the first delta that goes out (then never again)."""
        got, req.prompt_logprobs = req.prompt_logprobs, None
        if got is None:
            return ()
        return tuple(
            got[p] if p else None for p in range(req.seq.params.prompt_logprobs_start, len(req.seq.prompt_ids))
        )

    def _run(self, plan: StepPlan) -> StepOutput:
        """The engine's step over `plan`, once the KV tiers did what the pools logged (evicted blocks go down first)."""
        self._settle_kv()
        return self.engine.step(plan)

    def _settle_kv(self) -> None:
        if self.kv_tiers is not None:
            self.kv_tiers.settle(self.tables.pool)

    def _verdict(self, req: _Request, token: int) -> Verdict:
        """Feed a sampled token to the request's grammar and text: whether it completes the grammar or reaches a stop
        string (what that ends, the batcher's post-process decides)."""
        grammar_done = req.matcher is not None and self.grammars.advance(req.matcher, token)
        if req.text is not None:
            req.text.push(token)
        return Verdict(stop_string=req.text is not None and req.text.stopped, grammar_done=grammar_done)

    def _advance(self, req: _Request, tokens: tuple[int, ...], logprobs: tuple, now: float) -> Delta:
        seq = req.seq
        req.first_token = req.first_token or now
        text = "" if req.text is None else req.text.take(final=seq.is_finished)
        lps = tuple(lp for lp in logprobs if lp is not None)
        if not seq.is_finished:
            return Delta(seq.seq_id, tokens, text, now, logprobs=lps, prompt_logprobs=self._given_prompt_logprobs(req))
        del self._requests[seq.seq_id]
        return self._final(req, tokens, text, now, lps)

    def _final(self, req: _Request, tokens: tuple[int, ...], text: str, now: float, lps: tuple) -> Delta:
        seq = req.seq
        if seq.finish_reason == "abort" and req.text is not None:
            text = req.text.take(final=False)  # what was safe to show; no stop string can complete now
        self._totals["requests_finished"] += 1
        metrics = RequestMetrics(
            req.arrival, req.first_token, now, len(seq.prompt_ids), len(seq.output_ids), seq.prompt_cached
        )
        prompt_lps = self._given_prompt_logprobs(req) if seq.finish_reason != "abort" else ()
        return Delta(seq.seq_id, tokens, text, now, seq.finish_reason, lps, metrics, prompt_lps)

    # ---- scoring and the KV pool ------------------------------------------------------------------

    def score(self, prompt_ids: list[list[int]]) -> list[torch.Tensor]:
        """Logits [len(ids), vocab] (float32) at every position of each token list (each checked as a prompt), as
        many lists per step as the device part of the KV cache holds; running requests keep their ids and blocks."""
        pending = [(-1 - i, self.check_prompt(list(t), i)) for i, t in enumerate(prompt_ids)]  # ids no request has
        result: list[torch.Tensor] = []
        while pending:
            chunks = self._grow_scored(pending)
            plan = StepPlan(split_micro_batches(chunks, self.limits.micro_batch_tokens), all_logits=True)
            result.extend(self._run(plan).logits.split([len(c.token_ids) for c in chunks]))
            for c in chunks:
                self.tables.free(c.seq_id)
        return result

    def _grow_scored(self, pending: list[tuple[int, list[int]]]) -> list[SeqChunk]:
        """Chunks of whole token lists from the front of `pending`, while their blocks fit the device part."""
        chunks = []
        while pending and (table := self.tables.grow(pending[0][0], len(pending[0][1]))) is not None:
            seq_id, ids = pending.pop(0)
            chunks.append(SeqChunk(seq_id, tuple(ids), 0, tuple(table)))
        if not chunks:
            raise OffloadError("a prompt does not fit the KV cache")  # check_prompt makes this unreachable
        return chunks

    def reset_prefix_cache(self) -> None:
        """Forget the prefix blocks cached on the device and in host RAM (blocks running requests hold stay); the disk
        tier, which persists across runs, keeps its blocks."""
        self.tables.pool.drop_cached()
        self._settle_kv()  # what the pools logged lands (in host RAM, on disk) before the host part is cleared
        if self.kv_tiers is not None:
            self.kv_tiers.clear_host()

    def flush_kv(self) -> None:
        """The blocks the steps so far computed, written through to disk, and the disk's index made durable."""
        self._settle_kv()
        if self.kv_tiers is not None:
            self.kv_tiers.flush()

    def close(self) -> None:
        """Stop the grammar worker and the drafter; the blocks the last step computed go through to disk."""
        self.grammars.close()
        if self.drafter is not None:
            self.drafter.close()
        self._settle_kv()


def _logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int | None]) -> list[TokenLogprob | None]:
    """The sampled tokens' logprobs, with `wanted` top alternatives, for the rows that asked (else None)."""
    result: list[TokenLogprob | None] = [None] * len(tokens)
    rows = [i for i, n in enumerate(wanted) if n is not None]
    if not rows:
        return result
    lp = logits[rows].log_softmax(-1)  # [rows, vocab] float32
    top = lp.topk(max(max(wanted[i] for i in rows), 1), dim=-1)
    for k, i in enumerate(rows):
        n = wanted[i]
        alternatives = tuple(zip(top.indices[k, :n].tolist(), top.values[k, :n].tolist(), strict=True))
        result[i] = TokenLogprob(tokens[i], float(lp[k, tokens[i]]), alternatives)
    return result
