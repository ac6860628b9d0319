"""A GGUF file run in place: a model directory of its metadata only, the weights read from the file where they lie.

Where every tensor the engine reads is float or in blocks kernels/gguf_linear.py multiplies (Q4_0, Q4_1, Q8_0), and
the architecture needs nothing joined or repacked (offload/gguf/families.py), `write_index` writes config.json (the
"gguf" weight layout: offload/common/quant.py), the tokenizer and tiers/weights/checkpoint.py's GGUF_INDEX: each
tensor's Hugging Face name with its extent in the file (a mixture's expert, its slice of the stacked tensor). A few
hundred KiB, written in a second; nothing of the weights is copied, so bytes read per token are the file's bytes for
those tensors, and the first token waits for no import. llama.cpp's permuted q and k rows stay as they lie: the
model puts their products back in Hugging Face's order (quantization_config.interleaved_qk).

Any other file (Q4_K, Q6_K and the other types, DeepSeek, gpt-oss) is imported into a model directory instead
(offload/gguf/importer.py), as `in_place_refusal` says why.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, ReaderTensor

from offload.common.errors import OffloadError
from offload.common.model_config import parse_model_config
from offload.common.quant import QUANT_METHOD
from offload.convert.staging import STAGING_MARK, sigterm_unwinds, sweep_staged
from offload.gguf.codes import FLOATS
from offload.gguf.families import joined_tensors
from offload.gguf.importer import QUANTIZED_COMPUTE_DTYPE, float_dtype
from offload.gguf.metadata import PERMUTED, architecture, gguf_source, hf_config
from offload.gguf.tokenizer import write_tokenizer
from offload.model.registry import get_family, model_tensors
from offload.tiers.weights.checkpoint import GGUF_INDEX
from offload.tiers.weights.embedding import HEAD, TABLE

BLOCKS = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34}  # the block types read in place, and their bytes a block of 32
IN_PLACE = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")  # architectures with nothing joined or repacked


def in_place_refusal(reader: GGUFReader, path: Path) -> str | None:
    """Why the file cannot run in place (it is imported instead), or None where it can."""
    try:
        _index(reader, path)
    except _NotInPlace as why:
        return str(why)
    return None


def in_place_config(reader: GGUFReader, path: Path) -> dict | None:
    """config.json of the file run in place, from its header alone; None where it is imported instead."""
    try:
        return _index(reader, path)[0]
    except _NotInPlace:
        return None


def write_index(reader: GGUFReader, path: Path, out: Path, key: str) -> None:
    """The model directory `out` for GGUF file `path` run in place: config.json, the tokenizer, GGUF_INDEX; written
    into a temporary folder beside it and renamed into place (a SIGTERM or an error leaves no `out`)."""
    config, tensors = _index(reader, path)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_staged(out.parent)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}{STAGING_MARK}{os.getpid()}-", dir=out.parent))
    with sigterm_unwinds(out):
        try:
            (work / "config.json").write_text(json.dumps(config, indent=2))
            write_tokenizer(path, work, reader)
            index = {"source": str(path.resolve()), "size": path.stat().st_size, "key": key, "tensors": tensors}
            (work / GGUF_INDEX).write_text(json.dumps(index))
            os.rename(work, out)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise


class _NotInPlace(Exception):
    """The file needs the import (the message says why)."""


def _index(reader: GGUFReader, path: Path) -> tuple[dict, dict[str, list]]:
    """config.json and every tensor's [offset, bytes, code, shape] by Hugging Face name; _NotInPlace where the
    file cannot run as it lies."""
    arch = architecture(reader, path)
    if arch not in IN_PLACE:
        raise _NotInPlace(f"architecture {arch!r} is imported (in place: {', '.join(IN_PLACE)})")
    stored = {t.name: t for t in reader.tensors}
    quantized = any(t.tensor_type not in FLOATS for t in reader.tensors)
    config = hf_config(reader, path, QUANTIZED_COMPUTE_DTYPE if quantized else float_dtype(reader))
    spec = parse_model_config(config, str(path), name=path.stem)
    family = get_family(config["architectures"][0], str(path))
    family.check(spec, str(path))
    if joined_tensors(arch, stored, spec, path):
        raise _NotInPlace(f"{arch}: tensors llama.cpp split or repacked are joined by the import")
    wanted = model_tensors(family, spec)
    tensors, read, floats, bits = {}, set(), [], [0, 0]  # bits: stored bits and weights of the quantized matrices
    for group in (wanted.embed, wanted.head, *wanted.layers):
        for short, t in group.items():
            name, expert = gguf_source(t.name, stored)
            if name not in stored:
                raise OffloadError(f"{path}: no tensor {name!r} (the engine reads it as {t.name})")
            g = stored[name]
            tensors[t.name] = _extent(g, expert, t.shape, path)
            read.add(name)
            if short.endswith("_proj") and g.tensor_type in FLOATS:
                floats.append(t.name)
            elif short.endswith("_proj"):
                bits[0] += tensors[t.name][1] * 8
                bits[1] += math.prod(t.shape)
    held = {}  # bits a weight of the token table and the head as the engine holds them, where they are blocks
    for field, group, short in (("embed_bits", wanted.embed, TABLE), ("head_bits", wanted.head, HEAD)):
        t = group.get(short)
        if t is not None and stored[gguf_source(t.name, stored)[0]].tensor_type not in FLOATS:
            held[field] = round(tensors[t.name][1] * 8 / math.prod(t.shape), 4)
    unread = sorted(set(stored) - read - {"rope_freqs.weight"})  # Llama 3's rope factors are in config.json
    if unread:
        raise _NotInPlace(f"tensor {unread[0]!r} is not read in place ({len(unread)} unread)")
    if quantized:
        config["quantization_config"] = {
            "quant_method": QUANT_METHOD, "bits": 4, "group_size": 32, "layout": "gguf",
            "unquantized": sorted(floats), "interleaved_qk": arch in PERMUTED,
            "stored_bits": round(bits[0] / bits[1], 4) if bits[1] else 0.0, **held,
        }  # fmt: skip
    return config, tensors


def _extent(g: ReaderTensor, expert: int | None, shape: tuple[int, ...], path: Path) -> list:
    """[offset, bytes, code, shape] of GGUF tensor `g` (its expert `expert` of the stack) read as a `shape` tensor:
    float as stored, or blocks [rows, K / 32, block bytes]."""
    qtype = T(g.tensor_type)
    dims = [int(d) for d in reversed(g.shape)]  # numpy order: [(experts,) rows, columns]
    if expert is not None:
        dims = dims[1:]
    nbytes = int(g.n_bytes) // (int(g.shape[2]) if expert is not None else 1)
    offset = int(g.data_offset) + (expert or 0) * nbytes
    if math.prod(dims) != math.prod(shape) or dims[-1] != shape[-1]:
        raise OffloadError(f"{path}: tensor {g.name!r} has shape {dims}, the engine reads {list(shape)}")
    if qtype in FLOATS:
        return [offset, nbytes, FLOATS[qtype], list(shape)]
    if qtype not in BLOCKS or len(shape) != 2:
        raise _NotInPlace(f"tensor {g.name!r} is {qtype.name}, which is not read in place (Q4_0, Q4_1, Q8_0 are)")
    return [offset, nbytes, "U8", [shape[0], shape[1] // 32, BLOCKS[qtype]]]
