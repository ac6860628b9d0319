"""A GGUF file run in place (offload/gguf/in_place.py): a folder of its metadata in the cache, nothing of the weights
written, the weights read from the file where they lie; the model answers as its import does."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf import MOE_ARCH, moe_checkpoint, write_gguf, write_moe_gguf

from offload.api import LLM
from offload.cli import main
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.gguf import importer as gguf_import
from offload.gguf.importer import import_gguf
from offload.gguf.resolve import resolve_model
from offload.tiers.weights.checkpoint import GGUF_INDEX

IDS = [[5, 9, 40, 41, 42, 100, 200, 7], [3, 4, 5, 6]]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(path))
    return path


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_q4_0_file_runs_in_place_and_nothing_of_its_weights_is_written(
    capsys, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a: pytest.fail("a file that runs in place was imported"))
    argv = ["generate", "--model", str(path), "--prompt", "ab", "--max-new-tokens", "2", "--dtype", "float32"]
    assert main(argv) == 0 and main(argv) == 0
    assert "import" not in capsys.readouterr().err
    (folder,) = (cache / "gguf").iterdir()
    assert (folder / GGUF_INDEX).is_file() and not list(folder.glob("*.safetensors"))
    assert _folder_bytes(folder) < path.stat().st_size / 10  # metadata and the tokenizer: no weight is copied
    assert resolve_model(path) == folder


@pytest.mark.parametrize(
    ("arch", "types"),
    [
        ("llama", {}),  # q and k rows in llama.cpp's order
        ("llama", {"blk.0.attn_q.weight": T.Q4_1, "blk.1.ffn_down.weight": T.Q8_0, "blk.1.attn_v.weight": T.F16}),
        ("qwen2", {"blk.0.ffn_up.weight": T.Q4_1}),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_in_place_answers_as_the_import_does(tmp_path: Path, cache: Path, arch: str, types: dict, dtype: str):
    """In float32 greedy tokens equal and logits within 1e-4; in bfloat16 the logits no further from the float32 ones
    than the import's (they round apart: the import holds the Q8_0 table rounded to bfloat16, the blocks keep d q;
    a random model's near-ties then part greedy tokens, so the real model's are compared instead, below)."""
    path = tmp_path / "m.gguf"
    write_gguf(path, arch, types=types)
    imported = tmp_path / "imported"
    import_gguf(path, imported, "cpu")
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLM(path, EngineConfig(dtype=dtype)) as llm:
        assert (llm.model_dir / GGUF_INDEX).is_file()
        got, got_logits = llm.generate_ids(IDS, sampling), torch.cat(llm.score(IDS))
    with LLM(imported, EngineConfig(dtype=dtype)) as llm:
        want, want_logits = llm.generate_ids(IDS, sampling), torch.cat(llm.score(IDS))
    if dtype == "float32":
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)
        return
    with LLM(imported, EngineConfig(dtype="float32")) as llm:
        exact = torch.cat(llm.score(IDS))
    rms = [(x - exact).pow(2).mean().sqrt() for x in (got_logits, want_logits)]
    assert rms[0] <= 1.25 * rms[1], rms


@pytest.mark.parametrize("family", sorted(MOE_ARCH))
def test_a_mixture_runs_in_place_as_its_import_does_whole_and_by_expert(tmp_path: Path, cache: Path, family: str):
    moe_checkpoint(tmp_path / "hf", family)
    path = tmp_path / "moe.gguf"
    write_moe_gguf(path, family, tmp_path / "hf", T.Q4_0)
    imported = tmp_path / "imported"
    import_gguf(path, imported, "cpu")
    with LLM(imported, EngineConfig(dtype="float32")) as llm:
        want = llm.score(IDS)
    for config in (EngineConfig(dtype="float32"), EngineConfig(dtype="float32", expert_cache_memory=1 << 20)):
        with LLM(path, config) as llm:
            got = llm.score(IDS)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_a_file_that_cannot_run_in_place_is_imported_once_and_said_why(
    capsys, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "k.gguf"
    write_gguf(path, qtype=T.Q4_K)
    imports = []
    real = gguf_import.import_gguf
    monkeypatch.setattr(gguf_import, "import_gguf", lambda *a: imports.append(a) or real(*a))
    argv = ["generate", "--model", str(path), "--prompt", "ab", "--max-new-tokens", "2", "--dtype", "float32"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"{path} cannot run in place (tensor 'blk.0.attn_q.weight' is Q4_K" in err and "imported" in err
    assert main(argv) == 0
    assert "import" not in capsys.readouterr().err and len(imports) == 1
    with LLM(path, EngineConfig(dtype="float32")) as llm:  # the API resolves the same way
        assert not (llm.model_dir / GGUF_INDEX).exists()
    assert len(imports) == 1


def test_a_moved_file_is_indexed_where_it_now_lies(tmp_path: Path, cache: Path):
    first = tmp_path / "a" / "tiny.gguf"
    first.parent.mkdir()
    write_gguf(first)
    folder = resolve_model(first)
    moved = tmp_path / "b" / "tiny.gguf"
    moved.parent.mkdir()
    first.rename(moved)  # the same bytes, so the same key: the folder is made again for the file where it lies
    assert resolve_model(moved) == folder
    with LLM(moved, EngineConfig(dtype="float32")) as llm:
        assert len(llm.generate_ids([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_a_changed_or_missing_file_is_one_line(capsys, tmp_path: Path, cache: Path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    folder = resolve_model(path)
    with path.open("ab") as f:
        f.write(b"\0" * 32)  # the same key's header and samples? the size differs: the index no longer matches
    with pytest.raises(OffloadError, match="not the .* its index"):
        LLM(folder)
    path.unlink()
    argv = ["generate", "--model", str(folder), "--prompt", "ab", "--max-new-tokens", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and f"its GGUF file {path.resolve()} is missing" in err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_loading_shows_its_progress_on_a_terminal_and_nothing_elsewhere(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    resolve_model(path)
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        LLM(path, EngineConfig(dtype="float32")).close()
        assert ("\rloading    " in stream.getvalue()) == shown, stream.getvalue()
        assert " left" in stream.getvalue() or not shown
