"""What the benchmark scripts share: the machine facts their JSON reports record, a random-weight Llama checkpoint
built by transformers, greedy generation of an exact number of tokens through transformers, and the report itself.

The scripts import it by name: run as `python benchmarks/<script>.py`, benchmarks/ is sys.path[0]. Whatever loads
a script by path instead (the tests, benchmarks/gpu/) registers this module in sys.modules under its name first.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def timestamp() -> str:
    """Local time, ISO 8601 with the UTC offset: when a report was written."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def cpuinfo(key: str) -> str | None:
    """The first value of `key` in /proc/cpuinfo ("model name", "flags"), or None where it has none."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return None


def ram_bytes() -> int:
    """Physical memory, from /proc/meminfo's MemTotal (kB)."""
    mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
    return int(mem.split()[1]) * 1024


def host() -> dict[str, str | int | None]:
    """What every report names of the computer: hostname, CPU model, logical cores, kernel release."""
    return {
        "hostname": socket.gethostname(),
        "cpu": cpuinfo("model name") or platform.processor(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
    }


def storage(directory: Path) -> dict[str, str]:
    """The block device, filesystem and mount point holding `directory` (the longest mount point above it), and the
    device's rotational flag and model where sysfs has them."""
    resolved = str(directory.resolve())
    mount = max(
        (ln.split() for ln in Path("/proc/mounts").read_text().splitlines()),
        key=lambda m: len(m[1]) if resolved.startswith(m[1]) else -1,
    )
    info = {"device": mount[0], "filesystem": mount[2], "mount": mount[1]}
    block = Path("/sys/class/block") / Path(mount[0]).name
    for key, rel in (("rotational", "queue/rotational"), ("model", "device/model")):
        for base in (block, block.parent):  # a partition's queue facts live on its disk
            if (base / rel).exists():
                info[key] = (base / rel).read_text().strip()
                break
    return info


def machine(work_dir: Path) -> dict[str, str | int | None]:
    """The facts the offload benchmarks record: the host, its RAM, and the storage under their work dir."""
    return host() | {"ram_bytes": ram_bytes(), "work_dir": str(work_dir.resolve())} | storage(work_dir)


def ensure_checkpoint(model_dir: Path, shape: Mapping[str, int], family: str = "llama") -> Path:
    """A random-weight bf16 Llama (or, by `family`, Mixtral, DeepSeek-V3, gpt-oss) in Hugging Face layout
    (safetensors) at `model_dir`, written once and reused.

    `shape` holds the config's fields (hidden_size, num_hidden_layers, vocab_size, ...); the weights are seeded,
    the head is untied, bos and eos are ids 1 and 2. The directory's name must change with the shape.
    """
    if (model_dir / "config.json").exists() and any(model_dir.glob("*.safetensors")):
        return model_dir
    import torch
    import transformers

    name = {"llama": "Llama", "mixtral": "Mixtral", "deepseek_v3": "DeepseekV3", "gpt_oss": "GptOss"}[family]
    config_class, model_class = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    config = config_class(**shape, dtype="bfloat16", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # never materialise a float32 copy of the weights
    try:
        model = model_class(config)
    finally:
        torch.set_default_dtype(default)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(model_dir)
    return model_dir


def generate_exactly(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """Greedy transformers `generate` of exactly `new_tokens` tokens per row (pad id 0); the new tokens only.

    input_ids, attention_mask: [batch, prompt]; returns [batch, new_tokens]. Called as transformers documents it:
    `generate` runs under its own torch.no_grad. Not under torch.inference_mode: with Accelerate's disk offload
    that doubled the peak RSS (2.06 GB against 1.01 GB at batch 8 on the 1.1B checkpoint, 600 MB budget).
    """
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # random weights: eos must not end a row early
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, input_ids.shape[1] :]


def write_report(path: Path, report: Mapping[str, object]) -> None:
    """The report as indented JSON at `path` (its folder made if missing), and a line saying where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def kv_block_bytes(model_dir: Path, block_size: int, kv_dtype: str = "auto") -> int:
    """Bytes of one KV block of the model at `model_dir`, in its checkpoint dtype (read from config.json only)."""
    import torch

    from offload.model.loader import load_spec
    from offload.tiers.kv.kv_cache import KVCache

    spec, _ = load_spec(model_dir)
    dims = (spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim)
    return KVCache.block_bytes(*dims, getattr(torch, spec.dtype), kv_dtype)


def failure_status(exc: BaseException) -> str:
    """A worker's exception as its row's status, its traceback on stderr (the worker's log): an engine that cannot
    run here is a result, not a crash of the benchmark."""
    import traceback

    traceback.print_exc()
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"failed: {type(exc).__name__}: {reason}"[:300]
