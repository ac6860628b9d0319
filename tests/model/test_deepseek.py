"""DeepSeek-V3 and DeepSeek-V2 against transformers' own implementations, on tiny random checkpoints: multi-head
latent attention at odd ranks (the cache holds the latent alone; decode absorbed, prefill decompressed), YaRN with
its mscale, a dense first layer, group-limited routing (sigmoid scores with the correction bias, or softmax), routed
scaling, shared experts; streamed by expert; the latent in every KV tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.model_config import parse_model_config
from offload.common.quant import WeightQuant
from offload.convert.quantize import convert
from offload.kernels.paged_batch import PagedBatch
from offload.model.deepseek import absorbed, decompressed

ATOL = 1e-4
KV_BYTES = 1 << 22


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def deepseek(request, tmp_path_factory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp(request.param)
    return path, make_checkpoint(path, request.param)


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths]


def greedy(model, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = [model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False) for ids in batch]
    return [o[0, len(ids) :].tolist() for o, ids in zip(out, batch, strict=True)]


def test_spec_reads_latent_attention_routing_and_dense_layers(deepseek):
    path, model = deepseek
    with LLM(path, EngineConfig(kv_cache_bytes=KV_BYTES)) as llm:
        spec, cache = llm.spec, llm.parts.kv.cache
    m, r = spec.mla, spec.routing
    if spec.architecture == "DeepseekV3ForCausalLM":
        assert (m.q_rank, m.kv_rank, m.nope_dim, m.rope_dim, m.v_dim) == (37, 27, 10, 6, 13) and m.interleaved
        assert (r.scoring, r.groups, r.groups_kept, r.group_score, r.scale, r.score_bias) == (
            "sigmoid", 4, 2, "top2", 2.5, True
        )  # fmt: skip
        assert spec.dense_layers == (0,) and spec.norm_topk_prob and spec.rope.kind == "yarn"
    else:
        assert m.q_rank is None and m.kv_rank == 22 and (r.scoring, r.group_score, r.scale) == ("softmax", "max", 1.5)
        assert spec.dense_layers == () and not spec.norm_topk_prob and not r.score_bias
    stored = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    assert 0 <= stored - spec.total_params < spec.num_layers  # the average layer rounds down
    # one part per layer (no V), one "head" of the latent and the rotated key
    assert cache.storage.shape[:2] == (spec.num_layers, 1) and cache.storage.shape[4:] == (1, m.kv_rank + m.rope_dim)


@pytest.mark.parametrize("micro_batch_tokens", [4096, 13])
def test_prefill_logits_match_transformers(deepseek, micro_batch_tokens):
    """Whole prompts, and prompts cut into chunks of 13 tokens (each chunk decompresses the context cached before
    it)."""
    path, model = deepseek
    batch = prompts((5, 17, 30, 1))
    config = EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, block_size=4, micro_batch_tokens=micro_batch_tokens)
    with LLM(path, config) as llm:
        scored = llm.score(batch)
    for ids, ours in zip(batch, scored, strict=True):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(ours.cpu(), want, atol=ATOL, rtol=0)


def test_greedy_tokens_match_transformers_resident_and_streamed_by_expert(deepseek):
    path, model = deepseek
    batch = prompts((4, 9, 23), seed=2)
    expected = greedy(model, batch, 16)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with LLM(path, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, block_size=8)) as llm:
        assert [list(c.token_ids) for c in llm.generate_ids(batch, params)] == expected
    streamed = EngineConfig(
        dtype="float32", kv_cache_bytes=KV_BYTES, block_size=8, device="cpu", io_backend="pread",
        expert_cache_memory=3 * 3 * 24 * 64 * 4 + 4096,  # about three experts: the others read when chosen
    )  # fmt: skip
    with LLM(path, streamed) as llm:
        assert [list(c.token_ids) for c in llm.generate_ids(batch, params)] == expected
        experts = llm.last_run.experts
    assert experts.misses > 0 and experts.bytes_read > 0
    assert all(len(set(e)) >= 4 for e in expected), "degenerate reference: the comparison would be weak"


def test_absorbed_decode_equals_decompressed_attention():
    """The same queries over the same cached latents, in the latent space and decompressed per head: equal to float32
    rounding in float32, and within bfloat16's rounding of each other in bfloat16."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        **dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8),
        **dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=32),
        **dict(kv_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24),
    }
    spec = parse_model_config(config, "test")
    m, heads = spec.mla, spec.num_heads
    g = torch.Generator().manual_seed(0)
    lens, block = (5, 17, 40), 4
    tables = torch.arange(30).view(3, 10)
    cache = torch.randn(30, block, 1, m.width, generator=g)
    batch = PagedBatch((0, 1, 2, 3), lens, tables, torch.zeros(3, dtype=torch.int64))
    q_nope, q_rope = torch.randn(3, heads, m.nope_dim, generator=g), torch.randn(3, heads, m.rope_dim, generator=g)
    kv_b = torch.randn(heads, m.nope_dim + m.v_dim, m.kv_rank, generator=g) * 0.2
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        qn, qr, c, w = (t.to(dtype) for t in (q_nope, q_rope, cache, kv_b))
        a = absorbed(spec, qn, qr, c, batch, w, 0.1)
        d = decompressed(spec, torch.cat((qn, qr), dim=-1), c, batch, w, 0.1)
        assert a.shape == d.shape == (3, heads, m.v_dim) and a.dtype == dtype
        results[dtype] = a.float(), d.float()
    torch.testing.assert_close(*results[torch.float32], atol=1e-5, rtol=1e-5)
    a, d = results[torch.bfloat16]
    exact = results[torch.float32][1]
    tolerance = 2**-7 * exact.abs().max()  # bf16's relative rounding at the outputs' scale
    assert (a - d).abs().max() < tolerance
    assert (a - exact).abs().max() < tolerance and (d - exact).abs().max() < tolerance


def test_kv_cache_holds_the_latent_alone_in_every_tier(tmp_path):
    """(kv_lora_rank + qk_rope_head_dim) x layers x 2 bytes a token (bfloat16) in the device cache, in host RAM and
    on disk; a prompt run again reads its blocks back from the prefix cache and gives the same tokens; an int8 cache
    of the latents runs."""
    path = tmp_path / "model"
    make_checkpoint(path, "deepseek_v3", kv_lora_rank=26)  # a width of 32: int8's groups of 32 divide it
    per_token = (26 + 6) * 3 * 2
    with LLM(path, EngineConfig(dtype="bfloat16", kv_cache_bytes=KV_BYTES, block_size=4)) as probe:
        assert probe.spec.kv_bytes_per_token(2) == per_token
        assert probe.placement.kv_block_bytes == 4 * per_token
    tiers = dict(kv_host_memory=64 * 4 * per_token, kv_disk_memory=1 << 22, offload_dir=str(tmp_path / "offload"))
    batch, params = prompts((21, 14), seed=4), SamplingParams(max_new_tokens=6, ignore_eos=True)
    config = EngineConfig(dtype="bfloat16", kv_cache_bytes=KV_BYTES, block_size=4, **tiers)
    with LLM(path, config) as llm:
        kv = llm.parts.kv.tiers
        assert kv.host_kv.bytes_per_block == kv.disk.block_nbytes == 4 * per_token
        first = [c.token_ids for c in llm.generate_ids(batch, params)]
    with LLM(path, config) as llm:  # a new engine: the prompts' blocks come back from disk
        again = [c.token_ids for c in llm.generate_ids(batch, params)]
        assert llm.last_run.prefix_hit_tokens >= 4 * (5 + 3)  # every full block of each prompt
    assert again == first
    int8 = EngineConfig(dtype="bfloat16", kv_cache_bytes=KV_BYTES, block_size=4, kv_dtype="int8")
    with LLM(path, int8) as llm:
        assert llm.parts.kv.cache.storage.shape[:2] == (3, 1)
        quantized = [c.token_ids for c in llm.generate_ids(batch, params)]
    assert [q[0] for q in quantized] == [f[0] for f in first]


def test_converted_int8_weights_keep_kv_b_and_the_router_in_float(tmp_path):
    make_checkpoint(tmp_path / "float", "deepseek_v3")
    out = tmp_path / "int8"
    convert(tmp_path / "float", out, WeightQuant(8, 0, "triton" if torch.cuda.is_available() else "cpu"))
    batch = prompts((9,), seed=5)
    with LLM(tmp_path / "float", EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES)) as llm:
        want = llm.score(batch)[0]
    with LLM(out, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES)) as llm:
        layer = llm.parts.weights.store.acquire(1)
        assert "kv_b.scales" not in layer and "router.scales" not in layer and "q_b_proj.scales" in layer
        assert "expert3.down_proj.scales" in layer and "shared.up_proj.scales" in layer
        got = llm.score(batch)[0]
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_summary_says_the_multi_token_prediction_layer_is_not_run(deepseek):
    from offload.cli import _summary

    path, model = deepseek
    with LLM(path, EngineConfig(kv_cache_bytes=KV_BYTES)) as llm:
        completions = llm.generate_ids(prompts((5,)), SamplingParams(max_new_tokens=2, ignore_eos=True))
        summary = _summary(llm, completions)
    layers = model.config.to_dict().get("num_nextn_predict_layers") or 0  # DeepseekV3Config writes 1, V2 none
    assert llm.spec.mtp_layers == layers
    assert ("1 multi-token-prediction layer(s) in the checkpoint not run" in summary) == (layers == 1)
    width = llm.spec.mla.kv_rank + llm.spec.mla.rope_dim
    assert f"(multi-head latent attention: {width} values a token and layer)" in summary
