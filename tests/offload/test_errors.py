"""Bad input: one line naming the file, tensor or value, exit status 2, no traceback."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_checkpoint
from offload.cli import main


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good")
    make_checkpoint(path, "llama")
    return path


@pytest.fixture
def model_dir(good_dir, tmp_path) -> Path:
    """A fresh copy of a valid checkpoint for a test to break."""
    return Path(shutil.copytree(good_dir, tmp_path / "model"))


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["generate", "--max-new-tokens", "2", *args])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in {err!r}"


def rewrite_header(path: Path, edit) -> None:
    """Apply `edit` to the JSON header of a safetensors file, keeping the data section."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def test_valid_checkpoint_runs(capsys, model_dir):
    code = main(["generate", "--model", str(model_dir), "--prompt", "hello", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("hello") and "tokens/s" in out


def test_missing_model_directory(capsys, tmp_path):
    code, err = run_cli(capsys, "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert_one_line_error(code, err, "nope", "not found")


def test_missing_config(capsys, model_dir):
    (model_dir / "config.json").unlink()
    assert_one_line_error(*run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"), "config.json", "not found")


def test_config_not_json(capsys, model_dir):
    (model_dir / "config.json").write_text("{ nope")
    assert_one_line_error(*run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"), "config.json", "JSON")


def test_missing_weight_file(capsys, model_dir):
    (model_dir / "model.safetensors").unlink()
    assert_one_line_error(*run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"), "safetensors")


def test_missing_shard_listed_in_index(capsys, tmp_path):
    make_checkpoint(tmp_path, "llama", max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert_one_line_error(*run_cli(capsys, "--model", str(tmp_path), "--prompt", "hi"), shard.name, "missing")


def test_unknown_architecture(capsys, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert_one_line_error(
        *run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"),
        "GPTNeoXForCausalLM",
        "LlamaForCausalLM",
    )


def test_config_missing_field(capsys, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    del config["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert_one_line_error(*run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"), "hidden_size")


def test_tensor_with_wrong_shape(capsys, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 128  # the checkpoint's MLP tensors are 96 wide
    (model_dir / "config.json").write_text(json.dumps(config))
    code, err = run_cli(capsys, "--model", str(model_dir), "--prompt", "hi")
    assert_one_line_error(code, err, "model.layers.0.mlp.", "[96, 64]", "[128, 64]")


def test_tensor_with_wrong_dtype(capsys, model_dir):
    name = "model.layers.1.input_layernorm.weight"  # 64 float32 values, the same bytes as 64 int32 ones
    rewrite_header(model_dir / "model.safetensors", lambda h: h[name].update(dtype="I32"))
    assert_one_line_error(*run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"), name, "I32")


def test_missing_tensor(capsys, model_dir):
    rewrite_header(model_dir / "model.safetensors", lambda h: h.pop("model.norm.weight"))
    assert_one_line_error(*run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"), "model.norm.weight")


@pytest.mark.parametrize("keep", [0.5, 0.999, 4 / 1e9])
def test_truncated_safetensors(capsys, model_dir, keep):
    path = model_dir / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[: max(int(len(raw) * keep), 4)])
    assert_one_line_error(*run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"), "model.safetensors", "truncat")


def test_corrupt_header(capsys, model_dir):
    path = model_dir / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:12] = b"\xff\xfe{{"
    path.write_bytes(bytes(raw))
    assert_one_line_error(*run_cli(capsys, "--model", str(model_dir), "--prompt", "hi"), "model.safetensors", "corrupt")


def test_empty_prompt(capsys, good_dir):
    assert_one_line_error(
        *run_cli(capsys, "--model", str(good_dir), "--prompt", "ok", "--prompt", ""), "prompt 1", "empty"
    )


def test_prompt_longer_than_context_window(capsys, good_dir):
    code, err = run_cli(capsys, "--model", str(good_dir), "--prompt", "x" * 300)  # window: 256 positions
    assert_one_line_error(code, err, "prompt 0", "301 tokens", "context window is 256")


def test_kv_cache_too_small_for_the_window_shrinks_it(capsys, good_dir):
    # 3 layers x 2 kv heads x 16 dims x fp32 x K,V = 768 bytes per token: 16 KiB holds 21 tokens -> 1 block
    code, err = run_cli(capsys, "--model", str(good_dir), "--prompt", "x" * 20, "--kv-cache-memory", "16KiB")
    assert_one_line_error(code, err, "prompt 0", "context window is 16")


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--kv-cache-memory", "100B"], "holds no block"),
        (["--top-p", "0"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--block-size", "0"], "block_size"),
        (["--device", "tpu"], "device"),
    ],
)
def test_bad_flags(capsys, good_dir, flags, fragment):
    assert_one_line_error(*run_cli(capsys, "--model", str(good_dir), "--prompt", "hi", *flags), fragment)


def test_model_without_prompt(capsys, good_dir):
    assert_one_line_error(*run_cli(capsys, "--model", str(good_dir)), "--prompt")


def test_debug_shows_the_traceback(good_dir, tmp_path):
    from offload.common.errors import OffloadError

    with pytest.raises(OffloadError):
        main(["--debug", "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])


def test_console_entry_point_exit_status(tmp_path):
    """The real process: exit 2 and a single stderr line."""
    proc = subprocess.run(
        [sys.executable, "-m", "offload", "generate", "--model", str(tmp_path), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'config.json'}: not found (a model directory holds config.json and *.safetensors)"
    ]
