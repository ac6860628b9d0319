"""`offload convert --model FILE.gguf`: a llama.cpp GGUF file -> a model directory the engine runs, its quantized
matrices kept bit for bit where the engine's formats hold them (offload/gguf/codes.py).

The checkpoint has one weight format (config.json's quantization_config), int4 in groups of 32, chosen when any
decoder-layer matrix is 4-bit or less: Q4_0, Q4_1 and Q4_K become its codes and scales exactly (bar the zero points
float32 cannot hold, counted; Q4_0's scales, its float16 d with zero points of 0, are written in float16); other
types of 5 bits or less (Q5_*, Q2_K, Q3_K, IQ*, ...) are dequantized and requantized to it, their error recorded.
A matrix the format cannot hold exactly (Q8_0, Q6_K, F16, ...) stays float, listed in quantization_config.unquantized:
quantized types as gguf.quants.dequantize gives them in float32, float
types as stored. Where no layer matrix is 4-bit, the triton layout takes int8 in groups of 32 (Q8_0 exactly, Q6_K
requantized); the cpu layout's int8 has one scale per output channel, which holds neither, so there they stay
float. Embeddings, norms and the LM head are float as the engine reads them: quantized ones dequantized to float32.
A mixture's routed experts, stacked in the file, are written one matrix per expert (offload/gguf/metadata.py's
`gguf_source` names each one's slice), so the engine reads and streams them by expert. What llama.cpp's converter
split or repacked is joined back (offload/gguf/families.py): deepseek2's kv_b_proj, and gpt-oss's experts, MXFP4
as published (config.json's quantization_config "mxfp4", every other tensor float).

The output is written as `offload convert`'s is (offload/convert/quantize.py): aligned safetensors, MANIFEST with
checksums and, per tensor, what was kept and what it cost, a temporary folder renamed into place. A command given the
GGUF file itself runs it in place where it can (offload/gguf/resolve.py), else its import, made once in the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, ReaderTensor
from gguf import quants as gguf_quants

from offload.common.errors import OffloadError
from offload.common.model_config import parse_model_config
from offload.common.progress import Progress, decimal_size
from offload.common.quant import QUANT_METHOD, WeightQuant
from offload.convert.quantize import FORMAT, MANIFEST, Planned, check_new, file_sha256, staged, write_weights
from offload.gguf.codes import (
    FLOATS,
    GROUP,
    INT4_EXACT,
    INT8_EXACT,
    engine_int4,
    engine_int8,
    float_tensor,
    int4_groups,
    int8_groups,
)
from offload.gguf.families import Joined, joined_tensors
from offload.gguf.kept import ImportStats, Kept
from offload.gguf.metadata import (
    ROPE_FACTORS,
    architecture,
    gguf_source,
    hf_config,
    open_gguf,
    rotary_row_order,
)
from offload.gguf.tokenizer import write_tokenizer
from offload.kernels.quant_linear import SCALES_SUFFIX, cpu_pack_probe, to_cpu_layout
from offload.model.registry import get_family, model_tensors
from offload.tiers.weights.checkpoint import TORCH_DTYPES, ModelTensors, TensorSpec

REQUANT_INT8 = (T.Q6_K,)  # more than 5 bits: int8 is the nearest engine format
# 5 bits or less: int4 groups of 32 are the nearest
REQUANT_INT4 = (
    *(T.Q5_0, T.Q5_1, T.Q5_K, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.TQ1_0, T.TQ2_0, T.MXFP4),
    *(T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S),
)
READ = (*FLOATS, *INT4_EXACT, *INT8_EXACT, *REQUANT_INT8, *REQUANT_INT4)
KEY_HEAD_BYTES = 8 << 20  # source_key digests this much of the file's start (metadata and tensor table) ...
KEY_SAMPLES = 16  # ... and this many 4 KiB extents spread over the rest
QUANTIZED_COMPUTE_DTYPE = "bfloat16"  # config.json's dtype for a quantized file: the default compute dtype (--dtype)
IMPORT_VERSION = 3  # part of the cache key: a change in what an import writes imports again
# block types whose engine scales are the file's float16 d and whose zero points are 0: their scales are written in
# float16, exactly, not float32 (a third of a 6-bit weight's bytes were its float32 scale and zero)
F16_SCALES = (T.Q4_0, T.Q8_0)


@dataclass(frozen=True, slots=True)
class _Model:
    """What an import writes, decided from the file's metadata and tensor table before any weight is read."""

    arch: str  # general.architecture
    config: dict  # config.json
    quant: WeightQuant | None  # the checkpoint's weight format (None: every matrix float)
    plan: list[Planned]  # the output tensors, each with the GGUF tensor it is made from
    experts: dict[str, int]  # weight name -> the expert it is of its GGUF tensor's stack (absent: the whole tensor)
    # checkpoint tensors made from several GGUF tensors or repacked (offload/gguf/families.py)
    joined: dict[str, Joined]


def import_gguf(path: Path, out: Path, layout: str) -> ImportStats:
    """Write the model in GGUF file `path` to the new directory `out`, its int4/int8 matrices in `layout`; on a
    terminal, the bytes written so far and the time left are shown on stderr (offload/common/progress.py)."""
    check_new(out)
    reader = open_gguf(path)
    model = _model(reader, path, layout)
    source = _Source({t.name: t for t in reader.tensors}, model)
    progress = Progress("importing", sum(p.nbytes for p in model.plan))

    def part(p: Planned) -> torch.Tensor:
        made = source.part(p)
        progress.advance(p.nbytes)
        return made

    try:
        with staged(out) as work:
            files, crcs = write_weights(work, model.plan, part)
            progress.say(f"{decimal_size(progress.total)} written; checking checksums")
            (work / "config.json").write_text(json.dumps(model.config, indent=2))
            write_tokenizer(path, work, reader)
            tensors = {n: dataclasses.asdict(k) for n, k in source.kept.items()}
            manifest = {
                "format": FORMAT,
                "source": str(path.resolve()),
                "source_sha256": file_sha256(path),
                "gguf": {"architecture": model.arch, "tensors": tensors},
                "quant": model.config.get("quantization_config"),
                "cpu_pack_probe": cpu_pack_probe() if model.quant is not None and layout == "cpu" else None,
                "files": files,
                "tensors": crcs,
            }
            (work / MANIFEST).write_text(json.dumps(manifest, indent=1))
    finally:
        progress.close()
    return ImportStats(out, model.quant, source.kept, path.stat().st_size, sum(f["size"] for f in files.values()))


def import_shape(reader: GGUFReader, path: Path, layout: str) -> tuple[dict, int]:
    """config.json as the import of `path` in `layout` writes it, and the bytes of the weight tensors it writes:
    from the metadata and the tensor table alone, nothing read of the weights nor written."""
    model = _model(reader, path, layout)
    return model.config, sum(p.nbytes for p in model.plan)


def local_layout() -> str:
    """The int4/int8 layout this machine multiplies: triton with CUDA, else cpu."""
    return "triton" if torch.cuda.is_available() else "cpu"


def _model(reader: GGUFReader, path: Path, layout: str) -> _Model:
    """The config, the weight format and the plan of the model in `reader`; every tensor of the file must be read."""
    arch = architecture(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    quantized = any(t.tensor_type not in FLOATS for t in reader.tensors)
    config = hf_config(reader, path, "float32" if quantized else float_dtype(reader))
    spec = parse_model_config(config, str(path), name=path.stem)
    family = get_family(config["architectures"][0], str(path))
    family.check(spec, str(path))
    joined = joined_tensors(arch, tensors, spec, path)
    layers = model_tensors(family, spec).layers
    # the projections `offload convert` would quantize: short names "*_proj" (Mixtral's experts' among them)
    proj = [t.name for g in layers for s, t in g.items() if s.endswith("_proj") and t.name not in joined]
    matrices = {name: _gguf(tensors, name, path)[0] for name in proj}
    # one weight format: gpt-oss's MXFP4 experts (quantization_config "mxfp4") leave the rest float
    quant = None if spec.mxfp4_experts else _format({n: T(g.tensor_type) for n, g in matrices.items()}, layout)
    if quant is not None:
        config["quantization_config"] = _quant_config(quant)
        spec = dataclasses.replace(spec, quant=quant)
    plan, experts = _plan(model_tensors(family, spec), tensors, joined, path, config["dtype"])
    if quantized:  # stored exactly, in float32; run by default in bfloat16, where torch's int4 CPU matmul is fast
        config["dtype"] = QUANTIZED_COMPUTE_DTYPE
    read = {p.source.name for p in plan} | {s for j in joined.values() for s in j.sources} | {ROPE_FACTORS}
    unused = sorted(set(tensors) - read)  # ROPE_FACTORS is read into config.json
    if unused:
        raise OffloadError(f"{path}: tensor {unused[0]!r} is not read by the engine's {arch} ({len(unused)} unread)")
    return _Model(arch, config, quant, plan, experts, joined)


def _gguf(tensors: dict[str, ReaderTensor], hf_name: str, path: Path) -> tuple[ReaderTensor, int | None]:
    """The GGUF tensor `hf_name` is read from, and its expert in that tensor's stack (None: all of it)."""
    name, expert = gguf_source(hf_name, tensors)
    if name not in tensors:
        raise OffloadError(f"{path}: no tensor {name!r} (the engine reads it as {hf_name})")
    g = tensors[name]
    if expert is not None and (len(g.shape) != 3 or expert >= int(g.shape[2])):
        raise OffloadError(f"{path}: tensor {name!r} of shape {list(reversed(g.shape))} has no expert {expert}")
    return g, expert


def float_dtype(reader: GGUFReader) -> str:
    """The dtype of a file without quantized tensors: its matrices' (float32 when they mix or are float32)."""
    kinds = {FLOATS[t.tensor_type] for t in reader.tensors if len(t.shape) > 1}
    if kinds == {"F16"}:
        return "float16"
    return "bfloat16" if kinds == {"BF16"} else "float32"


def _target(qtype: T) -> str:
    """The engine form a layer matrix of `qtype` wants alone: "int4", "int8" or "float"."""
    if qtype in FLOATS:
        return "float"
    if qtype in INT8_EXACT or qtype in REQUANT_INT8:
        return "int8"
    return "int4"


def _format(matrices: dict[str, T], layout: str) -> WeightQuant | None:
    """The checkpoint's one format, with the layer matrices it cannot hold listed as float (module docstring)."""
    targets = {name: _target(qtype) for name, qtype in matrices.items()}
    if "int4" in targets.values():
        bits = 4
    elif "int8" in targets.values() and layout == "triton":
        bits = 8
    else:
        return None
    wanted = "int4" if bits == 4 else "int8"
    unquantized = frozenset(n for n, t in targets.items() if t != wanted)
    return WeightQuant(bits, GROUP, layout, unquantized)


def _quant_config(quant: WeightQuant) -> dict:
    return {
        "quant_method": QUANT_METHOD,
        "bits": quant.bits,
        "group_size": quant.group_size,
        "layout": quant.layout,
        "unquantized": sorted(quant.unquantized),
    }


def _plan(
    read: ModelTensors, tensors: dict[str, ReaderTensor], joined: dict[str, Joined], path: Path, dtype: str
) -> tuple[list[Planned], dict[str, int]]:
    """Every tensor the engine reads, in its order, with the GGUF tensor it is made from; and each routed expert's
    weight name with its place in that tensor's stack. A joined tensor is planned once (gpt-oss's experts are rows
    of one)."""
    float_code = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    plan, experts, planned = [], {}, set()
    for group in (read.embed, *read.layers, read.head):
        for short, t in group.items():
            if t.name in joined:
                if t.name not in planned:
                    plan.append(joined[t.name].planned)
                    planned.add(t.name)
                continue
            weight = _weight_name(t.name)
            g, expert = _gguf(tensors, weight, path)
            qtype = T(g.tensor_type)
            if qtype not in READ:
                raise OffloadError(f"{path}: tensor {g.name!r} has type {qtype.name}, which the import does not read")
            shape = tuple(int(d) for d in reversed(g.shape))
            if expert is not None:  # one expert's slice of the stack
                shape, experts[weight] = shape[1:], expert
            if len(shape) == 1 and len(t.shape) == 2 and t.shape == (1, *shape):
                shape = t.shape  # a [1, n] matrix llama.cpp stores as a vector (Qwen2-MoE's shared expert gate)
            if t.name == weight and shape != t.shape:
                raise OffloadError(
                    f"{path}: tensor {g.name!r} has shape {list(shape)}, the engine wants {list(t.shape)}"
                )
            if short.endswith(SCALES_SUFFIX):  # in 16 bits where the file's were and stay exact (F16_SCALES)
                part, code = "scales", "F16" if qtype in F16_SCALES else float_code
            elif t.name != weight:
                part, code = "codes", t.dtype
            else:  # float types as stored, quantized ones as their float32 dequantization
                part, code = "copy", FLOATS.get(qtype, "F32")
            plan.append(Planned(t.name, TensorSpec(g.name, shape), code, t.shape, part))
    return plan, experts


def _weight_name(name: str) -> str:
    """The weight a checkpoint tensor stands for: "<prefix>.qweight" and "<prefix>.scales" -> "<prefix>.weight"."""
    for suffix in (".qweight", SCALES_SUFFIX):
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight"
    return name


class _Source:
    """The parts of `_plan` made from the GGUF tensors: each tensor's rows put in Hugging Face's order, then kept as
    codes and scales or as float, once per tensor (its codes and scales come from one decoding)."""

    def __init__(self, tensors: dict[str, ReaderTensor], model: _Model) -> None:
        self.tensors, self.arch, self.config, self.quant = tensors, model.arch, model.config, model.quant
        self.experts, self.joined = model.experts, model.joined
        self.kept: dict[str, Kept] = {}
        self._made: dict[str, dict[str, torch.Tensor]] = {}

    def part(self, p: Planned) -> torch.Tensor:
        if p.part == "joined":
            j = self.joined[p.name]
            self.kept[j.weight] = j.kept
            return j.make(self.tensors)
        weight = _weight_name(p.name)  # its codes and scales come from one decoding
        if weight not in self._made:
            self._made = {weight: self._make(p)}
        return self._made[weight][p.part].to(TORCH_DTYPES[p.dtype][0])  # scales in the code planned for them

    def _make(self, p: Planned) -> dict[str, torch.Tensor]:
        g = self.tensors[p.source.name]
        qtype, rows = T(g.tensor_type), p.source.shape[0]
        weight = _weight_name(p.name)
        raw = np.asarray(g.data).view(np.uint8)
        if (expert := self.experts.get(weight)) is None:
            raw = raw.reshape(rows, -1)  # [rows, bytes per row]
        else:  # the stack's rows expert after expert: this expert's
            raw = raw.reshape(int(g.shape[2]) * rows, -1)[expert * rows : (expert + 1) * rows]
        order = rotary_row_order(self.arch, g.name, rows, self.config)
        raw = raw if order is None else raw[order]
        if p.part == "copy":
            w, stored = float_tensor(raw, qtype, p.source.shape)
            self.kept[weight] = Kept(g.name, qtype.name, stored, True)
            return {"copy": w}
        codes, scales, kept = _quantized(raw, qtype, p.source.shape, self.quant)
        self.kept[weight] = dataclasses.replace(kept, gguf=g.name)
        if self.quant.layout == "cpu":
            codes = to_cpu_layout(codes, self.quant.bits)
        return {"codes": codes, "scales": scales}


def _quantized(
    raw: np.ndarray, qtype: T, shape: tuple[int, ...], quant: WeightQuant
) -> tuple[torch.Tensor, torch.Tensor, Kept]:
    """A layer matrix as the checkpoint format's codes and scales (triton layout): kept exactly, or requantized."""
    name = f"int{quant.bits}-g{GROUP}"
    if quant.bits == 4 and qtype in INT4_EXACT:
        groups = int4_groups(raw, qtype)
        codes, scales = engine_int4(groups)
        if not groups.inexact:
            return codes, scales, Kept("", qtype.name, name, True)
        w = torch.from_numpy(gguf_quants.dequantize(raw, qtype)).reshape(shape)
        rel, worst = _error(w, codes, scales, 4)  # codes kept, some zero points rounded
        return codes, scales, Kept("", qtype.name, name, False, rel, worst, groups.inexact)
    if quant.bits == 8 and qtype in INT8_EXACT:
        return *engine_int8(*int8_groups(raw)), Kept("", qtype.name, name, True)
    from offload.kernels.quant_matmul import quantize

    w = torch.from_numpy(gguf_quants.dequantize(raw, qtype)).reshape(shape)
    codes, scales = quantize(w, quant.bits, GROUP, dtype=torch.float32)
    return codes, scales, Kept("", qtype.name, name, False, *_error(w, codes, scales, quant.bits))


def _error(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[float, float]:
    """(||w' - w|| / ||w||, max |w' - w|) of the engine's values w' against gguf's dequantization w."""
    from offload.kernels.quant_matmul import dequantize

    err = dequantize(codes, scales, bits) - w
    return float(err.norm() / w.norm().clamp(min=1e-30)), float(err.abs().max())


def source_key(path: Path, layout: str) -> str:
    """The cache key of GGUF file `path` imported in `layout`: a digest of its size, its first KEY_HEAD_BYTES (the
    metadata and the tensor table: names, types, shapes, offsets) and KEY_SAMPLES 4 KiB extents spread over the
    weights, as offload/tiers/weights/checkpoint.py's weights_fingerprint samples a checkpoint. Reading 8.1 MiB instead
    of hashing a file of many GiB on every run; a copy (new mtime) keeps its key, a different file of the same shapes
    (a fine-tune, another quantization) differs in the samples."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{IMPORT_VERSION}:{layout}:{size}".encode())
    with path.open("rb") as f:
        digest.update(f.read(KEY_HEAD_BYTES))
        for i in range(KEY_SAMPLES):
            f.seek(i * max(size - 4096, 0) // (KEY_SAMPLES - 1))
            digest.update(f.read(4096))
    return digest.hexdigest()[:16]
