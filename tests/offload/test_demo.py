import json
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch
from jinja2.exceptions import TemplateError
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaForCausalLM

from offload import demo


@pytest.fixture(scope="module")
def model_dir(demo_model: Path) -> Path:
    return demo_model


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(model_dir)


def _shards(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("model-*.safetensors"))


@pytest.mark.slow
def test_layout_and_index_cover_every_tensor(model_dir: Path, tokenizer) -> None:
    assert model_dir.name == demo.DEMO_MODEL_NAME
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    shards = _shards(model_dir)
    assert [p.name for p in shards] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    stored: dict[str, str] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            keys = f.keys()
            assert keys, shard.name
            for key in keys:
                assert f.get_slice(key).get_dtype() == "BF16", key
                stored[key] = shard.name
    assert weight_map == stored
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id


@pytest.mark.slow
def test_tokenizer_round_trips_and_prepends_bos(tokenizer) -> None:
    assert len(tokenizer) == 1024
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token, tokenizer.pad_token) == (
        "<s>",
        "</s>",
        "<unk>",
        "<pad>",
    )
    for text in ("The engine streams layer weights to the accelerator.", "naïve café: 3×4 ≠ 12 ✓\n\tend"):
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.bos_token_id not in ids[1:]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.slow
def test_chat_template_renders_turns(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a page?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s>System: Be brief.\nUser: What is a page?\nAssistant:"
    history = [*messages, {"role": "assistant", "content": "A block of memory."}]
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    assert rendered == "<s>System: Be brief.\nUser: What is a page?\nAssistant: A block of memory.</s>\n"
    with pytest.raises(TemplateError, match="unknown role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


@pytest.mark.slow
def test_transformers_loads_llama3_bf16_checkpoint(model_dir: Path, tokenizer) -> None:
    loaded, info = LlamaForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert loaded.dtype == torch.bfloat16
    config = loaded.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (256, 688, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    assert config.vocab_size == len(tokenizer)
    assert config.max_position_embeddings == 2048
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    rope = config.rope_parameters
    assert rope["rope_type"] == "llama3"
    assert rope["rope_theta"] == 500000.0
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (8.0, 1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 256
    assert not torch.equal(loaded.model.embed_tokens.weight, loaded.lm_head.weight)


@pytest.mark.slow
def test_second_call_reuses_the_model(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert demo.ensure_demo_model(model_dir.parent) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_training_lowered_the_loss(model_dir: Path, model: LlamaForCausalLM, tokenizer) -> None:
    report = json.loads((model_dir / "demo_build.json").read_text())
    assert report["final_loss"] < 2.5 < math.log(len(tokenizer))
    corpus = demo._read_corpus()
    ids = demo._corpus_token_ids(tokenizer, corpus)
    assert demo._eval_loss(model, ids, 128) == pytest.approx(report["final_loss"], rel=1e-2)


@pytest.mark.slow
def test_greedy_completion_echoes_the_corpus(model: LlamaForCausalLM, tokenizer) -> None:
    corpus_words = set(re.findall(r"[a-z]+", demo._read_corpus().lower()))
    prompt = tokenizer(demo.DEMO_PROMPTS[0], return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    new_text = tokenizer.decode(out[0, prompt.input_ids.shape[1] :], skip_special_tokens=True)
    words = re.findall(r"[a-z]+", new_text.lower())
    assert len(words) >= 5, new_text
    assert sum(w in corpus_words for w in words) >= 0.9 * len(words), new_text


def _fake_build(out_dir: Path, recipe: demo.DemoRecipe) -> None:
    (out_dir / "config.json").write_text("{}")


def test_demo_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("OFFLOAD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert demo.cache_dir() == tmp_path / "home" / ".cache" / "offload"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.cache_dir() == tmp_path / "xdg" / "offload"
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "explicit"))
    assert demo.cache_dir() == tmp_path / "explicit"


def test_default_cache_dir_comes_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(demo, "_build_into", _fake_build)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    assert demo.ensure_demo_model() == tmp_path / demo.DEMO_MODEL_NAME


def test_build_announces_itself_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "_build_into", _fake_build)
    target = demo.ensure_demo_model(tmp_path)
    err = capsys.readouterr().err
    assert err.startswith(f"building the embedded demo model in {target} (once, ~") and err.count("\n") == 1
    demo.ensure_demo_model(tmp_path)
    assert capsys.readouterr().err == ""


def test_stale_temp_build_is_never_the_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fresh = tmp_path / f".{demo.DEMO_MODEL_NAME}.building-crashed"
    old = tmp_path / f".{demo.DEMO_MODEL_NAME}.building-ancient"
    for leftover in (fresh, old):
        leftover.mkdir()
        (leftover / "config.json").write_text('{"half": "built"}')
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    monkeypatch.setattr(demo, "_build_into", _fake_build)

    target = demo.ensure_demo_model(tmp_path)

    assert target == tmp_path / demo.DEMO_MODEL_NAME
    assert (target / "config.json").read_text() == "{}"
    assert fresh.is_dir()  # may belong to a live concurrent build
    assert not old.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name, demo.DEMO_MODEL_NAME]


def test_failed_build_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing_build(out_dir: Path, recipe: demo.DemoRecipe) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo, "_build_into", failing_build)
    with pytest.raises(RuntimeError, match="disk full"):
        demo.ensure_demo_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_losing_a_concurrent_build_keeps_the_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / demo.DEMO_MODEL_NAME

    def racing_build(out_dir: Path, recipe: demo.DemoRecipe) -> None:
        (out_dir / "config.json").write_text('{"by": "loser"}')
        target.mkdir()
        (target / "config.json").write_text('{"by": "winner"}')

    monkeypatch.setattr(demo, "_build_into", racing_build)
    assert demo.ensure_demo_model(tmp_path) == target
    assert (target / "config.json").read_text() == '{"by": "winner"}'
    assert [p.name for p in tmp_path.iterdir()] == [demo.DEMO_MODEL_NAME]


@pytest.mark.slow
@pytest.mark.fixed_kernels
def test_generate_without_a_model_chats_with_the_real_model(smollm2_gguf: Path, capsys) -> None:
    """The default model is the wheel's SmolLM2, imported once, asked DEMO_QUESTIONS as chat turns."""
    from offload.cli import main

    assert main(["generate", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "What is the capital of France?\nThe capital of France is Paris." in out
    assert all(q in out for q in demo.DEMO_QUESTIONS)
    model_dir = demo.default_model()
    assert model_dir.parent.name == "gguf" and model_dir.name.startswith(smollm2_gguf.stem)


def test_without_the_wheel_the_demo_model_stands_in(demo_model: Path, monkeypatch) -> None:
    monkeypatch.setattr(demo, "real_model_file", lambda: None)
    monkeypatch.setattr(demo, "ensure_demo_model", lambda: demo_model)
    assert demo.default_model() == demo_model
    assert demo.default_prompts(demo_model) == (list(demo.DEMO_PROMPTS), False)
    assert demo.default_prompts(demo_model.parent / "smollm2") == (list(demo.DEMO_QUESTIONS), True)
