"""The prepared GPU benchmark loads and shares the peer benchmark's helpers on a CPU machine (its CUDA parts
run only where a GPU is lent): a broken import would otherwise surface only during a rare GPU session."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "offload_vs_accelerate.py"


def test_gpu_script_loads_the_peer_helpers_and_their_prompts():
    spec = importlib.util.spec_from_file_location("offload_vs_accelerate", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    common, peers = script.siblings()
    assert peers.machine is common.machine  # offload_vs_peers imported the shared module registered by name
    ids = script.prompts(peers, 3, 7)
    assert ids == peers.Workload(prompts=3, prompt_tokens=7).prompt_ids(script.LAYER_SHAPE["vocab_size"])
    assert len(ids) == 3 and all(len(p) == 7 for p in ids)
    h, i = script.LAYER_SHAPE["hidden_size"], script.LAYER_SHAPE["intermediate_size"]
    assert script.layer_params() == 4 * h * h + 3 * h * i + 2 * h  # Llama-2-7B's layer: 202,383,360
    assert script.layer_params() == 202_383_360
