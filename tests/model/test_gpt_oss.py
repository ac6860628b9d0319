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


def greedy(model, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, eos or not."""
    model.generation_config.eos_token_id = None
    out = []
    for ids in batch:
        with torch.no_grad():
            out.append(model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids) :])
    return [o.tolist() for o in out]


def test_greedy_tokens_match_transformers_resident_and_streamed(gpt_oss):
    path, model = gpt_oss
    batch = prompts((4, 9, 23), seed=2)
    expected = greedy(model, batch, 16)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with LLM(path, EngineConfig(kv_cache_bytes=1 << 22, block_size=8)) as llm:
        assert [list(c.token_ids) for c in llm.generate_ids(batch, params)] == expected
        layer = llm.parts.weights.store.acquire(0)
        assert "qkv_proj" in layer and layer["expert3.gate_up_proj"].shape == (64, 192)
        budget = llm.stats().device_used - llm.placement.kv_bytes  # all weights resident
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
    expected = greedy(model, batch, 8)
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
    from offload.tiers.weights.weight_store import WeightStore

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


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory) -> tuple[Path, object]:
    """The checkpoint with its experts in MXFP4 as the published files store them (kernels/mxfp4.py writes the
    blocks), and transformers' model of the same weights: its experts replaced by their dequantized values."""
    from conftest import mxfp4_copy

    path, model = gpt_oss
    out = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    return out, mxfp4_copy(path, model, out)


def test_mxfp4_experts_run_as_stored_and_compute_their_dequantized_values(gpt_oss_mxfp4):
    path, reference = gpt_oss_mxfp4
    batch = prompts((5, 23), seed=4)
    with LLM(path, EngineConfig(kv_cache_bytes=1 << 22, block_size=8, dtype="float32")) as llm:
        assert llm.spec.mxfp4_experts
        layer = llm.parts.weights.store.acquire(0)
        assert layer["expert1.gate_up_proj_blocks"].dtype == torch.uint8 and "expert1.gate_up_proj" not in layer
        for ids, ours in zip(batch, llm.score(batch), strict=True):
            with torch.no_grad():
                torch.testing.assert_close(ours, reference(torch.tensor([ids])).logits[0], atol=ATOL, rtol=0)
        got = llm.generate_ids(batch, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [list(c.token_ids) for c in got] == greedy(reference, batch, 8)


def test_mxfp4_experts_stream_by_expert_at_4_25_bits_a_weight(gpt_oss_mxfp4):
    from offload.model.expert_streaming import model_layouts
    from offload.model.registry import get_family
    from offload.tiers.io.buffered import BufferedReader
    from offload.tiers.weights.checkpoint import Checkpoint

    path, reference = gpt_oss_mxfp4
    with LLM(path, EngineConfig(kv_cache_bytes=1 << 22, dtype="float32", expert_cache_memory=1 << 16)) as llm:
        spec = llm.spec
        ids = prompts((9,), seed=5)[0]
        with torch.no_grad():
            torch.testing.assert_close(llm.score([ids])[0], reference(torch.tensor([ids])).logits[0], atol=ATOL, rtol=0)
    with BufferedReader() as reader:
        _, experts = model_layouts(Checkpoint(path, reader), get_family(spec.architecture), spec, True)
    h, i = spec.hidden_size, spec.expert_size
    weights = 2 * i * h + h * i  # gate_up and down
    for group in experts.values():
        matrices = sum(t.nbytes for t in group.tensors if not t.short.endswith("_bias"))
        assert matrices * 8 == weights * 4.25  # 4 bits a value and an 8-bit exponent a block of 32
        assert group.tensor_bytes == matrices + 4 * (2 * i + h)  # and the float32 biases


def test_other_quantization_methods_are_refused_by_name(gpt_oss, tmp_path):
    path, _ = gpt_oss
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    for f in path.iterdir():
        (gptq / f.name).write_bytes(f.read_bytes())
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(OffloadError, match="quant_method 'gptq' is not run by this engine"):
        LLM(gptq)


def test_a_row_of_a_stacked_tensor_is_its_own_extent_and_bad_rows_are_named(gpt_oss):
    from offload.tiers.io.buffered import BufferedReader
    from offload.tiers.weights.checkpoint import Checkpoint

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


def test_convert_writes_the_experts_in_mxfp4_as_published(gpt_oss, gpt_oss_mxfp4, tmp_path, capsys):
    """`offload convert --quant mxfp4` writes what the published files hold (the fixture's own MXFP4 copy: the same
    blocks), checksummed, and the engine runs it; int4/int8 refuse the stacked experts by name, and mxfp4 other
    families."""
    from safetensors import safe_open

    from offload.cli import main
    from offload.convert.quantize import verify

    path, _ = gpt_oss
    out = tmp_path / "converted"
    assert main(["convert", "--model", str(path), "--quant", "mxfp4", "--out", str(out)]) == 0
    assert "converted  8 expert matrices to mxfp4" in capsys.readouterr().err
    verify(out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    with (
        safe_open(out / "model.safetensors", "pt") as got,
        safe_open(gpt_oss_mxfp4[0] / "model.safetensors", "pt") as want,
    ):
        names = {n for n in got.keys() if not n.startswith("__pad__")}  # noqa: SIM118 (the 4 KiB alignment's padding)
        assert names == set(want.keys())
        for name in names:
            assert torch.equal(got.get_tensor(name), want.get_tensor(name)), name
    ids = prompts((12,), seed=6)
    with (
        LLM(out, EngineConfig(kv_cache_bytes=1 << 22, dtype="float32")) as a,
        LLM(gpt_oss_mxfp4[0], EngineConfig(kv_cache_bytes=1 << 22, dtype="float32")) as b,
    ):
        assert torch.equal(a.score(ids)[0], b.score(ids)[0])
    assert main(["convert", "--model", str(path), "--quant", "int4", "--out", str(tmp_path / "int4")]) == 2
    err = capsys.readouterr().err.strip()
    assert "stores its experts stacked; --quant int4|int8 does not write them" in err and "\n" not in err
    assert not (tmp_path / "int4").exists()
    llama = tmp_path / "llama"
    make_checkpoint(llama, "llama")
    assert main(["convert", "--model", str(llama), "--quant", "mxfp4", "--out", str(tmp_path / "m")]) == 2
    assert (
        "--quant mxfp4 writes gpt-oss's experts (GptOssForCausalLM), not LlamaForCausalLM's" in capsys.readouterr().err
    )
    assert not (tmp_path / "m").exists()
