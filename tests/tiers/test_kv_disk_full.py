"""A full disk under the KV cache's disk tier (tiers/kv/lower_tiers.py): the tier takes no more blocks, says so once,
the tokens stay those of a working disk, and what it wrote before reads back; a budget the folder cannot hold is
refused at start. The disk is filled by a monkeypatched os.pwrite (the store's one write call), no root needed."""

from __future__ import annotations

import errno
import os
import re
import shutil
import types
from pathlib import Path

import pytest

from offload.api import LLM
from offload.common.config import EngineConfig, SamplingParams
from offload.common.errors import OffloadError

KV = 1 << 20  # bytes of the device part: small, so blocks are evicted down to the disk as well as written through
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
SYSTEMS = [list(range(3 + 50 * s, 3 + 50 * s + 45)) for s in range(4)]  # four 45-token prefixes
PROMPTS = [system + [200 + s, 7] for s, system in enumerate(SYSTEMS)]


def config(folder: Path, disk: int) -> EngineConfig:
    return EngineConfig(block_size=4, kv_cache_bytes=KV, offload_dir=str(folder), kv_disk_memory=disk)


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[list[int]]:
    with LLM(tiny_llama, EngineConfig(block_size=4, kv_cache_bytes=KV)) as llm:
        return [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def file_nbytes(tiny_llama, tmp_path_factory) -> int:
    """Bytes of one of tiny_llama's block files."""
    with LLM(tiny_llama, config(tmp_path_factory.mktemp("probe"), 1 << 22)) as llm:
        return llm.parts.kv.tiers.disk.file_nbytes


def fill_after(monkeypatch, room: int, code: int = errno.ENOSPC) -> list[int]:
    """os.pwrite writes `room` more bytes, the last of them short, then fails with `code`; the bytes left, in a
    list the caller may read."""
    real, left = os.pwrite, [room]

    def pwrite(fd, data, offset):
        n = min(len(data), left[0])
        if n == 0:
            raise OSError(code, os.strerror(code))
        left[0] -= n
        return real(fd, memoryview(data)[:n], offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return left


def said(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kv disk tier:")]


def test_a_full_disk_turns_the_tier_off_once_and_the_tokens_stay_the_same(
    tiny_llama, expected, file_nbytes, tmp_path, monkeypatch, capsys
):
    left = fill_after(monkeypatch, 6 * file_nbytes + 4096)  # the manifest at open, six blocks, then part of one
    llm = LLM(tiny_llama, config(tmp_path, 1 << 22))
    tiers, folder = llm.parts.kv.tiers, tmp_path / "kv"
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)] == expected
    assert [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)] == expected  # a second pass: no second line
    llm.core.flush_kv()
    line = f"kv disk tier: {folder}: no space left on device; the disk tier takes no more blocks"
    assert left == [0] and said(capsys.readouterr().err) == [line] and tiers.disk_off == line
    disk = tiers.disk
    assert disk.blocks == 6 and not any(name.endswith(".tmp") for name in os.listdir(folder))
    disk.check_integrity()  # nothing half-written indexed: the index is the whole block files
    llm.close()
    monkeypatch.undo()
    with LLM(tiny_llama, config(tmp_path, 1 << 22)) as again:  # a working disk: the six blocks read back
        assert again.parts.kv.tiers.disk.blocks == 6
        assert [c.token_ids for c in again.generate_ids(PROMPTS, GREEDY)] == expected
        assert again.parts.kv.tiers.disk.dropped_corrupt == 0 and again.parts.kv.tiers.disk.hits > 0
    assert said(capsys.readouterr().err) == []


@pytest.mark.parametrize(("code", "reason"), [(errno.EDQUOT, "disk quota exceeded"), (errno.EFBIG, "file too large")])
def test_a_quota_or_a_file_size_limit_is_a_full_disk_too(
    tiny_llama, expected, tmp_path, monkeypatch, capsys, code, reason
):
    fill_after(monkeypatch, 4096, code)  # the manifest at open, then nothing
    with LLM(tiny_llama, config(tmp_path, 1 << 22)) as llm:
        assert [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)] == expected
        assert llm.parts.kv.tiers.disk.blocks == 0
    assert said(capsys.readouterr().err) == [
        f"kv disk tier: {tmp_path / 'kv'}: {reason}; the disk tier takes no more blocks"
    ]


def test_a_disk_full_at_open_still_reads_the_blocks_it_holds(tiny_llama, expected, tmp_path, monkeypatch, capsys):
    with LLM(tiny_llama, config(tmp_path, 1 << 22)) as first:
        first.generate_ids(PROMPTS, GREEDY)
    held = first.parts.kv.tiers.disk.blocks  # closed: the last step's blocks went through too
    fill_after(monkeypatch, 0)
    with LLM(tiny_llama, config(tmp_path, 1 << 22)) as llm:
        assert said(capsys.readouterr().err) == [
            f"kv disk tier: {tmp_path / 'kv'}: no space left on device; the disk tier takes no more blocks"
        ]
        assert [c.token_ids for c in llm.generate_ids(PROMPTS, GREEDY)] == expected
        disk = llm.parts.kv.tiers.disk
        assert held > 0 and disk.blocks == held and disk.hits > 0 and disk.dropped_corrupt == 0
    assert said(capsys.readouterr().err) == []


def test_another_write_error_on_the_writer_thread_stops_the_run_at_the_next_step(tiny_llama, tmp_path, monkeypatch):
    fill_after(monkeypatch, 4096, errno.EIO)
    llm = LLM(tiny_llama, config(tmp_path, 1 << 22))
    with pytest.raises(
        OffloadError, match=rf"^{tmp_path / 'kv'}: {os.strerror(errno.EIO)} \(writing a KV cache block\)$"
    ):
        llm.generate_ids(PROMPTS, GREEDY)
    assert llm.parts.kv.tiers.disk_off.startswith(f"kv disk tier: {tmp_path / 'kv'}: ")
    llm.generate_ids(PROMPTS, GREEDY)  # raised once: the disk tier takes no more blocks
    monkeypatch.undo()
    llm.close()  # returns: the writer thread lived on, and its queue drained


def test_a_budget_larger_than_the_free_space_is_refused_at_start(tiny_llama, file_nbytes, tmp_path, monkeypatch):
    with LLM(tiny_llama, config(tmp_path, 4 * file_nbytes)) as first:  # a budget the first run fills
        first.generate_ids(PROMPTS, GREEDY)
    assert first.parts.kv.tiers.disk.blocks == 4  # closed: every block written went through
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=1 << 30, used=1 << 30, free=0))
    with LLM(tiny_llama, config(tmp_path, 4 * file_nbytes)):  # a rerun on the disk it filled
        pass
    folder = re.escape(str(tmp_path / "kv"))
    with pytest.raises(
        OffloadError,
        match=rf"^--kv-disk-memory of 64\.0 MiB is more than {folder} can hold \(0 B free and .* held there already\)$",
    ):
        LLM(tiny_llama, config(tmp_path, 64 << 20))
    fresh = tmp_path / "fresh"
    folder = re.escape(str(fresh / "kv"))
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: types.SimpleNamespace(total=1 << 30, used=1 << 30, free=256 << 10)
    )
    with pytest.raises(
        OffloadError,
        match=rf"^--kv-disk-memory of 64\.0 MiB is more than {folder} can hold \(256\.0 KiB free\)$",
    ):
        LLM(tiny_llama, config(fresh, 64 << 20))
    assert not fresh.exists()  # refused before anything was made
