"""Constrained decoding: a request's reply held to a JSON schema, a regular expression or a grammar.

    params = SamplingParams(json_schema={"type": "object", ...})     # or regex="...", or grammar="<Lark>"
    grammars = Grammars(prompts, vocab_size, eos_ids)                # one per engine core, built on first use
    matcher = grammars.matcher(params)                               # per request; None when unconstrained
    masks = grammars.start_masks([matcher or None per logits row])   # on a worker thread, during the forward pass
    sample_from = masks.apply(logits)                                # waits, then -inf on every token not allowed
    grammars.advance(matcher, token)                                 # after sampling

The grammar engine is llguidance (a kept library, the one vLLM and SGLang offer too): it compiles JSON schemas,
regular expressions and Lark grammars against the tokenizer and computes a step's token mask, a bit per vocabulary
entry, in tens of microseconds. The mask of a step depends only on the tokens sampled before it, so it is computed
on a worker thread while the layers run (llguidance releases the GIL), and applied to the logits of the constrained
rows only when the step's logits exist: a step with no constrained request does none of this.

A request's matcher follows its output tokens, which no preemption, recompute, KV move or prefix-cache hit ever
changes (they change where the KV lives, not the tokens), so its state needs no care from the scheduler; each
choice of an `n > 1` request is a request of its own with its own matcher. Once the grammar is complete (the matcher
is stopped), the request ends with finish_reason "stop" without spending a step on the end-of-sequence token.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from offload.common.config import SamplingParams
from offload.common.errors import OffloadError

PROTOTYPES = 256  # compiled grammars kept (a matcher per request is a copy of its grammar's)
# JSON as json.dumps writes it, on one line: no free whitespace for a small model to wander into (llguidance's
# default lets it put newlines and indents anywhere, and a 135M model then loses its way). A schema's own
# "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def closed(schema: object) -> object:
    """`schema` with every object that lists its `properties` and says nothing of others closed to them
    (`"additionalProperties": false`), as xgrammar does by default and OpenAI's strict mode requires: a reply still
    validates against the schema as given, and a small model cannot go on inventing keys until its token budget ends.
    A schema that states `additionalProperties` (or `patternProperties`) keeps what it states."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # names -> schemas
            out[key] = {name: closed(sub) for name, sub in value.items()}
        else:  # values, not schemas, are left as they are
            out[key] = value if key in ("const", "enum", "default", "examples") else closed(value)
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def schema_grammar(schema_text: str) -> str:
    """The llguidance grammar of a JSON schema (JSON text): closed, in JSON_STYLE. ValueError for a schema llguidance
    cannot read."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(json.dumps(closed(json.loads(schema_text))), defaults=JSON_STYLE)


def styled(schema: dict) -> dict:
    """`schema` with JSON_STYLE as its llguidance options, under any it states itself."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def _grammar(params: SamplingParams) -> str:
    """The llguidance grammar of a constrained request; ValueError for a JSON schema llguidance cannot read."""
    from llguidance import LLMatcher

    if params.json_schema is not None:
        return schema_grammar(params.json_schema)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    return LLMatcher.grammar_from_lark(params.grammar)


def constraint_field(params: SamplingParams) -> str:
    return next(f for f in ("json_schema", "regex", "grammar") if getattr(params, f) is not None)


def grammar_error(params: SamplingParams) -> str | None:
    """Why the constraint of `params` does not compile, on one line (checked without a tokenizer); None when it does,
    or when there is none."""
    from llguidance import LLMatcher

    if not params.constrained:
        return None
    try:
        error = LLMatcher.validate_grammar(_grammar(params))
    except ValueError as exc:
        return str(exc)
    return one_line(error) if error else None


class Grammars:
    """The compiled grammars and the token masks of one engine core."""

    def __init__(self, prompts: Callable[[], object] | None, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        """`prompts` returns the model's encoder (offload/prompts.py's Prompts, whose grammar_tokenizer builds
        llguidance's view of the tokenizer); None: the model has no tokenizer."""
        self._prompts, self.vocab_size, self.eos_ids = prompts, vocab_size, eos_ids
        self._llt = None  # llguidance.LLTokenizer, built on the first constrained request (about 0.3 s)
        self._prototypes: dict[tuple[str, str], object] = {}  # (field, constraint) -> a fresh LLMatcher to copy
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance.LLExecutor: fills a batch's masks on its own threads
        self.mask_seconds = 0.0  # worker time computing masks, over the core's life
        self.wait_seconds = 0.0  # time a step waited for its masks after the forward pass
        self.masks = 0  # rows masked

    def _tokenizer_for_grammars(self):
        if self._llt is None:
            import llguidance

            if self._prompts is None:
                raise OffloadError("constrained decoding needs a tokenizer, and this model has none")
            self._llt = self._prompts().grammar_tokenizer(self.vocab_size, self.eos_ids)
            self._executor = llguidance.LLExecutor()
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="offload-masks")
        return self._llt

    def matcher(self, params: SamplingParams):
        """A new matcher for a request (llguidance.LLMatcher), or None when it is not constrained. OffloadError
        naming the field if the constraint does not compile."""
        if not params.constrained:
            return None
        from llguidance import LLMatcher

        field = constraint_field(params)
        key = (field, getattr(params, field))  # a constraint's grammar is built and compiled once
        with self._lock:
            proto = self._prototypes.get(key)
            if proto is None:
                try:
                    grammar = _grammar(params)
                except ValueError as exc:
                    raise OffloadError(f"{field}: {exc}") from None
                proto = LLMatcher(self._tokenizer_for_grammars(), grammar, log_level=0)
                if proto.is_error():
                    raise OffloadError(f"{field}: {one_line(proto.get_error())}")
                if len(self._prototypes) >= PROTOTYPES:
                    self._prototypes.pop(next(iter(self._prototypes)))
                self._prototypes[key] = proto
            return proto.deep_copy()

    def start_masks(self, matchers: list) -> Masks | None:
        """Start computing the masks of a step's logits rows (`matchers[row]`, None for a free row) on the worker
        thread; None when no row is constrained."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        bitmask = allocate_token_bitmask(len(rows), self.vocab_size)
        packed = [(m, k) for k, (m, _) in enumerate(rows)]

        def fill() -> float:
            start = time.perf_counter()
            fill_next_token_bitmask_par(self._executor, packed, bitmask)
            return time.perf_counter() - start

        self.masks += len(rows)
        return Masks(self, [i for _, i in rows], bitmask, self._worker.submit(fill))

    def advance(self, matcher, token: int) -> bool:
        """Feed a sampled token to a request's matcher; True once the grammar is complete (only the end may follow).
        A token the grammar refuses (which a mask makes impossible) is an error, not a silent wrong answer."""
        if not matcher.consume_token(token):
            raise OffloadError(f"the grammar refused token {token}: {one_line(matcher.get_error())}")
        return matcher.is_stopped()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


@dataclass(eq=False)
class Masks:
    """One step's masks, computed while its forward pass runs."""

    grammars: Grammars
    rows: list[int]  # the constrained rows of the step's logits
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, a bit per token (1 = allowed)
    future: Future

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` [rows, vocab] with every token a constrained row's grammar refuses at -inf (the
        caller's logits stay the model's, for logprobs)."""
        start = time.perf_counter()
        self.grammars.mask_seconds += self.future.result()
        self.grammars.wait_seconds += time.perf_counter() - start
        vocab = logits.shape[-1]
        words = self.bitmask.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
        out = logits.clone()
        rows = torch.tensor(self.rows, device=logits.device)
        out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
        return out


def one_line(message: str) -> str:
    """A grammar compiler's message on one line: its lines that say something, joined."""
    lines = [ln.strip() for ln in message.strip().splitlines()]
    return " ".join(ln for ln in lines if ln and not set(ln) <= set("^ |0123456789")) or "invalid"
