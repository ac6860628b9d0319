"""The dtypes the engine computes in and reads weights in, by the names config.json and users give them.

(Safetensors' own dtype codes, "BF16" and the like, are the checkpoint reader's: tiers/weights/checkpoint.py.)
"""

from __future__ import annotations

DTYPES = ("float32", "float16", "bfloat16")  # compute dtypes, and the checkpoint dtypes config.json may declare
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_QUANT_DTYPES = ("int8", "int4", "fp8")  # KV formats stored quantized per group along head_dim
KV_DTYPES = ("auto", *DTYPES, *KV_QUANT_DTYPES)  # what --kv-dtype may say; "auto" = the compute dtype
MATMUL_DTYPES = (*DTYPES, "int8")  # what a hardware profile may give GEMM rates for

# config.json's spellings (torch_dtype or, from transformers 5, dtype) -> one of DTYPES
_ALIASES = {name: name for name in DTYPES} | {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def canonical_dtype(name: object) -> str | None:
    """One of DTYPES for any spelling config.json uses ("bf16", "half", ...); None for anything else."""
    return _ALIASES.get(name) if isinstance(name, str) else None
