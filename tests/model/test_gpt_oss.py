"""gpt-oss against transformers' own implementation, on a tiny random checkpoint: attention sinks, sliding and full
layers alternating (a window shorter than the prompts), biased projections, YaRN, the biased router's softmax over
the chosen experts and the clamped SwiGLU of stacked experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError

ATOL = 1e-4


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("gpt-oss")
    return path, make_checkpoint(path, "gpt_oss")


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths]


def test_spec_reads_sinks_windows_experts_and_yarn(gpt_oss):
    path, _ = gpt_oss
    with LLM(path, EngineConfig(kv_cache_bytes=1 << 22)) as llm:
        spec = llm.spec
    assert spec.attention_sinks and spec.qkv_bias and spec.o_bias and spec.rope.kind == "yarn"
    assert spec.sliding_windows == (7, None, 7, None) and spec.num_experts == 4 and spec.experts_per_token == 2
    assert spec.swiglu_limit == 7.0 and spec.total_params == sum(p.numel() for p in gpt_oss[1].parameters())


@pytest.mark.parametrize("micro_batch_tokens", [4096, 13])
def test_prefill_logits_match_transformers(gpt_oss, micro_batch_tokens):
    path, model = gpt_oss
    batch = prompts((5, 17, 30, 1))
    with LLM(path, EngineConfig(kv_cache_bytes=1 << 22, block_size=4, micro_batch_tokens=micro_batch_tokens)) as llm:
        scored = llm.score(batch)
    for ids, ours in zip(batch, scored, strict=True):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(ours.cpu(), want, atol=ATOL, rtol=0)


def test_greedy_tokens_match_transformers_resident_and_streamed(gpt_oss):
    path, model = gpt_oss
    batch = prompts((4, 9, 23), seed=2)
    model.generation_config.eos_token_id = None
    expected = []
    for ids in batch:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with LLM(path, EngineConfig(kv_cache_bytes=1 << 22, block_size=8)) as llm:
        assert [list(c.token_ids) for c in llm.generate_ids(batch, params)] == expected
        layer = llm.parts.weights.store.acquire(0)
        assert "qkv_proj" in layer and layer["expert3.gate_up_proj"].shape == (64, 192)
        budget = llm.stats().device_used - llm.parts.kv.cache.nbytes  # all weights resident
    # half the layers' bytes: the rest stream from disk, whole (experts and all)
    streamed = EngineConfig(kv_cache_bytes=1 << 22, block_size=8, device_memory=(1 << 22) + budget * 3 // 4)
    with LLM(path, streamed) as llm:
        assert "nvme" in llm.placement.layer_tiers
        assert [list(c.token_ids) for c in llm.generate_ids(batch, params)] == expected
    assert all(len(set(e)) >= 4 for e in expected), "degenerate reference: the comparison would be weak"


def test_streaming_by_expert_reads_each_experts_rows_of_the_stacked_tensors(gpt_oss):
    """Each expert is its row of every stacked tensor: through an expert cache of two experts' bytes, only the
    chosen ones are read, and the tokens are transformers'."""
    path, model = gpt_oss
    batch = prompts((4, 9, 23), seed=2)
    model.generation_config.eos_token_id = None
    expected = []
    for ids in batch:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    expert = 4 * (64 * 192 + 192 + 96 * 64 + 64)  # float32 bytes of one expert's four rows
    config = EngineConfig(kv_cache_bytes=1 << 22, block_size=8, expert_cache_memory=2 * expert + (64 << 10))
    with LLM(path, config) as llm:
        got = llm.generate_ids(batch, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert [list(c.token_ids) for c in got] == expected
        assert llm.parts.experts is not None and "expert0.gate_up_proj" not in llm.parts.weights.store.acquire(0)


def test_bfloat16_packs_linear_weights_and_keeps_the_experts_input_major(gpt_oss, monkeypatch):
    """In bfloat16 the CPU may pack matrices multiplied as linear weights (q/k/v, o, the router); the experts'
    input-major matrices stay as stored. Packed or not, the logits are the same up to the GEMM's order of sums,
    and no farther from float32 transformers' than transformers' own bfloat16 is."""
    import copy
    import functools

    from offload import build
    from offload.tiers.weights import WeightStore

    path, model = gpt_oss
    ids = prompts((30,))[0]
    config = EngineConfig(kv_cache_bytes=1 << 22, dtype="bfloat16")
    with LLM(path, config) as llm:
        layer = llm.parts.weights.store.acquire(0)
        assert not layer["expert0.gate_up_proj"].is_mkldnn and layer["expert0.gate_up_proj"].shape == (64, 192)
        if llm.parts.weights.store.prepack:
            assert layer["qkv_proj"].is_mkldnn and layer["router"].is_mkldnn
        got = llm.score([ids])[0].float()
    monkeypatch.setattr(build, "WeightStore", functools.partial(WeightStore, prepack=False))
    with LLM(path, config) as llm:
        torch.testing.assert_close(got, llm.score([ids])[0].float(), atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].float()
        theirs = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    # this tiny random mixture is sensitive to rounding (transformers' own bfloat16 lies 23% of the logits' norm
    # from its float32): ours must lie no farther
    assert float((got - want).norm() / want.norm()) < 1.2 * float((theirs - want).norm() / want.norm())


def test_mxfp4_experts_are_refused_by_name(gpt_oss, tmp_path):
    path, _ = gpt_oss
    mxfp4 = tmp_path / "mxfp4"
    mxfp4.mkdir()
    for f in path.iterdir():
        (mxfp4 / f.name).write_bytes(f.read_bytes())
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn"]}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(OffloadError, match="quant_method 'mxfp4' is not run by this engine"):
        LLM(mxfp4)


def test_a_row_of_a_stacked_tensor_is_its_own_extent_and_bad_rows_are_named(gpt_oss):
    from offload.tiers.checkpoint import Checkpoint
    from offload.tiers.io.buffered import BufferedReader

    path, model = gpt_oss
    name = "model.layers.1.mlp.experts.down_proj"
    with BufferedReader() as reader:
        checkpoint = Checkpoint(path, reader)
        whole = checkpoint.check(name, (4, 96, 64))
        row = checkpoint.check(name, (96, 64), row=2)
        assert (row.offset, row.nbytes) == (whole.offset + 2 * whole.nbytes // 4, whole.nbytes // 4)
        assert torch.equal(checkpoint.read(row), model.model.layers[1].mlp.experts.down_proj[2].detach())
        with pytest.raises(OffloadError, match=f"tensor {name} has shape \\[4, 96, 64\\], expected rows of"):
            checkpoint.check(name, (96, 64), row=4)
        with pytest.raises(OffloadError, match="expected rows of \\[64, 96\\]"):
            checkpoint.check(name, (64, 96), row=0)
