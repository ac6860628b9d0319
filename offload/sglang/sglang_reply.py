"""SGLang's /generate replies (sglang 0.4.10's shape): `{"text", "meta_info"}` for each output, built from the engine
core's deltas as they arrive.

    reply = Reply("rid", prompt_ids, params, logprob_start=None, top=0, with_text=False)
    for delta in deltas: reply.add(delta)
    reply.body(token_text, decode)   # {"text": ..., "meta_info": {"id", "finish_reason", "prompt_tokens", ...}}

A streamed reply sends the same body after each step, its `text` and logprob lists cumulative (SGLang's frontend
takes each chunk's text past what it has already read). `finish_reason` is null until the last body, then SGLang's
object: {"type": "stop", "matched": <token id or stop string>}, {"type": "length", "length": <max_new_tokens>} or
{"type": "abort", "message": ...}. Logprob entries are `[logprob, token id, token text or null]`; as SGLang does,
the first prompt position returned (logprob_start_len) has a null logprob, and the top alternatives there are null.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from offload.common.config import SamplingParams
from offload.common.outputs import Delta, RequestMetrics, TokenLogprob

TokenText = Callable[[int], str]  # a token id's text, special tokens spelt out (what logprobs name it)
Decode = Callable[[list[int]], str]  # token ids as the reply's text (special tokens left out)


@dataclass(eq=False)
class Reply:
    """One output of a /generate request: its prompt, its parameters, and what its deltas have brought so far."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    logprob_start: int | None  # SGLang's logprob_start_len, resolved; None: the request asked for no logprobs
    top: int = 0  # top_logprobs_num: alternatives per position
    with_text: bool = False  # return_text_in_logprobs
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # positions logprob_start + 1 on
    finish_reason: str | None = None  # the engine's: "stop", "length" or "abort"
    metrics: RequestMetrics | None = None
    _texts: dict[int, str] = field(default_factory=dict, init=False, repr=False)  # token id -> its text

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.output_ids.extend(delta.token_ids)
        self.output_logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.metrics = delta.finish_reason, delta.metrics

    def body(self, token_text: TokenText, decode: Decode) -> dict:
        return {"text": self.text, "meta_info": self.meta_info(token_text, decode)}

    def meta_info(self, token_text: TokenText, decode: Decode) -> dict:
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_json(decode),
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.metrics.cached_tokens if self.metrics is not None else 0,
        }
        if self.logprob_start is not None:
            meta["input_token_logprobs"] = [self._entry(lp, t, token_text) for t, lp in self._prompt_positions()]
            meta["output_token_logprobs"] = [self._entry(lp, lp.token_id, token_text) for lp in self.output_logprobs]
            if self.top > 0:
                meta["input_top_logprobs"] = [self._top(lp, token_text) for _, lp in self._prompt_positions()]
                meta["output_top_logprobs"] = [self._top(lp, token_text) for lp in self.output_logprobs]
        if self.metrics is not None:
            meta["e2e_latency"] = self.metrics.finished - self.metrics.arrival  # seconds
        return meta

    def finish_json(self, decode: Decode) -> dict | None:
        """SGLang's finish_reason object; None while the output runs."""
        reason = self.finish_reason
        if reason is None:
            return None
        if reason == "length":
            return {"type": "length", "length": self.params.max_new_tokens}
        if reason == "abort":
            return {"type": "abort", "message": "the request was aborted", "status_code": None, "err_type": None}
        last = self.output_ids[-1] if self.output_ids else None
        if last is not None and last in self.params.stop_token_ids:
            return {"type": "stop", "matched": last}
        # a stop string, else the token that ended it: end-of-sequence, or the last one a grammar allowed
        return {"type": "stop", "matched": self._stop_string(decode) or last}

    def _stop_string(self, decode: Decode) -> str | None:
        """The stop string the output reached (the first that occurs in it: the engine stops there), if any."""
        if not self.params.stop:
            return None
        full = decode(self.output_ids)
        found = [(full.find(s), s) for s in self.params.stop if s in full]
        return min(found)[1] if found else None

    def _prompt_positions(self) -> list[tuple[int, TokenLogprob | None]]:
        """(token id, its logprob or None) of each prompt position from logprob_start on; the first has none."""
        start, given = self.logprob_start, self.prompt_logprobs
        return [
            (self.prompt_ids[p], given[p - start - 1] if start < p and p - start - 1 < len(given) else None)
            for p in range(start, len(self.prompt_ids))
        ]

    def _text(self, token_id: int, token_text: TokenText) -> str | None:
        if not self.with_text:
            return None
        if token_id not in self._texts:
            self._texts[token_id] = token_text(token_id)
        return self._texts[token_id]

    def _entry(self, lp: TokenLogprob | None, token_id: int, token_text: TokenText) -> list:
        return [None if lp is None else lp.logprob, token_id, self._text(token_id, token_text)]

    def _top(self, lp: TokenLogprob | None, token_text: TokenText) -> list | None:
        if lp is None or not lp.top:
            return None
        return [[value, t, self._text(t, token_text)] for t, value in lp.top]


def replies_body(replies: list[Reply], batch: bool, token_text: TokenText, decode: Decode) -> dict | list[dict]:
    """The whole reply of a request: one body, or a list of them for a batch (prompt-major, as SGLang orders)."""
    bodies = [r.body(token_text, decode) for r in replies]
    return bodies if batch else bodies[0]
