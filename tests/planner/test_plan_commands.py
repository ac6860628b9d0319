"""From plan to run: the command `offload plan` prints for a policy makes the engine place the model and size its
batch as the plan priced them."""

from __future__ import annotations

import json
import shlex

import pytest
from test_autoconfig import slow_disk_cpu

from conftest import make_checkpoint
from offload.api import LLM
from offload.cli import build_parser, engine_config, main
from offload.common.config import EngineConfig
from offload.common.knobs import to_flags
from offload.planner.profiles import save_profile


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(),
        EngineConfig(device_memory=700_000, host_memory=5 << 20, dtype="float32", max_num_seqs=12, prefix_cache=False),
        EngineConfig(kv_cache_bytes=1 << 20, kv_dtype="int8", max_step_tokens=120, micro_batch_tokens=40, ring_slots=3),
    ],
)
def test_flags_written_from_a_config_read_back_as_that_config(config: EngineConfig) -> None:
    args = build_parser().parse_args(["serve", *to_flags(EngineConfig, config)])
    assert engine_config(args) == config


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan-to-run")
    make_checkpoint(path, "llama", num_hidden_layers=6)
    return path


@pytest.mark.parametrize("budget", ["700000", "2MB"])  # some layers streamed; every layer resident
def test_the_printed_command_places_and_batches_as_planned(six_layers, tmp_path, capsys, budget) -> None:
    profile = tmp_path / "cpu.json"
    save_profile(slow_disk_cpu(), profile)
    plan = ["plan", "--model", str(six_layers), "--hardware", str(profile), "--device-memory", budget]
    plan += ["--prompt-len", "10", "--gen-len", "6", "--requests", "12", "--dtype", "float32", "--json"]
    assert main(plan) == 0
    best = json.loads(capsys.readouterr().out)["best"][0]
    words = shlex.split(best["command"])
    assert words[:2] == ["offload", "batch"] and words[words.index("--model") + 1] == str(six_layers)
    config = engine_config(build_parser().parse_args(words[1:]))
    with LLM(six_layers, config) as llm:
        assert list(llm.parts.weights.policy.counts) == best["policy"]["layers"]
        assert llm.config.max_num_seqs == best["policy"]["batch"]
        assert llm.placement.device_budget == config.device_memory
    # the text report prints the same command under its table
    assert main(plan[:-1]) == 0
    assert best["command"] in capsys.readouterr().out


def test_a_named_model_gets_a_placeholder_and_a_quantized_policy_converts_first(capsys) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "rtx4090-24gb", "--quantize", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["best"]
    commands = [r["command"] for r in rows if r["command"]]
    assert commands and all("--model MODEL_DIR" in c for c in commands)
    for r in rows:
        if r["command"] and r["policy"]["weight_bits"] in (4, 8):
            bits = r["policy"]["weight_bits"]
            assert r["command"].startswith(
                f"offload convert --model MODEL_DIR --out MODEL_DIR-int{bits} --quant int{bits} && "
            )
