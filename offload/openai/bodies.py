"""A request body as every face checks it: JSON decoded, then validated into a strict pydantic model, each failure
a `RequestError` naming the field (the OpenAI routes and batch lines through offload/openai/protocol.py, SGLang's
/generate through offload/sglang/sglang_request.py). The error carries OpenAI's error JSON, which every route
answers with."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, the offending field, OpenAI's error type and code."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code=None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def decoded(raw: bytes) -> object:
    """A request body's JSON value, or RequestError(400)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON ({exc})") from None


def checked(body: object, model: type[M]) -> M:
    """A decoded request body as `model`, or RequestError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"] if not _type_tag(part))
        raise RequestError(400, f"{field or 'body'}: {err['msg']}", field or None) from None


def _type_tag(part: str | int) -> bool:
    """Whether a part of a pydantic error location names a member of a union type rather than a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in part)
