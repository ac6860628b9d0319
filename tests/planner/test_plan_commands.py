"""From plan to run: the command `offload plan` prints for a policy makes the engine place the model and size its
batch as the plan priced them."""

from __future__ import annotations

import json
import random
import re
import shlex

import pytest
from test_autoconfig import slow_disk_cpu

from conftest import make_checkpoint
from offload.api import LLM
from offload.cli import build_parser, engine_config, main
from offload.common.config import EngineConfig
from offload.common.hardware import ComputeUnit, HardwareProfile
from offload.common.knobs import flag_name, knobs, to_flags
from offload.common.sizes import parse_size, typed_size
from offload.common.tier import Tier
from offload.planner.autoconfig import activation_bytes
from offload.planner.commands import command, planned_config
from offload.planner.models import load_model_spec
from offload.planner.profiles import load_profile, save_profile
from offload.planner.rows import per_batch
from offload.scheduler.cost.predict import Budgets, Workload, capacity
from offload.scheduler.cost.search import search


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
        assert list(llm.placement.counts) == best["policy"]["layers"]
        assert llm.config.max_num_seqs == best["policy"]["batch"]
        assert llm.placement.device_budget == config.device_memory
    # the text report prints the same command under its table
    assert main(plan[:-1]) == 0
    assert best["command"] in capsys.readouterr().out


TINYLLAMA = {  # TinyLlama-1.1B's shape, as the streamed benchmarks' checkpoint has it
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def sparse_checkpoint(path, config: dict) -> int:
    """A Llama checkpoint of `config`'s shape whose tensors are all zeros, written as a sparse file: its header and
    a hole, so that 2.2 GB of bfloat16 take no disk and no time to write. Returns the file's size."""
    import struct

    h = config["hidden_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": [config["vocab_size"], h], "model.norm.weight": [h]}
    shapes["lm_head.weight"] = [config["vocab_size"], h]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]}
        shapes |= {p + f"self_attn.{n}_proj.weight": [h, h] for n in ("q", "o")}
        shapes |= {p + f"self_attn.{n}_proj.weight": [kv, h] for n in ("k", "v")}
        shapes |= {p + f"mlp.{n}_proj.weight": [config["intermediate_size"], h] for n in ("gate", "up")}
        shapes[p + "mlp.down_proj.weight"] = [h, config["intermediate_size"]]
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


def test_the_printed_command_places_a_1b_checkpoint_as_planned(tmp_path, capsys) -> None:
    model = tmp_path / "llama-1.1b"
    assert sparse_checkpoint(model, TINYLLAMA) > 2e9
    profile = tmp_path / "cpu.json"
    ram = ComputeUnit(16 << 30, 2e10, {"float32": 1e11, "bfloat16": 1e11})
    save_profile(HardwareProfile("test cpu", "cpu", ram, ram, 0.0, 0.0, 2e9, 2e9, "test"), profile)
    plan = ["plan", "--model", str(model), "--hardware", str(profile), "--device-memory", "600MB"]
    plan += ["--host-memory", "0", "--prompt-len", "128", "--gen-len", "16", "--requests", "8", "--dtype", "bfloat16"]
    plan += ["--json"]
    assert main(plan) == 0
    best = json.loads(capsys.readouterr().out)["best"][0]
    layers = best["policy"]["layers"]
    assert layers[0] > 0 and layers[2] > 0 and sum(layers) == 22  # some resident, the rest streamed from disk
    words = shlex.split(best["command"])
    assert words[:2] == ["offload", "batch"] and words[words.index("--model") + 1] == str(model)
    config = engine_config(build_parser().parse_args(words[1:]))
    with LLM(model, config) as llm:
        assert list(llm.placement.counts) == layers
        assert llm.config.max_num_seqs == best["policy"]["batch"]
        assert llm.placement.device_budget == config.device_memory <= 600_000_000


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


# ---- hardware options side by side ------------------------------------------------------------------------------


def test_hardware_options_side_by_side_with_their_cost_per_million_tokens(capsys) -> None:
    argv = ["plan", "--model", "llama-3.1-70b", "--hardware", "t4-16gb,l4-24gb,rtx4090-24gb,a100-80gb"]
    argv += [
        "--price",
        "t4-16gb=0.35",
        "--price",
        "L4-24GB=0.71",
        "--purchase",
        "rtx4090-24gb=2628",
        "--price",
        "a100-80gb=3.67",
    ]
    assert main([*argv, "--json"]) == 0
    rows = {r["hardware"]: r for r in json.loads(capsys.readouterr().out)["options"]}
    assert set(rows) == {"T4-16GB", "L4-24GB", "RTX4090-24GB", "A100-80GB-SXM"}
    assert rows["RTX4090-24GB"]["usd_per_hour"] == pytest.approx(2628 / (3 * 365 * 24))  # spread over three years
    for r in rows.values():
        assert r["fits"] and r["bound"] in ("disk", "link", "compute", "host")
        assert r["usd_per_million_tokens"] == pytest.approx(r["usd_per_hour"] / (r["tokens_per_second"] * 3600) * 1e6)
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in table if line.split() and line.split()[0] in rows]
    cheapest_first = sorted(rows, key=lambda name: rows[name]["usd_per_million_tokens"])
    assert listed == cheapest_first


def test_a_folder_of_profiles_a_disk_class_and_a_planning_only_card(capsys, tmp_path) -> None:
    from offload.planner.profiles import load_profile

    for name in ("rtx4090-24gb", "mi300x-192gb"):
        save_profile(load_profile(name), tmp_path / f"{name}.json")
    argv = ["plan", "--model", "llama-3.1-8b", "--hardware", str(tmp_path), "--disk", "sata", "--json"]
    assert main(argv) == 0
    rows = {r["hardware"]: r for r in json.loads(capsys.readouterr().out)["options"]}
    assert rows["MI300X-192GB"]["not_run"] and rows["RTX4090-24GB"]["not_run"] is None
    assert main(argv[:-1]) == 0
    assert "planning only" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--price", "t4-16gb"], "give PROFILE=USD"),
        (["--price", "h100-80gb=2"], "none of the --hardware options"),
        (["--purchase", "t4-16gb=1", "--amortize-hours", "0"], "--amortize-hours must be positive"),
        (["--disk", "floppy"], "--disk 'floppy': one of sata"),
    ],
)
def test_bad_prices_and_disks_are_one_line(capsys, extra, message) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "t4-16gb,l4-24gb", *extra]) != 0
    assert message in capsys.readouterr().err


def test_deepseek_v3_on_one_24gb_card_and_256gb_of_ram_runs_here(capsys) -> None:
    """The plan docs/benchmarks.md sets beside KTransformers: 671B parameters, 4-bit, on a 24 GB card with 256 GB of
    host RAM (less than the model); every row the engine runs, with a command, and a positive device budget in each
    (the routed experts of the average layer, not of a sparse one, leave the placed layers: its 3 dense layers hold
    none)."""
    argv = ["plan", "--model", "deepseek-v3", "--hardware", "rtx4090-24gb", "--host-memory", "256GB", "--quantize"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["best"]
    assert rows and all(r["fits"] and not r["unsupported"] and r["command"] for r in rows)
    for r in rows:
        words = r["command"].split()
        assert parse_size(words[words.index("--device-memory") + 1]) > 0


# ---- sizes as a user types them ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "spare", "text"),
    [
        (22_860_591_104, None, "22.86GB"),  # the fewest digits; of 22.86GB and 21.29GiB, the nearer
        (17_366_183_936, None, "16.17GiB"),
        (137_400_000_000, None, "137.4GB"),  # a datasheet's decimal size, exactly
        (68 << 20, None, "68MiB"),
        (27_380_416_512, 0, "25.5GiB"),
        (6_066_641_305, 0, "5.65GiB"),  # 5.65GiB is 6066641305.6 bytes, which parse_size reads as this
        (17_366_183_936, 1 << 20, "17366MB"),  # a spare of 1 MiB, less than 0.1%: 16.17GiB loses 3.6 MiB
        (650_123, 0, "650123"),  # exactly, and no unit writes it shorter
        (1023, None, "1023"),
        (0, None, "0"),
    ],
)
def test_typed_size_rounds_down_to_the_fewest_digits(nbytes: int, spare: int | None, text: str) -> None:
    assert typed_size(nbytes, spare) == text


def test_typed_size_never_exceeds_nor_loses_more_than_it_may() -> None:
    rng = random.Random(0)
    for _ in range(20_000):
        nbytes = rng.randrange(10 ** rng.randint(1, 14))
        spare = rng.choice([None, 0, rng.randrange(nbytes + 1)])
        allowed = nbytes // 1000 if spare is None else min(spare, nbytes // 1000)
        back = parse_size(typed_size(nbytes, spare))
        assert nbytes - allowed <= back <= nbytes, (nbytes, spare)
        assert parse_size(typed_size(back, 0)) == back  # a typed size is written back exactly


_SIZE_FLAGS = {flag_name(f, k): f.name for f, k in knobs(EngineConfig) if k.size}
_TYPED = re.compile(r"0|\d+(\.\d{1,3})?(TiB|TB|GiB|GB|MiB|MB|KiB|kB)")


@pytest.mark.parametrize(
    ("model", "hardware", "dtype", "budgets", "quantized"),
    [
        ("llama-3.1-8b", "l4-24gb", "bfloat16", Budgets(), False),
        ("qwen3-30b-a3b", "t4-16gb", "float16", Budgets(), False),  # KV in host RAM, its device part one sequence
        ("mixtral-8x7b", "rtx4090-24gb", "bfloat16", Budgets(host=256 * 10**9), True),  # expert caches, converted
    ],
)
def test_the_printed_sizes_are_in_units_and_never_exceed_the_plan(model, hardware, dtype, budgets, quantized) -> None:
    """Each size the command says parses back to no more than the plan's and at most 0.1% less, and to no less than
    the policy uses there, so that the engine places every layer and expert where the plan did."""
    shape, hw, work = load_model_spec(model), load_profile(hardware), Workload(512, 32)
    cap = capacity(hw, budgets)
    rows = [p for p in per_batch(search(shape, hw, work, dtype=dtype, budgets=budgets, quantized=quantized)).values()]
    rows = [p for p in rows if p.fits and not p.unsupported]
    assert rows and (not quantized or any(p.candidate.expert_cache for p in rows))
    for p in rows:
        c = p.candidate
        words = shlex.split(command(model, planned_config(shape, hw, dtype, p, work, budgets), "serve", c.weight_bits))
        for flag, word in zip(words, words[1:], strict=False):
            assert flag not in _SIZE_FLAGS or _TYPED.fullmatch(word), f"{flag} {word}"
        config = engine_config(build_parser().parse_args(words[words.index("serve") :]))
        one = config.kv_cache_bytes if c.kv_tier == Tier.HOST else 0  # the KV device part, added to the device's
        activations = activation_bytes(shape, hw, dtype, EngineConfig(dtype=dtype), c, work)
        planned = {"device_memory": (cap[Tier.DEVICE] - activations + one, p.memory[Tier.DEVICE] - activations + one)}
        if c.policy.counts[1]:
            planned["host_memory"] = (cap[Tier.HOST], p.memory[Tier.HOST])
        if c.expert_cache:
            planned["expert_cache_memory"] = (c.expert_cache, 0)
        for name, (nbytes, used) in planned.items():
            assert max(nbytes - nbytes // 1000, used) <= getattr(config, name) <= nbytes, (name, nbytes, c)
