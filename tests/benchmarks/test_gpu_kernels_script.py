"""The prepared GPU kernel benchmark on a CPU machine: its datasheet table, its roofline arithmetic, its refusal
without a CUDA device, and a dry run of the Triton kernels in the interpreter (its CUDA timing runs only where a GPU
is lent: a broken script would otherwise surface only during a rare GPU session)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
SCRIPT = GPU_DIR / "bench_kernels.py"


@pytest.fixture(scope="module")
def script():
    """The script loaded by path, registered under its name while the tests run (its dataclasses look their module
    up while being defined)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["bench_kernels"]


@pytest.mark.parametrize(
    "card, bandwidth, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12, 989),
        ("NVIDIA H100 PCIe", 2.0e12, 756),
        ("NVIDIA H100 NVL", 3.9e12, 835),
        ("NVIDIA H200", 4.8e12, 989),
        ("NVIDIA GH200 480GB", 4.0e12, 989),
        ("NVIDIA A100-SXM4-80GB", 2.039e12, 312),
        ("NVIDIA A100 80GB PCIe", 1.935e12, 312),
        ("NVIDIA A100-SXM4-40GB", 1.555e12, 312),
        ("NVIDIA L4", 300e9, 121),
        ("NVIDIA L40S", 864e9, 362),
        ("NVIDIA A10G", 600e9, 125),
        ("Tesla T4", 320e9, 65),
        ("NVIDIA GeForce RTX 4090", 1008e9, 165),
    ],
)
def test_peak_table_names_each_card(script, card, bandwidth, tflops):
    peak = script.table_peak(card)
    assert (peak.bytes_per_s, peak.flops, peak.source) == (bandwidth, tflops * 1e12, "datasheet")


@pytest.mark.parametrize("card", ["NVIDIA B200", "AMD Instinct MI300X", "NVIDIA GeForce RTX 3090"])
def test_unknown_card_has_no_table_peak(script, card):
    assert script.table_peak(card) is None  # the run measures it instead


def test_rows_take_the_nearer_roof(script):
    bench = script.Bench(clock=None, peak=script.Peak(bytes_per_s=1e12, flops=1e14, source="datasheet"))
    # 0.5 GB in 1 ms = 500 GB/s (half the bandwidth); 1 GFLOP in 1 ms = 1 TFLOP/s (1% of the compute)
    memory = bench.row("k", "triton", "s", 1e-3, 500_000_000, 1_000_000_000, baseline_s=2e-3, err=0.5)
    assert (memory.peak_fraction, memory.bound, memory.speedup, memory.max_abs_err) == (0.5, "memory", 2.0, 0.5)
    assert memory.gb_per_s == pytest.approx(500) and memory.tflops == pytest.approx(1)
    compute = bench.row("k", "torch", "s", 1e-3, 1_000_000, 80_000_000_000)  # 80 TFLOP/s, 1 GB/s
    assert (compute.peak_fraction, compute.bound, compute.speedup) == (pytest.approx(0.8), "compute", None)
    assert script.Bench(None, None).row("k", "triton", "s", 1e-3, 1, 1).peak_fraction is None


def test_a_missing_kernel_is_skipped_with_the_reason(script):
    assert script.find("x", "offload.kernels.rms_norm", "rms_norm_residual")[1] is None
    module, why = script.find("x", "offload.kernels.no_such_kernel", "f")
    assert module is None and "cannot import offload.kernels.no_such_kernel" in why
    module, why = script.find("rms_norm", "offload.kernels.rms_norm", "rms_norm_residual", "no_such_function")
    assert module is None and why == "rms_norm: offload.kernels.rms_norm has no no_such_function"


def test_unknown_kernel_name_is_refused(script):
    with pytest.raises(SystemExit):
        script.parse_args(["--kernels", "rms_norm,softmax"])
    assert script.parse_args(["--kernels", "rotary"]).kernels == ["rotary"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_refuses_without_a_cuda_device(script, tmp_path):
    out = tmp_path / "k.json"
    with pytest.raises(SystemExit, match="needs a CUDA device; --dry-run"):
        script.main(["--out", str(out)])
    assert not out.exists()


def test_dry_run_needs_the_interpreter(script, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in script.refusal(script.parse_args(["--dry-run"]))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton's CPU interpreter")
def test_dry_run_times_the_kernels_and_writes_the_report(script, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(GPU_DIR))  # as when the script runs: it imports its sibling by name
    out = tmp_path / "k.json"
    script.main(["--dry-run", "--kernels", "rms_norm,rotary", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["benchmark"] == "gpu_kernels" and report["dry_run"] and report["card"] == "cpu (dry run)"
    assert report["torch"] == torch.__version__ and report["peak"] is None and report["skipped"] == []
    rows = {(r["kernel"], r["impl"]): r for r in report["rows"]}
    assert set(rows) == {("rms_norm", "triton"), ("rms_norm", "torch"), ("rotary", "triton"), ("rotary", "torch")}
    assert rows["rms_norm", "triton"]["bytes"] == 4 * 3 * 96 * 4 + 96 * 4  # x, residual, normed, h; the weight
    assert rows["rotary", "triton"]["bytes"] == 2 * 3 * 6 * 16 * 4 + 2 * 3 * 16 * 4  # q, k in and out; cos, sin
    assert rows["rms_norm", "triton"]["max_abs_err"] < 1e-5 and rows["rotary", "triton"]["max_abs_err"] == 0
    assert all(r["seconds"] > 0 and r["gb_per_s"] > 0 for r in rows.values())
    printed = capsys.readouterr().out
    assert "us/call" in printed and "T=3 H=96 +residual" in printed
