"""The endpoint and a batch job on the real model: SmolLM2-135M-Instruct, served from its GGUF file (imported once
into the tests' cache), answers a chat request through its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from serving import BOUND, start_server

from offload.cli import main

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ENGINE = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "4"]


@pytest.mark.slow
@pytest.mark.fixed_kernels
def test_the_endpoint_answers_a_chat_request(smollm2_gguf: Path, tmp_path: Path) -> None:
    served = start_server(smollm2_gguf, tmp_path / "server.log", "--served-model-name", "smollm2", *ENGINE)
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=BOUND)
        reply = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=12, temperature=0)
        assert "Paris" in reply.choices[0].message.content
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        served.stop()


@pytest.mark.slow
def test_a_batch_job_answers_a_chat_line(smollm2_gguf: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"id": "capital", "messages": QUESTION, "max_tokens": 12, "temperature": 0}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["batch", "--model", str(smollm2_gguf), "--input", str(src), "--output", str(out), *ENGINE]) == 0
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["id"] == "capital" and "Paris" in result["text"]
