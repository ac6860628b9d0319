"""Spill files (tiers/spill/spilling.py): layout and round trip, checksums, reuse, failure modes that leave nothing
behind, and the engine streaming converted layers from --offload-dir: a float32 checkpoint run in bfloat16."""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import re
import shutil
import types
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_checkpoint
from offload import build
from offload.api import LLM
from offload.cli import main
from offload.common.config import EngineConfig, Policy, SamplingParams
from offload.common.errors import OffloadError
from offload.model.loader import load_spec
from offload.model.registry import model_tensors
from offload.tiers.io.base import ALIGN, aligned_buffer
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.io.direct import PreadBackend
from offload.tiers.spill.spill_store import MANIFEST, SpillStore, plan_file
from offload.tiers.weights.checkpoint import Checkpoint
from offload.tiers.weights.layout import model_layout
from offload.tiers.weights.placement import group_cost, place_weights
from offload.tiers.weights.ring import read
from offload.tiers.weights.weight_store import WeightStore

KV = 1 << 20
LAYERS = 12  # enough that the converted layers do not all fit where the checkpoint's stream
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 17], [1, 44, 45, 46, 47, 48, 49, 50, 51]]
KEY = {"format": 1, "files": [["/m/model.safetensors", 123, 456]], "dtype": "bfloat16"}


# ---- the tier alone ---------------------------------------------------------------------------------------


def group(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of odd sizes in three dtypes: no tensor ends on an ALIGN boundary."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b": torch.randn(1031, generator=g),
        "c": torch.randn(70, 33, generator=g).to(torch.float16),
    }


def spec(name: str, tensors: dict[str, torch.Tensor]):
    codes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
    return plan_file(name, [(k, codes[t.dtype], tuple(t.shape)) for k, t in tensors.items()])


def read_back(layout) -> dict[str, torch.Tensor]:
    buf = aligned_buffer(layout.slot_bytes)
    with PreadBackend() as backend:
        for r in read(backend, layout, buf):
            r.wait()
        return {k: v.clone() for k, v in layout.views(buf).items()}


def write_two(folder) -> tuple[SpillStore, dict[str, dict[str, torch.Tensor]]]:
    tier = SpillStore(folder, capacity=None)
    tier.open(KEY)
    data = {"g0.bin": group(0), "g1.bin": group(1)}
    tier.write([spec(n, t) for n, t in data.items()], lambda f: data[f.name])
    return tier, data


def test_spill_files_round_trip_bit_for_bit_at_aligned_offsets(tmp_path):
    tier, data = write_two(tmp_path / "spill")
    sizes = 0
    for name, tensors in data.items():
        layout = tier.lookup(spec(name, tensors))
        assert [t.slot_offset % ALIGN for t in layout.tensors] == [0, 0, 0]
        assert len(layout.runs) == 1 and layout.runs[0].offset == 0
        assert layout.read_bytes == layout.slot_bytes == os.path.getsize(tmp_path / "spill" / name)
        got = read_back(layout)
        assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in tensors.items())
        sizes += layout.slot_bytes
    assert tier.bytes_written == tier.used == tier.peak == sizes
    manifest = json.loads((tmp_path / "spill" / MANIFEST).read_text())
    assert manifest["key"] == KEY
    for f in manifest["files"]:
        assert f["crc32"] == zlib.crc32((tmp_path / "spill" / f["name"]).read_bytes())
    assert sorted(os.listdir(tmp_path / "spill")) == ["g0.bin", "g1.bin", MANIFEST]  # no temp file left


def test_reopened_tier_reuses_checked_files_and_drops_a_corrupt_one(tmp_path):
    _, data = write_two(tmp_path)
    path = tmp_path / "g1.bin"
    raw = bytearray(path.read_bytes())
    raw[5000] ^= 0x10
    path.write_bytes(raw)
    tier = SpillStore(tmp_path, capacity=None)
    tier.open(KEY)
    good = tier.lookup(spec("g0.bin", data["g0.bin"]))
    assert good is not None and tier.bytes_verified == good.slot_bytes
    assert tier.lookup(spec("g1.bin", data["g1.bin"])) is None
    assert not path.exists()
    assert tier.lookup(spec("g0.bin", data["g0.bin"])) is not None and tier.bytes_verified == good.slot_bytes
    tier.write([spec("g1.bin", data["g1.bin"])], lambda f: data[f.name])
    assert tier.bytes_written == good.slot_bytes  # both groups are the same size
    assert torch.equal(read_back(tier.lookup(spec("g1.bin", data["g1.bin"])))["c"], data["g1.bin"]["c"])


def test_stale_manifest_is_replaced_and_its_files_deleted(tmp_path):
    _, data = write_two(tmp_path)
    tier = SpillStore(tmp_path, capacity=None)
    tier.open(KEY | {"dtype": "float16"})
    assert tier.used == 0 and tier.lookup(spec("g0.bin", data["g0.bin"])) is None
    tier.write([spec("g2.bin", data["g0.bin"])], lambda f: data["g0.bin"])
    assert sorted(os.listdir(tmp_path)) == ["g2.bin", MANIFEST]
    assert json.loads((tmp_path / MANIFEST).read_text())["key"]["dtype"] == "float16"


def test_disk_budget_is_a_hard_limit(tmp_path):
    tensors = group()
    file = spec("g.bin", tensors)
    tier = SpillStore(tmp_path / "spill", capacity=file.size - 1)
    tier.open(KEY)
    with pytest.raises(OffloadError, match=f"--offload-dir {tmp_path / 'spill'}: needs .*--disk-memory budget"):
        tier.write([file], lambda f: tensors)
    assert not (tmp_path / "spill").exists()


# ---- the engine with --offload-dir ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama32")
    make_checkpoint(path, "llama", num_hidden_layers=LAYERS)  # float32
    return path


@pytest.fixture(scope="module")
def budget(model_dir) -> int:
    """A device budget that streams every layer of the float32 checkpoint run in bfloat16 (the default ring)."""
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, dtype="bfloat16"))
    spec, family = load_spec(model_dir)
    with BufferedReader() as reader:
        layout = model_layout(Checkpoint(model_dir, reader), model_tensors(family, spec))
    cost = [group_cost(g, torch.bfloat16, llm.parts.device_tier) for g in (layout.embed, layout.head, layout.layers[0])]
    return KV + cost[0] + cost[1] + EngineConfig().ring_slots * cost[2]


@pytest.fixture(scope="module")
def streamed(model_dir, budget):
    """(LLM streaming from the checkpoint, its tokens)."""
    llm = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, dtype="bfloat16", device_memory=budget))
    assert llm.placement.layer_tiers == ("nvme",) * LAYERS
    return llm, [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)]


def spilled_llm(model_dir, budget, offload_dir) -> LLM:
    config = EngineConfig(kv_cache_bytes=KV, dtype="bfloat16", device_memory=budget, offload_dir=str(offload_dir))
    return LLM(model_dir, config)


def files_under(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def test_offload_dir_streams_converted_layers_with_the_same_tokens(model_dir, budget, streamed, tmp_path):
    base, expected = streamed
    llm = spilled_llm(model_dir, budget, tmp_path)
    tiers = llm.placement.layer_tiers
    # planned on the converted sizes: the smaller ring leaves room for resident layers
    counts = [tiers.count(t) for t in ("device", "host", "nvme")]
    assert "device" in tiers and "nvme" in tiers and tiers == Policy.from_counts(*counts, ring_slots=2).layer_tiers
    nvme = [i for i, t in enumerate(tiers) if t == "nvme"]
    spill = llm.placement.spill
    # every layer: the plan keeps some resident only in their converted size, so those load from spill files too
    assert spill.layers == tuple(range(LAYERS)) and spill.convertible == LAYERS
    sizes = [os.path.getsize(os.path.join(spill.directory, f"layer{i}.bin")) for i in range(LAYERS)]
    assert spill.bytes_written == spill.nbytes == sum(sizes)
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected
    for i in nvme:  # views equal the tensors converted on the fly, bit for bit
        a, b = llm.parts.weights.store.acquire(i), base.parts.weights.store.acquire(i)
        assert set(a) == set(b) and all(a[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in b)
        llm.parts.weights.store.release(i)
        base.parts.weights.store.release(i)
    # bytes read per pass: the bfloat16 size of each streamed layer, about half of the float32 checkpoint's
    per_layer = llm.parts.weights.store.layouts[nvme[0]].read_bytes
    assert llm.parts.weights.store.layouts[nvme[0]].runs[0].path.parent.as_posix() == spill.directory
    assert llm.placement.streamed_bytes_per_pass == len(nvme) * per_layer
    checkpoint_layer = base.parts.weights.store.layouts[nvme[0]].read_bytes
    assert 0.45 < per_layer / checkpoint_layer < 0.55
    steps = llm.last_run.steps
    assert abs(llm.last_run.bytes_read - steps * len(nvme) * per_layer) <= 3 * per_layer  # give or take the read-ahead
    assert llm.placement.device_peak <= budget


def test_second_llm_reuses_the_files_and_a_corrupt_one_is_rewritten(model_dir, budget, streamed, tmp_path):
    _, expected = streamed
    first = spilled_llm(model_dir, budget, tmp_path).placement.spill
    stamps = {f: os.stat(tmp_path / f).st_mtime_ns for f in files_under(tmp_path)}

    again = spilled_llm(model_dir, budget, tmp_path)
    assert again.placement.spill.bytes_written == 0 and again.placement.spill.bytes_verified == first.nbytes
    assert {f: os.stat(tmp_path / f).st_mtime_ns for f in files_under(tmp_path)} == stamps
    assert [c.token_ids for c in again.generate_ids(PROMPTS, PARAMS)] == expected
    again.close()

    bad = Path(first.directory) / "layer7.bin"
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 0x01  # inside the first tensor
    bad.write_bytes(raw)
    fixed = spilled_llm(model_dir, budget, tmp_path)
    assert fixed.placement.spill.bytes_written == len(raw)
    assert fixed.placement.spill.bytes_verified == first.nbytes - len(raw)
    assert bad.read_bytes()[100] == raw[100] ^ 0x01
    assert [c.token_ids for c in fixed.generate_ids(PROMPTS, PARAMS)] == expected


def test_staged_path_streams_spill_files_without_conversion(model_dir, budget, streamed, tmp_path, monkeypatch):
    monkeypatch.setattr(build, "WeightStore", functools.partial(WeightStore, staged=True))
    monkeypatch.setattr(build, "place_weights", functools.partial(place_weights, staged=True))
    _, expected = streamed
    llm = spilled_llm(model_dir, budget, tmp_path)
    assert (
        llm.parts.weights.store.staged and llm.parts.weights.store._ring._scratch is None
    )  # nothing left to convert on the device
    nvme = [i for i, t in enumerate(llm.placement.layer_tiers) if t == "nvme"]
    assert nvme and set(nvme) <= set(llm.placement.spill.layers)
    assert llm.placement.streamed_bytes_per_pass == sum(llm.parts.weights.store.layouts[i].slot_bytes for i in nvme)
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected


def test_config_checks_the_offload_fields(tmp_path):
    assert EngineConfig(offload_dir=tmp_path).offload_dir == str(tmp_path)
    with pytest.raises(OffloadError, match="disk_memory .* needs offload_dir"):
        EngineConfig(disk_memory=1 << 30)
    with pytest.raises(OffloadError, match="offload_dir must be a folder path, got ''"):
        EngineConfig(offload_dir="")
    with pytest.raises(OffloadError, match="disk_memory must be a non-negative number of bytes, got -1"):
        EngineConfig(offload_dir=str(tmp_path), disk_memory=-1)


def test_nothing_to_convert_writes_nothing(model_dir, tmp_path):
    config = EngineConfig(kv_cache_bytes=KV, dtype="float32", device_memory=None, offload_dir=str(tmp_path / "off"))
    llm = LLM(model_dir, config)
    assert llm.placement.spill.layers == () and llm.placement.spill.convertible == 0
    assert not (tmp_path / "off").exists()


def test_layers_already_in_the_compute_dtype_stream_from_the_checkpoint(model_dir, budget, tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in os.listdir(model_dir):
        if not f.endswith(".safetensors"):
            os.symlink(model_dir / f, mixed / f)
    tensors = load_file(model_dir / "model.safetensors")
    half = {k: v.to(torch.bfloat16) if k.startswith("model.layers.") and int(k.split(".")[2]) % 2 else v
            for k, v in tensors.items()}  # fmt: skip
    save_file(half, mixed / "model.safetensors", metadata={"format": "pt"})
    llm = spilled_llm(mixed, budget, tmp_path / "off")
    odd = set(range(1, LAYERS, 2))
    assert llm.placement.spill.convertible == LAYERS // 2 and not odd & set(llm.placement.spill.layers)
    for i, layout in enumerate(llm.parts.weights.store.layouts):
        assert (layout.runs[0].path.name == "model.safetensors") == (i not in llm.placement.spill.layers)
    nvme = {i for i, t in enumerate(llm.placement.layer_tiers) if t == "nvme"}
    assert (
        nvme - odd <= set(llm.placement.spill.layers) and nvme & odd
    )  # some bfloat16 layers stream from the checkpoint


def assert_clean_failure(tmp_path, match: str, **kw) -> None:
    """LLM construction fails with one OffloadError line naming the folder, and leaves no file behind."""
    off = tmp_path / "off"
    with pytest.raises(OffloadError, match=match) as info:
        spilled_llm(kw.pop("model_dir"), kw.pop("budget"), off)
    message = str(info.value)
    assert "\n" not in message and f"--offload-dir {off}" in message
    assert list(tmp_path.rglob("*")) in ([], [off])  # no file, no folder but what was there


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_directory_is_a_clear_error(model_dir, budget, tmp_path):
    (tmp_path / "off").mkdir()
    (tmp_path / "off").chmod(0o555)
    try:
        assert_clean_failure(tmp_path, "permission denied", model_dir=model_dir, budget=budget)
    finally:
        (tmp_path / "off").chmod(0o755)


def test_read_only_filesystem_is_a_clear_error(model_dir, budget, tmp_path, monkeypatch):
    def erofs(path, mode=0o777):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(os, "mkdir", erofs)
    assert_clean_failure(tmp_path, r": read-only filesystem \(writing .* of converted weights\)$", model_dir=model_dir,
                         budget=budget)  # fmt: skip


def free(monkeypatch, nbytes: int) -> None:
    """The filesystem under every folder has `nbytes` free (shutil.disk_usage, which free_space reads)."""
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: types.SimpleNamespace(total=1 << 30, used=1 << 30, free=nbytes)
    )


def checkpoint_layers(llm: LLM) -> list[int]:
    return [i for i, g in enumerate(llm.parts.weights.store.layouts) if g.runs[0].path.name == "model.safetensors"]


def test_without_a_budget_the_layers_the_free_space_cannot_hold_stream_from_the_checkpoint(
    model_dir, budget, streamed, tmp_path, monkeypatch, capsys
):
    _, expected = streamed
    off = tmp_path / "off"
    free(monkeypatch, 300 << 10)  # three converted layers and their manifest
    llm = spilled_llm(model_dir, budget, off)
    spill = llm.placement.spill
    assert spill.layers == (0, 1, 2) and spill.unwritten == tuple(range(3, LAYERS))
    assert checkpoint_layers(llm) == list(range(3, LAYERS))
    assert sorted(os.listdir(spill.directory)) == ["layer0.bin", "layer1.bin", "layer2.bin", MANIFEST]
    assert spill.bytes_written == spill.nbytes < 300 << 10
    needed = f"{LAYERS * spill.nbytes // 3 / 1024:.1f} KiB"
    assert capsys.readouterr().err.splitlines() == [
        f"--offload-dir {off}: 300.0 KiB free, {needed} needed; 9 converted layers stream from the checkpoint "
        "instead of spill files"
    ]
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected


@pytest.mark.parametrize(
    ("code", "reason"), [(errno.ENOSPC, "no space left on device"), (errno.EDQUOT, "disk quota exceeded")]
)
def test_a_disk_full_mid_file_leaves_no_file_and_the_layers_stream_from_the_checkpoint(
    model_dir, budget, streamed, tmp_path, monkeypatch, capsys, code, reason
):
    _, expected = streamed
    real, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) >= 40:  # a few files in, inside one, and every write after it
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    off = tmp_path / "off"
    llm = spilled_llm(model_dir, budget, off)
    monkeypatch.undo()
    assert len(calls) == 40 and list(tmp_path.rglob("*")) in ([], [off])  # no file, no folder but what was there
    assert llm.placement.spill.layers == () and llm.placement.spill.unwritten == tuple(range(LAYERS))
    assert checkpoint_layers(llm) == list(range(LAYERS)) and llm.placement.layer_tiers == ("nvme",) * LAYERS
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"--offload-dir {off}: {reason} (writing 816.0 KiB of converted weights); {LAYERS} converted layers stream "
        "from the checkpoint instead of spill files"
    ]
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == expected


def test_a_disk_budget_larger_than_the_free_space_is_refused_at_start(model_dir, budget, tmp_path, monkeypatch):
    off = tmp_path / "off"
    config = EngineConfig(kv_cache_bytes=KV, dtype="bfloat16", device_memory=budget, offload_dir=str(off))
    free(monkeypatch, 1 << 20)
    match = rf"^--disk-memory of 2\.0 MiB is more than {re.escape(str(off))}/\S+ can hold \(1\.0 MiB free\)$"
    with pytest.raises(OffloadError, match=match):
        LLM(model_dir, dataclasses.replace(config, disk_memory=2 << 20))
    assert not off.exists()
    assert LLM(model_dir, dataclasses.replace(config, disk_memory=1 << 20)).placement.spill.nbytes <= 1 << 20


def test_the_kv_disk_part_is_taken_out_of_the_disk_budget(model_dir, budget, tmp_path):
    """--disk-memory is all the disk the engine fills in --offload-dir: the spill files and the KV disk part."""
    needed = spilled_llm(model_dir, budget, tmp_path / "first").placement.spill.nbytes
    part = 1 << 20
    fields = dict(kv_cache_bytes=KV, dtype="bfloat16", device_memory=budget, kv_disk_memory=part)
    llm = LLM(model_dir, EngineConfig(**fields, offload_dir=str(tmp_path / "fits"), disk_memory=needed + part))
    assert llm.placement.spill.nbytes == needed
    with pytest.raises(OffloadError, match="--disk-memory budget"):
        LLM(model_dir, EngineConfig(**fields, offload_dir=str(tmp_path / "short"), disk_memory=needed + part - 1))


def test_cli_generate_with_offload_dir(model_dir, budget, tmp_path, capsys):
    args = ["generate", "--model", str(model_dir), "--prompt", "hello", "--max-new-tokens", "3", "--dtype", "bfloat16"]
    args += ["--device-memory", str(budget), "--kv-cache-memory", str(KV), "--offload-dir", str(tmp_path)]
    assert main(args) == 0
    spill = [line for line in capsys.readouterr().out.splitlines() if line.startswith("spill")]
    assert len(spill) == 1 and f"in {tmp_path}/" in spill[0] and "written now" in spill[0], spill
    assert MANIFEST in "".join(files_under(tmp_path))
    assert main(args) == 0
    assert "reused; checksums verified" in capsys.readouterr().out
    code = main([*args, "--disk-memory", "1KiB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: --offload-dir {tmp_path}") and "--disk-memory budget" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_spill_files_bit_identical_to_resident(model_dir, tmp_path):
    base = LLM(model_dir, EngineConfig(kv_cache_bytes=KV, device="cuda", dtype="bfloat16"))
    spec, family = load_spec(model_dir)
    with BufferedReader() as reader:
        layout = model_layout(Checkpoint(model_dir, reader), model_tensors(family, spec))
    fixed, layer = (group_cost(g, torch.bfloat16, base.parts.device_tier) for g in (layout.embed, layout.layers[0]))
    head = group_cost(layout.head, torch.bfloat16, base.parts.device_tier)
    config = EngineConfig(
        kv_cache_bytes=KV, device="cuda", dtype="bfloat16", device_memory=KV + fixed + head + 5 * layer,
        offload_dir=str(tmp_path),
    )  # fmt: skip
    llm = LLM(model_dir, config)
    nvme = [i for i, t in enumerate(llm.placement.layer_tiers) if t == "nvme"]
    assert nvme and set(nvme) <= set(llm.placement.spill.layers) and llm.parts.weights.store._ring._scratch is None
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == [
        c.token_ids for c in base.generate_ids(PROMPTS, PARAMS)
    ]
    for i in range(LAYERS):
        a, b = llm.parts.weights.store.acquire(i), base.parts.weights.store.acquire(i)
        assert all(torch.equal(a[k], b[k]) for k in b), f"layer {i}"
        llm.parts.weights.store.release(i)
        base.parts.weights.store.release(i)
    torch.cuda.synchronize()
    assert llm.placement.device_peak <= config.device_memory
