"""The model directory a command's --model names: a directory as it is; a GGUF file run in place where it can be
(offload/gguf/in_place.py: a folder of its metadata in the cache, the weights read from the file), else its import
(offload/gguf/importer.py), made once in the cache and reused."""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import sys
import time
from pathlib import Path

from offload.common.errors import OffloadError
from offload.common.paths import cache_dir
from offload.common.progress import decimal_size
from offload.convert.quantize import MANIFEST
from offload.convert.staging import sweep_staged
from offload.gguf import importer
from offload.gguf.importer import local_layout, source_key
from offload.gguf.in_place import in_place_refusal, write_index
from offload.gguf.metadata import check_magic, open_gguf
from offload.tiers.weights.checkpoint import GGUF_INDEX, indexed_source

IN_PLACE = "gguf"  # the layout name in an in-place folder's name and key
# the in-place folder's format in its key: a folder of another (an earlier config.json) is made again beside it.
# 2: quantization_config says at how many bits the token table and head are held
IN_PLACE_FORMAT = 2


def resolve_model(model: str | Path, in_place: bool = True) -> Path:
    """The model directory `model` names: a directory as it is; a GGUF file's folder in the cache (cache_dir()/gguf):
    run in place where `in_place` and the file allow it, else imported on first use in the layout this machine
    multiplies (triton with CUDA, else cpu). What an import killed outright left there is removed first
    (offload/convert/staging.py's `sweep_staged`)."""
    path = Path(model).expanduser()
    if not path.is_file():
        return path
    check_magic(path)  # a file that is not GGUF is said as such; the rest reads the rest
    folder = cache_dir() / "gguf"
    if folder.is_dir():
        sweep_staged(folder)
    if in_place:
        out = folder / f"{path.stem}-{IN_PLACE}-{source_key(path, f'{IN_PLACE}.{IN_PLACE_FORMAT}')}"
        if (out / GGUF_INDEX).is_file():
            if indexed_source(out) == path.resolve():
                return out
            shutil.rmtree(out, ignore_errors=True)  # the same bytes moved or copied here: index this file instead
        reader = open_gguf(path)
        refusal = in_place_refusal(reader, path)
        if refusal is None:
            try:
                write_index(reader, path, out, out.name.rsplit("-", 1)[1])
            except (OffloadError, OSError):
                if (out / GGUF_INDEX).is_file():  # another process wrote it meanwhile
                    return out
                raise
            return out
        return _imported(path, f"{path} cannot run in place ({refusal}): it is imported instead\n")
    return _imported(path, "")


def _imported(path: Path, why: str) -> Path:
    """GGUF file `path` imported into the cache, once (`why` said first)."""
    layout = local_layout()
    out = cache_dir() / "gguf" / f"{path.stem}-{layout}-{source_key(path, layout)}"
    if (out / MANIFEST).is_file():
        return out
    print(why, end="", file=sys.stderr)
    print(
        f"importing  {path} ({decimal_size(path.stat().st_size)}) into {out.parent} once; later runs reuse it",
        file=sys.stderr,
    )
    start = time.perf_counter()
    try:
        stats = importer.import_gguf(path, out, layout)
    except (OffloadError, OSError):
        if (out / MANIFEST).is_file():  # another process imported it meanwhile
            return out
        raise
    print(
        f"imported   {path} in {time.perf_counter() - start:.1f} s -> {out} (once; later runs reuse it)\n"
        + stats.summary(),
        file=sys.stderr,
    )
    with contextlib.suppress(OSError, AttributeError):  # the heap the import freed, back to the system (glibc)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return out
