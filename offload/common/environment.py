"""The environment variables the engine reads, declared once: each one's name and what it does (docs/flags.md lists
them, generated from here)."""

from __future__ import annotations

import os

KERNELS = "OFFLOAD_KERNELS"
CACHE_DIR = "OFFLOAD_CACHE_DIR"
API_KEY = "OFFLOAD_API_KEY"
COMPILER = "CC"
TRITON_INTERPRET = "TRITON_INTERPRET"

VARIABLES = {
    KERNELS: "which kernels run. Unset: on a CUDA device the Triton kernels; on a CPU each native C kernel "
    "(kernels/csrc, built for this CPU at the first model load) where it was timed faster than torch's path on this "
    "machine, for that many rows (timed once, kept in the cache). `torch`: torch's paths only. `native`: every "
    "native kernel wherever it runs, at fixed thresholds, untimed",
    CACHE_DIR: "the cache folder: imported GGUF models, the built native kernels and their timings, build logs of "
    "failed builds, the saved hardware profile (default: $XDG_CACHE_HOME/offload, else ~/.cache/offload)",
    COMPILER: "the C compiler that builds the native CPU kernels (default: cc); it must take -march=native and "
    "-fopenmp. A build that fails is logged in the cache and not tried again until the source, the compiler or the "
    "CPU changes; the run summary's `cpu paths` line says why the native kernels are off",
    API_KEY: "`offload serve`'s API key when --api-key is not given",
    TRITON_INTERPRET: "`1`: Triton's CPU interpreter runs the Triton kernels (tests; set before triton's import)",
}


def get(name: str) -> str:
    """The variable's value ("" where unset); `name` must be declared above."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of the declared environment variables: {', '.join(VARIABLES)}")
    return os.environ.get(name, "")


def kernel_mode() -> str:
    """How OFFLOAD_KERNELS has the kernels chosen: "torch" (torch's paths only), "native" (every native kernel
    where it runs, untimed) or "measured" (unset or anything else: by this machine's timings)."""
    value = get(KERNELS).lower()
    return value if value in ("torch", "native") else "measured"


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the Triton kernels, on CPU tensors (TRITON_INTERPRET=1; triton reads it
    at its import)."""
    return get(TRITON_INTERPRET) == "1"


def reference() -> list[str]:
    """docs/flags.md's section on them (Markdown lines)."""
    lines = ["## Environment variables", "", "| variable | what it sets |", "| --- | --- |"]
    return lines + [f"| `{name}` | {text.replace('|', chr(92) + '|')} |" for name, text in VARIABLES.items()]
