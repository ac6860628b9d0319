"""`offload plan`: the report, its JSON and plot, the FlexGen anchor, and bad input."""

from __future__ import annotations

import json

import pytest

from offload.cli import main
from offload.planner.models import load_model_spec
from offload.planner.profiles import load_profile
from offload.scheduler.cost.predict import Budgets, Workload
from offload.scheduler.cost.search import RING_SLOTS, best, search

FLEXGEN_OPT175B_T4 = 0.69  # tokens/s FlexGen published for OPT-175B on a T4, 208 GB DRAM, SSD; prompt 512, gen 32


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_opt175b_on_a_t4_is_within_2x_of_flexgen():
    shape, hw = load_model_spec("opt-175b"), load_profile("t4-16gb")
    preds = search(shape, hw, Workload(512, 32), dtype="float16", budgets=Budgets(host=208 * 10**9))
    top = best(preds)
    assert top is not None and top.fits
    assert FLEXGEN_OPT175B_T4 / 2 <= top.tokens_per_second <= FLEXGEN_OPT175B_T4 * 2
    # 349 GB of fp16 weights cannot sit in 16 + 208 GB: the best policy streams layers from disk and is bound by it
    assert top.candidate.policy.counts[2] > 0 and top.candidate.policy.ring_slots == RING_SLOTS
    assert top.bound == "disk"
    assert top.memory["device"] <= 16 * 10**9 and top.memory["host"] <= 208 * 10**9


def test_plan_report_names_the_best_policy_and_the_losers(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "llama-3.1-8b", "--hardware", "l4-24gb", "--prompt-len", "512", "--gen-len", "32"
    )
    assert code == 0
    assert "best policies" in out and "why the others lose" in out
    assert "does not fit" in out  # the largest batches overflow some tier
    assert "llama-3.1-8b (LlamaForCausalLM): 32 layers, 8.03 B parameters" in out
    assert "bfloat16 16.06 GB" in out  # the estimate-memory answer: total size per dtype


def test_plan_json_agrees_with_the_search(capsys):
    argv = ["plan", "--model", "mixtral-8x7b", "--hardware", "a100-80gb", "--prompt-len", "256", "--gen-len", "16"]
    code, out, _ = run(capsys, *argv, "--requests", "64", "--json", "--top", "3")
    assert code == 0
    data = json.loads(out)
    shape, hw = load_model_spec("mixtral-8x7b"), load_profile("a100-80gb")
    top = best(search(shape, hw, Workload(256, 16, 64), dtype="bfloat16"))
    assert len(data["best"]) == 3
    assert data["best"][0]["tokens_per_second"] == pytest.approx(top.tokens_per_second)
    assert data["best"][0]["policy"]["batch"] == top.candidate.batch
    assert data["best"][0]["policy"]["layers"] == list(top.candidate.policy.counts)  # device, host, disk
    assert all(row["fits"] for row in data["best"])
    assert {s["dtype"] for s in data["sizes"]} >= {"float16", "bfloat16", "int8", "int4"}


def test_plan_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    code, _, err = run(capsys, "plan", "--model", "qwen2.5-7b", "--hardware", "t4-16gb", "--plot", str(path))
    assert code == 0 and "plot written" in err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.partial"))


def test_plan_on_a_local_directory(capsys, tmp_path):
    from conftest import make_checkpoint

    make_checkpoint(tmp_path / "m", "qwen3")
    code, out, _ = run(capsys, "plan", "--model", str(tmp_path / "m"), "--hardware", "h100-80gb", "--gen-len", "8")
    assert code == 0 and "(Qwen3ForCausalLM): 3 layers" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-9"], "gpt-9"),
        (["--model", "llama-3.1-8b", "--hardware", "abacus"], "abacus"),
        (["--model", "llama-3.1-8b", "--hardware", "t4-16gb", "--dtype", "bfloat16"], "bfloat16"),
        (["--model", "llama-3.1-8b", "--hardware", "t4-16gb", "--gen-len", "0"], "gen-len"),
        (["--model", "llama-3.1-8b", "--hardware", "t4-16gb", "--device-memory", "lots"], "--device-memory"),
        (["--model", "llama-3.1-8b", "--hardware", "t4-16gb", "--disk-read", "-1"], "--disk-read"),
    ],
)
def test_plan_bad_input_is_one_line(capsys, argv, message):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_nothing_fits_says_by_how_much(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "llama-3.1-405b", "--hardware", "t4-16gb", "--device-memory", "1GB", "--gen-len", "4"
    )
    assert code == 0
    assert "nothing fits" in out and "over by" in out


def test_quantized_candidates_name_the_conversion_that_runs_them(capsys):
    argv = ["plan", "--model", "llama-3.1-8b", "--hardware", "t4-16gb", "--quantize", "--top", "8"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    rows = [line for line in out.splitlines() if " w4/" in line or " w8/" in line]
    assert rows and all("yes, converted: offload convert --quant int" in line for line in rows)
    assert all(line.split(" w")[1][0] == line.split("--quant int")[1][0] for line in rows)  # w4 -> int4, w8 -> int8
