"""What the endpoints' clients ask of the core besides tokens: each prompt token's logprob (OpenAI's echo, SGLang's
logprob_start_len), prompt-only requests that leave their prefix cached (SGLang's fork), stop token ids and min-p,
all through the one scheduled step loop."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError

PROMPT = list(range(3, 3 + 30))  # 30 token ids: 7 full blocks of 4 and 2 more


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt_logprobs")
    make_checkpoint(path, "llama", dtype=torch.float32)
    return path


def engine(model_dir, **config) -> LLM:
    return LLM(model_dir, EngineConfig(block_size=4, **{"kv_cache_bytes": 1 << 22} | config))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    """Every request's deltas, in the order of `prompts`."""
    rids = [llm.core.add_request(p, params) for p in prompts]
    deltas = {rid: [] for rid in rids}
    while llm.core.has_work:
        for d in llm.core.step():
            deltas[d.request_id].append(d)
    return [deltas[r] for r in rids]


def reference(llm: LLM, ids: list[int]) -> torch.Tensor:
    """logprob of ids[p] given ids[:p], for p = 1 .., from the core's scoring path (every position in one step)."""
    lp = llm.score([ids])[0].log_softmax(-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@pytest.mark.parametrize("config", [{}, {"max_step_tokens": 8, "micro_batch_tokens": 4}], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_the_scored_ones_however_the_prompt_is_cut(model_dir, config) -> None:
    with engine(model_dir, **config) as llm:
        want = reference(llm, PROMPT)
        top_want = llm.score([PROMPT])[0].log_softmax(-1).topk(3)
        (deltas,) = run(llm, [PROMPT], SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=3))
    first = deltas[0].prompt_logprobs
    assert len(first) == len(PROMPT) and first[0] is None
    assert [e.token_id for e in first[1:]] == PROMPT[1:]
    torch.testing.assert_close(torch.tensor([e.logprob for e in first[1:]]), want, atol=1e-4, rtol=0)
    for p, e in enumerate(first[1:]):  # position p's logits give token p + 1's alternatives
        assert [t for t, _ in e.top] == top_want.indices[p].tolist()
    assert all(not d.prompt_logprobs for d in deltas[1:])  # once, on the first delta


def test_prompt_logprobs_from_a_start_position_and_past_the_prefix_cache(model_dir) -> None:
    with engine(model_dir) as llm:
        want = reference(llm, PROMPT)
        run(llm, [PROMPT], SamplingParams(max_new_tokens=1))  # caches the prompt's 7 full blocks
        before = llm.core.counters()
        (deltas,) = run(llm, [PROMPT], SamplingParams(max_new_tokens=1, prompt_logprobs=0, prompt_logprobs_start=21))
        ran = llm.core.counters() - before
    entries = deltas[0].prompt_logprobs
    assert len(entries) == len(PROMPT) - 21 and all(e.top == () for e in entries)
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), want[20:], atol=1e-4, rtol=0)
    # position 20's logits are needed: the cache gives whole blocks before it (20 tokens), the rest is computed
    assert ran.prefix_hit_tokens == 20 and ran.prefill_tokens == len(PROMPT) - 20
    assert deltas[-1].metrics.cached_tokens == 20


def test_a_prompt_only_request_leaves_its_prefix_for_the_next(model_dir) -> None:
    with engine(model_dir) as llm:
        (prefill,) = run(llm, [PROMPT], SamplingParams(max_new_tokens=0, prompt_logprobs=1))
        assert len(prefill) == 1 and prefill[0].token_ids == () and prefill[0].finish_reason == "length"
        assert len(prefill[0].prompt_logprobs) == len(PROMPT) and prefill[0].metrics.output_tokens == 0
        assert llm.stats().kv_blocks_used == 0
        before = llm.core.counters()
        branches = run(llm, [PROMPT + [40 + i] for i in range(4)], SamplingParams(max_new_tokens=3, ignore_eos=True))
        ran = llm.core.counters() - before
    # each branch computes only what follows the cached blocks: 2 prompt tokens and its own
    assert ran.prefill_tokens == 4 * 3 and [b[-1].metrics.cached_tokens for b in branches] == [28] * 4
    assert ran.generated_tokens == 4 * 3


def test_a_stop_token_id_ends_the_request_with_it(model_dir) -> None:
    with engine(model_dir) as llm:
        (plain,) = run(llm, [PROMPT], SamplingParams(max_new_tokens=8, ignore_eos=True))
        tokens = [t for d in plain for t in d.token_ids]
        stop = tokens[3]
        (ended,) = run(llm, [PROMPT], SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=(stop,)))
    got = [t for d in ended for t in d.token_ids]
    assert got == tokens[: tokens.index(stop) + 1] and ended[-1].finish_reason == "stop"


def test_min_p_of_one_samples_the_most_likely_token(model_dir) -> None:
    with engine(model_dir) as llm:
        greedy = llm.generate_ids([PROMPT], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
        hot = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.5, min_p=1.0, seed=3)
        assert llm.generate_ids([PROMPT], hot)[0].token_ids == greedy


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in 0..20"),
        ({"prompt_logprobs_start": -1}, "prompt_logprobs_start must be >= 0"),
        ({"min_p": 1.5}, "min_p must be in"),
    ],
)
def test_bad_fields_are_refused_by_name(fields, message) -> None:
    with pytest.raises(OffloadError, match=message):
        SamplingParams(**fields)


def test_a_start_past_the_prompt_is_refused(model_dir) -> None:
    with engine(model_dir) as llm, pytest.raises(OffloadError, match="prompt_logprobs_start 30 is past"):
        llm.core.add_request(PROMPT, SamplingParams(prompt_logprobs=1, prompt_logprobs_start=30))
