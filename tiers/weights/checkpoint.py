"""Checkpoints read tensor by tensor, by file extent; the whole file is never loaded.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON naming each tensor's
dtype, shape and [begin, end) byte range relative to the end of the header, then the data.

A GGUF file run in place has a model directory of its metadata only (offload/gguf/in_place.py writes it): config.json,
the tokenizer, and GGUF_INDEX naming each tensor's extent in the GGUF file under its Hugging Face name. Float
tensors are read as stored; a matrix in GGUF's blocks is read as uint8 [rows, K / 32, block bytes]
(kernels/gguf_linear.py multiplies it), which a TensorSpec of dtype GGUF_BLOCKS accepts.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from offload.common.errors import OffloadError
from offload.tiers.io.buffered import BufferedReader

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header

# safetensors dtype code -> (torch dtype, bytes per element)
TORCH_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F64": (torch.float64, 8),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
FLOAT_CODES = ("F32", "F16", "BF16")
GGUF_INDEX = "gguf_index.json"  # {"source": path, "size": bytes, "tensors": {name: [offset, nbytes, code, shape]}}
GGUF_BLOCKS = "GGUF"  # a TensorSpec dtype: any float as stored, or GGUF blocks of a type below
GGUF_BLOCK_BYTES = (18, 20, 34)  # Q4_0, Q4_1, Q8_0: 32 values a block


def held_dtype(code: str, compute: torch.dtype) -> torch.dtype:
    """The dtype a tensor stored as `code` is computed with: floats in the compute dtype, integers (quantized
    weights) as stored."""
    stored = TORCH_DTYPES[code][0]
    return compute if stored.is_floating_point else stored


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A checkpoint tensor a model family needs: its name in the checkpoint, the shape it must have, and its dtype
    (a safetensors code; None: any float, converted to the compute dtype). With `row`, it is that row of the stacked
    tensor `name` ([rows, *shape]: one expert of gpt-oss's experts stored together), read alone."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None = None
    row: int | None = None


TensorGroup = dict[str, TensorSpec]  # short name (e.g. "q_proj") -> the checkpoint tensor


class ModelTensors(NamedTuple):
    """Every tensor a model reads, by the group it is loaded and streamed as. With tied embeddings the head
    group holds only the final norm (the embedding serves as the LM head)."""

    embed: TensorGroup
    head: TensorGroup
    layers: tuple[TensorGroup, ...]


@dataclass(frozen=True, slots=True)
class Extent:
    """Where one tensor's bytes lie in a file."""

    name: str
    path: Path
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]


def _parse_header(reader: BufferedReader, path: Path) -> dict[str, Extent]:
    file_size = reader.size(path)
    if file_size < 8:
        raise OffloadError(f"{path}: truncated: {file_size} bytes, not a safetensors file")
    (header_len,) = struct.unpack("<Q", reader.read(path, 0, 8))
    if header_len > min(MAX_HEADER_BYTES, file_size - 8):
        raise OffloadError(f"{path}: truncated or corrupt: header of {header_len} bytes in a {file_size}-byte file")
    try:
        header = json.loads(reader.read(path, 8, header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OffloadError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise OffloadError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    extents = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        extents[name] = _extent(path, name, info, data_start, file_size)
    return extents


def _extent(path: Path, name: str, info: object, data_start: int, file_size: int) -> Extent:
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise OffloadError(f"{path}: tensor {name}: malformed header entry {info!r}") from None
    if dtype not in TORCH_DTYPES:
        raise OffloadError(f"{path}: tensor {name}: unsupported dtype {dtype!r}")
    nbytes = math.prod(shape) * TORCH_DTYPES[dtype][1]
    if end - begin != nbytes or begin < 0:
        raise OffloadError(f"{path}: tensor {name}: byte range {begin}..{end} does not hold {dtype} {list(shape)}")
    if data_start + end > file_size:
        raise OffloadError(
            f"{path}: truncated: tensor {name} ends at byte {data_start + end}, the file has {file_size}"
        )
    return Extent(name, path, data_start + begin, nbytes, dtype, shape)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise OffloadError(f"{index}: not a safetensors index ({exc})") from None
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise OffloadError(f"{f}: weight file listed in {INDEX_FILE} is missing")
        return files
    if (model_dir / SINGLE_FILE).exists():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise OffloadError(f"{model_dir}: no *.safetensors weight files (only safetensors checkpoints are read)")
    return files


class Checkpoint:
    """Every tensor of a model directory's safetensors files, by extent; data is read on demand."""

    def __init__(self, model_dir: Path, reader: BufferedReader) -> None:
        self.model_dir = model_dir
        self.reader = reader
        self.extents: dict[str, Extent] = {}
        if (model_dir / GGUF_INDEX).is_file():
            self.extents = gguf_extents(model_dir)
            return
        for path in _weight_files(model_dir):
            self.extents.update(_parse_header(reader, path))

    def __contains__(self, name: str) -> bool:
        return name in self.extents

    def extent(self, name: str) -> Extent:
        try:
            return self.extents[name]
        except KeyError:
            raise OffloadError(f"{self.model_dir}: checkpoint has no tensor {name!r}") from None

    def check(self, name: str, shape: tuple[int, ...], dtype: str | None = None, row: int | None = None) -> Extent:
        """The extent of `name` (of its row `row`: the tensor's first dimension stacks rows of `shape`), verified to
        be a tensor of `shape` stored as `dtype` (None: any float)."""
        ext = self.extent(name)
        if row is not None:
            if ext.shape[1:] != shape or not 0 <= row < (ext.shape[0] if ext.shape else 0):
                raise OffloadError(
                    f"{ext.path.name}: tensor {name} has shape {list(ext.shape)}, expected rows of {list(shape)} "
                    f"and a row {row}"
                )
            size = ext.nbytes // ext.shape[0]
            ext = Extent(f"{name}[{row}]", ext.path, ext.offset + row * size, size, ext.dtype, shape)
        if dtype == GGUF_BLOCKS and ext.dtype == "U8":  # blocks of 32 values along the last dimension
            if len(shape) != 2 or shape[1] % 32 or ext.shape[:2] != (shape[0], shape[1] // 32):
                raise OffloadError(f"{ext.path.name}: tensor {name} in blocks does not hold a {list(shape)} matrix")
            if ext.shape[2:] not in ((b,) for b in GGUF_BLOCK_BYTES):
                raise OffloadError(f"{ext.path.name}: tensor {name} has blocks of {ext.shape[2:]} bytes")
            return ext
        if ext.shape != shape:
            raise OffloadError(f"{ext.path.name}: tensor {name} has shape {list(ext.shape)}, expected {list(shape)}")
        if dtype == GGUF_BLOCKS:
            dtype = None
        if dtype is not None and ext.dtype != dtype:
            raise OffloadError(f"{ext.path.name}: tensor {name} has dtype {ext.dtype}, expected {dtype}")
        if dtype is None and ext.dtype not in FLOAT_CODES:
            raise OffloadError(
                f"{ext.path.name}: tensor {name} has dtype {ext.dtype}, expected one of {', '.join(FLOAT_CODES)}"
            )
        return ext

    def read(self, ext: Extent) -> torch.Tensor:
        """The tensor at `ext`, in its stored dtype, on the CPU."""
        buf = self.reader.read(ext.path, ext.offset, ext.nbytes)
        dtype = TORCH_DTYPES[ext.dtype][0]
        if ext.nbytes == 0:
            return torch.empty(ext.shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(ext.shape)


def gguf_extents(model_dir: Path) -> dict[str, Extent]:
    """The extents a GGUF index names, in its source file, checked against that file's size."""
    index = model_dir / GGUF_INDEX
    try:
        data = json.loads(index.read_text())
        source, size = Path(data["source"]), int(data["size"])
        tensors = {n: Extent(n, source, int(o), int(b), c, tuple(s)) for n, (o, b, c, s) in data["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OffloadError(f"{index}: not a GGUF index ({exc})") from None
    try:
        found = source.stat().st_size
    except OSError:
        raise OffloadError(f"{index}: its GGUF file {source} is missing") from None
    if found != size:
        raise OffloadError(f"{source}: {found} bytes, not the {size} its index {index} was made from")
    return tensors


FINGERPRINT_SAMPLES = 16  # 4 KiB reads spread over each weight file


def weights_fingerprint(model_dir: Path) -> str:
    """A digest naming the checkpoint's weights: config.json, and each weight file's name, size, header and
    FINGERPRINT_SAMPLES small extents spread over its data. A fine-tuned copy of the same shapes differs in the
    samples; reading them costs 64 KiB per file, not the whole checkpoint."""
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    if (model_dir / GGUF_INDEX).is_file():  # its source's key (size, metadata, samples) and extents
        digest.update((model_dir / GGUF_INDEX).read_bytes())
        return digest.hexdigest()
    for path in _weight_files(model_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(min(header_len, MAX_HEADER_BYTES)))
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(i * max(size - 4096, 0) // max(FINGERPRINT_SAMPLES - 1, 1))
                digest.update(f.read(4096))
    return digest.hexdigest()


def indexed_source(folder: Path) -> Path | None:
    """The GGUF file an in-place folder's index names (None where it cannot be read)."""
    try:
        return Path(json.loads((folder / GGUF_INDEX).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
