"""Speculative decoding: drafted tokens verified in the same step as a sequence's next token, greedy output the
target's own, sampled output distributed as the target's, rejected positions never cached."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.model.speculation.acceptance import accept_draft
from offload.model.speculation.drafters import NgramDrafter
from offload.planner.speculation import DEFAULT_K, acceptance

# prompts that repeat themselves, so that prompt lookup has something to propose
PROMPTS = [[3, 4, 5, 6, 7, 8] * 3, [20, 21, 22, 20, 21, 22, 20, 21], [40 + i for i in range(11)]]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("speculative")
    make_checkpoint(path, "llama", dtype=torch.float32)
    return path


def run(model_dir, prompts, params, speculate="ngram", **config):
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, speculate=speculate, **config)) as llm:
        out = llm.generate_ids(prompts, params)
        llm.check_integrity()
        assert llm.stats().kv_blocks_used == 0
        return out, llm.core.counters()


def test_a_run_keeps_its_acceptance_for_the_models_plans(model_dir) -> None:
    longer = dataclasses.replace(GREEDY, max_new_tokens=64)
    _, counters = run(model_dir, PROMPTS, longer)  # no chain length given, no profile saved: the default's
    assert counters.verify_passes > 0 and counters.drafted_tokens >= DEFAULT_K * counters.verify_passes // 2
    got = acceptance(model_dir, "ngram")  # this module's earlier runs of the model are in it too
    assert got.source.startswith("measured") and 0 < got.value < 1


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    drafter = NgramDrafter(min_n=1, max_n=3)
    assert drafter.lookup([1, 2, 9, 1, 2, 7, 1, 2], 2) == (7, 1)  # the latest (1, 2) before the end
    assert drafter.lookup([5, 1, 2, 3, 6, 2, 3], 4) == (6, 2, 3, 6)  # past the end, the run after (2, 3) repeats
    assert drafter.lookup([9, 7, 7], 3) == (7, 7, 7)
    assert drafter.lookup([1, 2, 3], 4) == ()  # nothing repeats
    assert drafter.lookup([256, 1, 256], 2) == (1, 256)  # whole tokens only, never bytes inside one
    assert drafter.propose([[9, 7, 7], [1, 2, 3]], 2) == [(7, 7), ()]  # one draft per sequence, in order


@pytest.mark.parametrize(
    "config", [{}, {"max_step_tokens": 6, "micro_batch_tokens": 4}, {"prefix_cache": False}], ids=str
)
def test_greedy_output_is_the_targets_own(model_dir, config) -> None:
    plain, _ = run(model_dir, PROMPTS, GREEDY, speculate=None, **config)
    fast, counters = run(model_dir, PROMPTS, GREEDY, **config)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert counters.drafted_tokens > 0 and counters.accepted_tokens > 0  # the drafts were checked, some passed


def test_fewer_steps_where_drafts_pass(model_dir) -> None:
    _, plain = run(model_dir, PROMPTS[:1], GREEDY, speculate=None)
    _, fast = run(model_dir, PROMPTS[:1], GREEDY)
    assert fast.generated_tokens == plain.generated_tokens == GREEDY.max_new_tokens
    assert fast.steps == plain.steps - fast.accepted_tokens  # every accepted token saved one step


class Oracle:
    """A drafter that knows the plain run's output: every draft passes unless the request ends inside it."""

    def __init__(self, prompt: list[int], output: tuple[int, ...]) -> None:
        self.prompt, self.output = prompt, output

    def propose(self, sequences, k):
        return [tuple(self.output[len(ids) - len(self.prompt) :][:k]) for ids in sequences]

    def close(self):
        pass


def deltas(model_dir, prompt, params, drafter=None) -> list:
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22)) as llm:
        llm.core.drafter = drafter
        rid, out = llm.core.add_request(prompt, params), []
        while llm.core.has_work:
            out += [d for d in llm.core.step() if d.request_id == rid]
        return out


@pytest.mark.parametrize("end", ["length", "stop"])
def test_an_accepted_draft_stops_where_the_request_ends(model_dir, end) -> None:
    (plain,), _ = run(model_dir, PROMPTS[:1], GREEDY, speculate=None)
    oracle = Oracle(PROMPTS[0], plain.token_ids)
    stop = plain.token_ids[10]
    assert stop not in plain.token_ids[:10]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2)
    params = dataclasses.replace(params, max_new_tokens=10) if end == "length" else params
    params = dataclasses.replace(params, stop_token_ids=(stop,)) if end == "stop" else params
    want, got = deltas(model_dir, PROMPTS[0], params), deltas(model_dir, PROMPTS[0], params, oracle)
    tokens = [t for d in got for t in d.token_ids]
    assert tokens == [t for d in want for t in d.token_ids] == list(plain.token_ids[: 10 if end == "length" else 11])
    assert len(got) == 3  # the first token, then drafts of 4 passing: 1 + 5 + the rest, cut where it ends
    assert got[-1].finish_reason == want[-1].finish_reason == end
    lps = [lp for d in got for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == tokens and all(len(lp.top) == 2 for lp in lps)
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in lps]), torch.tensor([lp.logprob for d in want for lp in d.logprobs])
    )


def test_blocks_cached_while_speculating_hold_the_accepted_tokens(model_dir) -> None:
    """A later request whose prompt is the earlier one's prompt and output shares its cached blocks; it continues
    as one computed from scratch does only if those blocks hold the accepted tokens' keys, not rejected ones'."""
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, speculate="ngram")) as llm:
        (first,) = llm.generate_ids(PROMPTS[:1], GREEDY)
        follow = PROMPTS[0] + list(first.token_ids[:20])
        before = llm.core.counters()
        (cont,) = llm.generate_ids([follow], SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert (llm.core.counters() - before).prefix_hit_tokens >= 32
    (fresh,), _ = run(model_dir, [follow], SamplingParams(max_new_tokens=8, ignore_eos=True), prefix_cache=False)
    assert cont.token_ids == fresh.token_ids


def test_seeded_sampling_with_drafts_is_reproducible(model_dir) -> None:
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.7, seed=11)
    once, _ = run(model_dir, PROMPTS, params)
    again, _ = run(model_dir, PROMPTS, params)
    assert [c.token_ids for c in once] == [c.token_ids for c in again]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of `counts` against `probs` (categories expecting >= 5 only)."""
    expected = probs * counts.sum()
    keep = expected >= 5
    rest = expected[~keep].sum(), counts[~keep].sum()
    exp = torch.cat([expected[keep], rest[0].reshape(1)]) if rest[0] > 0 else expected[keep]
    got = torch.cat([counts[keep], rest[1].reshape(1)]) if rest[0] > 0 else counts[keep]
    stat = ((got - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2.0), stat / 2))


@pytest.mark.parametrize("draft_rank", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_rejection_sampling_keeps_the_targets_distribution(draft_rank) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 12) * 1.5
    params = SamplingParams(temperature=0.8, top_k=8)
    first = [filter_probs(logits[0], params), filter_probs(logits[1], params)]
    draft = (int(first[0].argsort(descending=True)[draft_rank]), int(first[1].argmax()))
    gen = torch.Generator().manual_seed(5)
    counts, seconds = torch.zeros(12), torch.zeros(12)
    for _ in range(10_000):
        out = accept_draft(logits, draft, 0, params, gen)
        counts[out[0]] += 1
        if out[0] == draft[0]:
            seconds[out[1]] += 1
    assert chi_square_p(counts, first[0]) > 0.01  # the first token: as the target alone samples it
    assert chi_square_p(seconds, first[1]) > 0.01  # the second, given the first was the draft's


def filter_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from offload.model.sampling import filter_logits

    return filter_logits(row, params).softmax(-1)


def test_a_greedy_draft_is_accepted_while_it_agrees() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 3]):
        logits[row, best] = 5.0
    assert accept_draft(logits, (2, 4, 1), 3, SamplingParams(), None) == (2, 4, 1, 3)
    assert accept_draft(logits, (2, 5, 1), 3, SamplingParams(), None) == (2, 4)


def test_an_unknown_method_is_refused() -> None:
    with pytest.raises(OffloadError, match="speculate must be ngram, self or a draft model's directory or GGUF file"):
        EngineConfig(speculate="medusa")  # no such method, and no such file


@pytest.mark.slow
@pytest.mark.fixed_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_real_model_answers_the_same_with_and_without_drafts(smollm2_gguf, dtype) -> None:
    """A verify step's rows get the logits a one-row step gives them on the native CPU path (the kernels at their
    fixed thresholds): greedy output is the plain output token for token, on a reply that copies its input."""
    passage = "The quick brown fox jumps over the lazy dog. " * 3 + "Then it ran home to sleep."
    ask = [{"role": "user", "content": f"Copy this text exactly:\n\n{passage}"}]
    out = {}
    for speculate in (None, "ngram"):
        with LLM(smollm2_gguf, EngineConfig(dtype=dtype, speculate=speculate, kv_cache_bytes=64 << 20)) as llm:
            (reply,) = llm.generate_ids([llm.encode_chat(ask)], SamplingParams(max_new_tokens=40))
            out[speculate] = (reply.token_ids, llm.core.counters())
    assert out["ngram"][0] == out[None][0]
    assert out["ngram"][1].accepted_tokens >= 10 and out["ngram"][1].steps < out[None][1].steps
