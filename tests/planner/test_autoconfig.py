"""The engine's batch from the cost model: sized to the budget, runnable, and what the CLI uses by default."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.common.hardware import ComputeUnit, HardwareProfile
from offload.planner.autoconfig import autoconfigure
from tiers.kv import KVCache


def slow_disk_cpu(disk_read: float = 1e8) -> HardwareProfile:
    ram = ComputeUnit(16 << 30, 2e10, {"float32": 1e11})
    return HardwareProfile("test cpu", "cpu", ram, ram, 0.0, 0.0, disk_read, disk_read, "test")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto")
    make_checkpoint(path, "llama", num_hidden_layers=6)
    return path


def test_planned_config_fits_the_budget_and_runs(model_dir):
    budget = 700_000  # bytes: of six layers of 124 KB, one resident, the rest streamed through 3 slots
    base = EngineConfig(device_memory=budget, dtype="float32")
    config, prediction = autoconfigure(model_dir, base, [10] * 12, 6, slow_disk_cpu())
    cand = prediction.candidate
    assert prediction.fits and not prediction.unsupported
    assert config.max_num_seqs == cand.batch and config.device_memory == budget
    spec_blocks = -(-(10 + 6) // config.block_size)
    per_block = KVCache.block_bytes(6, config.block_size, 2, 16, torch.float32)
    assert config.kv_cache_bytes == cand.batch * spec_blocks * per_block
    assert config.max_step_tokens >= cand.batch * 10  # every prompt of the batch in one pass
    llm = LLM(model_dir, config)
    assert llm.device_tier.capacity == budget
    assert llm.policy == cand.policy  # the engine runs the placement the cost model priced, ring included
    out = llm.generate_ids([[5 + i] * 10 for i in range(12)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(c.token_ids) == 6 for c in out)
    assert llm.stats.preemptions == 0  # the KV cache holds the whole batch
    assert llm.device_tier.peak <= budget


def test_a_slow_disk_makes_the_batch_as_large_as_the_requests(model_dir):
    """Disk-bound: each extra sequence shares the same reads, so the best batch serves every request at once."""
    base = EngineConfig(device_memory=800_000, dtype="float32")
    config, prediction = autoconfigure(model_dir, base, [8] * 5, 4, slow_disk_cpu(disk_read=1e6))
    assert prediction.bound == "disk" and config.max_num_seqs == 5


def test_nothing_fits_is_one_clear_error(model_dir):
    with pytest.raises(OffloadError, match="no batch fits"):
        autoconfigure(model_dir, EngineConfig(device_memory=10_000, dtype="float32"), [8], 4, slow_disk_cpu())


def test_cli_plans_when_neither_batch_nor_kv_is_fixed(model_dir, capsys, monkeypatch):
    import offload.planner.probe
    from offload.cli import main

    monkeypatch.setattr(offload.planner.probe, "local_profile", slow_disk_cpu)
    argv = ["generate", "--model", str(model_dir), "--prompt", "abc", "--prompt", "de", "--max-new-tokens", "3"]
    assert main([*argv, "--device-memory", "700000", "--dtype", "float32"]) == 0
    assert "the cost model's choice" in capsys.readouterr().err
    assert (
        main(
            [
                *argv,
                "--device-memory",
                "700000",
                "--dtype",
                "float32",
                "--max-num-seqs",
                "1",
                "--kv-cache-memory",
                "64KiB",
            ]
        )
        == 0
    )
    assert "the cost model's choice" not in capsys.readouterr().err
