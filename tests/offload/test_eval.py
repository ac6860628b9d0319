"""Perplexity by the protocol of offload/eval.py: the windowing and the arithmetic exactly, the batching by the KV
cache on a tiny model, and on the real model (SmolLM2-135M) the engine's perplexity of the shipped text against
transformers' own loss, `offload eval` against the API, and layers streamed from disk against resident ones."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from offload.api import LLM
from offload.cli import main
from offload.common.config import EngineConfig
from offload.common.errors import OffloadError
from offload.eval import (
    Perplexity,
    check_context,
    evaluate,
    scored_windows,
    summarize,
    window_nll,
    window_spans,
)
from real_model import reference_perplexity

TEXT = Path(__file__).resolve().parents[1] / "data" / "eval_text.txt"
EXCERPT_PARAGRAPHS = 9  # the title and 8 paragraphs: about 1,200 tokens
CONTEXT = 512


# ---- windows and arithmetic --------------------------------------------------------------------------------------


def test_windows_are_consecutive_and_the_last_one_shorter():
    assert window_spans(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert window_spans(8, 4) == [range(0, 4), range(4, 8)]
    assert window_spans(3, 512) == [range(0, 3)]
    assert window_spans(0, 4) == []


def test_a_last_window_of_one_token_predicts_nothing_and_is_left_out():
    ids = list(range(100, 109))  # 9 tokens, windows of 4: 4, 4, 1
    assert window_spans(9, 4)[-1] == range(8, 9)
    assert scored_windows(ids, 4) == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert scored_windows(ids[:6], 4) == [[100, 101, 102, 103], [104, 105]]
    assert scored_windows([7], 4) == []


def test_window_nll_is_the_hand_computed_sum():
    # vocab 3, window [0, 2, 1]: row 0 gives token 2 probability 2/4, row 1 gives token 1 probability 3/8; the last
    # row predicts past the window and is never read (NaN would poison the sum)
    logits = torch.tensor([[1.0, 1.0, 2.0], [1.0, 3.0, 4.0], [math.nan] * 3], dtype=torch.float64).log()
    assert window_nll([0, 2, 1], logits) == pytest.approx(math.log(2) + math.log(8 / 3), rel=1e-12)
    with pytest.raises(ValueError, match="3 rows of logits for a window of 2 tokens"):
        window_nll([0, 2], logits)


def test_perplexity_is_exp_of_the_mean_nll():
    p = summarize(7 * math.log(2), predicted=7, tokens=10, windows=3, context=4)
    assert p.perplexity == pytest.approx(2.0, rel=1e-12) and p.nll == pytest.approx(math.log(2), rel=1e-12)
    assert (p.tokens, p.predicted, p.windows, p.context) == (10, 7, 3, 4)
    assert p.to_json() == {
        "perplexity": p.perplexity,
        "nll": p.nll,
        "tokens": 10,
        "predicted": 7,
        "windows": 3,
        "context": 4,
    }


class UniformScorer:
    """Logits that give every token of a `vocab` the same probability; records the windows of each call."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.calls = vocab, []

    def __call__(self, batch: list[list[int]]) -> list[torch.Tensor]:
        self.calls.append(batch)
        return [torch.zeros(len(w), self.vocab) for w in batch]


def test_uniform_logits_score_the_vocabulary_size_in_steps_of_the_given_width():
    score, seen = UniformScorer(vocab=50), []
    ids = list(range(19))  # windows of 4: 4, 4, 4, 4, 3
    p = evaluate(score, ids, 4, per_step=2, progress=lambda done, total: seen.append((done, total)))
    assert p.perplexity == pytest.approx(50.0, rel=1e-12)
    assert (p.tokens, p.predicted, p.windows, p.context) == (19, 4 * 3 + 2, 5, 4)
    assert [len(b) for b in score.calls] == [2, 2, 1]
    assert [w for b in score.calls for w in b] == scored_windows(ids, 4)
    assert seen == [(2, 5), (4, 5), (5, 5)]


def test_a_text_too_short_to_predict_anything_is_refused():
    with pytest.raises(OffloadError, match=r"the text has 1 token\(s\): nothing to predict"):
        evaluate(UniformScorer(5), [3], 4, per_step=1)


@pytest.mark.parametrize("context", [1, 0, 64, 100])
def test_a_context_that_is_too_short_or_does_not_fit_is_refused(context):
    with pytest.raises(OffloadError, match=rf"context \(--context\).* {context}"):
        check_context(context, max_model_len=64)
    check_context(63, max_model_len=64)


# ---- the engine on a tiny model ------------------------------------------------------------------------------------


def test_windows_are_scored_as_many_per_step_as_the_kv_cache_holds(tiny_llama):
    # 3 layers * 2 * 2 kv heads * 16 dims * 4 bytes = 768 bytes/token: 48 KiB hold 64 tokens, 4 blocks of 16, so
    # two windows of 32 tokens (2 blocks each) per step
    with LLM(tiny_llama, EngineConfig(kv_cache_bytes=48 << 10, block_size=16, dtype="float32")) as llm:
        text = "Blocks of a fixed size hold the keys and values. " * 3  # 147 bytes, 148 tokens with <s>
        ids = llm.prompts.encode(text)
        seen = []
        p = llm.perplexity(text, 32, lambda done, total: seen.append((done, total)))
        assert seen == [(2, 5), (4, 5), (5, 5)]
        one_at_a_time = evaluate(llm.score, ids, 32, per_step=1)
        with pytest.raises(OffloadError, match=r"context \(--context\) 64 does not fit .* 64 tokens"):
            llm.perplexity(text, 64)
        llm.check_integrity()
        assert llm.stats().kv_blocks_used == 0
    assert (p.tokens, p.predicted, p.windows) == (148, 148 - 5, 5)
    assert p.perplexity == pytest.approx(one_at_a_time.perplexity, rel=1e-6)


def test_eval_prints_one_human_line_and_json_with_every_field(tiny_llama, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The page cache absorbs writes. " * 4)
    assert main(["eval", "--model", str(tiny_llama), "--text", str(text), "--context", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and re.match(r"perplexity \d+\.\d{4} \(nll \d\.\d{4}\) over 123 predicted tokens", out[0])
    assert main(["eval", "--model", str(tiny_llama), "--text", str(text), "--context", "64", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    got = json.loads(line)
    assert got.keys() >= {"perplexity", "nll", "tokens", "predicted", "windows", "context", "model", "text"}
    assert (got["tokens"], got["predicted"], got["windows"], got["context"]) == (125, 123, 2, 64)
    assert got["perplexity"] == pytest.approx(math.exp(got["nll"]), rel=1e-12)


@pytest.mark.parametrize(
    "args, content, named",
    [
        (["--context", "1"], "some text", "--context must be at least 2, got 1"),
        ([], None, "text.txt: text file not found"),
        ([], " \n\n", "text.txt: the text is empty"),
        ([], b"\xff\xfe text", "text.txt: not UTF-8 text"),
    ],
    ids=["context", "missing", "empty", "not-utf8"],
)
def test_bad_input_is_one_line_naming_the_flag_or_file(tmp_path, capsys, args, content, named):
    text = tmp_path / "text.txt"
    if content is not None:
        text.write_bytes(content if isinstance(content, bytes) else content.encode())
    # checked before the model is read: the model folder need not exist
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--text", str(text), *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0]


# ---- the real model ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def excerpt(tmp_path_factory) -> Path:
    """The shipped text's first paragraphs, as a file."""
    path = tmp_path_factory.mktemp("eval") / "excerpt.txt"  # three windows: two of 512 tokens and a shorter one
    path.write_text("\n\n".join(TEXT.read_text().split("\n\n")[:EXCERPT_PARAGRAPHS]))
    return path


@pytest.fixture(scope="module")
def engine(smollm2_float):
    with LLM(smollm2_float, EngineConfig(dtype="float32")) as llm:
        yield llm


@pytest.fixture(scope="module")
def excerpt_perplexity(engine, excerpt) -> Perplexity:
    return engine.perplexity(excerpt.read_text(), CONTEXT)


@pytest.mark.slow
def test_the_engine_perplexity_of_the_shipped_text_is_transformers_own(smollm2_float, engine):
    text = TEXT.read_text()
    p = engine.perplexity(text, CONTEXT)
    assert 5000 <= p.tokens <= 6000 and p.windows == math.ceil(p.tokens / CONTEXT)  # its last window is not 1 token
    assert p.predicted == p.tokens - p.windows and p.context == CONTEXT
    assert p.perplexity == pytest.approx(reference_perplexity(smollm2_float, text, CONTEXT), rel=1e-3)


@pytest.mark.slow
def test_offload_eval_prints_the_api_perplexity(smollm2_float, excerpt, excerpt_perplexity, capsys):
    assert main(["eval", "--model", str(smollm2_float), "--text", str(excerpt), "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    got = json.loads(line)
    assert got["perplexity"] == pytest.approx(excerpt_perplexity.perplexity, rel=1e-6)
    assert excerpt_perplexity.windows == 3
    assert (got["tokens"], got["predicted"], got["windows"]) == (
        excerpt_perplexity.tokens,
        excerpt_perplexity.predicted,
        excerpt_perplexity.windows,
    )


def test_a_text_of_one_token_is_refused_naming_the_file(smollm2_float, tmp_path, capsys):
    text = tmp_path / "one.txt"
    text.write_text("Memory")  # SmolLM2's tokenizer adds no <s>: one token
    assert main(["eval", "--model", str(smollm2_float), "--text", str(text)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {text}: 1 token(s), nothing to predict (a window needs at least 2)"]


@pytest.mark.slow
def test_layers_streamed_from_disk_score_the_same_perplexity(smollm2_float, engine, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(TEXT.read_text().split("\n\n")[:3]))  # the title and 2 paragraphs: about 300 tokens
    resident = engine.perplexity(text.read_text(), 128)
    # the tied embedding (108 MiB in float32), the KV cache and a ring of two 13.5 MiB layer slots leave room for a
    # few of the 30 layers: the rest are read from the checkpoint on every step
    budget = ["--device-memory", "300MB", "--kv-cache-memory", "32MiB", "--io-backend", "pread", "--show-placement"]
    assert (
        main(["eval", "--model", str(smollm2_float), "--text", str(text), "--context", "128", "--json", *budget]) == 0
    )
    out, err = capsys.readouterr()
    streamed = int(re.search(r"(\d+) nvme; ring of", err).group(1))
    assert 0 < streamed < 30
    got = json.loads(out)
    assert (got["windows"], got["predicted"]) == (resident.windows, resident.predicted)
    assert got["perplexity"] == pytest.approx(resident.perplexity, rel=1e-4)
