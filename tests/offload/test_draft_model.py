"""A draft model as the drafter (`--speculate PATH`, `--speculate self`): a second engine core drafting every
speculating sequence of a step as one batch; greedy output stays the target's own, the draft's bytes are charged to
the target's budget, a draft of another tokenizer is refused, `self` is converted once and reused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_speculative import GREEDY, PROMPTS

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.common.paths import cache_dir
from offload.draft_core import tensor_bytes
from offload.model.speculation.model_drafter import ModelDrafter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_checkpoint(path, "llama", dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another random model of the same tokenizer: a draft that mostly disagrees."""
    path = tmp_path_factory.mktemp("other")
    make_checkpoint(path, "llama", dtype=torch.float32, seed=1, num_hidden_layers=1)
    return path


def run(model_dir, prompts, params, **config):
    with LLM(model_dir, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, **config)) as llm:
        out = llm.generate_ids(prompts, params)
        llm.check_integrity()
        return [c.token_ids for c in out], llm.core.counters(), llm


@pytest.mark.parametrize("config", [{}, {"max_step_tokens": 6, "micro_batch_tokens": 4}], ids=str)
def test_self_greedy_output_is_the_targets_own(target, config) -> None:
    plain, _, _ = run(target, PROMPTS, GREEDY, **config)
    fast, counters, llm = run(target, PROMPTS, GREEDY, speculate="self", **config)
    assert fast == plain
    assert counters.drafted_tokens > 0 and counters.accepted_tokens > 0
    assert counters.steps < 3 * GREEDY.max_new_tokens  # accepted drafts saved steps
    assert isinstance(llm.core.drafter, ModelDrafter)
    assert llm.core.drafter.model_dir.parent == cache_dir() / "draft"  # the float target's int4 copy


def test_self_with_the_drafts_runners_up_keeps_the_targets_output_and_takes_more_a_pass(target) -> None:
    plain, _, _ = run(target, PROMPTS, GREEDY)
    chain, by_chain, _ = run(target, PROMPTS, GREEDY, speculate="self", num_speculative_tokens=4)
    tree, by_tree, llm = run(target, PROMPTS, GREEDY, speculate="self", num_speculative_tokens=4, speculative_topk=3)
    assert tree == chain == plain
    # each drafted position offers two runners-up: up to 3 x 4 drafted rows a pass, and a runner-up the target
    # chooses gives a pass one more token than the chain's
    assert by_tree.drafted_tokens > 2 * by_chain.drafted_tokens
    assert by_tree.accepted_tokens / by_tree.verify_passes > by_chain.accepted_tokens / by_chain.verify_passes


def test_self_shares_the_targets_token_table_and_head(target) -> None:
    """`self`'s table and head are the target's bytes (the converter copies them): the target holds the draft's
    tensors, so the process holds them once and the draft is charged its layers and KV cache alone."""
    plain, _, _ = run(target, PROMPTS, GREEDY)
    budget = 64 << 20
    fast, counters, llm = run(target, PROMPTS, GREEDY, speculate="self", device_memory=budget)
    assert fast == plain
    drafter, store = llm.core.drafter, llm.parts.weights.store
    draft = drafter.core.weights  # the draft engine's weight store
    assert set(drafter.shared) == {"embed", "head"}
    assert store.embed["embed"] is draft.embed["embed"] and store.head["lm_head"] is draft.head["lm_head"]
    assert drafter.nbytes == draft.device_tier.peak - tensor_bytes(drafter.shared) > 0
    assert llm.config.device_memory == budget - drafter.nbytes
    # a step's time holds its drafting: the run's rates are what its user waits
    assert counters.prefill_seconds + counters.decode_seconds >= drafter.seconds > 0


def test_self_is_converted_once_and_reused(target) -> None:
    run(target, PROMPTS[:1], SamplingParams(max_new_tokens=2), speculate="self")
    (copy,) = (cache_dir() / "draft").glob(f"{target.name}-int4-g32-cpu-*")
    config = json.loads((copy / "config.json").read_text())
    assert config["quantization_config"]["bits"] == 4 and config["quantization_config"]["group_size"] == 32
    written = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    _, _, llm = run(target, PROMPTS[:1], SamplingParams(max_new_tokens=2), speculate="self")
    assert llm.core.drafter.model_dir == copy
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == written  # nothing rewritten


def test_an_int4_target_is_its_own_draft(target, tmp_path) -> None:
    from offload.common.quant import WeightQuant
    from offload.convert.quantize import convert

    int4 = tmp_path / "int4"
    convert(target, int4, WeightQuant(4, 32, "cpu"))
    plain, _, _ = run(int4, PROMPTS, GREEDY)
    fast, counters, llm = run(int4, PROMPTS, GREEDY, speculate="self")
    assert fast == plain and llm.core.drafter.model_dir == int4
    # the same weights draft what the target says: nearly every draft passes (a verify row may round apart)
    assert counters.accepted_tokens >= 0.9 * counters.drafted_tokens > 0


def test_a_draft_model_path_keeps_the_targets_output(target, other) -> None:
    plain, _, _ = run(target, PROMPTS, GREEDY)
    fast, counters, llm = run(target, PROMPTS, GREEDY, speculate=str(other))
    assert fast == plain
    assert counters.drafted_tokens > 0 and llm.core.drafter.model_dir == other


def test_seeded_sampling_with_a_draft_model_is_reproducible(target) -> None:
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.7, seed=11)
    once, counters, _ = run(target, PROMPTS, params, speculate="self")
    again, _, _ = run(target, PROMPTS, params, speculate="self")
    assert once == again and counters.drafted_tokens > 0


def test_the_draft_is_charged_to_the_budget(target, other) -> None:
    budget = 64 << 20
    _, _, llm = run(target, PROMPTS[:1], SamplingParams(max_new_tokens=2), speculate=str(other), device_memory=budget)
    drafter = llm.core.drafter
    assert drafter.nbytes > 0 and not drafter.shared  # another model's table is not the target's
    assert llm.given_config.device_memory == budget
    assert llm.config.device_memory == budget - drafter.nbytes  # the target placed its layers in what is left
    with pytest.raises(OffloadError, match="leaves nothing for the model once its draft"):
        run(target, PROMPTS[:1], GREEDY, speculate=str(other), device_memory=drafter.nbytes)


def test_one_call_drafts_every_sequence_as_the_draft_alone_would(target, other) -> None:
    """A batch of sequences drafted in one call gets, for each, the draft model's own greedy continuation."""
    with LLM(target, EngineConfig(block_size=4, kv_cache_bytes=1 << 22, speculate=str(other))) as llm:
        drafter = llm.core.drafter
        drafts = drafter.propose(PROMPTS, 5)
        again = drafter.propose(PROMPTS, 5)  # served from the draft's prefix cache: the same tokens
    alone, _, _ = run(other, PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert drafts == again == [tuple(t) for t in alone]
    assert drafter.calls == 2


def test_a_draft_of_another_tokenizer_is_refused(target, other, tmp_path) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(other, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped: same size, other ids
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(OffloadError) as err:
        run(target, PROMPTS[:1], GREEDY, speculate=str(draft))
    message = str(err.value)
    assert "\n" not in message and str(draft) in message and str(target) in message
    assert "tokenizer" in message


def test_a_missing_draft_is_refused_by_the_config() -> None:
    with pytest.raises(OffloadError, match="speculate must be ngram, self or a draft model"):
        EngineConfig(speculate="/no/such/draft")


@pytest.mark.slow
@pytest.mark.fixed_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_real_model_answers_the_same_with_its_int4_draft(smollm2_float, dtype) -> None:
    """SmolLM2-135M-Instruct as float weights drafted by its own int4 copy (`self`, converted once): greedy output
    is the plain output token for token on the native CPU path, and most drafts pass."""
    ask = [{"role": "user", "content": "What are three good habits for staying healthy? Explain each briefly."}]
    out = {}
    for speculate in (None, "self"):
        with LLM(smollm2_float, EngineConfig(dtype=dtype, speculate=speculate, kv_cache_bytes=32 << 20)) as llm:
            (reply,) = llm.generate_ids([llm.encode_chat(ask)], SamplingParams(max_new_tokens=32))
            out[speculate] = (reply.token_ids, llm.core.counters())
    assert out["self"][0] == out[None][0]
    counters = out["self"][1]
    assert counters.accepted_tokens >= 0.5 * counters.drafted_tokens and counters.steps < out[None][1].steps


@pytest.mark.slow
@pytest.mark.fixed_kernels
def test_a_gguf_file_drafts_for_the_real_model(smollm2_float, smollm2_gguf) -> None:
    """A GGUF file as `--speculate PATH`, resolved as --model resolves it, drafts for the float model."""
    ask = [{"role": "user", "content": "Describe your ideal weekend in a few sentences."}]
    out = {}
    for speculate in (None, str(smollm2_gguf)):
        with LLM(smollm2_float, EngineConfig(speculate=speculate, kv_cache_bytes=32 << 20)) as llm:
            (reply,) = llm.generate_ids([llm.encode_chat(ask)], SamplingParams(max_new_tokens=24))
            out[speculate] = (reply.token_ids, llm.core.counters())
    assert out[str(smollm2_gguf)][0] == out[None][0]
    assert out[str(smollm2_gguf)][1].accepted_tokens > 0
