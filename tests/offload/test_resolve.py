"""One resolve step for every face: the API and the command line plan the same config for the same budget."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import make_checkpoint, slow_disk_cpu
from offload import build as build_module
from offload import cli
from offload.api import LLM
from offload.common.config import DEFAULT_KV_CACHE, DEFAULT_MAX_NUM_SEQS, EngineConfig
from offload.common.errors import OffloadError
from offload.planner import autoconfig
from offload.planner.autoconfig import needs_plan, resolve
from offload.prompts import Prompts
from offload.scheduler.cost.predict import Workload

PROMPTS = ["the quick brown fox", "jumps over the lazy dog again"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("resolve")
    make_checkpoint(path, "llama", num_hidden_layers=6)
    return path


@pytest.fixture
def planned(monkeypatch):
    """Every resolved config the engine is built with, in order; the machine's profile and this process's RSS held
    still, so that two plans of the same workload are the same plan."""
    monkeypatch.setattr("offload.planner.probe.local_profile", slow_disk_cpu)
    monkeypatch.setattr(autoconfig, "process_rss", lambda: 300 << 20)
    seen: list[EngineConfig] = []

    def recording(model_dir, config, workload=None, hardware=None):
        resolved = resolve(model_dir, config, workload, hardware)
        seen.append(resolved[0])
        return resolved

    monkeypatch.setattr(build_module, "resolve", recording)
    return seen


def workload_of(model_dir, new_tokens: int) -> Workload:
    prompts = Prompts.load(model_dir)
    lengths = [len(prompts.encode(p)) for p in PROMPTS]
    return Workload(max(lengths), new_tokens, len(lengths))


@pytest.mark.parametrize(
    ("flags", "config"),
    [
        (["--memory", "1200MiB"], EngineConfig(memory=1200 << 20, dtype="float32")),  # RSS + MEMORY_RESERVE + room
        (["--device-memory", "700000"], EngineConfig(device_memory=700_000, dtype="float32")),
    ],
    ids=["memory", "device-memory"],
)
def test_the_api_plans_as_the_command_line_does(model_dir, planned, capsys, flags, config):
    argv = ["generate", "--model", str(model_dir), "--dtype", "float32", "--max-new-tokens", "4", *flags]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert cli.main(argv) == 0
    assert "plan       batch" in capsys.readouterr().err  # the cost model chose, and said so
    with LLM(model_dir, config, workload_of(model_dir, 4)) as llm:
        assert planned[0] == planned[1] == llm.config
        assert llm.prediction is not None
    assert planned[0].memory is None and planned[0].device_memory is not None  # a cap becomes a device budget


def test_none_means_the_planner_decides_for_every_budget(model_dir):
    config = EngineConfig()
    assert not needs_plan(config)  # no budget: nothing to size the batch within
    resolved, prediction, _ = resolve(model_dir, config)
    assert prediction is None
    assert resolved.max_num_seqs == DEFAULT_MAX_NUM_SEQS and resolved.kv_cache_bytes == DEFAULT_KV_CACHE
    for name in ("host_memory", "kv_host_memory", "kv_disk_memory", "expert_cache_memory", "expert_host_memory"):
        assert getattr(resolved, name) == 0, name
    assert resolved.device_memory is None and resolved.disk_memory is None  # no budget given: none imposed
    assert resolve(model_dir, resolved) == (resolved, None, None)  # a resolved config stays as it is


def test_a_fixed_batch_is_not_replanned(model_dir):
    config = EngineConfig(device_memory=700_000, max_num_seqs=3, dtype="float32")
    assert not needs_plan(config)
    resolved, prediction, _ = resolve(model_dir, config)
    assert prediction is None and resolved.max_num_seqs == 3 and resolved.kv_cache_bytes == DEFAULT_KV_CACHE


def test_a_cap_and_a_fixed_batch_are_refused_by_the_config_itself():
    with pytest.raises(OffloadError, match="memory sizes the batch and the KV cache itself"):
        EngineConfig(memory=1 << 30, max_num_seqs=4)
    with pytest.raises(OffloadError, match="kv_cache_bytes"):
        dataclasses.replace(EngineConfig(memory=1 << 30), kv_cache_bytes=1 << 20)
