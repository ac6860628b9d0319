"""The NVMe read backends: exact bytes for awkward extents, O_DIRECT really used, and every error path."""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from offload.common.errors import OffloadError
from offload.tiers.io import base
from offload.tiers.io.aio import AioBackend, aio_unavailable
from offload.tiers.io.backends import BackendChoice, choose_backend, make_backend
from offload.tiers.io.base import ALIGN, ReadBackend, aligned_buffer, aligned_span, evict_page_cache
from offload.tiers.io.direct import PreadBackend

SIZE = 3 * (1 << 20) + 1234  # bytes; the last page is partial
EXTENTS = [  # (offset, nbytes)
    (0, 1),
    (1, 1),
    (4095, 1),
    (4095, 2),
    (0, 4095),
    (1, 4095),
    (0, 4096),
    (0, 4097),
    (4095, 4097),
    (8191, 3 * 4096 + 2),
    (12345, 1_000_000),  # crosses many pages and several chunks / iocbs
    (0, SIZE),  # the whole file
    (SIZE - 100, 100),  # ends exactly at end of file
    (SIZE - 5000, 5000),
    (SIZE - 1, 1),
    (SIZE - 1200, 1000),  # ends inside the last, partial page
    (SIZE - 1234 - 1, 2),  # straddles the start of the last page
    (SIZE, 0),
]
# small chunks, blocks and an odd thread count, so every split and remainder path runs on a few MiB
CONFIGS = {
    "pread": lambda: PreadBackend(threads=4, chunk_bytes=64 << 10),
    "aio": lambda: AioBackend(block_size=64 << 10, queue_depth=4, aio_threads=3, threads=2, chunk_bytes=64 << 10),
}


def aio_skip_reason() -> str | None:
    reason = aio_unavailable()
    return None if reason is None else f"aio backend unavailable here: {reason}"


def open_backend(name: str) -> ReadBackend:
    if name == "aio" and (reason := aio_skip_reason()):
        pytest.skip(reason)
    return CONFIGS[name]()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, bytes]:
    """A file of SIZE random bytes on the real disk (tmp_path: ext4 here, where O_DIRECT works), not cached."""
    path = tmp_path_factory.mktemp("io") / "data.bin"
    payload = random.Random(0).randbytes(SIZE)
    path.write_bytes(payload)
    evict_page_cache(path)
    return path, payload


@pytest.fixture(params=list(CONFIGS))
def backend(request) -> ReadBackend:
    backend = open_backend(request.param)
    yield backend
    backend.close()


def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache, by mincore over a private mapping of it."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), pages)
        del anchor
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(p & 1 for p in pages) * mmap.PAGESIZE


def direct_supported(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def read(backend: ReadBackend, path: Path, offset: int, nbytes: int) -> bytes:
    buf = aligned_buffer(aligned_span(offset, nbytes).length)
    return backend.submit(path, offset, nbytes, buf).wait().numpy().tobytes()


def test_aligned_span_and_buffer():
    assert aligned_span(0, 0) == (0, 0)
    assert aligned_span(0, 1) == (0, ALIGN)
    assert aligned_span(4095, 2) == (0, 2 * ALIGN)
    assert aligned_span(4096, 4096) == (4096, 4096)
    assert aligned_span(5000, 10_000) == (4096, 3 * ALIGN)  # bytes 5000..15000 lie in pages 1..3
    for nbytes in (0, 1, 4096, 10_000):
        buf = aligned_buffer(nbytes)
        assert buf.dtype == torch.uint8 and buf.data_ptr() % ALIGN == 0
        assert buf.numel() == aligned_span(0, nbytes).length


def test_extents_match_python_read(backend, data):
    path, payload = data
    for offset, nbytes in EXTENTS:
        assert read(backend, path, offset, nbytes) == payload[offset : offset + nbytes], (offset, nbytes)


def test_many_requests_in_flight(backend, data):
    path, payload = data
    rng = random.Random(1)
    extents = EXTENTS + [(o, rng.randrange(1, SIZE - o + 1)) for o in rng.sample(range(SIZE), 30)]
    requests = []
    for offset, nbytes in extents:
        buf = aligned_buffer(aligned_span(offset, nbytes).length + ALIGN)
        buf.fill_(0xAB)
        requests.append((offset, nbytes, buf, backend.submit(path, offset, nbytes, buf)))
    for offset, nbytes, buf, request in reversed(requests):  # reap out of order
        assert request.wait().numpy().tobytes() == payload[offset : offset + nbytes], (offset, nbytes)
        if nbytes:  # a view into the caller's buffer (an empty tensor has no address)
            assert request.wait().data_ptr() == buf.data_ptr() + offset % ALIGN
        beyond = buf[aligned_span(offset, nbytes).length :]
        assert bool((beyond == 0xAB).all()), "wrote past the aligned span"


def test_submit_from_several_threads(backend, data):
    path, payload = data
    failures: list[tuple[int, int]] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            offset = rng.randrange(SIZE)
            nbytes = rng.randrange(1, min(SIZE - offset, 300_000) + 1)
            if read(backend, path, offset, nbytes) != payload[offset : offset + nbytes]:
                failures.append((offset, nbytes))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_backends_return_identical_bytes(data):
    path, payload = data
    rng = random.Random(2)
    extents = EXTENTS + [(o, rng.randrange(1, SIZE - o + 1)) for o in rng.sample(range(SIZE), 20)]
    results = {}
    for name in CONFIGS:
        with open_backend(name) as backend:
            results[name] = [read(backend, path, offset, nbytes) for offset, nbytes in extents]
    assert results["pread"] == results["aio"]
    assert results["pread"][-1] == payload[extents[-1][0] : sum(extents[-1])]


def test_direct_io_bypasses_page_cache(backend, data):
    path, payload = data
    assert direct_supported(path), "the test file should sit on a filesystem with O_DIRECT (ext4/xfs), not tmpfs"
    assert backend.is_direct(path)
    evict_page_cache(path)
    assert resident_bytes(path) == 0
    assert read(backend, path, 0, SIZE) == payload
    assert resident_bytes(path) == 0  # every byte came from the device
    with open(path, "rb") as f:  # the probe can see a cached file: a buffered read fills the cache
        f.read()
    assert resident_bytes(path) == aligned_span(0, SIZE).length
    evict_page_cache(path)


def test_counters_count_aligned_bytes(backend, data):
    path, _ = data
    read(backend, path, 1, 4095)
    assert backend.bytes_read == ALIGN
    read(backend, path, SIZE - 10, 10)  # the partial last page: only the bytes the file has
    assert backend.bytes_read == ALIGN + SIZE % ALIGN
    read(backend, path, 5000, 100_000)
    assert backend.bytes_read == ALIGN + SIZE % ALIGN + aligned_span(5000, 100_000).length
    assert backend.read_seconds > 0
    assert backend.file_size(path) == SIZE


@pytest.mark.parametrize("name", list(CONFIGS))
def test_filesystem_without_o_direct_falls_back_to_buffered(name, data, monkeypatch):
    path, payload = data
    real_open = os.open

    def refuse_direct(p, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(base.os, "open", refuse_direct)
    with open_backend(name) as backend:
        assert not backend.is_direct(path)
        for offset, nbytes in EXTENTS:
            assert read(backend, path, offset, nbytes) == payload[offset : offset + nbytes]


def test_read_past_end_of_file(backend, data):
    path, _ = data
    with pytest.raises(OffloadError, match=rf"data.bin: truncated: wanted bytes {SIZE - 10}..{SIZE + 1}, file ends"):
        read(backend, path, SIZE - 10, 11)
    with pytest.raises(OffloadError, match=f"file ends at {SIZE}"):
        read(backend, path, SIZE + 4096, 1)


def test_missing_file(backend, tmp_path):
    with pytest.raises(OffloadError, match="nope.bin: file not found"):
        read(backend, tmp_path / "nope.bin", 0, 1)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.open("ab").write(b"x" * 10), "changed size during the run \\(was 20000, now 20010\\)"),
        (lambda p: os.truncate(p, 5000), "changed size during the run \\(was 20000, now 5000\\)"),
        (lambda p: os.utime(p, ns=(1, 1)), "modified during the run"),
        (lambda p: os.replace(p.with_suffix(".new"), p), "replaced by another file during the run"),
        (lambda p: p.unlink(), "removed during the run"),
    ],
    ids=["grew", "shrank", "touched", "replaced", "removed"],
)
def test_file_changed_after_first_open(backend, tmp_path, change, message):
    path = tmp_path / "ckpt.bin"
    path.write_bytes(bytes(20000))
    path.with_suffix(".new").write_bytes(bytes(20000))
    assert read(backend, path, 100, 100) == bytes(100)
    change(path)
    with pytest.raises(OffloadError, match=f"ckpt.bin: {message}"):
        read(backend, path, 100, 100)


def test_bad_buffers(backend, data):
    path, _ = data
    with pytest.raises(ValueError, match="4096-byte boundary"):
        backend.submit(path, 0, 10, aligned_buffer(2 * ALIGN)[1:])
    with pytest.raises(ValueError, match="holds 4096 bytes, the aligned span needs 8192"):
        backend.submit(path, 4095, 2, aligned_buffer(ALIGN))
    with pytest.raises(ValueError, match="contiguous uint8 CPU tensor"):
        backend.submit(path, 0, 10, torch.zeros(ALIGN, dtype=torch.float32))
    with pytest.raises(ValueError, match="must be >= 0"):
        backend.submit(path, -1, 10, aligned_buffer(ALIGN))


def test_make_backend_by_name(monkeypatch):
    with make_backend("pread") as backend:
        assert isinstance(backend, PreadBackend) and backend.name == "pread"
    with pytest.raises(OffloadError, match="I/O backend 'nvme-magic': unknown; choose one of auto, pread, aio"):
        make_backend("nvme-magic")
    if aio_skip_reason() is None:
        with make_backend("auto") as backend:  # aio only where buffers can be page-locked
            assert backend.name == ("aio" if torch.cuda.is_available() else "pread")
    from offload.tiers.io import aio

    monkeypatch.setattr(aio, "_load_op", lambda: "libaio is missing (apt-get install libaio-dev)")
    with pytest.raises(OffloadError, match="I/O backend 'aio': libaio is missing"):
        make_backend("aio")
    with make_backend("auto") as backend:
        assert backend.name == "pread"


@pytest.fixture
def aio_runs(monkeypatch):
    """Whether the aio op is built and loads, set by the test: the rule only asks aio_ready(), never builds a
    handle."""
    from offload.tiers.io import aio

    def set_runs(runs: bool, cuda: bool = False) -> None:
        monkeypatch.setattr(aio, "_load_op", (lambda: object()) if runs else (lambda: "libaio is missing"))
        monkeypatch.setattr(aio, "aio_built", lambda: runs)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)

    return set_runs


def test_auto_takes_the_faster_backend_the_probe_measured(aio_runs):
    aio_runs(True)
    assert choose_backend("auto", {"pread": 1.02e9, "aio": 1.5e9}) == BackendChoice(
        "aio", "probe: 1.50 vs pread 1.02 GB/s"
    )
    assert choose_backend("auto", {"pread": 1.02e9, "aio": 0.88e9}) == BackendChoice(
        "pread", "probe: 1.02 vs aio 0.88 GB/s"
    )
    assert choose_backend("auto", {"pread": 1e9, "aio": 1e9}).name == "pread"  # a tie keeps the simpler path
    # an expert cache in memory torch does not pin: the op would page-lock every slot at load
    assert choose_backend("auto", {"pread": 1.02e9, "aio": 1.5e9}, locked_cache=20 << 30) == BackendChoice(
        "pread", "probe: aio 1.50 vs pread 1.02 GB/s, but aio would lock the expert cache's slots at load"
    )
    assert choose_backend("aio", locked_cache=20 << 30) == BackendChoice("aio", "asked")  # an ask stands
    aio_runs(False)  # measured faster once, unavailable now
    assert choose_backend("auto", {"pread": 1.02e9, "aio": 1.5e9}) == BackendChoice(
        "pread", "probe measured aio, but its op is not built or loadable now"
    )


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_without_both_rates_keeps_the_default_rule(aio_runs, cuda):
    aio_runs(True, cuda=cuda)
    default = "aio" if cuda else "pread"  # aio only where buffers are page-locked
    assert choose_backend("auto") == BackendChoice(default, "no probe: default")
    assert choose_backend("auto", {}) == BackendChoice(default, "no probe: default")
    assert choose_backend("auto", {"pread": 2e9}) == BackendChoice(default, "probe measured pread alone: default")
    aio_runs(False, cuda=cuda)
    assert choose_backend("auto") == BackendChoice("pread", "no probe: default")


def test_a_named_backend_is_taken_as_asked(aio_runs):
    aio_runs(False)
    assert choose_backend("pread", {"pread": 1e9, "aio": 2e9}) == BackendChoice("pread", "asked")
    assert choose_backend("aio") == BackendChoice("aio", "asked")  # make_backend says why it cannot run
    with pytest.raises(OffloadError, match="I/O backend 'aio': libaio is missing"):
        make_backend("aio")
    with pytest.raises(OffloadError, match="I/O backend 'fast': unknown; choose one of auto, pread, aio"):
        choose_backend("fast")


def test_aio_refuses_a_bounce_buffer_beyond_the_mlock_limit(data, monkeypatch):
    """The op mlocks a bounce buffer for an unpinned one and aborts the process if mlock fails: refuse first."""
    if reason := aio_skip_reason():
        pytest.skip(reason)
    from offload.tiers.io import aio

    path, payload = data
    monkeypatch.setattr(aio, "_memlock_limit", lambda: 64 << 10)
    with AioBackend(aio_threads=1) as backend:
        assert read(backend, path, 0, 64 << 10) == payload[: 64 << 10]
        with pytest.raises(OffloadError, match="data.bin: aio read of 131072 bytes into an unpinned buffer"):
            read(backend, path, 0, 128 << 10)


class _GatedBackend(ReadBackend):
    """Reads that land only when the test opens the gate."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def _start(self, file, start, region):
        self._io_begin()

        def reap() -> int:
            self.gate.wait()
            self._io_end(region.numel())
            return region.numel()

        return reap


def test_read_seconds_counts_a_busy_interval_still_open(tmp_path):
    """The ring keeps reads in flight across steps, so a busy interval may never close during a run: the time it
    has been open so far must count, or the achieved bandwidth comes out absurd."""
    path = tmp_path / "f"
    path.write_bytes(bytes(2 * ALIGN))
    backend = _GatedBackend()
    assert backend.read_seconds == 0.0
    request = backend.submit(path, 0, ALIGN, aligned_buffer(ALIGN))
    first = backend.read_seconds
    threading.Event().wait(0.05)
    assert backend.read_seconds >= first + 0.05  # open, still counting
    backend.gate.set()
    request.wait()
    closed = backend.read_seconds
    threading.Event().wait(0.02)
    assert backend.read_seconds == closed >= 0.05  # closed: no longer grows
    assert backend.bytes_read == ALIGN
    backend.close()


def test_aio_built_looks_for_the_cached_build_without_building(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as ext

    from offload.tiers.io import aio

    monkeypatch.setattr(aio, "_load_op", functools.cache(lambda: pytest.fail("aio_built must not load the op")))
    monkeypatch.setattr(ext, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    assert not aio.aio_built()
    (tmp_path / "async_io").mkdir()
    (tmp_path / "async_io" / "async_io.so").write_bytes(b"")
    assert aio.aio_built()


def test_auto_never_builds_the_aio_op(monkeypatch):
    """A machine whose probe rated aio faster, in an environment where the op is not built yet: "auto" takes pread
    at once rather than waiting minutes for DeepSpeed's JIT build (the demo from a fresh clone)."""
    from offload.tiers.io import aio

    monkeypatch.setattr(aio, "_load_op", functools.cache(lambda: pytest.fail("auto must not build the op")))
    monkeypatch.setattr(aio, "aio_built", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert choose_backend("auto", {"pread": 0.9e9, "aio": 1.5e9}).name == "pread"
    assert choose_backend("auto").name == "pread"


def test_the_op_builds_in_the_environments_own_folder(tmp_path, monkeypatch):
    from offload.tiers.io import aio

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    assert aio.use_environment_build_dir() == tmp_path / "venv" / "torch_extensions" / "async_io"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "venv" / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))  # the user's choice stands
    assert aio.use_environment_build_dir() == tmp_path / "chosen" / "async_io"


def test_a_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path):
    """torch's build lock is a plain file: a build killed midway leaves it, and torch waits on it forever. Under
    the flock (released by the kernel when its holder dies), a torch lock is stale and goes."""
    from offload.tiers.io import aio

    build = tmp_path / "async_io"
    build.mkdir()
    (build / "lock").write_bytes(b"")
    done = threading.Event()

    def take() -> None:
        with aio._build_lock(build):
            done.set()

    worker = threading.Thread(target=take, daemon=True)
    worker.start()
    assert done.wait(10), "a stale torch lock blocked the build"
    assert not (build / "lock").exists()


def test_an_aio_backend_dropped_with_reads_in_flight_does_not_abort_the_process(data):
    """DeepSpeed's handle aborts the process when destroyed with reads pending; a ring always reads ahead, so a
    backend that is never closed (the engine dropped, or the interpreter exiting) must drain its handle first."""
    if reason := aio_skip_reason():
        pytest.skip(reason)
    path, _ = data
    script = (
        "import sys; from tiers.io.aio import AioBackend; from tiers.io.base import aligned_buffer\n"
        "backend = AioBackend(); buf = aligned_buffer(1 << 20)\n"
        "backend.submit(sys.argv[1], 0, 1 << 20, buf)\n"  # never waited, never closed
        "print('submitted')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("submitted")


def test_the_cpus_description_for_the_aio_ops_flags_is_asked_once_and_kept(tmp_path, monkeypatch):
    """DeepSpeed's loader asks py-cpuinfo (a Python process spawned for each answer) for the op's flags: the
    answer is kept beside the build, so a later load asks nothing, and the real function is back afterwards."""
    cpuinfo = pytest.importorskip("cpuinfo")
    from offload.tiers.io import aio

    calls = []
    described = {"arch": "X86_64", "flags": ["avx2", "avx512f"]}
    asked = lambda: calls.append(1) or described  # noqa: E731
    monkeypatch.setattr(cpuinfo, "get_cpu_info", asked)
    for _ in range(2):
        with aio._known_cpu(tmp_path):
            assert cpuinfo.get_cpu_info() == described and cpuinfo.get_cpu_info() == described
        assert cpuinfo.get_cpu_info is asked
    assert len(calls) == 1 and len(list(tmp_path.glob("cpuinfo-*.json"))) == 1


def _mapping_flags(address: int) -> list[str] | None:
    """The VmFlags of this process's mapping holding `address` (/proc/self/smaps); None when none holds it."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux")
def test_a_large_buffer_is_a_mapping_of_its_own_asked_for_huge_pages_and_gone_with_its_tensor():
    buf = aligned_buffer(base.HUGE_FROM + 100)
    address = buf.data_ptr()
    assert address % ALIGN == 0 and buf.numel() == aligned_span(0, base.HUGE_FROM + 100).length
    assert "hg" in _mapping_flags(address)  # MADV_HUGEPAGE: the kernel may back it with 2 MiB pages
    view = buf[ALIGN:]
    buf.fill_(7)
    del buf
    assert int(view[-1]) == 7  # a view keeps the mapping
    del view
    assert _mapping_flags(address) is None  # unmapped with the last tensor on it
