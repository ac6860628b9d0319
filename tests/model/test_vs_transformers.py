"""Our runtime against transformers' own implementation of each family, on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.scheduler.plan import SeqChunk, StepPlan, split_micro_batches

ATOL = 1e-4  # fp32 logits, max abs


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths]


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("micro_batch_tokens", [4096, 13])
def test_prefill_logits_ragged_batch(family_checkpoint, micro_batch_tokens):
    """Every position of a ragged batch (no padding), in one micro-batch or split across several."""
    _, path, model = family_checkpoint
    llm = LLM(path, EngineConfig(kv_cache_bytes=1 << 22, block_size=4, micro_batch_tokens=micro_batch_tokens))
    batch = prompts((5, 17, 30, 1))
    for ids, ours in zip(batch, llm.score(batch), strict=True):
        assert ours.shape == (len(ids), 300)
        torch.testing.assert_close(ours.cpu(), reference_logits(model, ids), atol=ATOL, rtol=0)
    llm.check_integrity()
    assert llm.stats().kv_blocks_used == 0


def test_decode_logits_through_the_paged_cache(family_checkpoint):
    """Prefill ragged prefixes, then decode known tokens one step at a time: each step's logits match."""
    _, path, model = family_checkpoint
    llm = LLM(path, EngineConfig(kv_cache_bytes=1 << 22, block_size=3))
    full = prompts((9, 14, 20), seed=1)
    prefix = [6, 12, 11]  # decode the rest: sequences cross block boundaries at different steps
    refs = [reference_logits(model, ids) for ids in full]
    chunks = []
    for seq_id, (ids, n) in enumerate(zip(full, prefix, strict=True)):
        table = llm.parts.kv.tables.grow(seq_id, n)
        chunks.append(SeqChunk(seq_id, tuple(ids[:n]), 0, tuple(table)))
    out = llm.parts.engine.step(StepPlan(split_micro_batches(chunks, 4096)))
    for row, seq_id in enumerate(out.seq_ids):
        torch.testing.assert_close(out.logits[row].cpu(), refs[seq_id][prefix[seq_id] - 1], atol=ATOL, rtol=0)
    for pos in range(min(prefix), max(len(ids) for ids in full)):
        chunks = []
        for seq_id, ids in enumerate(full):
            if prefix[seq_id] <= pos < len(ids):
                table = llm.parts.kv.tables.grow(seq_id, pos + 1)
                chunks.append(SeqChunk(seq_id, (ids[pos],), pos, tuple(table)))
        if not chunks:
            continue
        out = llm.parts.engine.step(StepPlan(split_micro_batches(chunks, 4096)))
        for row, seq_id in enumerate(out.seq_ids):
            torch.testing.assert_close(out.logits[row].cpu(), refs[seq_id][pos], atol=ATOL, rtol=0)
    llm.check_integrity()


def test_greedy_tokens_match_transformers_generate(family_checkpoint):
    _, path, model = family_checkpoint
    batch = prompts((4, 9, 23), seed=2)
    model.generation_config.eos_token_id = None  # compare 32 tokens even if eos comes up
    expected = []
    for ids in batch:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    llm = LLM(path, EngineConfig(kv_cache_bytes=1 << 22, block_size=8))
    got = llm.generate_ids(batch, SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert [list(c.token_ids) for c in got] == expected
    assert all(len(set(e)) >= 4 for e in expected), "degenerate reference: the comparison would be weak"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_track_transformers(tmp_path, dtype):
    """bf16/fp16 run in the checkpoint's dtype, like transformers; logits agree to that dtype's precision."""
    model = make_checkpoint(tmp_path, "llama", dtype=dtype)
    llm = LLM(tmp_path, EngineConfig(kv_cache_bytes=1 << 22))
    assert llm.parts.dtype == dtype
    ids = prompts((24,))[0]
    ours = llm.score([ids])[0]
    ref = reference_logits(model, ids)
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() < 0.03 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def test_sharded_checkpoint_with_index(tmp_path):
    model = make_checkpoint(tmp_path, "qwen3", max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    llm = LLM(tmp_path, EngineConfig(kv_cache_bytes=1 << 22))
    ids = prompts((11,))[0]
    torch.testing.assert_close(llm.score([ids])[0], reference_logits(model, ids), atol=ATOL, rtol=0)
    total = sum(p.stat().st_size for p in tmp_path.glob("model-*.safetensors"))
    groups = llm.spec.num_layers + 2  # each group's reads are 4 KiB-aligned: at most a page of slack per end
    assert 0.9 * total < llm.placement.checkpoint_bytes_read <= total + groups * 2 * 4096


def test_config_defaults_follow_transformers():
    """Fields a config.json may omit or that an architecture ignores are read as transformers reads them."""
    from offload.common.model_config import parse_model_config

    base = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}
    base |= {"num_key_value_heads": 2, "vocab_size": 100, "torch_dtype": "float32"}
    qwen3 = parse_model_config(base | {"architectures": ["Qwen3ForCausalLM"]}, "config.json")
    assert qwen3.head_dim == 128  # Qwen3Config's default, not hidden_size / heads (64)
    mistral = parse_model_config(
        base | {"architectures": ["MistralForCausalLM"], "attention_bias": True}, "config.json"
    )
    assert not mistral.qkv_bias and not mistral.o_bias  # transformers' Mistral has no attention biases
    llama = parse_model_config(base | {"architectures": ["LlamaForCausalLM"], "attention_bias": True}, "c")
    assert llama.qkv_bias and llama.o_bias and llama.head_dim == 64


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_yarn_scaled_checkpoints_track_transformers(tmp_path, family):
    """YaRN rope scaling (the interpolated frequencies and the factor on cos and sin), over positions past the
    original context, gives transformers' logits and greedy tokens."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    model = make_checkpoint(tmp_path, family, rope_parameters=yarn)
    llm = LLM(tmp_path, EngineConfig(kv_cache_bytes=1 << 22, block_size=4))
    assert llm.spec.rope.kind == "yarn"
    batch = prompts((40, 9))
    for ids, ours in zip(batch, llm.score(batch), strict=True):
        torch.testing.assert_close(ours.cpu(), reference_logits(model, ids), atol=ATOL, rtol=0)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for ids, out in zip(batch, llm.generate_ids(batch, params), strict=True):
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert list(out.token_ids) == want[0, len(ids) :].tolist()
