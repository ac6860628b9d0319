"""lm-evaluation-harness driving `offload serve` (docs/lm_eval.md): the real `lm_eval` command, its
`local-completions` model over /v1/completions with echo and logprobs, on the tasks the tests ship
(tests/data/lm_eval: offload_choice, multiple choice; offload_passages, loglikelihood_rolling) against the real model.

Its per-item loglikelihoods must be what the engine's own scoring gives in-process (`LLM.score`) on the same GGUF
file, and its multiple-choice picks what lm-eval's `hf` backend picks on transformers' float32 copy of the same
weights (the engine computes in bfloat16: choices whose float32 loglikelihoods lie within TIE of each other may
swap; the shipped items have none, the closest two choices are 0.45 apart)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import BOUND, Served, start_server

from offload.api import LLM
from offload.common.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("offload_choice", "offload_passages")
MODEL = "smollm2"
# one request a step: its rows are one prompt's, as in-process scoring computes them, so the kernel paths (chosen by
# row count) are the same; in a step shared with other prompts a bfloat16 loglikelihood can round apart (by 0.075
# nats on one choice, seen once)
FLAGS = ("--served-model-name", MODEL, "--max-num-seqs", "1", "--log-level", "warning")
RESIDENT = ("--kv-cache-memory", "64MiB")
# the embedding and head (54 MiB) and about two of the 30 layers on the device, the other layers (71.5 MiB) read from
# disk at every step
STREAMED = ("--device-memory", "90MiB", "--kv-cache-memory", "16MiB")
TIE = 0.05  # nats: float32 loglikelihoods of two choices this close may rank the other way in bfloat16

pytestmark = [pytest.mark.slow, pytest.mark.fixed_kernels]


@pytest.fixture(scope="module", autouse=True)
def native_kernels() -> Iterator[None]:
    """The server and the in-process reference take the same kernel paths (conftest pins them per test; the server
    starts before a test does)."""
    with pytest.MonkeyPatch.context() as patch:
        if os.environ.get("OFFLOAD_KERNELS", "").lower() != "torch":
            patch.setenv("OFFLOAD_KERNELS", "native")
        yield


def serve(gguf: Path, log: Path, *memory: str) -> Served:
    return start_server(gguf, log, *FLAGS, *memory)


def lm_eval(out: Path, model: str, model_args: str) -> dict[str, list[dict]]:
    """`lm_eval` on both tasks, as docs/lm_eval.md runs it (from the repository root); each task's logged samples,
    by doc_id."""
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args]
    command += ["--tasks", ",".join(TASKS), "--include_path", "tests/data/lm_eval", "--batch_size", "4"]
    command += ["--log_samples", "--output_path", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=BOUND)
    assert done.returncode == 0, done.stderr[-3000:]
    samples = {}
    for task in TASKS:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return samples


def served_args(served: Served, tokenizer: Path) -> str:
    return f"model={MODEL},base_url={served.url}/v1/completions,tokenizer={tokenizer},tokenizer_backend=huggingface"


def loglikelihoods(sample: dict) -> list[float]:
    """A sample's loglikelihoods: one per choice (multiple choice), or the passage's (loglikelihood_rolling)."""
    return [float(r[0]) if isinstance(r, list) else float(r) for r in sample["filtered_resps"]]


@pytest.fixture(scope="module")
def served(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = serve(smollm2_gguf, tmp_path_factory.mktemp("lm_eval") / "server.log", *RESIDENT)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def offload_samples(served: Served, smollm2_float: Path, tmp_path_factory) -> dict[str, list[dict]]:
    return lm_eval(tmp_path_factory.mktemp("lm_eval-offload"), "local-completions", served_args(served, smollm2_float))


def token_pairs(samples: dict[str, list[dict]], tokenizer: Path) -> dict[str, list[list[tuple[list[int], list[int]]]]]:
    """Per task and sample, the (context, continuation) token ids lm-eval scores, by its own tokenization: each
    choice's pair, or a passage's rolling windows after the prefix token."""
    from lm_eval import utils
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url="http://unused/v1/completions", tokenizer=str(tokenizer), tokenizer_backend="huggingface"
    )
    pairs = {"offload_choice": [], "offload_passages": []}
    for s in samples["offload_choice"]:
        args = [s["arguments"][f"gen_args_{k}"] for k in range(len(s["filtered_resps"]))]
        pairs["offload_choice"].append([lm._encode_pair(a["arg_0"], a["arg_1"]) for a in args])
    for s in samples["offload_passages"]:
        tokens = lm.tok_encode(s["arguments"]["gen_args_0"]["arg_0"])
        windows = utils.get_rolling_token_windows(tokens, lm.prefix_token_id, lm.max_length - 1, 1)
        pairs["offload_passages"].append([utils.make_disjoint_window(w) for w in windows])
    return pairs


def scored(llm: LLM, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Each continuation's loglikelihood after its context, from the engine's logits (LLM.score)."""
    out = []
    for (context, continuation), logits in zip(pairs, llm.score([c + t for c, t in pairs]), strict=True):
        ids = context + continuation
        lp = logits.log_softmax(-1)  # [len(ids), vocab]: position p - 1 gives token p
        out.append(sum(lp[p - 1, ids[p]].item() for p in range(len(context), len(ids))))
    return out


def test_its_loglikelihoods_are_the_engines_own(offload_samples, smollm2_gguf, smollm2_float):
    pairs = token_pairs(offload_samples, smollm2_float)
    with LLM(smollm2_gguf, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=4)) as llm:
        for task in TASKS:
            assert len(offload_samples[task]) == (16 if task == "offload_choice" else 12)
            for sample, item in zip(offload_samples[task], pairs[task], strict=True):
                got = loglikelihoods(sample)
                # a passage's loglikelihood is its windows' sum
                want = [sum(scored(llm, item))] if task == "offload_passages" else scored(llm, item)
                assert got == pytest.approx(want, abs=1e-3, rel=0), (task, sample["doc_id"])


def test_its_multiple_choice_picks_are_the_hf_backends(offload_samples, smollm2_float, tmp_path):
    hf = lm_eval(tmp_path / "hf", "hf", f"pretrained={smollm2_float},dtype=float32")
    ties = []
    for ours, theirs in zip(offload_samples["offload_choice"], hf["offload_choice"], strict=True):
        assert ours["doc_id"] == theirs["doc_id"]
        got, want = loglikelihoods(ours), loglikelihoods(theirs)
        picked, expected = got.index(max(got)), want.index(max(want))
        if picked != expected and abs(want[picked] - want[expected]) < TIE:
            ties.append(ours["doc_id"])
            continue
        assert (picked, ours["acc"]) == (expected, theirs["acc"]), (ours["doc_id"], got, want)
    print(f"items whose choices tie within {TIE} nats and ranked apart: {ties or 'none'}")


def test_layers_streamed_from_disk_give_the_same_numbers(offload_samples, smollm2_gguf, smollm2_float, tmp_path):
    server = serve(smollm2_gguf, tmp_path / "server.log", *STREAMED)
    try:
        streamed = lm_eval(tmp_path / "out", "local-completions", served_args(server, smollm2_float))
        read = server.metrics()['offload_weight_bytes_read_total{tier="nvme"}']
    finally:
        assert server.stop() == 0
    for task in TASKS:
        assert [loglikelihoods(s) for s in streamed[task]] == [loglikelihoods(s) for s in offload_samples[task]]
    # lm-eval sends 26 requests one after another (14 batches of choices, 12 passages): each step reads the streamed
    # layers (71.5 MiB) from disk again
    assert read > 20 * (70 << 20)
