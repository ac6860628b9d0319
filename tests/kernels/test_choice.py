"""kernels/choice.py: each kernel's path chosen by its timings, kept on disk and read back without timing again;
OFFLOAD_KERNELS; and a failing compiler called once per source across processes (kernels/native_build.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from offload.common import environment
from offload.kernels import choice, dispatch, native, native_build, timing
from offload.kernels.linear import logits

INT4 = (
    choice.Timing(1, {"native": 10.0, "torch": 12.0}),
    choice.Timing(4, {"native": 13.0, "torch": 12.0}),
    choice.Timing(16, {"native": 30.0, "torch": 40.0}),
    choice.Timing(64, {"native": 90.0, "torch": 100.0, "dense": 50.0}),
)


def test_rows_take_one_path_up_to_a_switch_and_another_from_it():
    """Each path one range of rows, where the paths cost the least over the timed counts: the near-tie at 4 rows
    (torch's 12 against 13) does not make 4 to 15 rows take another path than 1 to 3 and 16 to 63 (a batch's size
    would then change a sequence's tokens)."""
    c = choice.Choices({"int4": INT4})
    assert [c.path("int4", r) for r in (1, 3, 4, 15, 16, 63, 64, 5000)] == ["native"] * 6 + ["dense"] * 2
    assert c.describe("int4") == "native 1-63, dense from 64"
    assert choice.split(INT4[:3]) == ((1, "native"),)
    assert INT4[3].path == "dense" and INT4[3].speedup == pytest.approx(90 / 50)
    assert choice.Choices({"argmax": (choice.Timing(1, {"native": 1.0, "torch": 2.0}),)}).describe("argmax") == "native"


def test_forcing_overrides_every_kernel_and_a_path_a_kernel_lacks_is_torchs(monkeypatch):
    monkeypatch.delenv("OFFLOAD_KERNELS", raising=False)
    with choice.forcing("dense"):
        assert choice.path("int4", 1) == "dense" and choice.path("bf16", 1) == "torch"
        with choice.forcing("native"):
            assert choice.path("bf16", 1) == "native"
    monkeypatch.setenv("OFFLOAD_KERNELS", "torch")
    assert choice.path("int4", 8) == "torch" and environment.kernel_mode() == "torch"


def test_offload_kernels_native_takes_the_fixed_thresholds(monkeypatch):
    monkeypatch.setenv("OFFLOAD_KERNELS", "native")
    assert environment.kernel_mode() == "native"
    assert [choice.path("int4", r) for r in (1, 255, 256)] == ["native", "native", "dense"]
    assert [choice.path("bf16", r) for r in (16, 17)] == ["native", "torch"]
    assert choice.path("rms_norm", 4096) == "native"


def test_a_speculating_engine_takes_one_rows_path_for_its_verify_rows(monkeypatch):
    """A verify step of k + 1 rows rounds as k + 1 one-row steps do: its products take the one-row path."""
    monkeypatch.setenv("OFFLOAD_KERNELS", "native")
    try:
        choice.one_row_path_up_to(20)
        assert [choice.path("bf16", r) for r in (1, 17, 20, 21)] == ["native", "native", "native", "torch"]
        assert choice.path("rms_norm", 4096) == "native"  # past the rule: as before
    finally:
        choice.forget()
    assert choice.path("bf16", 17) == "torch"


def test_row_wise_kernels_other_than_products_take_one_path_at_every_row_count(measured, monkeypatch):
    """silu_mul timed faster on torch's path at one row and natively from 16 (as on the AMD EPYC): it takes one path
    for every row count, the one of least cost over the counts timed, so that a prompt's rows round alike however
    the prompt is cut into steps (a prefix-cache hit leaves a few rows where a fresh prefill computes them all), and
    a verify step's rows as its one-row steps."""
    made = timing.measure()  # the fixture's made-up timings, and silu_mul's
    rows = tuple(
        choice.Timing(r, {"native": n, "torch": t}) for r, n, t in ((1, 2.0, 1.0), (16, 1.0, 2.0), (256, 1.0, 2.0))
    )
    monkeypatch.setattr(timing, "measure", lambda: made | {"silu_mul": rows})
    timing.ensure()
    assert {choice.path("silu_mul", r) for r in (1, 2, 9, 15, 16, 300)} == {"native"}
    assert choice.kept().describe("silu_mul") == "native"
    assert {row["taken"] for row in choice.timing_table(choice.kept()) if row["kernel"] == "silu_mul"} == {"native"}
    choice.one_row_path_up_to(17)
    assert {choice.path("silu_mul", r) for r in (1, 17, 18)} == {"native"}


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The timed mode in a cache folder of its own, the timings made up (counted), no native kernel built anew."""
    if native_build.why_off() is not None:
        pytest.skip(native_build.why_off())
    monkeypatch.delenv("OFFLOAD_KERNELS", raising=False)
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure():
        calls.append(1)
        return {k: (choice.Timing(1, {"native": 2.0, "torch": 1.0}),) for k in choice.PLAN} | {"int4": INT4}

    monkeypatch.setattr(timing, "measure", fake_measure)
    choice.forget()
    yield calls
    choice.forget()


def test_timings_are_kept_and_read_back_without_timing_again(measured, tmp_path):
    assert choice.kept() is None and choice.path("int4", 20) == "torch"  # not timed yet: torch's paths
    first = timing.ensure()
    assert measured == [1] and choice.path("int4", 20) == "native" and choice.path("rms_norm", 8) == "torch"
    kept = json.loads(first.file.read_text())
    assert first.file.parent == tmp_path / "native" and kept["timings"]["int4"][3]["us"]["dense"] == 50.0
    choice.forget()  # a new process
    again = timing.ensure()
    assert measured == [1] and again.timings == first.timings  # read from the file
    assert f"timed on this machine ({first.file}): int4 native 1-63, dense from 64;" in choice.summary()
    first.file.write_text("{not json")  # a damaged file is timed again, never used
    choice.forget()
    assert timing.ensure().timings == first.timings and measured == [1, 1]
    timing.retime()  # `offload probe`: timed again, whatever is kept
    assert measured == [1, 1, 1]


def test_the_engine_takes_the_timed_path(measured):
    """rms_norm timed slower natively: torch's reference runs it; int4 at 20 rows: the native kernel."""
    timing.ensure()
    from offload.common.quant import WeightQuant
    from offload.kernels.quant_linear import quant_linear
    from offload.kernels.rms_norm import fused_rms_norm

    x = torch.randn(4, 64).to(torch.bfloat16)
    fused_rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    assert dispatch.picked()["rms_norm"] == "torch"
    q = torch.randint(0, 16, (64, 64), dtype=torch.int32)
    codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = torch.rand(2, 64, 2).to(torch.bfloat16)
    quant_linear(torch.randn(20, 64).to(torch.bfloat16), codes, scales, WeightQuant(4, 32, "cpu"))
    assert dispatch.picked()["quant_matmul"] == "native"


@pytest.mark.parametrize("rows", [1, 3])
def test_logits_are_float32_on_torchs_path_too(rows: int, monkeypatch):
    """The head's float32 sums on every path: torch's (a float32 GEMM over the converted weight) agrees with the
    native kernel's to float32 summation's error, and greedy picks the same token."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(2000, 576, generator=gen).div(24).to(torch.bfloat16)
    exact = x.double() @ w.double().t()
    with choice.forcing("torch"):
        got = logits(x, w)
    assert got.dtype == torch.float32 and dispatch.picked()["logits"] == "torch"
    assert (got.double() - exact).abs().max() <= exact.abs().max() * 2.0**-20
    if native._bf16_mm() is not None:
        with choice.forcing("native"):
            assert torch.equal(logits(x, w).argmax(-1), got.argmax(-1))


def test_a_failing_compiler_is_called_once_per_source_across_processes(tmp_path, monkeypatch):
    """Two processes each ask for every native kernel with a compiler that fails: it is called once per source in
    all, and both say why the kernels are off, naming the kept log."""
    if native.cpu_missing() is not None:
        pytest.skip(native.cpu_missing())
    count = tmp_path / "calls"
    compiler = tmp_path / "cc"
    compiler.write_text(f"#!/bin/sh\necho \"$@\" >> {count}\necho 'cc: no' >&2\nexit 1\n")
    compiler.chmod(0o755)
    env = {"CC": str(compiler), "OFFLOAD_CACHE_DIR": str(tmp_path / "cache"), "OFFLOAD_KERNELS": ""}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ask = "from offload.kernels import native_build as b; print(b.why_off())"
    said = [subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True) for _ in range(2)]
    sources = sorted(native_build.SOURCES.glob("*.c"))
    assert len(count.read_text().splitlines()) == len(sources)
    for run in said:
        assert "building bf16_mm.c with" in run.stdout and ".failed.log" in run.stdout


def test_a_models_own_shapes_are_timed_once_and_decide_its_products(measured, monkeypatch):
    """The model's matrices are timed at their own shapes as it loads (once: kept beside the kernel's timings), and
    a product of that shape takes their path; other shapes take the kernel's own timings."""
    made = []
    fake = {"native": 1.0, "torch": 2.0}

    def fake_timings(kernel, rows, make, rounds=3):
        made.append(kernel)
        return (choice.Timing(1, dict(fake)), choice.Timing(8, {"native": 3.0, "torch": 2.0}))

    monkeypatch.setattr(timing, "_timings", fake_timings)
    monkeypatch.setattr(timing, "MIN_SHAPE_ELEMENTS", 128 * 64)
    # 100 rows of codes: not the native kernel's; 64 x 64: too small to time
    timed = timing.ensure([("int4", 128, 64), ("int4", 100, 64), ("int4", 64, 64)])
    assert made == ["int4"] and "int4 128x64" in timed.timings
    assert "int4 100x64" not in timed.timings and "int4 64x64" not in timed.timings
    assert choice.path("int4", 4, (128, 64)) == "native" and choice.path("int4", 8, (128, 64)) == "torch"
    assert choice.path("int4", 20, (256, 64)) == "native"  # not timed: INT4's 16-63 rows
    assert "int4 128x64 native 1-7, torch from 8" in choice.summary() and "int4 native 1-3" not in choice.summary()
    choice.forget()
    timing.ensure([("int4", 128, 64)])
    assert made == ["int4"]  # read back


def test_a_near_tie_does_not_move_a_switch_to_fewer_rows():
    """Paths tied at 64 rows (within NEAR_TIE): the switch stays at 256, where the other path clearly wins, so that a
    timing's noise does not put a path change inside a short prompt's rows."""
    ts = tuple(
        choice.Timing(r, {"native": n, "torch": t})
        for r, n, t in ((1, 1.0, 3.0), (32, 1.0, 1.4), (64, 1.001, 1.0), (256, 1.3, 1.0))
    )
    assert choice.split(ts) == ((1, "native"), (256, "torch"))
    clear = (*ts[:2], choice.Timing(64, {"native": 1.3, "torch": 1.0}), ts[3])
    assert choice.split(clear) == ((1, "native"), (64, "torch"))


def test_three_paths_take_three_ranges_where_each_switch_pays():
    """An Intel Xeon with AMX (benchmarks/results/native_cpu-xeon-amx-quiet.json, int4 14336 x 4096, microseconds a
    pass): torch's int4 kernel wins at 1-4 rows, the native one from 16 (tied at 8), the dense GEMM from 128. One
    switch cost 4-18% at 1-4 rows, a decode step's; two switches take each path where it wins, the tie at 8 staying
    with the fewer rows' path. A second switch that gains less than NEAR_TIE is not made."""
    us = ((1, 3133, 3016, None), (4, 6292, 5344, None), (8, 10499, 10494, None), (16, 18938, 20798, None))
    us += ((64, 70673, 83997, 107583), (128, 140118, 166350, 118740), (256, 298182, 334235, 131361))
    ts = tuple(choice.Timing(r, {"native": n, "torch": t} | ({"dense": d} if d else {})) for r, n, t, d in us)
    assert choice.split(ts) == ((1, "torch"), (16, "native"), (128, "dense"))
    c = choice.Choices({"int4": ts})
    assert c.describe("int4") == "torch 1-15, native 16-127, dense from 128"
    assert [c.path("int4", r) for r in (1, 15, 16, 127, 128, 4096)] == ["torch"] * 2 + ["native"] * 2 + ["dense"] * 2
    assert {row["taken"] for row in choice.timing_table(c)} == {"torch", "native", "dense"}
    slight = (choice.Timing(1, {"native": 1.02, "torch": 1.0}), *ts[2:])  # torch 2% ahead at one row only
    assert choice.split(slight) == ((1, "native"), (128, "dense"))
    assert choice.split(ts, one=True) == ((1, "native"),)
