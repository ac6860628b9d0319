"""Hardware profiles: the shipped JSON files, their units, validation, overrides and atomic saving."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest

from offload.common.errors import OffloadError
from offload.common.hardware import ComputeUnit, HardwareProfile, ServedStep
from offload.planner.profile_text import format_profile
from offload.planner.profiles import (
    PROFILE_DIR,
    known_profiles,
    load_profile,
    parse_profile,
    profile_to_json,
    save_profile,
    with_overrides,
)

SHIPPED = [
    *("a100-40gb", "a100-80gb", "a10g-24gb", "h100-80gb", "h200-141gb", "l4-24gb", "l40s-48gb", "mi300x-192gb"),
    *("rtx3090-24gb", "rtx4090-24gb", "rtx5090-32gb", "t4-16gb"),
]


SERVED_US = {"step_us": 350, "per_stream_us": 120, "per_prompt_token_us": 0.5, "request_us": 1700}


def tiny_profile(**changes) -> HardwareProfile:
    unit = ComputeUnit(
        memory=8_000_000_000,
        memory_bandwidth=12.5e9,
        matmul_flops={"float32": 0.25e12, "bfloat16": 1.5e12},
        matmul_curve={"float32": ((1, 1.0e9), (8, 7.5e9), (2048, 0.25e12))},
        packed_matmul_curve={"float32": ((1, 2.0e9), (2048, 0.3e12))},
        elementwise_curve={"float32": ((1, 0.5e9), (2048, 9.5e9))},
        prefill_attention_curve={"float32": ((16, 2e9), (512, 40e9))},
        decode_attention_curve={"float32": ((16, 1e9), (512, 3e9))},
        layer_floor={"float32": 250e-6},
    )
    fields = dict(
        name="tiny",
        device_kind="cpu",
        device=unit,
        host=unit,
        host_to_device=0.0,
        device_to_host=0.0,
        disk_read=1.5e9,
        disk_write=0.75e9,
        source="a test",
    )
    return HardwareProfile(**(fields | changes))


def test_known_profiles_are_the_shipped_files():
    assert known_profiles() == SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_loads_and_round_trips(name, tmp_path):
    p = load_profile(name)
    assert p == load_profile(name.upper())  # names are case-insensitive
    on_disk = json.loads((PROFILE_DIR / f"{name}.json").read_text())
    assert profile_to_json(p) == on_disk
    save_profile(p, tmp_path / "copy.json")
    assert load_profile(tmp_path / "copy.json") == p
    assert load_profile(str(PROFILE_DIR / f"{name}.json")) == p


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_is_a_cuda_card_on_a_host(name):
    p = load_profile(name)
    assert p.device_kind == "cuda"
    assert p.host_to_device == p.device_to_host and p.host_to_device in (12e9, 24e9, 48e9)  # PCIe gen3/4/5 x16
    assert p.device.matmul_flops["float16"] > p.device.matmul_flops["float32"] > p.host.matmul_flops["float32"]
    assert p.device.memory_bandwidth > p.host.memory_bandwidth
    assert p.device.matmul_curve == {} and p.host.matmul_curve == {}  # published figures, nothing measured
    assert set(p.host.matmul_flops) == {"float32", "float16", "bfloat16"}
    assert "datasheet" in p.source or "whitepaper" in p.source


def test_t4_numbers_in_si_units():
    p = load_profile("t4-16gb")
    assert p.device.memory == 16_000_000_000
    assert p.device.memory_bandwidth == 272e9  # 0.85 x 320 GB/s
    assert p.device.matmul_flops == {"float32": 5.67e12, "float16": 45.5e12, "int8": 91e12}  # no bfloat16 on a T4
    assert p.host.memory == 208_000_000_000
    assert (p.host_to_device, p.device_to_host) == (12e9, 12e9)
    assert (p.disk_read, p.disk_write) == (2e9, 1e9)  # FlexGen's SSD


def test_h100_is_derated_from_the_dense_datasheet_peak():
    p = load_profile("h100-80gb")
    assert p.device.matmul_flops["bfloat16"] == pytest.approx(0.7 * 989.5e12)
    assert p.device.memory_bandwidth == pytest.approx(0.85 * 3.35e12)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(OffloadError) as err:
        load_profile("v100-16gb")
    message = str(err.value)
    assert "'v100-16gb'" in message and "t4-16gb" in message and "h200-141gb" in message


def test_missing_file_and_bad_json_name_the_file(tmp_path):
    with pytest.raises(OffloadError, match="nope.json: hardware profile not found"):
        load_profile(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",')
    with pytest.raises(OffloadError, match=r"bad.json: not valid JSON .* line 1"):
        load_profile(bad)


def _set(path: str, value):
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[key]
        data[last] = value

    return edit


def _delete(path: str):
    def edit(data: dict) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[key]
        del data[last]

    return edit


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (_delete("device.memory_gb"), ["device.memory_gb: missing"]),
        (_delete("disk"), ["disk: missing"]),
        (_delete("links.device_to_host_gbps"), ["links.device_to_host_gbps: missing"]),
        (_set("host.memory_bandwidth_gbps", -3), ["host.memory_bandwidth_gbps: must not be negative", "-3"]),
        (_set("disk.read_gbps", "fast"), ["disk.read_gbps: must be a number", "'fast'"]),
        (_set("device.memory_gb", True), ["device.memory_gb: must be a number"]),
        (_set("disk.write_gbps", 0), ["disk.write_gbps: must be positive"]),
        (_set("links.host_to_device_gbps", 0), ["links.host_to_device_gbps: must be positive"]),  # cuda needs a link
        (_set("device.matmul_tflops.float8", 100), ["device.matmul_tflops.float8: unknown dtype", "bfloat16"]),
        (_set("host.matmul_tflops", {}), ["host.matmul_tflops: must be a non-empty object"]),
        (_set("device.kind", "tpu"), ["device.kind: unknown kind 'tpu'", "cuda, cpu"]),
        (_set("host.kind", "cuda"), ["host.kind: unknown field"]),
        (_set("device.memroy_gb", 16), ["device.memroy_gb: unknown field"]),
        (_set("name", ""), ["name: must be a non-empty string"]),
        (_set("device.matmul_curve", {"float16": [[8, 1.0], [1, 0.5]]}), ["device.matmul_curve.float16[1]: rows"]),
        (_set("device.matmul_curve", {"float16": [[0, 1.0]]}), ["matmul_curve.float16[0]: rows must be a positive"]),
        (_set("device.matmul_curve", {"float16": [[8, -1.0]]}), ["matmul_curve.float16[0].tflops: must not be neg"]),
        (_set("device.matmul_curve", {"int4": [[8, 1.0]]}), ["device.matmul_curve.int4: unknown dtype"]),
        (_set("host.elementwise_curve", {"float16": [[8, 0]]}), ["elementwise_curve.float16[0].gbps: must be pos"]),
        (_set("device.prefill_attention_curve", {"float16": [[0, 1.0]]}), ["[0]: tokens must be a positive integer"]),
        (_set("device.decode_attention_curve", {"float16": [8, 1.0]}), ["float16[0]: must be a [tokens, GB/s] pair"]),
        (_set("host.layer_floor_us", {"float16": -2}), ["host.layer_floor_us.float16: must not be negative"]),
        (_set("device.layer_floor_us", {"fp8": 2}), ["device.layer_floor_us.fp8: unknown dtype"]),
        (_set("disk.read_gbps_by_backend", {"io_uring": 2}), ["read_gbps_by_backend.io_uring: unknown backend"]),
        (_set("disk.read_gbps_by_backend", {"aio": 0}), ["disk.read_gbps_by_backend.aio: must be positive"]),
        (_set("disk.read_gbps_by_backend", {}), ["disk.read_gbps_by_backend: must be a non-empty object"]),
        (_set("disk.read_gbps_by_backend", [2, 1]), ["disk.read_gbps_by_backend: must be a non-empty object"]),
        (_set("device.layer_floor_curve", {"float16": [[8, 0]]}), ["layer_floor_curve.float16[0].krows: must be pos"]),
        (_set("serving", {"step_us": 1, "per_stream_us": 1}), ["serving.per_prompt_token_us: missing"]),
        (_set("serving", {**SERVED_US, "request_us": -1}), ["serving.request_us: must not be negative"]),
        (_set("serving", {**SERVED_US, "per_token_us": 1}), ["serving.per_token_us: unknown field"]),
    ],
)
def test_validation_names_the_file_and_the_field(tmp_path, edit, fragments):
    data = json.loads((PROFILE_DIR / "t4-16gb.json").read_text())
    edit(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(OffloadError) as err:
        load_profile(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_a_cpu_profile_may_have_no_links_and_keeps_its_curves(tmp_path):
    p = tiny_profile()
    data = profile_to_json(p)
    assert data["links"] == {"host_to_device_gbps": 0, "device_to_host_gbps": 0}
    assert data["device"]["matmul_curve"] == {"float32": [[1, 0.001], [8, 0.0075], [2048, 0.25]]}
    assert data["device"]["elementwise_curve"] == {"float32": [[1, 0.5], [2048, 9.5]]}  # GB/s
    assert data["device"]["prefill_attention_curve"] == {"float32": [[16, 0.002], [512, 0.04]]}  # TFLOP/s
    assert data["device"]["decode_attention_curve"] == {"float32": [[16, 1], [512, 3]]}  # GB/s
    assert data["device"]["layer_floor_us"] == {"float32": 250}
    assert data["device"]["packed_matmul_curve"] == {"float32": [[1, 0.002], [2048, 0.3]]}
    assert parse_profile(data) == p
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p
    assert "[8, 0.0075]" in (tmp_path / "p.json").read_text()  # a curve point stays on one line


def test_the_floor_by_rows_and_the_served_engine_s_costs_round_trip_and_are_optional(tmp_path):
    unit = dataclasses.replace(tiny_profile().device, layer_floor_curve={"bfloat16": ((1, 2000.0), (128, 80000.0))})
    p = tiny_profile(device=unit, host=unit, served_step=ServedStep(350e-6, 120e-6, 0.5e-6, 1.7e-3))
    data = profile_to_json(p)
    assert data["serving"] == SERVED_US
    assert data["device"]["layer_floor_curve"] == {"bfloat16": [[1, 2], [128, 80]]}  # thousand rows/s
    assert parse_profile(data) == p
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p
    text = format_profile(p)
    assert "350 us a step, 120 us a stream in it, 0.5 us a prompt token, 1700 us a request" in text
    assert "a tiny decoder layer (the least a layer costs), prompts of up to 128 tokens, thousand rows/s" in text
    assert "serving" not in profile_to_json(tiny_profile()) and tiny_profile().served_step is None


def test_read_rates_by_backend_round_trip_and_are_optional(tmp_path):
    p = tiny_profile(disk_read_by_backend={"pread": 1.5e9, "aio": 1.25e9})
    data = profile_to_json(p)
    assert data["disk"] == {"read_gbps": 1.5, "write_gbps": 0.75, "read_gbps_by_backend": {"pread": 1.5, "aio": 1.25}}
    assert parse_profile(data) == p
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == p
    # a profile from an older probe, or a published card: no field, no rates, and saved again without one
    del data["disk"]["read_gbps_by_backend"]
    old = parse_profile(data)
    assert old.disk_read_by_backend == {} and old == tiny_profile()
    assert profile_to_json(old)["disk"] == {"read_gbps": 1.5, "write_gbps": 0.75}
    assert load_profile("t4-16gb").disk_read_by_backend == {}


def test_the_small_read_rate_round_trips_and_is_optional():
    p = tiny_profile(disk_read_small=0.5e9)
    data = profile_to_json(p)
    assert data["disk"]["small_read_gbps"] == 0.5 and parse_profile(data) == p
    del data["disk"]["small_read_gbps"]
    assert parse_profile(data).disk_read_small is None
    assert "small_read_gbps" not in profile_to_json(tiny_profile())["disk"]


def test_with_overrides_replaces_facts_and_says_so():
    p = load_profile("a100-80gb")
    q = with_overrides(p, host_memory=64_000_000_000, disk_read=3e9, host_to_device=20e9)
    assert q.host.memory == 64_000_000_000 and q.host.memory_bandwidth == p.host.memory_bandwidth
    assert (q.disk_read, q.host_to_device) == (3e9, 20e9)
    assert (q.disk_write, q.device_to_host, q.device) == (p.disk_write, p.device_to_host, p.device)
    assert q.source.startswith(p.source) and "host memory 64 GB" in q.source and "disk read 3 GB/s" in q.source
    assert with_overrides(p) is p
    q = with_overrides(p, device_memory=40_000_000_000)
    assert q.device.memory == 40_000_000_000 and q.device.matmul_flops == p.device.matmul_flops
    with pytest.raises(OffloadError, match="disk-write: must be a positive number, got -1"):
        with_overrides(p, disk_write=-1)


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "hw" / "local.json"
    save_profile(tiny_profile(), path)  # creates the directory
    before = path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o644"

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OffloadError, match=r"local.json: cannot write the profile \(No space left on device\)"):
        save_profile(tiny_profile(name="other"), path)
    assert path.read_text() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["local.json"]  # no temporary file left


def test_format_profile_shows_every_fact():
    text = format_profile(load_profile("t4-16gb"))
    for fragment in ("T4-16GB", "272 GB/s", "45.5 TFLOP/s", "host->device 12 GB/s", "read 2 GB/s, write 1 GB/s"):
        assert fragment in text
    text = format_profile(tiny_profile())
    assert "none (the device is the host)" in text and "2048: 0.25" in text
    assert "non-GEMM work (bytes as the cost model counts them), GB/s by rows:" in text and "2048: 9.5" in text
    assert "causal attention of whole prompts, TFLOP/s by tokens:" in text and "512: 0.04" in text
    assert "paged K/V cache (K and V bytes), GB/s by tokens:" in text and "16: 1  512: 3" in text
    assert "least a decoder layer costs (a tiny model, one token):\n  device float32   250 us" in text
    assert "weight packed for the CPU's GEMM (resident layers), TFLOP/s by rows:\n  device float32   1: 0.002" in text
    assert text.count("  device float32") == 6 and "  host " not in text  # host is the device: shown once
    assert "by backend" not in text
    assert "read by backend: pread 1.5 GB/s\n" in format_profile(tiny_profile(disk_read_by_backend={"pread": 1.5e9}))
    text = format_profile(tiny_profile(disk_read_by_backend={"pread": 1.5e9, "aio": 1.25e9}))
    assert (
        "read 1.5 GB/s, write 0.75 GB/s\n          read by backend: pread 1.5 GB/s, aio 1.25 GB/s (pread fastest)"
        in text
    )


def test_parse_does_not_modify_its_input():
    data = json.loads((PROFILE_DIR / "h200-141gb.json").read_text())
    kept = copy.deepcopy(data)
    parse_profile(data, "h200")
    assert data == kept


def test_profile_dir_is_the_repository_configs():
    assert Path(__file__).resolve().parents[2] / "configs" / "hardware" == PROFILE_DIR
