"""Building and loading the native CPU kernels of kernels/native.py: C sources in kernels/csrc/, compiled once per
machine with the system's C compiler, called through ctypes.

They run where the CPU has AVX-512 BF16 and VBMI, a C compiler with OpenMP is on the PATH ($CC, else cc) and
OFFLOAD_KERNELS is not "torch"; anywhere else torch's kernels run, and `why_off` says why (the run summary prints
it). Each library is built into cache_folder(), named by a digest of its source, the compiler, the flags and the
CPU (-march=native: a cache folder shared with another CPU builds its own), written to a temporary name and renamed
into place, so concurrent first runs never load half a file. A build that fails leaves its log under the same name
(`.failed.log`): that compiler is not called again for that source, by this process or any other, until the source,
the compiler or the CPU changes. The engine builds them as it loads a model (kernels/native.py's `prepare`), not in
a step.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from offload.common import environment
from offload.common.paths import cache_dir

SOURCES = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
CPU_FEATURES = ("avx512bw", "avx512_bf16", "avx512vbmi")  # /proc/cpuinfo's names of what the C sources use
CPU_KEYS = ("model name", "flags")  # what names the CPU a library is built for
PTR, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int  # the C arguments' types


def cpu_missing() -> str | None:
    """Why this CPU cannot run the native kernels, or None when it can."""
    if environment.kernel_mode() == "torch":  # no native kernel ("native": every one where it runs, kernels/choice.py)
        return f"{environment.KERNELS}=torch"
    flags = _cpu("flags").split()
    if not flags:
        return "no CPU flags in /proc/cpuinfo"
    missing = [f for f in CPU_FEATURES if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


@functools.cache
def _cpu(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo ("model name", "flags"), or "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), "")


_off: dict[str, str] = {}  # library name -> why it cannot run here


def why_off() -> str | None:
    """Why the native kernels do not run here (the CPU, no compiler, a failed build and its log), or None when they
    do: asks for every library, building what is not built yet."""
    if (missing := cpu_missing()) is not None:
        return missing
    for name in sorted(p.stem for p in SOURCES.glob("*.c")):
        library(name)
    return "; ".join(dict.fromkeys(_off.values())) or None


def known_off() -> str | None:
    """`why_off` as far as this process has asked, building nothing."""
    return cpu_missing() or "; ".join(dict.fromkeys(_off.values())) or None


def built() -> list[str]:
    """The file names of the libraries this process loaded (each names its digest)."""
    return sorted(_loaded.values())


_loaded: dict[str, str] = {}  # library name -> the file loaded


def cache_folder() -> Path:
    return cache_dir() / "native"


def cpu_name() -> str:
    return _cpu("model name")


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """kernels/csrc/`name`.c built for this machine (once, cached on disk), or None where it cannot be (`why_off`
    says why). A built library, or a failed build's log, is found without running anything: its name digests the
    source and the headers, the flags, the CPU and the compiler's path, size and modification time."""
    if cpu_missing() is not None:
        return None
    cc = environment.get(environment.COMPILER) or "cc"
    compiler = shutil.which(cc)
    if compiler is None:
        _off[name] = f"no C compiler ({cc!r} is not on the PATH; set CC)"
        return None
    source = SOURCES / f"{name}.c"
    stat = os.stat(compiler)
    built_for = "\n".join((compiler, str(stat.st_size), str(stat.st_mtime_ns), " ".join(FLAGS), *map(_cpu, CPU_KEYS)))
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))  # what the sources include
    digest = hashlib.sha256(source.read_bytes() + headers + built_for.encode()).hexdigest()[:16]
    out = cache_folder() / f"{name}-{digest}.so"
    failed_log = out.with_suffix(".failed.log")
    if failed_log.is_file():
        _off[name] = f"building {source.name} with {compiler} failed (log: {failed_log})"
        return None
    if not out.is_file():
        try:
            failed = _build(compiler, source, out)
        except OSError as exc:  # the cache folder cannot be written
            failed = f"{out.parent}: {exc}"
        if failed is not None:
            try:
                write_atomically(failed_log, failed.encode())
                where = f"log: {failed_log}"
            except OSError:
                where = "its log could not be kept"
            _off[name] = f"building {source.name} with {compiler} failed ({where})"
            print(f"offload: {_off[name]}; torch's kernels run instead:\n{failed}", file=sys.stderr)
            return None
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as exc:  # a library this system cannot load
        _off[name] = f"loading {out} failed ({exc})"
        print(f"offload: {_off[name]}; torch's kernels run instead", file=sys.stderr)
        return None
    _loaded[name] = out.name
    _off.pop(name, None)
    return lib


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holding `data`, written through a temporary name in its folder, so that no reader sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, path)


def _build(compiler: str, source: Path, out: Path) -> str | None:
    """Compile `source` into `out` through a temporary name; what went wrong, or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        built = Path(work) / out.name
        try:
            run = subprocess.run(
                [compiler, *FLAGS, "-o", str(built), str(source)], capture_output=True, text=True, timeout=300
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return str(exc)
        if run.returncode != 0:
            return run.stderr
        os.replace(built, out)
    return None


def bind(name: str, symbol: str, argtypes: list, restype: type | None = None) -> ctypes._CFuncPtr | None:
    """Function `symbol` of library `name` taking `argtypes` and returning `restype` (None: nothing), or None where it
    cannot run."""
    lib = library(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, restype
    return fn
