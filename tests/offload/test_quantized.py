"""Weight-quantized checkpoints: `offload convert` writes them, the engine runs them resident and streamed.

The runtime is checked against the same model with every quantized matrix replaced by its dequantized float values
(the "fake-quantized" checkpoint): in float32 the two compute the same function, so the logits agree to rounding.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_checkpoint
from offload.api import LLM
from offload.cli import main
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.common.quant import WeightQuant
from offload.convert import quantize as convert_module
from offload.convert.quantize import ALIGN, MANIFEST, convert, read_manifest, verify
from offload.kernels.quant_linear import SCALES_SUFFIX
from offload.kernels.quant_matmul import dequantize
from offload.model.llama import LlamaFamily
from offload.model.loader import load_spec
from offload.model.registry import model_tensors
from offload.tiers.device import DeviceTier
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import Checkpoint
from offload.tiers.weights.layout import model_layout
from offload.tiers.weights.placement import group_cost

FORMATS = [
    WeightQuant(4, 32, "cpu"),
    WeightQuant(4, 64, "triton"),
    WeightQuant(8, 0, "cpu"),
    WeightQuant(8, 32, "triton"),
]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(3, 80))]  # the long one: a prefill-sized product
KV_BYTES = 1 << 22
SHAPE = dict(hidden_size=64, intermediate_size=128)  # every projection takes 32-multiple inputs: all are quantized


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("float-llama")
    make_checkpoint(path, "llama", **SHAPE)
    return path


@pytest.fixture(scope="module", params=FORMATS, ids=lambda q: q.name)
def converted(request, source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[WeightQuant, Path, Path]:
    """(format, its converted checkpoint, the fake-quantized float32 checkpoint of the same values)."""
    quant = request.param
    root = tmp_path_factory.mktemp(quant.name)
    out = root / "quantized"
    convert(source, out, quant)
    fake = root / "fake"
    fake.mkdir()
    for f in source.iterdir():
        if not f.name.endswith(".safetensors"):
            (fake / f.name).write_bytes(f.read_bytes())
    tensors = {}
    with safe_open(source / "model.safetensors", "pt") as src, safe_open(out / "model.safetensors", "pt") as q:
        names = set(q.keys())
        for name in list(src.keys()):
            prefix = name.removesuffix(".weight")
            if prefix + ".qweight" in names:
                tensors[name] = _dequantized(q.get_tensor(prefix + ".qweight"), q.get_tensor(prefix + ".scales"), quant)
            else:
                tensors[name] = src.get_tensor(name)
    save_file(tensors, fake / "model.safetensors", metadata={"format": "pt"})
    return quant, out, fake


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, quant: WeightQuant) -> torch.Tensor:
    if quant.layout == "cpu" and quant.bits == 4:  # unpack torch's CPU packing by multiplying the identity
        k = codes.shape[1] * 2
        eye = torch.eye(k)
        return (
            torch.ops.aten._weight_int4pack_mm_for_cpu(eye, codes, k // scales.shape[0], scales.float())
            .t()
            .contiguous()
        )
    return dequantize(codes, scales.float(), quant.bits)


def _streaming_budget(model: Path, dtype: torch.dtype) -> int:
    """A device budget that holds the KV cache, the embedding and head and a two-slot ring, and not every layer."""
    spec, family = load_spec(model)
    with BufferedReader() as reader:
        layout = model_layout(Checkpoint(model, reader), model_tensors(family, spec))
    tier = DeviceTier(None, torch.device("cpu"))
    layers = [group_cost(g, dtype, tier) for g in layout.layers]
    return (
        KV_BYTES
        + group_cost(layout.embed, dtype, tier)
        + group_cost(layout.head, dtype, tier)
        + 2 * max(layers)
        + min(layers) // 2
    )


def _score(model: Path, **config) -> list[torch.Tensor]:
    with LLM(model, EngineConfig(dtype="float32", **config)) as llm:
        return llm.score(PROMPTS)


def test_the_engine_computes_what_the_dequantized_weights_compute(converted):
    quant, out, fake = converted
    for got, want in zip(_score(out), _score(fake), strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_streamed_quantized_layers_compute_what_resident_ones_do(converted):
    quant, out, _ = converted
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLM(out, EngineConfig(dtype="float32")) as llm:
        resident = [c.token_ids for c in llm.generate_ids(PROMPTS, params)]
    budget = _streaming_budget(out, torch.float32)
    config = EngineConfig(dtype="float32", kv_cache_bytes=KV_BYTES, device_memory=budget, io_backend="pread")
    with LLM(out, config) as llm:
        assert "nvme" in llm.placement.layer_tiers
        streamed = [c.token_ids for c in llm.generate_ids(PROMPTS, params)]
        assert llm.stats().weights.bytes_read > 0
    assert streamed == resident


@pytest.mark.parametrize("quant", FORMATS, ids=lambda q: q.name)
def test_stacked_projections_compute_what_separate_ones_do(quant, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Layers held whole run q/k/v and gate/up as one product each (LlamaFamily.fuse); with stacking turned off they
    run one product a part, and the logits are the same. q has 128 rows, k and v 64: whole row blocks of torch's CPU
    int4 packing, which stacks only such parts."""
    source = tmp_path / "source"
    make_checkpoint(source, "llama", hidden_size=128, intermediate_size=128)
    out = tmp_path / "quantized"
    convert(source, out, quant)
    with LLM(out, EngineConfig(dtype="float32")) as llm:
        layer = llm.parts.weights.store.acquire(0)
        assert {"qkv_proj", "qkv_proj" + SCALES_SUFFIX, "gate_up_proj"} <= set(layer) and "q_proj" not in layer
        stacked = llm.score(PROMPTS)
    monkeypatch.setattr(LlamaFamily, "fuse", lambda self, spec, w: w)
    with LLM(out, EngineConfig(dtype="float32")) as llm:
        assert "q_proj" in llm.parts.weights.store.acquire(0)
        separate = llm.score(PROMPTS)
    for got, want in zip(stacked, separate, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_int4_parts_torch_cannot_stack_run_one_product_each(source: Path, tmp_path: Path):
    """SHAPE's k and v have 32 rows, half of a row block of torch's CPU int4 packing: stacked codes would not be
    the stacked rows' codes, so q, k and v stay apart (gate and up, 128 rows each, stack)."""
    out = tmp_path / "q"
    convert(source, out, WeightQuant(4, 32, "cpu"))
    with LLM(out, EngineConfig(dtype="float32")) as llm:
        layer = llm.parts.weights.store.acquire(0)
        assert {"q_proj", "k_proj", "v_proj", "gate_up_proj"} <= set(layer) and "qkv_proj" not in layer


def test_quantized_files_are_aligned_valid_safetensors_with_checksums(converted, source: Path):
    quant, out, _ = converted
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "offload",
        "bits": quant.bits,
        "group_size": quant.group_size,
        "layout": quant.layout,
    }
    assert (out / "tokenizer.json").exists()
    path = out / "model.safetensors"
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert (8 + header_len) % ALIGN == 0
    header = json.loads(raw[8 : 8 + header_len])
    for name, info in header.items():
        if name != "__metadata__" and not name.startswith("__pad__"):
            assert (8 + header_len + info["data_offsets"][0]) % ALIGN == 0, name
    with safe_open(path, "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.qweight")
        assert q.dtype == (torch.uint8 if quant.bits == 4 else torch.int8)
        assert "model.layers.0.self_attn.q_proj.weight" not in set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32  # embeddings keep their dtype
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"]["model.safetensors"]["size"] == path.stat().st_size
    assert len(manifest["tensors"]) == sum(not n.startswith("__") for n in header)
    verify(out)


def test_a_corrupt_or_truncated_file_is_named(source: Path, tmp_path: Path):
    out = tmp_path / "q"
    convert(source, out, WeightQuant(4, 32, "cpu"))
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(OffloadError, match="model.safetensors: SHA-256 differs"):
        verify(out)
    path.write_bytes(bytes(data[:-4096]))
    with pytest.raises(OffloadError, match="model.safetensors: missing or not the"):
        LLM(out)


def test_a_packing_from_another_torch_is_refused(source: Path, tmp_path: Path):
    out = tmp_path / "q"
    convert(source, out, WeightQuant(4, 32, "cpu"))
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["cpu_pack_probe"] = "0" * 16
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OffloadError, match="CPU packing differs"):
        LLM(out)


def test_a_failed_conversion_leaves_nothing(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def fail(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(convert_module, "_write_config", fail)
    with pytest.raises(OSError, match="No space"):
        convert(source, tmp_path / "q", WeightQuant(8, 0, "cpu"))
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_an_existing_output_and_a_quantized_source(source: Path, tmp_path: Path):
    out = tmp_path / "q"
    convert(source, out, WeightQuant(8, 0, "cpu"))
    with pytest.raises(OffloadError, match="already exists"):
        convert(source, out, WeightQuant(8, 0, "cpu"))
    with pytest.raises(OffloadError, match="already quantized"):
        convert(out, tmp_path / "again", WeightQuant(4, 32, "cpu"))


def test_convert_command_and_its_errors(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "q"
    assert main(["convert", "--model", str(source), "--quant", "int4", "--out", str(out)]) == 0
    assert "int4-g32-" in capsys.readouterr().err  # the default group: 32 (docs/benchmarks.md, real accuracy)
    bad = ["convert", "--model", str(source), "--quant", "int8", "--group-size", "64", "--layout", "cpu"]
    assert main([*bad, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one scale per output channel" in err
    assert not (tmp_path / "r").exists()


def test_searched_int4_codes_leave_less_error_than_rounded_ones(source: Path, tmp_path: Path, capsys):
    """--method search: the same format, codes and scales chosen per group for the least squared error."""
    errors = {}
    for method in ("rtn", "search"):
        out = tmp_path / method
        args = ["convert", "--model", str(source), "--quant", "int4", "--group-size", "32", "--method", method]
        assert main([*args, "--out", str(out)]) == 0
        assert read_manifest(out)["quant"]["method"] == method
        with safe_open(out / "model.safetensors", "pt") as f, safe_open(source / "model.safetensors", "pt") as g:
            name = "model.layers.0.mlp.down_proj"
            w = g.get_tensor(name + ".weight").float()
            codes, scales = f.get_tensor(name + ".qweight"), f.get_tensor(name + SCALES_SUFFIX)
            got = _dequantized(codes, scales, WeightQuant(4, 32, "cpu"))
            errors[method] = (got.float() - w).square().sum().item()
    assert errors["search"] < errors["rtn"]
    bad = ["convert", "--model", str(source), "--quant", "int8", "--method", "search", "--out", str(tmp_path / "r")]
    assert main(bad) == 2
    assert "--method search chooses int4 codes" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_a_checkpoint_of_another_quantization_method_is_refused(tmp_path: Path):
    make_checkpoint(tmp_path, "llama", **SHAPE)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OffloadError, match=r"config.json: quantization_config.quant_method 'gptq'"):
        LLM(tmp_path)


def test_a_float32_checkpoint_quantized_streams_in_bfloat16_through_spill_files(converted, tmp_path: Path):
    """Scales stored in float32 are converted once into --offload-dir's spill files; the codes are kept as stored."""
    quant, out, _ = converted
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    with LLM(out, EngineConfig(dtype="bfloat16")) as llm:
        resident = [c.token_ids for c in llm.generate_ids(PROMPTS, params)]
    config = EngineConfig(
        dtype="bfloat16",
        kv_cache_bytes=KV_BYTES,
        device_memory=_streaming_budget(out, torch.bfloat16),
        offload_dir=str(tmp_path),
        io_backend="pread",
    )
    with LLM(out, config) as llm:
        assert llm.placement.spill is not None and llm.placement.spill.layers
        assert [c.token_ids for c in llm.generate_ids(PROMPTS, params)] == resident
