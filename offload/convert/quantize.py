"""`offload convert`: a float checkpoint -> a weight-quantized one the engine runs directly, streamed or resident.

The output is a model directory: config.json with a `quantization_config` of method "offload", the tokenizer and
generation files copied, safetensors shards whose every tensor starts on a 4 KiB boundary (the NVMe tier reads them
with O_DIRECT, no bounce; "__pad__.N" byte tensors fill the gaps, so the files stay valid safetensors), and
MANIFEST (offload-quant.json): the source's weights fingerprint, the format, how this torch packs int4 codes for
its CPU kernel, each file's size and SHA-256 and each tensor's CRC-32.

Tensors are read, quantized and written one at a time (memory: a few copies of the largest tensor), into a
temporary folder beside the output that is renamed into place when every file is written, synced and read back
against its checksums: an interrupted or failed conversion leaves no output directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.common.errors import OffloadError
from offload.common.model_config import ModelSpec, read_config
from offload.common.quant import QUANT_METHOD, WeightQuant
from offload.convert.staging import STAGING_MARK, sigterm_unwinds, sweep_staged
from offload.kernels.quant_linear import SCALES_SUFFIX, cpu_pack_probe, to_cpu_layout
from offload.kernels.quant_matmul import QUANT_METHODS
from offload.model.loader import load_spec
from offload.model.registry import model_tensors, quantized_tensors
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import (
    INDEX_FILE,
    TORCH_DTYPES,
    Checkpoint,
    ModelTensors,
    TensorSpec,
    gguf_extents,
    weights_fingerprint,
)

MANIFEST = "offload-quant.json"
FORMAT = 1
ALIGN = 4096  # bytes; every tensor's first byte, from the start of its file
SHARD_BYTES = 4 << 30  # a shard is closed once it holds this much
COPIED = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
          "generation_config.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")  # fmt: skip
CODES = {dtype: code for code, (dtype, _) in TORCH_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class Planned:
    """One output tensor: where it comes from and how it is made."""

    name: str  # in the output checkpoint
    source: TensorSpec  # the source tensor it is made from
    dtype: str  # safetensors code of what is written
    shape: tuple[int, ...]
    part: str  # "copy" | "codes" | "scales"

    @property
    def nbytes(self) -> int:
        n = TORCH_DTYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class ConvertStats:
    out: Path
    quant: WeightQuant | None  # None: gpt-oss's experts in MXFP4 (offload/convert/mxfp4_experts.py)
    tensors_quantized: int
    tensors_copied: int
    source_bytes: int  # bytes of the tensors read from the source
    bytes_written: int  # bytes of the output's weight files


def convert(model_dir: Path, out: Path, quant: WeightQuant, method: str = "rtn") -> ConvertStats:
    """Write `quant`'s conversion of the float checkpoint in `model_dir` to the new directory `out`. `method`: how
    int4 codes are chosen (kernels/quant_matmul.py's quantize: "rtn" round to nearest, "search" least error)."""
    if method not in QUANT_METHODS:
        raise OffloadError(f"--method must be one of {', '.join(QUANT_METHODS)}, got {method!r}")
    if method != "rtn" and quant.bits != 4:
        raise OffloadError(f"--method {method} chooses int4 codes; int8 is rounded to nearest (--method rtn)")
    spec, family = load_spec(model_dir)
    if spec.quant is not None:
        raise OffloadError(f"{model_dir / 'config.json'}: already quantized ({spec.quant.name}); convert a float model")
    check_new(out)
    tensors = model_tensors(family, spec)
    if any(t.row is not None for group in tensors.layers for t in group.values()):
        raise OffloadError(
            f"{model_dir / 'config.json'}: {spec.architecture} stores its experts stacked; --quant int4|int8 does not "
            "write them (gpt-oss: --quant mxfp4 does)"
        )
    store_dtype = getattr(torch, spec.dtype)  # scales and float tensors keep the model's declared dtype
    plan = _plan(tensors, quant, CODES[store_dtype])
    with BufferedReader() as reader, staged(out) as work:
        source = Source(
            Checkpoint(model_dir, reader),
            lambda w, p: _make(w, quant, store_dtype, method, quantized=p.part != "copy"),
        )
        for p in plan:
            source.checkpoint.check(p.source.name, p.source.shape)
        files, crcs = write_weights(work, plan, source.part)
        _write_config(model_dir, work, quant)
        manifest = {
            "format": FORMAT,
            "source": str(model_dir.resolve()),
            "source_fingerprint": weights_fingerprint(model_dir),
            "quant": {"bits": quant.bits, "group_size": quant.group_size, "layout": quant.layout, "method": method},
            "cpu_pack_probe": cpu_pack_probe() if quant.layout == "cpu" and quant.bits == 4 else None,
            "files": files,
            "tensors": crcs,
        }
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1))
    quantized = sum(p.part == "codes" for p in plan)
    return ConvertStats(
        out,
        quant,
        quantized,
        sum(p.part == "copy" for p in plan),
        source.read_bytes,
        sum(f["size"] for f in files.values()),
    )


def check_new(out: Path) -> None:
    if out.exists():
        raise OffloadError(f"--out {out}: already exists (choose a new directory; nothing is overwritten)")


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` to write a model into. When the block ends, its weight files are read back
    against MANIFEST (which the block writes), synced, and the folder renamed to `out`; on any error it is removed,
    so an interrupted or failed write leaves no output directory. SIGTERM during the block (in the main thread) is
    such an error, the signal delivered again once the folder is gone; what a process killed outright leaves, its
    id in the folder's name says, and the next `staged` beside it (or `sweep_staged`) removes."""
    check_new(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_staged(out.parent)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGING_MARK}{os.getpid()}-", dir=out.parent))
    with sigterm_unwinds(out):
        try:
            yield work
            verify(work)
            _fsync_dir(work)
            os.rename(work, out)
            _fsync_dir(out.parent)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise


class Source:
    """The parts a conversion's plan names, made from a float checkpoint: each source tensor read once, and `make`
    (the tensor read, the planned part asked for first) turning it into every part written from it (its copy, or its
    codes and scales)."""

    def __init__(
        self, checkpoint: Checkpoint, make: Callable[[torch.Tensor, Planned], dict[str, torch.Tensor]]
    ) -> None:
        self.checkpoint, self.make = checkpoint, make
        self.read_bytes = 0  # of the source tensors
        self._made: dict[str, dict[str, torch.Tensor]] = {}

    def part(self, p: Planned) -> torch.Tensor:
        if p.source.name not in self._made:
            ext = self.checkpoint.extent(p.source.name)
            w = self.checkpoint.read(ext)
            self.read_bytes += ext.nbytes
            self._made = {p.source.name: self.make(w, p)}
        return self._made[p.source.name][p.part]


def write_weights(
    work: Path, plan: list[Planned], part: Callable[[Planned], torch.Tensor]
) -> tuple[dict[str, dict], dict[str, int]]:
    """Write `plan`'s tensors, in order, into aligned safetensors shards in `work` (and their index when there is
    more than one); `part(p)` gives each tensor's data. Returns MANIFEST's "files" (each file's size and SHA-256)
    and "tensors" (each tensor's CRC-32)."""
    shards = _shards(plan)
    files, crcs = {}, {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        files[name], shard_crcs = _write_shard(work / name, shard, part)
        crcs.update(shard_crcs)
    if len(shards) > 1:
        weight_map = {p.name: name for name, shard in zip(files, shards, strict=True) for p in shard}
        (work / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return files, crcs


def _plan(tensors: ModelTensors, quant: WeightQuant, float_code: str) -> list[Planned]:
    """Every output tensor, in checkpoint order: the layers' tensors as the engine reads a `quant` checkpoint
    (offload.model.registry.quantized_tensors names them), the embedding and head copied."""
    plan = [Planned(t.name, t, float_code, t.shape, "copy") for t in tensors.embed.values()]
    for group in tensors.layers:
        for short, t in quantized_tensors(group, quant).items():
            if short.endswith(SCALES_SUFFIX):
                plan.append(Planned(t.name, group[short.removesuffix(SCALES_SUFFIX)], float_code, t.shape, "scales"))
            elif t.name != group[short].name:
                plan.append(Planned(t.name, group[short], t.dtype, t.shape, "codes"))
            else:
                plan.append(Planned(t.name, t, float_code, t.shape, "copy"))
    return plan + [Planned(t.name, t, float_code, t.shape, "copy") for t in tensors.head.values()]


def _shards(plan: list[Planned]) -> list[list[Planned]]:
    shards, current, size = [], [], 0
    for p in plan:
        if current and size + p.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(p)
        size += -(-p.nbytes // ALIGN) * ALIGN
    return shards + [current] if current else shards


def _header(shard: list[Planned]) -> tuple[bytes, list[int]]:
    """The safetensors header of `shard` (padded so data starts at a multiple of ALIGN) and each tensor's data
    offset; the gaps before aligned tensors are "__pad__.N" uint8 tensors (safetensors wants no holes)."""
    entries, offsets, at = {}, [], 0
    for i, p in enumerate(shard):
        if at % ALIGN:
            pad = ALIGN - at % ALIGN
            entries[f"__pad__.{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [at, at + pad]}
            at += pad
        entries[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [at, at + p.nbytes]}
        offsets.append(at)
        at += p.nbytes
    entries["__metadata__"] = {"format": "pt", "quant_method": QUANT_METHOD}
    raw = json.dumps(entries, separators=(",", ":")).encode()
    length = -(-(8 + len(raw)) // ALIGN) * ALIGN - 8  # data starts on an ALIGN boundary
    return struct.pack("<Q", length) + raw + b" " * (length - len(raw)), offsets


def _write_shard(
    path: Path, shard: list[Planned], part: Callable[[Planned], torch.Tensor]
) -> tuple[dict, dict[str, int]]:
    """Write one shard; returns its manifest entry and each tensor's CRC-32."""
    header, offsets = _header(shard)
    digest, crcs = hashlib.sha256(), {}
    with path.open("wb") as f:
        f.write(header)
        digest.update(header)
        start = len(header)
        for p, offset in zip(shard, offsets, strict=True):
            data = part(p).contiguous()
            assert data.dtype == TORCH_DTYPES[p.dtype][0] and tuple(data.shape) == p.shape, (p, data.shape)
            # the tensor's own bytes, not a copy of them (a copy doubled a float32 token table's gigabyte)
            raw = memoryview(data.view(torch.uint8).numpy()).cast("B") if data.numel() else b""
            pad = start + offset - f.tell()
            f.write(b"\0" * pad)
            digest.update(b"\0" * pad)
            f.write(raw)
            digest.update(raw)
            crcs[p.name] = zlib.crc32(raw)
        f.flush()
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}, crcs


def _make(
    w: torch.Tensor, quant: WeightQuant, store_dtype: torch.dtype, method: str, quantized: bool
) -> dict[str, torch.Tensor]:
    """The parts written for source tensor `w` [N, K]: its float copy, or its codes and scales."""
    from offload.kernels.quant_matmul import quantize

    if not quantized:
        return {"copy": w.to(store_dtype)}
    codes, scales = quantize(w.float(), quant.bits, quant.group(w.shape[1]), dtype=store_dtype, method=method)
    return {"codes": to_cpu_layout(codes, quant.bits) if quant.layout == "cpu" else codes, "scales": scales}


def _write_config(model_dir: Path, work: Path, quant: WeightQuant) -> None:
    fields = {"quant_method": QUANT_METHOD, "bits": quant.bits, "group_size": quant.group_size, "layout": quant.layout}
    write_config(model_dir, work, fields)


def write_config(model_dir: Path, work: Path, quantization_config: dict) -> None:
    """`model_dir`'s config.json with `quantization_config`, and its tokenizer files, into `work`."""
    config = read_config(model_dir)
    config["quantization_config"] = quantization_config
    (work / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, work / name)


def verify(model_dir: Path) -> None:
    """Read every weight file of a converted directory back against MANIFEST's sizes and SHA-256; an OffloadError
    names the first file that differs."""
    manifest = read_manifest(model_dir)
    for name, entry in manifest["files"].items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != entry["size"]:
            size = path.stat().st_size if path.is_file() else "no"
            raise OffloadError(f"{path}: {size} bytes, {MANIFEST} says {entry['size']}: truncated or replaced")
        if file_sha256(path) != entry["sha256"]:
            raise OffloadError(f"{path}: SHA-256 differs from {MANIFEST}: the file is corrupt")


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read 16 MiB at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(model_dir: Path) -> dict:
    path = model_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise OffloadError(f"{path}: missing (a quantized checkpoint is made by `offload convert`)") from None
    except json.JSONDecodeError as exc:
        raise OffloadError(f"{path}: not valid JSON ({exc})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise OffloadError(f"{path}: not an offload-quant manifest of format {FORMAT}")
    return manifest


def check_runnable(model_dir: Path, spec: ModelSpec, device: torch.device) -> None:
    """Refuse a converted checkpoint that cannot run here, before any weight is read: missing or truncated files,
    the cpu layout on another device, or int4 codes packed by a torch whose CPU packing differs from this one's; a
    GGUF run in place whose file is missing or changed. A float checkpoint passes."""
    quant = spec.quant
    if quant is None:
        return
    if quant.layout == "gguf":  # a GGUF file run in place: its index names the file, which must be as indexed
        gguf_extents(model_dir)
        return
    manifest = read_manifest(model_dir)
    for name, entry in manifest["files"].items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != entry["size"]:
            raise OffloadError(f"{path}: missing or not the {entry['size']} bytes {MANIFEST} lists: convert again")
    if quant.layout == "cpu" and device.type != "cpu":
        raise OffloadError(
            f"{model_dir}: converted in the cpu layout ({quant.name}), which only the CPU multiplies; on {device} "
            "convert again with --layout triton"
        )
    probe = manifest.get("cpu_pack_probe")
    if quant.layout == "cpu" and quant.bits == 4 and probe != cpu_pack_probe():
        raise OffloadError(
            f"{model_dir / MANIFEST}: its int4 codes were packed by a torch whose CPU packing differs from this one's "
            f"(torch {torch.__version__}): convert again here"
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
