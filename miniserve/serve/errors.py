"""Errors as the HTTP API writes them: OpenAI's error object, mapped once.

Every refusal is a `UserError` (miniserve/core/errors.py) carrying its HTTP status, OpenAI's
error type and code, and the request field at fault; `error_response` writes any of them.
What pydantic finds wrong with a request body is turned into the same 400 (`from_validation`),
never FastAPI's 422. Anything else that escapes a route is a bug here (500), or, for a model
served over the network, its server's failure (502): `as_user_error`.

A refusal for want of room carries `Retry-After` (seconds), as RFC 9110 has it for 429 and 503:
429 when the queue is full (--max-queue requests running or waiting), with the time until
enough places are likely free, from how long requests have held theirs lately (Little's law:
metrics.retry_after; 1 to 60 s), or 1 s where nothing is known yet (a remote model, a fresh
engine); 503 when the engine is shutting down: 5 s (a restart takes seconds).
"""

from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from miniserve.core.errors import UserError
from miniserve.engine.engine import EngineClosed

# seconds a refused client should wait before it asks again, by status, where the refusal
# brings no estimate of its own (see above)
RETRY_AFTER_S = {429: 1, 503: 5}


class APIError(UserError, ValueError):
    """A refusal only the API makes (authentication, a field OpenAI has and we do not, a
    remote model asked for what only a local one can do), with its status, type, code and
    field given where it is raised. A ValueError too, so that pydantic carries it out of a
    field's check (protocol.py) as it does a ConfigError. `retry_after`: the seconds a refusal
    for want of room says to wait (else RETRY_AFTER_S's)."""

    def __init__(
        self,
        message: str,
        field: str | None = None,
        *,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.field, self.status, self.kind, self.code = field, status, kind, code
        self.retry_after = retry_after

    @classmethod
    def busy(cls, error: UserError, retry_after: int | None) -> APIError:
        """`error` (a 429: Busy) as the API answers it, with the seconds to wait."""
        return cls(
            str(error),
            error.field,
            status=error.status,
            kind=error.kind,
            code=error.code,
            retry_after=retry_after,
        )


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the API answers: {"error": {message, type, param, code}}."""

    error: ErrorDetail


def error_body(error: UserError) -> dict:
    return {
        "error": {
            "message": str(error),
            "type": error.kind,
            "param": error.field,
            "code": error.code,
        }
    }


def error_response(error: UserError) -> JSONResponse:
    """The one place a UserError becomes an HTTP response (with Retry-After for 429 and 503)."""
    wait = error.retry_after if isinstance(error, APIError) else None
    wait = wait or RETRY_AFTER_S.get(error.status)
    headers = {"Retry-After": str(wait)} if wait is not None else None
    return JSONResponse(status_code=error.status, content=error_body(error), headers=headers)


def error_event(error: BaseException | None) -> str:
    """An error after a stream has started (its status already sent: 200), reported in-band
    as a server-sent event."""
    if not isinstance(error, UserError):
        reason = error or "the generation ended without its final chunk"
        error = APIError(f"generation failed: {reason}", status=500, kind="server_error")
    return f"data: {json.dumps(error_body(error))}\n\n"


def as_user_error(error: BaseException, model: str, over_network: bool) -> UserError:
    """What a failure while serving `model` means to the client: a UserError as it is; an
    engine shutting down, 503; for a model served over the network, its server failed (502);
    here, a bug (500)."""
    if isinstance(error, UserError):
        return error
    if isinstance(error, EngineClosed):
        return APIError(
            f"model '{model}' is shutting down; try again in a moment",
            status=503,
            kind="server_error",
            code="model_unavailable",
        )
    if over_network:
        return APIError(
            f"model '{model}' failed: {error}",
            status=502,
            kind="server_error",
            code="model_unavailable",
        )
    return APIError(f"generation failed: {error}", status=500, kind="server_error")


def _field(loc: tuple) -> str | None:
    """pydantic's location of an error as the request field, as OpenAI's `param` writes it:
    ("body", "messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def from_validation(error: RequestValidationError) -> UserError:
    """The first problem pydantic found in a request body, as today's 400. Our field checks
    (protocol.py) raise UserErrors whose sentences name the field and the allowed range:
    pydantic carries them in `ctx`; its own findings (a missing field, a body that is not a
    JSON object) are said here in the same words as before."""
    errors = error.errors()
    first = next((e for e in errors if e["type"] == "missing"), errors[0]) if errors else None
    if first is None:
        return APIError("the request body is not valid")
    own = (first.get("ctx") or {}).get("error")
    if isinstance(own, UserError):
        return own
    loc = tuple(first.get("loc", ()))
    if first["type"] == "json_invalid":
        return APIError("the request body is not valid JSON")
    if loc in ((), ("body",)):
        return APIError("the request body must be a JSON object")
    field = _field(loc)
    if first["type"] == "missing":
        return APIError(f"'{field}' is required", field)
    message = str(own) if own is not None else first.get("msg", "is not valid")
    return APIError(f"'{field}': {message}", field)
