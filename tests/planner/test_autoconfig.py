"""The engine's batch from the cost model: sized to the budget, runnable, and what the CLI uses by default."""

from __future__ import annotations

import pytest
import torch

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.common.hardware import ComputeUnit, HardwareProfile
from offload.common.sizes import format_size, parse_size
from offload.planner import autoconfig
from offload.planner.autoconfig import autoconfigure
from offload.planner.models import load_model_spec
from offload.scheduler.cost.predict import Workload
from offload.tiers.kv.kv_cache import KVCache


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
    assert llm.placement.device_budget == budget
    assert llm.placement.policy == cand.policy  # the engine runs the placement the cost model priced, ring included
    out = llm.generate_ids([[5 + i] * 10 for i in range(12)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(c.token_ids) == 6 for c in out)
    assert llm.last_run.preemptions == 0  # the KV cache holds the whole batch
    assert llm.placement.device_peak <= budget


def test_a_quantized_kv_cache_is_planned_with_its_own_block_size(model_dir):
    """--kv-dtype int8: the cost model prices 8-bit KV (scales included) and the KV cache gets int8 blocks."""
    base = EngineConfig(device_memory=700_000, dtype="float32", kv_dtype="int8")
    config, prediction = autoconfigure(model_dir, base, [10] * 12, 6, slow_disk_cpu())
    assert prediction.candidate.kv_bits == 8 and not prediction.unsupported
    per_block = KVCache.block_bytes(6, config.block_size, 2, 16, torch.float32, "int8")
    assert per_block < KVCache.block_bytes(6, config.block_size, 2, 16, torch.float32) / 3
    assert config.kv_cache_bytes == prediction.candidate.batch * -(-(10 + 6) // config.block_size) * per_block
    with LLM(model_dir, config) as llm:
        out = llm.generate_ids([[5 + i] * 10 for i in range(12)], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert all(len(c.token_ids) == 6 for c in out) and llm.last_run.preemptions == 0


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


# ---- a cap on the whole process ---------------------------------------------------------------------------------

HELD = 50_000_000  # bytes: what the process holds when it plans, as the patched RSS reader says


# device bytes a cap leaves: one layer resident, five streamed through 2 slots, with room for the engine's 4 KiB
# alignment of each tensor (10% of these tiny layers), which the cost model does not count
ROOM = 1_000_000


@pytest.fixture
def held(monkeypatch):
    monkeypatch.setattr(autoconfig, "process_rss", lambda: HELD)


def test_memory_plans_in_the_cap_less_the_rss_and_the_reserve(model_dir, held):
    hw = slow_disk_cpu()
    cap = HELD + autoconfig.MEMORY_RESERVE + ROOM
    base = EngineConfig(memory=cap, dtype="float32", device="cpu")
    config, prediction = autoconfigure(model_dir, base, [10] * 12, 6, hw)
    _, same = autoconfigure(model_dir, EngineConfig(device_memory=ROOM, dtype="float32"), [10] * 12, 6, hw)
    assert prediction == same  # the cost model saw a device budget of ROOM bytes
    cand = prediction.candidate
    assert (cand.batch, cand.micro_batches, cand.policy.counts) == (12, 4, (1, 0, 5))
    shape = load_model_spec(str(model_dir))
    activations = autoconfig.activation_bytes(shape, hw, "float32", base, cand, Workload(10, 6, 12))
    # float32: a prefill micro-batch of 3 prompts of 10 tokens, 672 values live per token in a layer (hidden 64,
    # q/k/v, MLP 96), the batch's hidden states between layers, and the logits of 12 rows over 300 tokens
    assert activations == (3 * 10 * 672 + 12 * 10 * 64 + 12 * 300) * 4
    # the engine's device tier: the budget less the activations the cost model counted in it, allocated outside
    assert config.memory is None and config.device_memory == ROOM - activations
    assert config.max_num_seqs == cand.batch
    llm = LLM(model_dir, config)
    assert llm.placement.policy == cand.policy
    out = llm.generate_ids([[5 + i] * 10 for i in range(12)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(c.token_ids) == 6 for c in out) and llm.placement.device_peak <= config.device_memory


def test_what_the_process_holds_comes_out_of_the_cap(model_dir, monkeypatch):
    hw = slow_disk_cpu()
    cap = HELD + autoconfig.MEMORY_RESERVE + 700_000
    monkeypatch.setattr(autoconfig, "process_rss", lambda: HELD + 200_000)
    _, prediction = autoconfigure(model_dir, EngineConfig(memory=cap, dtype="float32"), [10] * 12, 6, hw)
    _, same = autoconfigure(model_dir, EngineConfig(device_memory=500_000, dtype="float32"), [10] * 12, 6, hw)
    assert prediction == same


def test_the_host_ram_the_engine_keeps_comes_out_of_the_cap(model_dir, held):
    """The KV host part is host RAM like the layers': a cap leaves the device what both do not take."""
    hw = slow_disk_cpu()
    cap = HELD + autoconfig.MEMORY_RESERVE + 700_000
    kv_host = EngineConfig(memory=cap + 200_000, kv_host_memory=200_000, dtype="float32")
    host = EngineConfig(memory=cap + 200_000, host_memory=200_000, kv_host_memory=200_000, dtype="float32")
    _, same = autoconfigure(model_dir, EngineConfig(device_memory=700_000, dtype="float32"), [10] * 12, 6, hw)
    assert autoconfigure(model_dir, kv_host, [10] * 12, 6, hw)[1] == same
    assert autoconfigure(model_dir, host, [10] * 12, 6, hw)[1] == same


@pytest.mark.parametrize("room", [10_000, -(1 << 20)])  # device bytes the cap leaves: too few, or below nothing
def test_a_cap_too_small_for_one_sequence_says_by_how_much(model_dir, held, room):
    cap = HELD + autoconfig.MEMORY_RESERVE + room
    with pytest.raises(OffloadError, match="over device by ") as budgeted:
        autoconfigure(model_dir, EngineConfig(device_memory=10_000, dtype="float32"), [8], 4, slow_disk_cpu())
    need = 10_000 + parse_size(str(budgeted.value).split("over device by ")[1].split(" (")[0].replace(" ", ""))
    with pytest.raises(OffloadError) as capped:
        autoconfigure(model_dir, EngineConfig(memory=cap, dtype="float32"), [8], 4, slow_disk_cpu())
    said = str(capped.value)
    assert "\n" not in said
    assert said.startswith(f"memory of {format_size(cap)} is {format_size(need - room)} short of one sequence of 12")
    assert f"held {format_size(HELD)} when it planned" in said


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"memory": -1}, "memory must be a non-negative number of bytes, got -1"),
        ({"memory": "2GiB"}, "memory must be a non-negative number of bytes, got '2GiB'"),
        ({"memory": 1 << 30, "device_memory": 1 << 29}, "are exclusive"),
    ],
)
def test_bad_memory_is_one_clear_error(fields, message):
    with pytest.raises(OffloadError, match=message):
        EngineConfig(**fields)


def test_an_llm_given_a_cap_runs_what_the_cost_model_plans(model_dir, held, monkeypatch):
    """LLM(model, EngineConfig(memory=...)) plans for its workload as autoconfigure does, and runs that plan."""
    import offload.planner.probe

    monkeypatch.setattr(offload.planner.probe, "local_profile", slow_disk_cpu)
    given = EngineConfig(memory=HELD + autoconfig.MEMORY_RESERVE + ROOM, dtype="float32", device="cpu")
    planned, prediction = autoconfigure(model_dir, given, [10] * 12, 6, slow_disk_cpu())
    with LLM(model_dir, given, Workload(10, 6, 12)) as llm:
        assert llm.config == planned and llm.prediction == prediction and llm.given_config == given
        assert llm.placement.device_budget == planned.device_memory and llm.config.memory is None
        out = llm.generate_ids([[5 + i] * 10 for i in range(12)], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert all(len(c.token_ids) == 6 for c in out) and llm.last_run.preemptions == 0
        assert llm.placement.device_peak <= planned.device_memory
    with pytest.raises(OffloadError, match="only on a CPU device"):
        autoconfigure(model_dir, EngineConfig(memory=1 << 30, device="cuda"), [8], 4, slow_disk_cpu())


def test_cli_memory_plans_like_device_memory(model_dir, held, capsys, monkeypatch):
    import offload.planner.probe
    from offload.cli import main

    monkeypatch.setattr(offload.planner.probe, "local_profile", slow_disk_cpu)
    argv = ["generate", "--model", str(model_dir), "--prompt", "abc", "--prompt", "de", "--max-new-tokens", "3"]
    cap = str(HELD + autoconfig.MEMORY_RESERVE + 700_000)
    assert main([*argv, "--memory", cap, "--dtype", "float32", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "the cost model's choice" in err and f"memory     cap {format_size(int(cap))}: " in err
    assert main([*argv, "--memory", cap, "--max-num-seqs", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: memory sizes the batch and the KV cache itself: leave max_num_seqs (--max-num-seqs) and "
        "kv_cache_bytes (--kv-cache-memory) unset"
    )
    assert main([*argv, "--memory", cap, "--device-memory", "700000"]) == 2
    assert "are exclusive" in capsys.readouterr().err


def test_a_quantized_checkpoint_is_planned_at_its_own_width(model_dir, tmp_path):
    """An int4 checkpoint: the cost model prices 4-bit layers (smaller: a larger batch fits the same budget)."""
    from offload.common.quant import WeightQuant
    from offload.convert.quantize import convert

    out = tmp_path / "int4"
    convert(model_dir, out, WeightQuant(4, 32, "cpu"))
    base = EngineConfig(device_memory=800_000, dtype="float32")
    _, dense = autoconfigure(model_dir, base, [8] * 64, 4, slow_disk_cpu())
    config, quantized = autoconfigure(out, base, [8] * 64, 4, slow_disk_cpu())
    assert dense.candidate.weight_bits == 32 and quantized.candidate.weight_bits == 4
    assert not quantized.unsupported
    assert quantized.memory["device"] <= 800_000
    with LLM(out, config) as llm:
        out_ids = llm.generate_ids([[5 + i] * 8 for i in range(4)], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert all(len(c.token_ids) == 4 for c in out_ids)


def test_the_planned_placement_leaves_a_big_table_in_storage_as_the_engine_does(tmp_path):
    """An 8 MiB embedding beside layers of 128 KiB: a budget without room for it still runs every layer resident
    but the ring's worth, and the engine places what the cost model priced, the table left in storage included."""
    make_checkpoint(tmp_path, "llama", num_hidden_layers=6, vocab_size=32768)
    budget = 14_000_000  # bytes: the 8.4 MB head, the 2 MiB row buffer, KV cache, logits and some layers
    config, prediction = autoconfigure(
        tmp_path, EngineConfig(device_memory=budget, dtype="float32"), [10] * 4, 6, slow_disk_cpu()
    )
    cand = prediction.candidate
    assert prediction.fits and cand.policy.embed_tier == "nvme" and cand.policy.counts[0] >= 1
    llm = LLM(tmp_path, config)
    assert llm.placement.policy == cand.policy
    out = llm.generate_ids([[5 + i] * 10 for i in range(4)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(c.token_ids) == 6 for c in out) and llm.stats().weights.embed_rows_read >= 4 * 6
    llm.close()
