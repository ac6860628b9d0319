"""Generation semantics: batching, eos, stop strings, limits, seeds, preemption, chat."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError

PROMPTS = ["Hello there", "The cat", "zzz", "A much longer prompt than the others, to make the batch ragged"]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22, block_size=4))


@pytest.fixture(scope="module")
def greedy_alone(llm):
    return [llm.generate(p, GREEDY)[0] for p in PROMPTS]


def test_batched_greedy_equals_one_at_a_time(llm, greedy_alone):
    batched = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in batched] == [c.token_ids for c in greedy_alone]
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in batched)
    assert llm.last_run.requests == 4 and llm.last_run.generated_tokens == 96
    assert llm.last_run.steps == 24  # one prefill step, then 23 decode steps
    llm.check_integrity()
    assert llm.stats().kv_blocks_used == 0


def test_micro_batches_do_not_change_results(model_dir, greedy_alone):
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22, block_size=4, micro_batch_tokens=8))
    assert [c.token_ids for c in llm.generate(PROMPTS, GREEDY)] == [c.token_ids for c in greedy_alone]


def test_preemption_when_kv_runs_out_recomputes_and_loses_nothing(model_dir, greedy_alone):
    # 3 layers * 2 * 2 kv heads * 16 dims * 4 bytes = 768 bytes/token; 72 KiB = 96 tokens = 24 blocks of 4,
    # enough for the longest request alone (63 + 24 tokens), not for all four (about 190)
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=72 << 10, block_size=4))
    assert llm.placement.kv_blocks == 24
    got = llm.generate(PROMPTS, GREEDY)
    assert llm.last_run.preemptions > 0
    assert llm.last_run.peak_kv_blocks <= 24
    assert [c.token_ids for c in got] == [c.token_ids for c in greedy_alone]
    llm.check_integrity()


def test_max_num_seqs_limits_the_running_set(model_dir, greedy_alone):
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22, max_num_seqs=2))
    got = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in got] == [c.token_ids for c in greedy_alone]
    assert llm.last_run.steps > 24  # the last two prompts joined when the first two finished


def test_eos_stops_a_sequence(model_dir, greedy_alone, tmp_path):
    tokens = greedy_alone[0].token_ids
    eos = tokens[5]
    first = tokens.index(eos)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 2]}))
    try:
        llm = LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22))
        (c,) = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=24))
    finally:
        (model_dir / "generation_config.json").unlink()
    assert c.token_ids == tokens[: first + 1]
    assert c.finish_reason == "stop"


def test_max_new_tokens(llm, greedy_alone):
    (c,) = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert c.token_ids == greedy_alone[1].token_ids[:5]
    assert c.finish_reason == "length"


def test_stop_string_ends_and_trims_the_text(llm, greedy_alone):
    text = greedy_alone[0].text
    match = re.search(r"[A-Za-z0-9_]{2}", text[3:])
    assert match, f"no ASCII pair to stop on in {text!r}"
    stop = match.group(0)
    (c,) = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop, "never")))
    assert c.finish_reason == "stop"
    assert c.text == text[: text.index(stop)]
    assert len(c.token_ids) < 24


def test_context_window_ends_generation(model_dir):
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=768 * 32, block_size=4))  # a 32-token window
    assert llm.placement.max_model_len == 32
    (c,) = llm.generate("0123456789", SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert c.prompt_tokens == 11 and len(c.token_ids) == 21 and c.finish_reason == "length"


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)
    alone = llm.generate(PROMPTS[2], params)
    other = llm.generate(
        PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)
    )
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert alone[0].token_ids == first[2].token_ids  # a request's draws do not depend on its batch
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_top_k_one_is_greedy(llm, greedy_alone):
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=1, seed=1, ignore_eos=True)
    assert llm.generate(PROMPTS[3], params)[0].token_ids == greedy_alone[3].token_ids


def test_chat_applies_the_template(llm):
    conv = [{"role": "user", "content": "hi"}]
    (c,) = llm.chat([conv], SamplingParams(max_new_tokens=4, ignore_eos=True))
    expected = llm.prompts.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert c.prompt_tokens == len(llm.prompts.tokenizer(expected, add_special_tokens=False)["input_ids"])
    assert len(c.token_ids) == 4


def test_stats_and_placement(llm):
    llm.generate(PROMPTS, GREEDY)
    s, p = llm.last_run, llm.placement
    assert s.prompt_tokens == sum(len(llm.encode(x)) for x in PROMPTS)
    assert s.prefill_seconds > 0 and s.decode_seconds > 0 and s.tokens_per_second > 0
    assert p.device == "cpu" and p.dtype == "float32"
    params = llm.spec.vocab_size * llm.spec.hidden_size  # the token table alone
    assert p.weight_bytes >= params * 4
    assert p.kv_bytes == p.kv_blocks * p.kv_block_bytes


def test_token_ids_need_no_tokenizer(model_dir, greedy_alone, tmp_path):
    import shutil

    from offload.common.errors import OffloadError

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "chat_template*"))
    llm = LLM(bare, EngineConfig(kv_cache_bytes=1 << 22, block_size=4))
    ids = LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22)).encode(PROMPTS[0])
    (c,) = llm.generate_ids([ids], GREEDY)
    assert c.token_ids == greedy_alone[0].token_ids and c.text == ""
    with pytest.raises(OffloadError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")


def test_each_prompt_may_have_its_own_sampling_params(tmp_path):
    """Per-request lengths and seeds in one batch: each request as if it ran alone."""
    make_checkpoint(tmp_path, "llama")
    llm = LLM(tmp_path, EngineConfig(kv_cache_bytes=1 << 20))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [
        SamplingParams(max_new_tokens=2, ignore_eos=True),
        SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=1.0, seed=3),
        SamplingParams(max_new_tokens=1, ignore_eos=True),
    ]
    together = llm.generate_ids(prompts, params)
    assert [len(c.token_ids) for c in together] == [2, 5, 1]
    alone = [llm.generate_ids([ids], p)[0].token_ids for ids, p in zip(prompts, params, strict=True)]
    assert [c.token_ids for c in together] == alone
    with pytest.raises(OffloadError, match="2 sampling params for 3 prompts"):
        llm.generate_ids(prompts, params[:2])


@pytest.fixture
def probed(tmp_path, monkeypatch):
    """Saves `offload probe`'s per-backend read rates (GB/s) as this machine's profile, in a temporary cache."""
    import dataclasses

    from offload.planner.profiles import load_profile, local_profile_path, save_profile

    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))

    def save(**gbps: float) -> None:
        rates = {backend: rate * 1e9 for backend, rate in gbps.items()}
        save_profile(dataclasses.replace(load_profile("t4-16gb"), disk_read_by_backend=rates), local_profile_path())

    return save


def test_auto_io_backend_follows_the_probe(model_dir, probed, monkeypatch):
    from offload.cli import _summary
    from offload.tiers.io import aio

    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4)
    assert config.io_backend == "auto"
    probed(pread=1.02, aio=0.88)
    llm = LLM(model_dir, config)
    assert llm.placement.io_backend == ("pread", "probe: 1.02 vs aio 0.88 GB/s")
    completions = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    assert "\ni/o        backend pread (probe: 1.02 vs aio 0.88 GB/s)" in _summary(llm, completions)
    probed(pread=1.02, aio=1.5)
    monkeypatch.setattr(aio, "_load_op", functools.cache(lambda: "libaio is missing"))
    assert LLM(model_dir, config).placement.io_backend == (
        "pread",
        "probe measured aio, but its op is not built or loadable now",
    )
    pread = LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22, block_size=4, io_backend="pread"))
    assert pread.placement.io_backend == ("pread", "asked")


def test_auto_io_backend_takes_aio_where_the_probe_found_it_faster(model_dir, probed, greedy_alone):
    from offload.tiers.io.aio import aio_unavailable

    if (why := aio_unavailable()) is not None:
        pytest.skip(f"aio backend unavailable here: {why}")
    probed(pread=1.02, aio=1.5)
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22, block_size=4))
    assert llm.placement.io_backend == ("aio", "probe: 1.50 vs pread 1.02 GB/s")
    assert llm.stats().weights.bytes_read > 0  # the checkpoint came through it
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == greedy_alone[0].token_ids


def test_auto_io_backend_without_a_probe_keeps_the_default(model_dir, probed):
    import torch

    from offload.planner.profiles import local_profile_path
    from offload.tiers.io.aio import aio_ready

    default = "aio" if torch.cuda.is_available() and aio_ready() else "pread"
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=4)
    assert LLM(model_dir, config).placement.io_backend == (default, "no probe: default")  # no profile in the cache
    assert not local_profile_path().exists()  # read if there, never measured now
    probed(pread=1.02)  # an older probe, or aio unavailable when it ran
    assert LLM(model_dir, config).placement.io_backend == (default, "probe measured pread alone: default")
    local_profile_path().write_text("{")
    with pytest.raises(OffloadError, match=f"{local_profile_path()}: not valid JSON"):
        LLM(model_dir, config)


def test_io_backend_is_checked():
    with pytest.raises(OffloadError, match="io_backend must be one of auto, pread, aio, got 'nvme'"):
        EngineConfig(io_backend="nvme")


def test_expert_prefetch_is_checked():
    with pytest.raises(OffloadError, match="expert_prefetch must be one of router, frequency, got 'lru'"):
        EngineConfig(expert_prefetch="lru")


def test_a_cpu_without_the_native_kernels_runs_torchs_paths_and_says_why(model_dir, monkeypatch):
    """A CPU with neither AVX-512 BF16 nor AMX, simulated by the flags the feature checks read: every kernel takes
    torch's path, the logits are float32 still, and the run summary says why the native kernels are off."""
    from offload.cli import _summary
    from offload.kernels import dispatch, native, native_build

    monkeypatch.delenv("OFFLOAD_KERNELS", raising=False)
    monkeypatch.setattr(native_build, "_cpu", lambda key: "sse2 avx avx2 fma" if key == "flags" else "a laptop")
    native.forget()
    try:
        llm = LLM(model_dir, EngineConfig(kv_cache_bytes=1 << 22, block_size=4, dtype="bfloat16"))
        completions = llm.generate(PROMPTS[:2], SamplingParams(max_new_tokens=3))
        picked = dispatch.picked()
        assert {picked[k] for k in ("rms_norm", "rotary", "argmax", "logits")} == {"torch"}
        assert "cpu paths  native off (the CPU lacks avx512bw, avx512_bf16, avx512vbmi)" in _summary(llm, completions)
        assert llm.score([[5, 6, 7, 8]])[0].dtype == torch.float32
    finally:
        monkeypatch.undo()
        native.forget()
