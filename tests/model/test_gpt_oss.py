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
        assert "qkv_proj" in layer and layer["experts.gate_up_proj"].shape == (4, 64, 192)
        budget = llm.stats().device_used - llm.parts.kv.cache.nbytes  # all weights resident
    # half the layers' bytes: the rest stream from disk, whole (experts and all)
    streamed = EngineConfig(kv_cache_bytes=1 << 22, block_size=8, device_memory=(1 << 22) + budget * 3 // 4)
    with LLM(path, streamed) as llm:
        assert "nvme" in llm.placement.layer_tiers
        assert [list(c.token_ids) for c in llm.generate_ids(batch, params)] == expected
    assert all(len(set(e)) >= 4 for e in expected), "degenerate reference: the comparison would be weak"


def test_expert_streaming_and_mxfp4_are_refused_by_name(gpt_oss, tmp_path):
    path, _ = gpt_oss
    with pytest.raises(OffloadError, match="stores them stacked, and they stream with their layers"):
        LLM(path, EngineConfig(kv_cache_bytes=1 << 22, expert_cache_memory=1 << 20))
    mxfp4 = tmp_path / "mxfp4"
    mxfp4.mkdir()
    for f in path.iterdir():
        (mxfp4 / f.name).write_bytes(f.read_bytes())
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn"]}
    (mxfp4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(OffloadError, match="quant_method 'mxfp4' is not run by this engine"):
        LLM(mxfp4)
