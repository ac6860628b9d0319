"""The disk part of the KV cache (tiers/kv/disk_store.py): round trips, restarts, keys, every kind of damage, the budget
and its LRU order, the folder lock, and a writer killed with SIGKILL mid-put."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from offload.common.errors import OffloadError
from offload.tiers.files import DiskFull
from offload.tiers.io.base import ALIGN
from offload.tiers.io.direct import PreadBackend
from offload.tiers.kv.disk_store import HEADER, MAGIC, MANIFEST, KVDiskStore

NBYTES = 5000  # bytes per block: not a multiple of ALIGN, so the payload is padded
FILE = ALIGN + 8192  # bytes per block file: the header page, then the payload's pages
KEY = {"model": "tiny-llama", "kv_dtype": "bfloat16", "block_size": 4, "layers": 3}
OTHER = KEY | {"model": "tiny-qwen"}


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def block(block_hash: bytes) -> torch.Tensor:
    """The bytes every test stores under `block_hash` (so any block read back can be checked on its own)."""
    return torch.frombuffer(bytearray(hashlib.shake_128(block_hash).digest(NBYTES)), dtype=torch.uint8)


def store(folder: Path, capacity: int = 64 * FILE, key: dict = KEY, **kw) -> KVDiskStore:
    return KVDiskStore(folder, key, NBYTES, capacity, **kw)


def filled(folder: Path, n: int = 4) -> None:
    """A closed store in `folder` holding blocks h(0)..h(n-1), used in that order."""
    with store(folder) as s:
        for i in range(n):
            assert s.put(h(i), block(h(i)))


def path_of(s: KVDiskStore, block_hash: bytes) -> Path:
    [path] = s.folder.glob(f"{block_hash.hex()}.*.kv")
    return path


def open_files(folder: Path) -> list[Path]:
    """The files in `folder` this process holds open, a deleted one as "<path> (deleted)"."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(Path(p) for p in held if p.startswith(f"{folder}/"))


def block_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)


# ---- round trips ------------------------------------------------------------------------------------------


def test_blocks_round_trip_bit_for_bit_in_aligned_checksummed_files(tmp_path):
    s = store(tmp_path / "offload" / "kv")  # missing parents are created
    for i in range(5):
        assert s.put(h(i), block(h(i)))
    assert s.blocks == 5 and s.used == s.peak == s.bytes_written == 5 * FILE
    for i in range(5):
        got = s.get(h(i))
        assert got.dtype == torch.uint8 and got.shape == (NBYTES,) and torch.equal(got, block(h(i)))
    got = s.get_many([h(0), h(9), h(3), h(0)])
    assert [None if g is None else g.tolist() for g in got] == [
        block(h(i)).tolist() if i != 9 else None for i in (0, 9, 3, 0)
    ]
    assert (s.hits, s.misses, s.bytes_read) == (8, 1, 8 * FILE)

    raw = path_of(s, h(2)).read_bytes()  # the format, as the module docstring gives it
    assert len(raw) == FILE and FILE % ALIGN == 0
    magic, _, n, stored_hash, nbytes, crc = HEADER.unpack_from(raw)
    assert (magic, stored_hash[:n], nbytes) == (MAGIC, h(2), NBYTES)
    assert raw[ALIGN : ALIGN + NBYTES] == bytes(block(h(2))) and crc == zlib.crc32(raw[ALIGN : ALIGN + NBYTES])
    assert raw[HEADER.size : ALIGN] == bytes(ALIGN - HEADER.size) and raw[ALIGN + NBYTES :] == bytes(
        FILE - ALIGN - NBYTES
    )

    assert s.put(h(0), block(h(0))) and s.bytes_written == 5 * FILE  # already held: nothing written
    assert not any(name.endswith(".tmp") for name in os.listdir(s.folder))
    s.check_integrity()
    s.close()
    s.close()


def test_put_refuses_a_wrong_payload_and_a_block_larger_than_the_budget(tmp_path):
    s = store(tmp_path, capacity=FILE - 1)
    with pytest.raises(ValueError, match="5000 uint8 bytes"):
        s.put(h(0), torch.zeros(NBYTES, dtype=torch.float16))
    with pytest.raises(ValueError, match="5000 uint8 bytes"):
        s.put(h(0), torch.zeros(NBYTES + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        s.put(b"", block(h(0)))
    assert s.put(h(0), block(h(0))) is False
    assert s.blocks == s.used == s.peak == 0 and block_files(tmp_path) == []


def test_get_many_submits_every_read_before_the_first_wait(tmp_path):
    log = []

    class Logged(PreadBackend):
        def submit(self, path, offset, nbytes, buf):
            request = super().submit(path, offset, nbytes, buf)
            log.append("submit")

            class Waited:
                def wait(self):
                    log.append("wait")
                    return request.wait()

            return Waited()

    with store(tmp_path, backend=Logged()) as s:
        for i in range(3):
            s.put(h(i), block(h(i)))
        got = s.get_many([h(2), h(7), h(0), h(1)])
    assert log == ["submit"] * 3 + ["wait"] * 3
    assert [g is not None and torch.equal(g, block(x)) for g, x in zip(got, [h(2), h(7), h(0), h(1)], strict=True)] == [
        1,
        0,
        1,
        1,
    ]


def test_restart_returns_the_same_bytes_in_the_same_recency_order(tmp_path):
    filled(tmp_path)
    with store(tmp_path) as s:
        assert s.get(h(0)) is not None  # now the most recent
    with store(tmp_path) as s:
        assert s.hashes() == [h(1), h(2), h(3), h(0)]
        assert s.used == s.peak == 4 * FILE and s.bytes_written == 0
        assert all(torch.equal(s.get(h(i)), block(h(i))) for i in range(4))
        assert (s.dropped_corrupt, s.dropped_foreign, s.evicted) == (0, 0, 0)


def test_another_key_sees_nothing_and_the_foreign_blocks_are_deleted(tmp_path):
    filled(tmp_path)
    with store(tmp_path, key=OTHER) as s:
        assert s.blocks == s.used == 0 and s.dropped_foreign == 4
        assert h(0) not in s and s.get(h(0)) is None
        assert block_files(tmp_path) == []
        s.put(h(0), block(h(0)))
    assert json.loads((tmp_path / MANIFEST).read_text())["key"] == OTHER
    with KVDiskStore(tmp_path, OTHER, NBYTES + 1, 64 * FILE) as s:  # another block size is another key too
        assert s.blocks == 0 and s.dropped_foreign == 1
    with store(tmp_path) as s:
        assert s.blocks == 0


# ---- damage -----------------------------------------------------------------------------------------------


def flip_payload(s, path):
    raw = bytearray(path.read_bytes())
    raw[ALIGN + 1234] ^= 0x04
    path.write_bytes(raw)


def flip_header(s, path):
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0x80  # inside the key digest
    path.write_bytes(raw)


def truncate(s, path):
    os.truncate(path, FILE - ALIGN)


def another_blocks_file(s, path):
    shutil.copyfile(path_of(s, h(1)), path)


def another_keys_file(s, path):
    with store(s.folder.parent / "other", key=OTHER) as other:  # the same hash and size, under another key
        other.put(h(0), block(h(0)))
        shutil.copyfile(path_of(other, h(0)), path)


def remove(s, path):
    path.unlink()


@pytest.mark.parametrize(
    "damage", [flip_payload, flip_header, truncate, another_blocks_file, another_keys_file, remove]
)
def test_a_damaged_block_is_never_returned_its_file_goes_and_it_is_counted(tmp_path, damage):
    folder = tmp_path / "kv"
    filled(folder)
    with store(folder) as s:
        path = path_of(s, h(0))
        damage(s, path)
        assert s.get_many([h(0), h(1)])[0] is None
        assert h(0) not in s and not path.exists() and s.dropped_corrupt == 1 and s.misses == 1
        assert all(torch.equal(s.get(h(i)), block(h(i))) for i in (1, 2, 3))
        assert s.put(h(0), block(h(0))) and torch.equal(s.get(h(0)), block(h(0)))  # the caller recomputed it
        s.check_integrity()


@pytest.mark.parametrize("damage", [truncate, remove])
def test_a_block_damaged_while_no_store_was_open_is_dropped_at_open(tmp_path, damage):
    filled(tmp_path)
    path = next(tmp_path.glob(f"{h(2).hex()}.*.kv"))
    damage(None, path)
    with store(tmp_path) as s:
        assert s.hashes() == [h(0), h(1), h(3)] and s.dropped_corrupt == 1 and not path.exists()
        s.check_integrity()


@pytest.mark.parametrize("manifest", [b"{not json", b"[1, 2]", b'{"format": 1, "key": {}, "lru": 5}', None])
def test_a_bad_or_missing_manifest_loses_only_the_recency_order(tmp_path, manifest):
    filled(tmp_path)
    if manifest is None:
        (tmp_path / MANIFEST).unlink()
    else:
        (tmp_path / MANIFEST).write_bytes(manifest)
    with store(tmp_path) as s:
        assert sorted(s.hashes()) == sorted(h(i) for i in range(4))  # in mtime order: written too fast to tell
        assert all(torch.equal(s.get(h(i)), block(h(i))) for i in range(4))
        assert s.dropped_corrupt == 0
    assert json.loads((tmp_path / MANIFEST).read_text())["key"] == KEY


def test_another_models_manifest_gives_no_order_and_no_blocks(tmp_path):
    filled(tmp_path)
    manifest = {"format": 1, "key": OTHER, "block_nbytes": NBYTES, "lru": [h(3).hex(), h(9).hex()]}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with store(tmp_path) as s:
        assert sorted(s.hashes()) == sorted(h(i) for i in range(4)) and h(9) not in s
        assert s.dropped_corrupt == 0  # h(9) was never this key's


def test_orphan_temp_files_of_a_killed_writer_are_removed_at_open(tmp_path):
    filled(tmp_path)
    with store(tmp_path) as s:
        name = path_of(s, h(0)).name.replace(h(0).hex(), h(7).hex())
    (tmp_path / f".{name}.tmp").write_bytes(b"\x00" * 5000)  # a torn block
    (tmp_path / f".{MANIFEST}.tmp").write_text('{"format": 1, "ke')
    with store(tmp_path) as s:
        assert s.dropped_corrupt == 1 and h(7) not in s and s.blocks == 4
        assert sorted(os.listdir(tmp_path)) == sorted([MANIFEST, *(path_of(s, h(i)).name for i in range(4))])


# ---- the budget -------------------------------------------------------------------------------------------


def test_eviction_is_least_recently_used_and_survives_a_restart(tmp_path):
    s = store(tmp_path, capacity=3 * FILE + 100)
    for i in range(3):
        s.put(h(i), block(h(i)))
    assert s.get(h(0)) is not None  # a get is a use
    assert h(1) in s  # a membership test is not
    s.put(h(3), block(h(3)))
    assert s.hashes() == [h(2), h(0), h(3)] and s.evicted == 1 and h(1) not in s
    assert s.put(h(0), block(h(0)))  # already held: a use
    s.put(h(4), block(h(4)))
    assert s.hashes() == [h(3), h(0), h(4)] and s.evicted == 2
    assert len(block_files(tmp_path)) == 3 and s.used == s.peak == 3 * FILE
    s.discard(h(3))
    s.discard(h(3))
    assert s.hashes() == [h(0), h(4)] and s.used == 2 * FILE and s.evicted == 2
    s.close()
    with store(tmp_path, capacity=FILE) as s:  # a smaller budget: the least recent goes at open
        assert s.hashes() == [h(4)] and s.evicted == 1 and s.peak == FILE
        s.check_integrity()


def test_the_budget_is_never_exceeded_under_random_puts_and_gets(tmp_path):
    rng = random.Random(7)
    capacity = 5 * FILE + ALIGN
    s = store(tmp_path, capacity=capacity)
    model: OrderedDict[bytes, None] = OrderedDict()  # the expected recency order
    for _ in range(250):
        x = h(rng.randrange(12))
        op = rng.random()
        if op < 0.5:
            assert s.put(x, block(x))
            model[x] = None
            model.move_to_end(x)
            while len(model) > 5:
                model.popitem(last=False)
        elif op < 0.9:
            got = s.get(x)
            assert (got is not None) == (x in model)
            if x in model:
                assert torch.equal(got, block(x))
                model.move_to_end(x)
        else:
            s.discard(x)
            model.pop(x, None)
        assert s.hashes() == list(model)
        assert s.used <= s.peak <= capacity
        assert sum(p.stat().st_size for p in tmp_path.iterdir() if p.name != MANIFEST) == s.used
    assert s.peak == 5 * FILE
    s.check_integrity()
    s.close()


def test_an_evicted_blocks_file_is_not_held_open(tmp_path):
    s = store(tmp_path, capacity=2 * FILE)
    s.put(h(0), block(h(0)))
    s.put(h(1), block(h(1)))
    assert s.get(h(0)) is not None and s.get(h(1)) is not None
    assert open_files(tmp_path) == sorted([path_of(s, h(0)), path_of(s, h(1))])  # the backend keeps them open
    s.put(h(2), block(h(2)))  # evicts h(0): its descriptor would keep the deleted file's space
    assert open_files(tmp_path) == []
    s.discard(h(0))
    s.put(h(0), block(h(0)))  # the same name, a new file: read as a block, not refused as "replaced"
    assert torch.equal(s.get(h(0)), block(h(0))) and s.dropped_corrupt == 0
    s.close()


# ---- failures the user sees -------------------------------------------------------------------------------


def test_a_read_only_filesystem_is_a_clear_error(tmp_path, monkeypatch):
    def erofs(path, mode=0o777):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(os, "mkdir", erofs)
    with pytest.raises(
        OffloadError, match=rf"^{tmp_path / 'kv'}: read-only filesystem \(opening the KV cache folder\)$"
    ):
        store(tmp_path / "kv")


def test_a_folder_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "kv").write_text("")
    with pytest.raises(OffloadError, match=rf"^{tmp_path / 'kv'}: not a directory"):
        store(tmp_path / "kv")


@pytest.mark.parametrize(
    ("code", "reason"),
    [(errno.ENOSPC, "no space left on device"), (errno.EDQUOT, "disk quota exceeded"), (errno.EFBIG, "file too large")],
)
def test_a_full_disk_fails_the_put_cleanly(tmp_path, monkeypatch, code, reason):
    s = store(tmp_path)
    s.put(h(0), block(h(0)))
    real, room = os.pwrite, [FILE // 2]  # bytes the disk still takes: half a block file, then nothing

    def full(fd, data, offset):
        n = min(len(data), room[0])
        if n == 0:
            raise OSError(code, os.strerror(code))
        room[0] -= n
        return real(fd, memoryview(data)[:n], offset)  # a short write first, as a filling disk gives

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(DiskFull, match=rf"^{tmp_path}: {reason} \(writing a KV cache block\)$") as info:
        s.put(h(1), block(h(1)))
    assert (info.value.where, info.value.reason) == (str(tmp_path), reason)
    with pytest.raises(DiskFull, match=rf"^{tmp_path}: {reason} \(writing the KV cache manifest\)$"):
        s.flush()
    monkeypatch.undo()
    assert room == [0] and not any(name.endswith(".tmp") for name in os.listdir(tmp_path))
    assert s.hashes() == [h(0)] and block_files(tmp_path) == [path_of(s, h(0)).name] and s.used == FILE
    assert torch.equal(s.get(h(0)), block(h(0))) and s.dropped_corrupt == 0
    s.check_integrity()
    s.close()


def test_a_store_opened_on_a_full_disk_reads_what_it_holds_and_says_why_it_wrote_nothing(tmp_path, monkeypatch):
    filled(tmp_path)
    before = (tmp_path / MANIFEST).read_bytes()

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", enospc)
    s = store(tmp_path)
    assert isinstance(s.full, DiskFull)
    assert str(s.full) == f"{tmp_path}: no space left on device (writing the KV cache manifest)"
    assert s.hashes() == [h(i) for i in range(4)]
    assert all(torch.equal(got, block(h(i))) for i, got in enumerate(s.get_many(s.hashes())))
    with pytest.raises(DiskFull):
        s.put(h(9), block(h(9)))
    with pytest.raises(DiskFull):
        s.close()  # the store is let go of all the same
    monkeypatch.undo()
    assert (tmp_path / MANIFEST).read_bytes() == before and len(block_files(tmp_path)) == 4
    with store(tmp_path) as again:  # the lock was released
        assert again.full is None and again.blocks == 4


# ---- other processes --------------------------------------------------------------------------------------

WRITER = """
import hashlib, sys, torch
from offload.tiers.kv.disk_store import KVDiskStore
store = KVDiskStore(sys.argv[1], {key!r}, {nbytes}, {capacity})
i = 0
while True:
    h = hashlib.blake2b(str(i).encode(), digest_size=16).digest()
    store.put(h, torch.frombuffer(bytearray(hashlib.shake_128(h).digest({nbytes})), dtype=torch.uint8))
    print(i, flush=True)
    i += 1
"""


def writer(folder: Path, capacity: int) -> subprocess.Popen:
    """Another process putting blocks h(0), h(1), ... into a store on `folder` forever, printing each index once
    its put returned."""
    script = WRITER.format(key=KEY, nbytes=NBYTES, capacity=capacity)
    return subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_puts(proc: subprocess.Popen, n: int, timeout: float = 60) -> int:
    """Read the writer's output until it has put `n` blocks; the last index it printed."""
    out, deadline = b"", time.monotonic() + timeout
    while out.count(b"\n") < n:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(proc.stdout.fileno(), 1 << 16) if ready else b""
        if not chunk:
            proc.kill()
            raise AssertionError(f"the writer stopped: {proc.stderr.read().decode()[-2000:]}")
        out += chunk
    return int(out[: out.rindex(b"\n")].rsplit(b"\n", 1)[-1])


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_second_store_on_the_folder_is_refused_while_another_process_holds_it(tmp_path):
    proc = writer(tmp_path, capacity=64 * FILE)
    try:
        wait_for_puts(proc, 1)
        with pytest.raises(OffloadError, match=rf"^{tmp_path}: another engine is using this KV cache folder$"):
            store(tmp_path)
    finally:
        kill(proc)
    with store(tmp_path) as s:  # the lock died with its holder
        with pytest.raises(OffloadError, match="another engine is using"):
            store(tmp_path)  # the same process counts as another engine too
        assert s.blocks >= 1


def test_a_writer_killed_mid_put_leaves_a_store_of_intact_blocks(tmp_path):
    capacity = 12 * FILE
    proc = writer(tmp_path, capacity)
    try:
        last = wait_for_puts(proc, random.Random(3).randrange(20, 40))
    finally:
        kill(proc)
    with store(tmp_path, capacity) as s:
        index = {h(i): i for i in range(last + 1000)}
        held = sorted(index[x] for x in s.hashes())
        # every put that returned is durable unless evicted since: the 11 or 12 most recent puts are held (11 when
        # the kill came after an eviction and before the new block's rename), none of them torn
        assert held[-1] >= last and held == list(range(held[0], held[-1] + 1)) and len(held) in (11, 12)
        assert all(torch.equal(got, block(x)) for got, x in zip(s.get_many(s.hashes()), s.hashes(), strict=True))
        assert s.dropped_corrupt <= 1 and not any(name.endswith(".tmp") for name in os.listdir(tmp_path))
        s.check_integrity()
