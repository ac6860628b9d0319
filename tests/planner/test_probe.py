"""`offload probe`: tiny measurements of this machine give a loadable profile; the disk test never leaves a file."""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from types import SimpleNamespace

import psutil
import pytest
import torch

import offload.planner.disk as disk_mod
import offload.planner.measured_rates as rates
import offload.planner.probe as probe_mod
from offload.cli import main
from offload.common.errors import OffloadError
from offload.common.hardware import ServedStep
from offload.planner.probe import ProbeSizes, measure_disk, probe
from offload.planner.profiles import load_profile
from offload.tiers.io.backends import make_backend

MiB = 1 << 20
# a few seconds on two cores: every stage runs, on sizes far too small to mean anything
TINY = ProbeSizes(
    disk_bytes=8 * MiB + 100,  # not a multiple of ALIGN: rounded up
    extent_bytes=2 * MiB,
    depth=2,
    copy_bytes=8 * MiB,
    link_bytes=4 * MiB,
    k=256,
    n=128,
    rows=(1, 8, 64),
    weight_pool_bytes=1 * MiB,
    min_seconds=0.0,
    head_dim=16,  # 16 query heads, 4 K/V heads
    attention_tokens=(4, 32),
    decode_seqs=3,
    served_tokens=0,  # the served engine: measured by a test of its own
)


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe")
    stages = []
    profile = probe(directory, TINY, log=stages.append)
    assert list(directory.iterdir()) == []  # the test file is gone
    return profile, stages


def test_probe_measures_every_unit(tiny_profile):
    p, stages = tiny_profile
    assert stages[0].startswith("disk: writing and reading 8.0 MiB")
    for unit in (p.device, p.host):
        assert unit.memory > 0 and unit.memory_bandwidth > 0
        assert set(unit.matmul_curve) <= {"float32", "bfloat16", "float16"} and "float32" in unit.matmul_curve
        for dtype, curve in unit.matmul_curve.items():
            assert [rows for rows, _ in curve] == [1, 8, 64]
            assert all(flops > 0 for _, flops in curve)
            assert unit.matmul_flops[dtype] == curve[-1][1]  # the largest product's rate
        assert unit.elementwise_curve.keys() == unit.matmul_curve.keys()
        from offload.kernels.linear import packing_pays

        packs = {
            d
            for d in unit.matmul_curve
            if unit is p.device and p.device_kind == "cpu" and packing_pays(getattr(torch, d))
        }
        assert unit.packed_matmul_curve.keys() == packs  # measured where the engine packs its resident layers
        for curve in unit.packed_matmul_curve.values():
            assert [rows for rows, _ in curve] == [1, 8, 64] and all(flops > 0 for _, flops in curve)
        for quantized in (unit.int4_matmul_curve, unit.gguf_matmul_curve):  # bfloat16 rows, below 64 of them
            assert quantized.keys() == {"bfloat16"} & unit.matmul_curve.keys()
            for curve in quantized.values():
                assert [rows for rows, _ in curve] == [1, 8] and all(flops > 0 for _, flops in curve)
        for dtype in unit.matmul_curve:
            assert [rows for rows, _ in unit.elementwise_curve[dtype]] == [1, 8, 64]
            assert [n for n, _ in unit.prefill_attention_curve[dtype]] == [4, 32]
            assert [n for n, _ in unit.decode_attention_curve[dtype]] == [4, 32]
            for curve in (unit.elementwise_curve, unit.prefill_attention_curve, unit.decode_attention_curve):
                assert all(rate > 0 for _, rate in curve[dtype])
            assert 0 < unit.layer_floor[dtype] < 1  # seconds: one tiny layer, one token
            assert [rows for rows, _ in unit.layer_floor_curve[dtype]] == [1, 8, 64]
            assert all(rate > 0 for _, rate in unit.layer_floor_curve[dtype])
    assert p.disk_read > 0 and p.disk_write > 0
    assert "pread" in p.disk_read_by_backend and set(p.disk_read_by_backend) <= {"pread", "aio"}
    assert p.disk_read == max(p.disk_read_by_backend.values())  # the rate of the backend "auto" then takes
    assert p.name.startswith("local (") and p.source.startswith("offload probe ")
    assert "offload.kernels.linear on [rows, 256] x [256, 128]" in p.source
    assert "hidden 256, 16 heads of 16 (4 K/V heads), MLP 704" in p.source


def test_attention_rates_count_the_work_the_cost_model_counts(monkeypatch):
    # every timed call takes exactly 1 s: the rates are then the FLOPs and bytes the probe says each call does
    monkeypatch.setattr(rates, "typical_seconds", lambda fn, device, min_seconds: (fn(), 1.0)[1])
    prefill, decode = rates.measure_attention(torch.device("cpu"), "bfloat16", (4, 32), 256, 16, 64, 3, 0.0)
    heads, kv_heads, d = 16, 4, 16
    # 64 prompt tokens: 16 prompts of 4 tokens, 2 of 32; causal: half of the square, QK and PV, 2 FLOPs each
    assert prefill == ((4, 16 * 2 * 2 * heads * d * 4 * 4 / 2), (32, 2 * 2 * 2 * heads * d * 32 * 32 / 2))
    # 3 sequences each reading K and V (bf16) of their whole context
    assert decode == ((4, 3 * 4 * 2 * kv_heads * d * 2), (32, 3 * 32 * 2 * kv_heads * d * 2))
    elementwise = rates.measure_elementwise(torch.device("cpu"), "float32", (1, 8), 256, 16, 0.0)
    from offload.scheduler.cost.gemm_rates import elementwise_bytes

    per_row = elementwise_bytes(256, 256, 64, 704, 4)
    assert elementwise == ((1, per_row), (8, 8 * per_row))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only layout")
def test_cpu_only_device_is_host_ram(tiny_profile):
    p, _ = tiny_profile
    assert p.device_kind == "cpu" and p.device == p.host
    assert p.device.memory == psutil.virtual_memory().total
    assert (p.host_to_device, p.device_to_host) == (0.0, 0.0)


def test_probed_profile_saves_and_loads(tiny_profile, tmp_path):
    from offload.planner.profiles import save_profile

    p, _ = tiny_profile
    save_profile(p, tmp_path / "local.json")
    q = load_profile(tmp_path / "local.json")
    assert (q.name, q.device_kind, q.source) == (p.name, p.device_kind, p.source)
    assert q.host.memory == p.host.memory
    assert q.disk_read == pytest.approx(p.disk_read, rel=1e-5)
    assert q.disk_read_by_backend.keys() == p.disk_read_by_backend.keys()
    assert list(q.disk_read_by_backend.values()) == pytest.approx(list(p.disk_read_by_backend.values()), rel=1e-5)
    assert q.host.layer_floor == pytest.approx(p.host.layer_floor, rel=1e-5)
    keys = (
        "matmul_curve",
        "gguf_matmul_curve",
        "elementwise_curve",
        "prefill_attention_curve",
        "decode_attention_curve",
    )
    for key in (*keys, "layer_floor_curve"):
        loaded, measured = getattr(q.host, key), getattr(p.host, key)
        assert loaded.keys() == measured.keys()
        for dtype, curve in loaded.items():
            assert [r for r, _ in curve] == [r for r, _ in measured[dtype]]
            assert [f for _, f in curve] == pytest.approx([f for _, f in measured[dtype]], rel=1e-5)


def test_timings_are_the_median_not_the_shortest(monkeypatch):
    # a run that is briefly twice as fast must not set the rate: the engine sustains the typical one
    clock = iter([0.0, 1.0, 1.0, 1.5, 1.5, 2.5, 2.5, 3.5])  # runs of 1.0, 0.5, 1.0, 1.0 s
    monkeypatch.setattr(rates.time, "perf_counter", lambda: next(clock))
    assert rates.typical_seconds(lambda: None, torch.device("cpu"), min_seconds=3.4) == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="remeasures CPU-only profiles")
def test_remeasure_replaces_rates_and_keeps_disk_and_other_dtypes(tiny_profile, tmp_path, monkeypatch):
    p, _ = tiny_profile
    q = probe_mod.remeasure(p, ("bfloat16",), TINY)
    assert (q.disk_read, q.disk_write, q.name, q.source) == (p.disk_read, p.disk_write, p.name, p.source)
    assert q.device == q.host and q.host.memory == p.host.memory
    assert q.host.matmul_curve["float32"] == p.host.matmul_curve["float32"]  # not measured again: kept
    assert [r for r, _ in q.host.matmul_curve["bfloat16"]] == [1, 8, 64]
    assert q.host.matmul_curve["bfloat16"] is not p.host.matmul_curve.get("bfloat16")
    assert q.host.matmul_flops["bfloat16"] == q.host.matmul_curve["bfloat16"][-1][1]
    for key in ("elementwise_curve", "prefill_attention_curve", "decode_attention_curve", "layer_floor"):
        fresh, old = getattr(q.host, key), getattr(p.host, key)
        assert fresh["float32"] == old["float32"] and fresh["bfloat16"] is not old.get("bfloat16")
    with_disk = probe_mod.remeasure(p, ("bfloat16",), TINY, disk_dir=tmp_path)
    assert with_disk.disk_read > 0 and with_disk.disk_read != p.disk_read and with_disk.disk_write != p.disk_write
    assert list(tmp_path.iterdir()) == []  # the test file is gone
    rates = iter([3e9, 1e9, 2e9])  # three disk tests: the median by read rate is kept

    def disk_test(*args):
        read = next(rates)
        return disk_mod.DiskSpeed(read, read / 2, True, {"pread": read}, "", read / 4)

    monkeypatch.setattr(probe_mod, "measure_disk", disk_test)
    median = probe_mod.remeasure(p, ("bfloat16",), TINY, disk_dir=tmp_path, disk_reads=3)
    assert (median.disk_read, median.disk_write, median.disk_read_by_backend) == (2e9, 1e9, {"pread": 2e9})
    assert median.disk_read_small == 0.5e9


def test_remeasure_refuses_a_cuda_profile(tiny_profile):
    import dataclasses

    p, _ = tiny_profile
    with pytest.raises(OffloadError, match="CPU-only profiles; 'x' is cuda"):
        probe_mod.remeasure(dataclasses.replace(p, name="x", device_kind="cuda"))


def test_disk_test_file_is_removed_on_interrupt(tmp_path, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(disk_mod, "_read_test_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        measure_disk(tmp_path, 4 * MiB, 1 * MiB, 2)
    assert list(tmp_path.iterdir()) == []


def test_disk_reads_the_same_file_through_each_backend(tmp_path, monkeypatch):
    from offload.tiers.io import aio

    monkeypatch.setattr(aio, "_load_op", lambda: object())  # aio runs here (never built: the reads are faked)
    monkeypatch.setattr(disk_mod, "aio_built", lambda: True)
    reads = []

    def timed(path, nbytes, extent, depth, backend):
        reads.append((path, nbytes, extent, depth, backend))
        return {"pread": 2.0, "aio": 0.5}[backend], True

    monkeypatch.setattr(disk_mod, "_read_test_file", timed)
    speed = measure_disk(tmp_path, 4 * MiB, 1 * MiB, 2)
    assert speed.by_backend == {"pread": 4 * MiB / 2.0, "aio": 4 * MiB / 0.5}
    assert speed.read == 4 * MiB / 0.5 and speed.missing == ""  # the fastest
    assert [r[1:] for r in reads] == [(4 * MiB, MiB, 2, "pread"), (4 * MiB, MiB, 2, "aio")]
    assert reads[0][0] == reads[1][0]  # one test file, written once
    assert speed.small_read > 0  # 512 KiB requests of the same file, shuffled: measured for real
    assert list(tmp_path.iterdir()) == []


def test_disk_test_never_builds_the_aio_op(tmp_path, monkeypatch):
    def no_build():
        raise AssertionError("the probe must not load (and so build) DeepSpeed's op")

    monkeypatch.setattr(disk_mod, "aio_built", lambda: False)
    monkeypatch.setattr(
        disk_mod, "make_backend", lambda name, threads=8: no_build() if name == "aio" else make_backend(name, threads)
    )
    speed = measure_disk(tmp_path, 4 * MiB, 1 * MiB, 2)
    assert list(speed.by_backend) == ["pread"]
    assert speed.missing == "aio not measured: its op is not built here (make aio-op)"


def test_disk_test_leaves_out_aio_where_it_cannot_read_and_says_why(tmp_path, monkeypatch):
    from offload.tiers.io import aio

    monkeypatch.setattr(disk_mod, "aio_built", lambda: True)
    monkeypatch.setattr(aio, "_load_op", lambda: "libaio is missing (apt-get install libaio-dev)")
    speed = measure_disk(tmp_path, 4 * MiB, 1 * MiB, 2)
    assert list(speed.by_backend) == ["pread"] and speed.read == speed.by_backend["pread"]
    assert speed.missing == "aio not measured: I/O backend 'aio': libaio is missing (apt-get install libaio-dev)"

    monkeypatch.setattr(aio, "_load_op", lambda: object())
    pread_only = disk_mod._read_test_file

    def refused(path, nbytes, extent, depth, backend):
        if backend == "aio":
            raise OffloadError(f"{path}: aio read needs a bounce buffer beyond RLIMIT_MEMLOCK")
        return pread_only(path, nbytes, extent, depth, backend)

    monkeypatch.setattr(disk_mod, "_read_test_file", refused)
    speed = measure_disk(tmp_path, 4 * MiB, 1 * MiB, 2)
    assert list(speed.by_backend) == ["pread"]
    assert speed.missing.startswith("aio not measured: ") and speed.missing.endswith("beyond RLIMIT_MEMLOCK")
    assert list(tmp_path.iterdir()) == []
    assert "(aio not measured: " in probe(tmp_path, TINY).source  # the saved profile says why


@pytest.mark.skipif(torch.cuda.is_available(), reason="where CUDA is present the probe reads into torch-pinned buffers")
def test_disk_test_reads_aio_into_buffers_the_op_locked_as_the_engines_ring_does(tmp_path, monkeypatch):
    from offload.tiers.io.aio import aio_ready

    if not aio_ready():
        pytest.skip("the aio op is not built here (make aio-op)")
    made = []

    def recorded(name, threads=8):
        made.append(make_backend(name, threads))
        return made[-1]

    monkeypatch.setattr(disk_mod, "make_backend", recorded)
    speed = measure_disk(tmp_path, 4 * MiB, 1 * MiB, 2)
    (aio,) = [b for b in made if b.name == "aio"]
    assert "aio" in speed.by_backend and aio.bytes_read == 4 * MiB
    assert aio.bounced_bytes == 0 and aio.locked_bytes == 0  # no read copied through a bounce buffer; all given back


def test_full_disk_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OffloadError) as err:
        measure_disk(tmp_path, 4 * MiB, 1 * MiB, 2)
    assert str(err.value) == f"{tmp_path}: disk test failed (No space left on device)"
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod.shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 40, free=10 * MiB))
    with pytest.raises(OffloadError, match=r"10.0 MiB free, the disk test needs .*--disk-bytes"):
        measure_disk(tmp_path, 1 << 30)
    assert list(tmp_path.iterdir()) == []


def test_read_only_filesystem_is_one_line(tmp_path, monkeypatch, capsys):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(disk_mod.tempfile, "mkstemp", read_only)
    monkeypatch.setattr(ProbeSizes, "quick", classmethod(lambda cls: TINY))
    code = main(["probe", "--quick", "--dir", str(tmp_path), "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == f"error: {tmp_path}: cannot write the disk test file (Read-only file system)"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_read_only_dir_gives_exit_2_and_no_file(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code = main(["probe", "--quick", "--dir", str(ro), "--out", str(tmp_path / "x.json")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2
        assert err[-1].startswith("error: ") and str(ro) in err[-1] and "Traceback" not in "\n".join(err)
        assert list(ro.iterdir()) == [] and not (tmp_path / "x.json").exists()
    finally:
        ro.chmod(stat.S_IRWXU)


def test_cli_wiring_with_tiny_sizes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ProbeSizes, "quick", classmethod(lambda cls: TINY))
    out = tmp_path / "hw" / "x.json"
    assert main(["probe", "--quick", "--dir", str(tmp_path), "--out", str(out), "--disk-bytes", "4MiB"]) == 0
    printed = capsys.readouterr()
    assert f"saved {out}" in printed.out and "disk      read" in printed.out and "read by backend: pread" in printed.out
    assert "disk: writing and reading 4.0 MiB" in printed.err  # --disk-bytes wins over the preset
    assert load_profile(out).name.startswith("local (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hw"]


def test_bad_disk_bytes_is_one_line(capsys, tmp_path):
    assert main(["probe", "--dir", str(tmp_path), "--disk-bytes", "lots"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: --disk-bytes: cannot read 'lots' as a size")


def test_missing_dir_is_one_line(capsys, tmp_path):
    assert main(["probe", "--quick", "--dir", str(tmp_path / "nope"), "--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {tmp_path / 'nope'}: no such directory")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(extent_bytes=1000), "extent-bytes: must be a multiple of 4096"),
        (dict(rows=(8, 1)), "rows: must be positive and ascending"),
        (dict(depth=0), "depth: must be positive"),
        (dict(min_seconds=-1.0), "min-seconds: must not be negative"),
        (dict(k=256, head_dim=128), r"k: must be a multiple of 4 x head-dim \(512\), got 256"),
        (dict(attention_tokens=(128, 16)), "attention-tokens: must be positive and ascending"),
        (dict(decode_seqs=0), "decode-seqs: must be positive"),
    ],
)
def test_probe_sizes_are_checked(changes, message):
    with pytest.raises(OffloadError, match=message):
        ProbeSizes(**changes)


@pytest.mark.slow
def test_cli_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert main(["probe", "--quick", "--dir", str(tmp_path), "--out", str(out)]) == 0
    assert f"saved {out}" in capsys.readouterr().out
    p = load_profile(out)
    assert p.disk_read > 0 and p.host.matmul_flops["float32"] > 0
    assert [r for r, _ in p.host.matmul_curve["float32"]] == [1, 8, 32, 128, 512, 2048]
    assert sorted(q.name for q in tmp_path.iterdir()) == ["x.json"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_and_links(tiny_profile):
    p, stages = tiny_profile
    assert p.device_kind == "cuda" and p.device != p.host
    assert p.device.memory == torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    assert p.host_to_device > 0 and p.device_to_host > 0
    assert [r for r, _ in p.device.matmul_curve["float16"]] == [1, 8, 64]
    assert any(line.startswith("links:") for line in stages)
    assert p.name.startswith(f"local ({torch.cuda.get_device_name()}, ")


def test_a_profile_from_an_older_probe_still_loads_and_says_so(tiny_profile, tmp_path, monkeypatch, capsys):
    import dataclasses

    from offload.planner.profiles import save_profile

    p, _ = tiny_profile
    old_unit = dataclasses.replace(
        p.host, elementwise_curve={}, prefill_attention_curve={}, decode_attention_curve={}, layer_floor={}
    )
    path = tmp_path / "local.json"
    monkeypatch.setattr(probe_mod, "local_profile_path", lambda: path)
    save_profile(dataclasses.replace(p, device=old_unit, host=old_unit), path)
    assert probe_mod.local_profile().device.matmul_curve.keys() == p.device.matmul_curve.keys()
    err = capsys.readouterr().err
    assert err.startswith(f"note: {path} comes from an older `offload probe`") and err.count("\n") == 1
    save_profile(p, path)  # without the served engine's costs (the fixture's probe leaves them out)
    probe_mod.local_profile()
    assert "without the layer floor by rows or the served engine's own step costs" in capsys.readouterr().err
    save_profile(dataclasses.replace(p, served_step=ServedStep(1e-4, 1e-5, 1e-6, 1e-3)), path)
    probe_mod.local_profile()
    assert capsys.readouterr().err == ""  # a current profile: nothing to say


@pytest.mark.slow
def test_the_served_step_is_measured_on_the_engine_s_own_server(tmp_path, monkeypatch):
    import tempfile

    from offload.planner.served_step import measure_served_step

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its model folder and the server's log go
    served = measure_served_step("bfloat16", tokens=8, min_seconds=0.0)
    assert served.step + served.per_stream > 0 and served.request > 0  # a served step costs more than its layer
    assert min(served.step, served.per_stream, served.per_prompt_token) >= 0
    assert served.step < 0.1 and served.per_stream < 0.1 and served.request < 1  # seconds: a tiny model on loopback
    assert not list(tmp_path.glob("offload-probe-serve-*"))  # the model folder is gone, the server with it


def test_a_server_that_does_not_come_up_is_one_line_and_the_probe_goes_on(tmp_path, monkeypatch):
    import offload.planner.served_step as served_mod

    (tmp_path / "model").mkdir()  # no config.json: `offload serve` exits with its one-line error
    expected = r"the probe's `offload serve` did not come up: error: .*config\.json"
    with pytest.raises(OffloadError, match=expected), served_mod._served(tmp_path, "bfloat16"):
        pass

    def refuse(*args):
        raise OffloadError("the probe's `offload serve` did not come up: no port")

    monkeypatch.setattr(probe_mod, "measure_served_step", refuse)
    stages = []
    p = probe(tmp_path, dataclasses.replace(TINY, served_tokens=8), log=stages.append)
    assert p.served_step is None and p.device.matmul_curve  # the rest of the profile stands
    assert "serving: not measured (the probe's `offload serve` did not come up: no port)" in stages


DYING_PARENT = """
import subprocess, sys, time
from offload.planner.served_step import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_the_probes_server_dies_with_the_probe_killed_outright():
    import os
    import signal
    import subprocess
    import sys
    import time

    def alive(pid: int) -> bool:  # a zombie (dead, not yet reaped by whoever adopted it) is dead
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    parent = subprocess.Popen([sys.executable, "-c", DYING_PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: nothing of the parent runs
    parent.wait(timeout=60)
    deadline = time.monotonic() + 60
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its parent's SIGKILL by 60 s")
