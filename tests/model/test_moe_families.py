"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers, on tiny random checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.model_config import parse_model_config
from offload.convert.quantize import convert
from offload.kernels.quant_linear import WeightQuant
from offload.kernels.quant_matmul import dequantize
from offload.model.loader import load_spec
from offload.model.moe import experts_forward
from offload.model.registry import model_tensors
from offload.tiers.device import DeviceTier
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import Checkpoint
from offload.tiers.weights.layout import model_layout
from offload.tiers.weights.placement import group_cost

ATOL = 1e-4  # fp32 logits, max abs
KV_BYTES = 1 << 22

# name -> (family, config overrides); the families' own configs are in conftest.family_config
VARIANTS = {
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert, top-k not renormalized, layer 1 dense
    "qwen3_moe": ("qwen3_moe", {}),  # top-k renormalized, layer 0 dense
    "qwen3_moe-step2": ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)),
}


@pytest.fixture(scope="module", params=VARIANTS)
def moe_checkpoint(request, tmp_path_factory):
    """(variant, model dir, transformers model), fp32."""
    family, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_checkpoint(path, family, **overrides)


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lengths]


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [len, vocab]


def test_spec_reads_which_layers_are_sparse(moe_checkpoint):
    variant, path, model = moe_checkpoint
    spec, _ = load_spec(path)
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
    assert [spec.sparse(i) for i in range(spec.num_layers)] == sparse
    assert sparse.count(False) == {"mixtral": 0, "qwen2_moe": 1, "qwen3_moe": 1, "qwen3_moe-step2": 2}[variant]
    assert spec.params.layer == max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)


@pytest.mark.parametrize("micro_batch_tokens", [4096, 13])
def test_prefill_logits_ragged_batch(moe_checkpoint, micro_batch_tokens):
    """Every position of a ragged batch (no padding), in one micro-batch or split across several."""
    _, path, model = moe_checkpoint
    config = EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, block_size=4, micro_batch_tokens=micro_batch_tokens)
    llm = LLM(path, config)
    batch = prompts((5, 17, 30, 1))
    for ids, ours in zip(batch, llm.score(batch), strict=True):
        assert ours.shape == (len(ids), 300)
        torch.testing.assert_close(ours.cpu(), reference_logits(model, ids), atol=ATOL, rtol=0)


def _reference_tokens(model, batch: list[list[int]], steps: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None  # compare every token even if eos comes up
    expected = []
    for ids in batch:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
        expected.append(out[0, len(ids) :].tolist())
    return expected


def test_greedy_tokens_match_transformers_generate(moe_checkpoint):
    _, path, model = moe_checkpoint
    batch = prompts((4, 9, 23), seed=2)
    expected = _reference_tokens(model, batch, 32)
    llm = LLM(path, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, block_size=8))
    got = llm.generate_ids(batch, SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert [list(c.token_ids) for c in got] == expected
    assert all(len(set(e)) >= 4 for e in expected), "degenerate reference: the comparison would be weak"


def _streaming_budget(model: Path) -> int:
    """A device budget that holds the KV cache, the embedding and head and a two-slot ring, and not every layer."""
    spec, family = load_spec(model)
    with BufferedReader() as reader:
        layout = model_layout(Checkpoint(model, reader), model_tensors(family, spec))
    tier = DeviceTier(None, torch.device("cpu"))
    layers = [group_cost(g, torch.float32, tier) for g in layout.layers]
    embed, head = group_cost(layout.embed, torch.float32, tier), group_cost(layout.head, torch.float32, tier)
    return KV_BYTES + embed + head + 2 * max(layers) + min(layers) // 2


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe"])
def test_streamed_layers_give_the_resident_tokens(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    make_checkpoint(tmp_path, family, **overrides)
    batch, params = prompts((6, 13), seed=3), SamplingParams(max_new_tokens=12, ignore_eos=True)
    with LLM(tmp_path, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES)) as llm:
        resident = [c.token_ids for c in llm.generate_ids(batch, params)]
    config = EngineConfig(
        dtype="float32", kv_cache_bytes=KV_BYTES, device_memory=_streaming_budget(tmp_path), io_backend="pread"
    )
    with LLM(tmp_path, config) as llm:
        assert "nvme" in llm.placement.layer_tiers
        streamed = [c.token_ids for c in llm.generate_ids(batch, params)]
        assert llm.stats().weights.bytes_read > 0
    assert streamed == resident


def test_quantized_experts_compute_what_their_dequantized_values_do(tmp_path):
    """`offload convert` quantizes every expert's matrices and the shared expert's, not the router; the engine runs
    them through their scales, computing what the float checkpoint of the dequantized values computes."""
    make_checkpoint(tmp_path / "float", "qwen2_moe")
    out, fake = tmp_path / "int8", tmp_path / "fake"
    convert(tmp_path / "float", out, WeightQuant(8, 0, "triton" if torch.cuda.is_available() else "cpu"))
    spec, family = load_spec(out)
    layer = model_tensors(family, spec).layers[0]
    assert layer["expert5.down_proj"].name.endswith("experts.5.down_proj.qweight")
    assert layer["shared.up_proj"].name.endswith("shared_expert.up_proj.qweight")
    assert layer["router"].name.endswith("mlp.gate.weight") and "router.scales" not in layer
    shutil.copytree(tmp_path / "float", fake)
    tensors = {}
    with safe_open(fake / "model.safetensors", "pt") as src, safe_open(out / "model.safetensors", "pt") as q:
        quantized = set(q.keys())
        for name in list(src.keys()):
            prefix = name.removesuffix(".weight")
            if prefix + ".qweight" in quantized:
                tensors[name] = dequantize(q.get_tensor(prefix + ".qweight"), q.get_tensor(prefix + ".scales"), 8)
            else:
                tensors[name] = src.get_tensor(name)
    save_file(tensors, fake / "model.safetensors", metadata={"format": "pt"})
    batch = prompts((20, 7), seed=4)
    with LLM(out, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES)) as llm:
        got = llm.score(batch)
    with LLM(fake, EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES)) as llm:
        want = llm.score(batch)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4)


def one_sparse_layer(**shape):
    """The spec of a one-layer Qwen3-MoE of `shape` (hidden_size, the experts' count, top-k and width)."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 10,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "norm_topk_prob": True,
    }
    return parse_model_config(config | shape, "test")


def test_experts_forward_reads_only_the_chosen_experts():
    """The chosen experts are fetched once each, together, in ascending order; the result is the per-token weighted
    sum."""
    spec = one_sparse_layer(hidden_size=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=4)
    g = torch.Generator().manual_seed(0)
    experts = [
        {m: torch.randn(shape, generator=g) for m, shape in (("gate_proj", (4, 8)), ("up_proj", (4, 8)))}
        | {"down_proj": torch.randn(8, 4, generator=g)}
        for _ in range(6)
    ]
    x = torch.randn(5, 8, generator=g)
    logits = torch.full((5, 6), -5.0)
    choice = [(0, 3), (3, 0), (3, 5), (5, 0), (0, 3)]  # experts 1, 2 and 4 unused
    for t, (a, b) in enumerate(choice):
        logits[t, a], logits[t, b] = 2.0, 1.0
    asked = []

    def fetch(chosen: list[int], last: bool, rows: list[int]):
        asked.append((chosen, last, rows))
        return {e: experts[e] for e in chosen}

    out = experts_forward(spec, x, logits, fetch, torch.float32)
    assert asked == [([0, 3, 5], True, [4, 4, 2])]  # each expert with the number of tokens routed to it
    asked.clear()
    torch.testing.assert_close(experts_forward(spec, x, logits, fetch, torch.float32, per_fetch=2), out)
    assert asked == [([0, 3], False, [4, 4]), ([5], True, [2])]  # a cache of two slots: in batches, each run first
    w_first = torch.tensor(2.0).exp() / (torch.tensor(2.0).exp() + torch.tensor(1.0).exp())  # renormalized top-2
    for t, (a, b) in enumerate(choice):
        want = sum(
            w
            * (torch.nn.functional.silu(x[t] @ experts[e]["gate_proj"].T) * (x[t] @ experts[e]["up_proj"].T))
            @ experts[e]["down_proj"].T
            for e, w in ((a, w_first), (b, 1 - w_first))
        )
        torch.testing.assert_close(out[t], want)


def test_qwen_moe_config_fields():
    base = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4}
    base |= {"num_key_value_heads": 2, "vocab_size": 100, "torch_dtype": "float32", "num_experts_per_tok": 2}
    base |= {"moe_intermediate_size": 64}
    qwen3 = parse_model_config(base | {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8}, "c")
    assert qwen3.head_dim == 64  # Qwen3MoeConfig has no head_dim default: hidden_size / heads
    assert qwen3.qk_norm and not qwen3.qkv_bias and not qwen3.norm_topk_prob
    assert qwen3.dense_layers == () and qwen3.expert_size == 64 and qwen3.shared_expert_size == 0
    stepped = parse_model_config(
        base
        | {"architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 8}  # transformers 5's spelling
        | {"decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True},
        "c",
    )
    assert stepped.num_experts == 8 and stepped.norm_topk_prob
    assert stepped.dense_layers == (0, 2, 3)
    qwen2 = parse_model_config(
        base | {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8, "shared_expert_intermediate_size": 96},
        "c",
    )
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm and qwen2.shared_expert_size == 96
    h = 256
    attention = h * h + 2 * h * 128 + h * h + h + 2 * 128  # q, k, v, o (2 K/V heads of 64) and the q/k/v biases
    always = 2 * h + 8 * h + 3 * h * 96 + h  # norms, router, shared expert and its gate
    assert qwen2.params.layer == attention + always + 8 * 3 * h * 64
    assert qwen2.params.active_layer == attention + always + 2 * 3 * h * 64


def test_experts_run_in_the_fetched_order_and_add_up_in_ascending_order():
    """Expert streaming hands the ready experts first; whatever the order they run in, their outputs are added in
    ascending order, so the bf16 sums equal the resident path's bit for bit (top-4 of 8: three roundings a token)."""
    spec = one_sparse_layer(hidden_size=16, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=8)
    g = torch.Generator().manual_seed(1)
    experts = [
        {"gate_proj": torch.randn(8, 16, generator=g), "up_proj": torch.randn(8, 16, generator=g)}
        | {"down_proj": torch.randn(16, 8, generator=g)}
        for _ in range(8)
    ]
    experts = [{m: w.bfloat16() for m, w in e.items()} for e in experts]
    x = torch.randn(64, 16, generator=g).bfloat16()
    logits = torch.randn(64, 8, generator=g)
    ran = []

    def fetch(order):
        def f(chosen: list[int], last: bool, rows: list[int]):
            fetched = {e: experts[e] for e in order(chosen)}
            ran.extend(fetched)
            return fetched

        return f

    ascending = experts_forward(spec, x, logits, fetch(lambda c: c), torch.bfloat16)
    assert ran == list(range(8))
    ran.clear()
    shuffled = experts_forward(spec, x, logits, fetch(lambda c: c[::-1]), torch.bfloat16, per_fetch=5)
    assert ran == [4, 3, 2, 1, 0, 7, 6, 5]
    assert torch.equal(shuffled, ascending)
