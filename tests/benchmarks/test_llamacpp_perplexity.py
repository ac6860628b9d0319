"""benchmarks/llamacpp_perplexity.py: llama.cpp scores the engine's perplexity protocol (skipped where llama-cpp-python,
an optional peer, is not installed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import benchmark_module


@pytest.mark.slow
def test_llama_cpp_scores_the_engines_windows_near_the_engines_perplexity(smollm2_gguf: Path):
    pytest.importorskip("llama_cpp")
    from offload.api import LLM
    from offload.common.config import EngineConfig

    text = (Path(__file__).resolve().parents[1] / "data" / "eval_text.txt").read_text()[:3000]
    with benchmark_module("llamacpp_perplexity") as bench, LLM(smollm2_gguf, EngineConfig(dtype="float32")) as llm:
        ids = llm.prompts.encode(text, "excerpt")
        ours = llm.perplexity(text, 128)
        repack = bench.repack_runs(smollm2_gguf) is None  # it kills its process on some CPUs: off there
        theirs = bench.llamacpp_perplexity(smollm2_gguf, ids, 128, repack)
        # each window scored alone, from an empty cache: two windows together give their two scores' mean
        both = bench.llamacpp_perplexity(smollm2_gguf, ids[:256], 128, repack)
        first, second = (bench.llamacpp_perplexity(smollm2_gguf, ids[i : i + 128], 128, repack) for i in (0, 128))
    assert ours.windows > 1 and math.isfinite(theirs)
    # the same weights; llama.cpp rounds the activations to 8 bits for its dot products (0.4% on the whole texts)
    assert abs(theirs / ours.perplexity - 1) < 0.02
    assert math.log(both) == pytest.approx((math.log(first) + math.log(second)) / 2, rel=1e-6)
