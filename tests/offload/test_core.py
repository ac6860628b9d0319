"""The engine core: one loop that requests join and leave while it runs, token and text deltas, abort, stats."""

from __future__ import annotations

import math

import pytest
import torch

from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.model.detokenize import TextStream

PROMPTS = ["Hello there", "The cat", "A much longer prompt than the others, to make the batch ragged"]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, EngineConfig(kv_cache_bytes=1 << 22, block_size=4))


def run_to_end(core, rids) -> dict[int, list]:
    deltas: dict[int, list] = {rid: [] for rid in rids}
    while any(not d or d[-1].finish_reason is None for d in deltas.values()):
        for delta in core.step():
            deltas[delta.request_id].append(delta)
    return deltas


def test_request_ids_are_unique_for_the_life_of_the_core(llm):
    first = llm.core.add_request(llm.encode("Hello"), GREEDY)
    run_to_end(llm.core, [first])
    llm.generate(PROMPTS, GREEDY)
    later = llm.core.add_request(llm.encode("Hello"), GREEDY)
    assert later > first + len(PROMPTS)
    run_to_end(llm.core, [later])


def test_a_request_added_mid_run_joins_at_the_next_step_and_changes_nothing(llm):
    alone = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    core = llm.core
    a = core.add_request(llm.encode(PROMPTS[0]), GREEDY)
    deltas = {a: []}
    for _ in range(5):
        for d in core.step():
            deltas[d.request_id].append(d)
    b = core.add_request(llm.encode(PROMPTS[1]), GREEDY)
    deltas[b] = []
    step = core.step()  # b's prefill rides in the same step as a's decode
    assert sorted(d.request_id for d in step) == [a, b]
    for d in step:
        deltas[d.request_id].append(d)
    deltas.update({k: deltas[k] + v for k, v in run_to_end(core, [a, b]).items()})
    assert tuple(t for d in deltas[a] for t in d.token_ids) == alone[0]
    assert tuple(t for d in deltas[b] for t in d.token_ids) == alone[1]
    assert llm.stats().kv_blocks_used == 0


def test_abort_returns_the_blocks_at_once_and_ends_the_request(llm):
    core = llm.core
    keep, drop = (core.add_request(llm.encode(p), GREEDY) for p in PROMPTS[:2])
    core.step()
    core.step()
    used = llm.stats().kv_blocks_used
    assert core.abort(drop)
    assert llm.stats().kv_blocks_used < used and not core.abort(drop)
    llm.check_integrity()
    deltas = run_to_end(core, [keep, drop])
    assert [d.finish_reason for d in deltas[drop]] == ["abort"]  # its final delta, handed out by the next step
    assert deltas[drop][0].metrics.output_tokens == 2
    assert len(deltas[keep]) == GREEDY.max_new_tokens - 2 and deltas[keep][-1].finish_reason == "length"
    assert llm.stats().kv_blocks_used == 0 and not core.has_work


def test_abort_of_a_waiting_request_before_any_step(llm):
    core = llm.core
    rid = core.add_request(llm.encode("Hello"), GREEDY)
    assert core.num_waiting == 1 and core.abort(rid) and core.num_waiting == 0
    (final,) = core.step()
    assert final.finish_reason == "abort" and final.metrics.first_token is None


def test_streamed_text_concatenates_to_the_decoded_output(llm):
    """Random weights over a byte-level vocabulary emit invalid UTF-8 and split characters: the incremental
    decoder's deltas must still add up to exactly the decode of the whole output."""
    core = llm.core
    params = [SamplingParams(max_new_tokens=40, temperature=1.5, seed=s, ignore_eos=True) for s in range(6)]
    rids = [core.add_request(llm.encode(PROMPTS[s % 3]), p) for s, p in enumerate(params)]
    for deltas in run_to_end(core, rids).values():
        tokens = [t for d in deltas for t in d.token_ids]
        whole = llm.prompts.tokenizer.decode(tokens, skip_special_tokens=True)
        assert "".join(d.text for d in deltas) == whole


def test_a_stop_string_never_shows_in_a_delta(llm):
    full = llm.generate(PROMPTS[0], GREEDY)[0].text
    stop = full[5:8]  # text the greedy output reaches, so it must stop there
    core = llm.core
    rid = core.add_request(llm.encode(PROMPTS[0]), SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)))
    deltas = run_to_end(core, [rid])[rid]
    assert deltas[-1].finish_reason == "stop"
    assert "".join(d.text for d in deltas) == full[: full.index(stop)]
    assert (
        llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,)))[0].text
        == (full[: full.index(stop)])
    )


def test_text_stream_holds_back_what_may_become_a_stop_string():
    class Chars:  # a tokenizer whose token i is chr(i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    stream = TextStream(Chars(), ["END"], incremental=True)
    shown = []
    for ch in "abcEN":
        stream.push(ord(ch))
        shown.append(stream.take(final=False))
    assert shown == ["a", "b", "c", "", ""]  # "E", "EN" may begin "END"
    stream.push(ord("X"))
    assert stream.take(final=False) == "ENX" and not stream.stopped
    for ch in "yEND":
        stream.push(ord(ch))
    assert stream.stopped and stream.take(final=True) == "y"


def test_logprobs_are_the_models_distribution(llm):
    ids = llm.encode(PROMPTS[1])
    rid = llm.core.add_request(ids, SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=3))
    deltas = run_to_end(llm.core, [rid])[rid]
    tokens = [d.token_ids[0] for d in deltas]
    scored = llm.score([ids + tokens[:-1]])[0].log_softmax(-1)  # [positions, vocab]
    for k, d in enumerate(deltas):
        (lp,) = d.logprobs
        row = scored[len(ids) - 1 + k]
        assert lp.token_id == tokens[k] and math.isclose(lp.logprob, float(row[tokens[k]]), abs_tol=1e-4)
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()  # greedy: the sampled token is the first
        assert lp.top[0][0] == lp.token_id
    with pytest.raises(OffloadError, match="logprobs must be in 0..20, got 21"):
        SamplingParams(logprobs=21)


def test_counters_cover_the_cores_life_and_each_request_has_its_timeline(llm):
    before = llm.core.counters()
    llm.generate(PROMPTS, GREEDY)
    after = llm.core.counters()
    assert after.requests_added - before.requests_added == 3
    assert after.requests_finished - before.requests_finished == 3
    assert after.generated_tokens - before.generated_tokens == 3 * GREEDY.max_new_tokens
    assert after.steps - before.steps == llm.last_run.steps
    rid = llm.core.add_request(llm.encode(PROMPTS[0]), GREEDY)
    final = run_to_end(llm.core, [rid])[rid][-1]
    m = final.metrics
    assert m.prompt_tokens == len(llm.encode(PROMPTS[0])) and m.output_tokens == GREEDY.max_new_tokens
    assert m.arrival < m.first_token <= m.finished and m.time_per_output_token > 0


def test_a_bad_prompt_is_refused_before_any_request_is_added(llm):
    added = llm.core.counters().requests_added
    with pytest.raises(OffloadError, match="prompt 1: token id 99999 is outside the vocabulary"):
        llm.generate_ids([[5, 6], [99999]], GREEDY)
    assert llm.core.counters().requests_added == added and not llm.core.has_work


def test_chat_prompt_ids_are_the_templates_tokens_not_a_batch_encoding(llm):
    """transformers 5 returns a BatchEncoding from apply_chat_template, whose len() is its number of keys: what the
    planner once took for a chat prompt's length."""
    from offload.prompts import Prompts

    ids = Prompts(llm.model_dir, llm.prompts.tokenizer).encode_chat([{"role": "user", "content": "hello"}])
    assert all(isinstance(t, int) for t in ids) and len(ids) > len("hello")
    assert ids == llm.encode_chat([{"role": "user", "content": "hello"}])


def test_scoring_between_steps_leaves_running_requests_alone(llm):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    alone = llm.generate_ids([[5, 6, 7, 8, 9]], params)[0].token_ids
    rid = llm.core.add_request([5, 6, 7, 8, 9], params)
    first = [t for d in llm.core.step() if d.request_id == rid for t in d.token_ids]
    llm.score([[5, 6, 7, 8, 9, 10, 11], [3, 4]])  # its sequences must not take the running request's id or blocks
    rest = [t for d in run_to_end(llm.core, [rid])[rid] for t in d.token_ids]
    llm.check_integrity()
    assert tuple(first + rest) == alone
