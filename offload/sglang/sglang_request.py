"""SGLang's POST /generate body (sglang 0.4.10's GenerateReqInput and its `sampling_params`), checked strictly, and
each of its prompts' engine SamplingParams.

Fields that would change the answer and that the engine cannot honour (penalties, min_new_tokens, images, LoRA,
EBNF grammars, per-prompt parameter lists) are refused with a 400 naming the field, unless they hold their neutral
value; fields that change nothing here (rid, log_metrics, routing hints) are taken and ignored; a field SGLang does
not have is refused, so a misspelt one is never silently dropped. Validation errors become `RequestError`s naming the
field, answered with the server's error JSON (offload/openai/protocol.py's RequestError).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from offload.common.config import MAX_LOGPROBS, SamplingParams
from offload.common.errors import OffloadError
from offload.model.structured import grammar_error
from offload.openai.bodies import RequestError, checked, decoded

MAX_BATCH = 64  # engine requests one /generate may make: prompts times n
MAX_N = 8  # samples per prompt
MAX_STOPS = 8  # stop strings
MAX_STOP_TOKEN_IDS = 16
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
GREEDY_BELOW = 1e-6  # SGLang samples greedily below this temperature

# sampling fields the engine has no way to honour: each accepted only at its neutral value
NEUTRAL_SAMPLING = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "skip_special_tokens": True,  # the engine's text never shows special tokens
    "no_stop_trim": False,  # the engine's text never shows the stop string
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "logit_bias": None,
}
# request fields the engine has no way to honour: each accepted only absent, null or false
UNSUPPORTED = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "session_params",
    "custom_logit_processor",
    "token_ids_logprob",
    "return_hidden_states",
)


class GenerateSampling(BaseModel):
    """`sampling_params`, as sglang 0.4.10's SamplingParams takes them (null fields: SGLang's defaults)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = Field(DEFAULT_MAX_NEW_TOKENS, ge=0)  # 0: the prompt only; None: the context's room
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1  # -1: no limit
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    regex: str | None = None
    json_schema: str | None = None  # JSON text, as SGLang takes it
    spaces_between_special_tokens: bool = True  # no special token is shown, so no space between them either
    stream_interval: int | None = None  # how often a stream sends: this engine sends every token
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None

    def check(self) -> None:
        """RequestError(400) naming the first field the engine cannot honour or that is out of range."""
        for name, neutral in NEUTRAL_SAMPLING.items():
            if getattr(self, name) != neutral:
                raise _refused(f"sampling_params.{name}", f"is not supported by this engine; leave it at {neutral!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise _refused("sampling_params.top_k", f"must be -1 (no limit) or at least 1, got {self.top_k}")
        stops = self.stops()
        if len(stops) > MAX_STOPS or not all(stops):
            raise _refused("sampling_params.stop", f"takes up to {MAX_STOPS} non-empty strings")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise _refused("sampling_params.stop_token_ids", f"takes up to {MAX_STOP_TOKEN_IDS} token ids")
        if self.regex is not None and self.json_schema is not None:
            raise _refused("sampling_params.regex", "give at most one of regex and json_schema")
        for name in ("regex", "json_schema"):
            if getattr(self, name) is not None:
                try:
                    error = grammar_error(SamplingParams(**{name: getattr(self, name)}))
                except OffloadError as exc:  # a json_schema that is not JSON
                    error = str(exc)
                if error:
                    raise _refused(f"sampling_params.{name}", error)

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class GenerateRequest(BaseModel):
    """POST /generate: one prompt (`text` a string, `input_ids` a list of ids) or a batch (a list of either),
    answered with one reply or a list of them, as SGLang does."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = Field(None, ge=-1)  # -1 (None): the prompt's last token only
    top_logprobs_num: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None  # the replies' meta_info.id where given
    # taken and ignored: they change nothing this engine answers
    log_metrics: bool = True
    modalities: list[Any] | None = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    data_parallel_rank: int | None = None
    # refused unless absent, null or false (UNSUPPORTED)
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = False

    def check(self) -> None:
        """RequestError(400) naming the first field the engine cannot honour (the fields' types and ranges are
        checked as the body is read)."""
        for name in UNSUPPORTED:
            if getattr(self, name) not in (None, False):
                raise _refused(name, "is not supported by this engine")
        if (self.text is None) == (self.input_ids is None):
            raise RequestError(400, "give exactly one of text and input_ids", "text")
        if isinstance(self.rid, list) and len(self.rid) != len(self.prompts()) * self.sampling().n:
            raise _refused("rid", "a list of rids needs one per reply")
        self.sampling().check()
        if self.input_field() == "input_ids" and not self.input_ids:
            raise _refused("input_ids", "is empty")
        if self.is_batch() and not self.prompts():
            raise _refused(self.input_field(), "is an empty batch")
        if len(self.prompts()) * self.sampling().n > MAX_BATCH:
            raise _refused(self.input_field(), f"prompts times sampling_params.n must be at most {MAX_BATCH}")

    # ---- reading the request -------------------------------------------------------------------------------

    def sampling(self) -> GenerateSampling:
        return self.sampling_params or GenerateSampling()

    def input_field(self) -> str:
        return "text" if self.text is not None else "input_ids"

    def is_batch(self) -> bool:
        """Whether the reply is a list: a list of prompts, or n > 1 (SGLang answers those with a list)."""
        single = isinstance(self.text, str) or (self.text is None and _flat(self.input_ids))
        return not single or self.sampling().n > 1

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        given = self.text if self.text is not None else self.input_ids
        if isinstance(given, str) or _flat(given):
            return [given]
        return list(given)

    def reply_ids(self) -> list[str] | None:
        """The ids the client gave its replies, one per reply (prompt-major, as SGLang orders them); None: none."""
        if self.rid is None:
            return None
        if isinstance(self.rid, str):
            n = len(self.prompts()) * self.sampling().n
            return [self.rid] if n == 1 else [f"{self.rid}-{k}" for k in range(n)]
        return list(self.rid)

    def logprob_start(self, prompt_len: int, index: int) -> int:
        """SGLang's logprob_start_len for a prompt of `prompt_len` tokens: -1 (or none) means its last token."""
        start = self.logprob_start_len
        if start is None or start == -1:
            return prompt_len - 1
        if start >= prompt_len:
            raise _refused(
                "logprob_start_len", f"{start} is past the last token of prompt {index} (it has {prompt_len} tokens)"
            )
        return start

    def engine_params(self, prompt_len: int, context_left: int, index: int) -> SamplingParams:
        """The engine's parameters for prompt `index` of `prompt_len` tokens, with `context_left` tokens of room.

        SGLang reports no logprob for the first position it returns (logprob_start_len): the engine is asked for the
        positions after it."""
        sp = self.sampling()
        wanted = bool(self.return_logprob)
        top = self.top_logprobs_num or 0
        start = self.logprob_start(prompt_len, index) if wanted else prompt_len - 1
        scored = wanted and start + 1 < prompt_len
        budget = context_left if sp.max_new_tokens is None else min(sp.max_new_tokens, context_left)
        return SamplingParams(
            max_new_tokens=budget,
            temperature=0.0 if sp.temperature < GREEDY_BELOW else sp.temperature,
            top_k=max(sp.top_k, 0),
            top_p=sp.top_p,
            min_p=sp.min_p,
            stop=sp.stops(),
            stop_token_ids=tuple(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
            regex=sp.regex,
            json_schema=sp.json_schema,
            logprobs=top if wanted else None,
            prompt_logprobs=top if scored else None,
            prompt_logprobs_start=start + 1 if scored else 0,
        )


def parse(raw: bytes) -> GenerateRequest:
    """A /generate body as a GenerateRequest, or RequestError(400) naming the first bad field."""
    request = checked(decoded(raw), GenerateRequest)
    request.check()
    return request


def _flat(ids: object) -> bool:
    """Whether `ids` is one prompt's token ids (a list of ints), not a batch of them."""
    return isinstance(ids, list) and bool(ids) and all(isinstance(t, int) for t in ids)


def _refused(field: str, why: str) -> RequestError:
    return RequestError(400, f"{field} {why}", field)
