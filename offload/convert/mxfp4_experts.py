"""`offload convert --quant mxfp4`: gpt-oss's routed experts written in MXFP4, as the published checkpoints store them.

Each stacked expert matrix of a float gpt-oss checkpoint ([experts, in, out], input-major, as transformers saves it)
becomes `<name>_blocks` [experts, out, in / 32, 16] and `<name>_scales` [experts, out, in / 32] (kernels/mxfp4.py
writes them: 4.25 bits a weight); every other tensor is copied as stored. config.json's quantization_config says
"mxfp4" with the modules left in float, as the published files do, so the engine (and transformers) read the result
as they read OpenAI's. Written as `offload convert` writes (offload/convert/quantize.py): aligned safetensors, MANIFEST
with checksums, a temporary folder renamed into place.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from offload.common.errors import OffloadError
from offload.common.model_config import GPT_OSS
from offload.convert.quantize import (
    CODES,
    FORMAT,
    MANIFEST,
    ConvertStats,
    Planned,
    Source,
    check_new,
    staged,
    write_config,
    write_weights,
)
from offload.kernels.mxfp4 import BLOCK, quantize_mxfp4
from offload.model.loader import load_spec
from offload.model.registry import model_tensors
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.weights.checkpoint import Checkpoint, ModelTensors, TensorSpec, weights_fingerprint

EXPERT_MATRICES = ("gate_up_proj", "down_proj")  # the stacked matrices MXFP4 holds; their biases stay float
KEPT_FLOAT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def convert_mxfp4(model_dir: Path, out: Path) -> ConvertStats:
    """Write gpt-oss's float checkpoint in `model_dir` with its experts in MXFP4 to the new directory `out`."""
    spec, family = load_spec(model_dir)
    config = model_dir / "config.json"
    if spec.architecture != GPT_OSS:
        raise OffloadError(f"{config}: --quant mxfp4 writes gpt-oss's experts ({GPT_OSS}), not {spec.architecture}'s")
    if spec.mxfp4_experts or spec.quant is not None:
        raise OffloadError(f"{config}: already quantized; convert a float model")
    check_new(out)
    with BufferedReader() as reader, staged(out) as work:
        checkpoint = Checkpoint(model_dir, reader)
        plan = _plan(model_tensors(family, spec), checkpoint, model_dir)
        source = Source(checkpoint, _made)
        files, crcs = write_weights(work, plan, source.part)
        write_config(model_dir, work, {"quant_method": "mxfp4", "modules_to_not_convert": KEPT_FLOAT})
        manifest = {
            "format": FORMAT,
            "source": str(model_dir.resolve()),
            "source_fingerprint": weights_fingerprint(model_dir),
            "quant": {"method": "mxfp4", "block": BLOCK, "matrices": list(EXPERT_MATRICES)},
            "files": files,
            "tensors": crcs,
        }
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1))
    quantized = sum(p.part == "blocks" for p in plan)
    copied, written = sum(p.part == "copy" for p in plan), sum(f["size"] for f in files.values())
    return ConvertStats(out, None, quantized, copied, source.read_bytes, written)


def _made(w: torch.Tensor, p: Planned) -> dict[str, torch.Tensor]:
    """A source tensor's parts: copied as stored, or its stacked experts [experts, in, out] as the published
    [experts, out, in] blocks and scales, an expert at a time (the rounding's float32 temporaries are several times an
    expert's size)."""
    if p.part == "copy":
        return {"copy": w}
    parts = [quantize_mxfp4(w[e].t()) for e in range(w.shape[0])]
    blocks, scales = (torch.stack(x) for x in zip(*parts, strict=True))
    return {"blocks": blocks, "scales": scales}


def _plan(tensors: ModelTensors, checkpoint: Checkpoint, model_dir: Path) -> list[Planned]:
    """Every checkpoint tensor the model reads, once, in its order: the stacked expert matrices as blocks and scales,
    the rest copied as stored."""
    plan, seen = [], set()
    for group in (tensors.embed, *tensors.layers, tensors.head):
        for t in group.values():
            if t.name in seen:
                continue
            seen.add(t.name)
            ext = checkpoint.extent(t.name)
            source = TensorSpec(t.name, ext.shape)
            if t.row is not None and t.name.rsplit(".", 1)[-1] in EXPERT_MATRICES:
                experts, cols, rows = ext.shape  # input-major: [experts, in, out]
                if cols % BLOCK:
                    raise OffloadError(f"{model_dir}: tensor {t.name} has {cols} inputs, not a multiple of {BLOCK}")
                blocks = (experts, rows, cols // BLOCK, BLOCK // 2)
                plan.append(Planned(t.name + "_blocks", source, CODES[torch.uint8], blocks, "blocks"))
                plan.append(Planned(t.name + "_scales", source, CODES[torch.uint8], blocks[:3], "scales"))
            else:
                plan.append(Planned(t.name, source, ext.dtype, ext.shape, "copy"))
    return plan
