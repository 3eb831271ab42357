"""Errors as the HTTP API writes them: OpenAI's error object, mapped once.

Every refusal is a `UserError` (miniserve/core/errors.py) carrying its HTTP status, OpenAI's
error type and code, and the request field at fault; `error_response` writes any of them.
What pydantic finds wrong with a request body is worded once (`explain`: the field, as
`param`, and what its declaration allows) and answered as the same 400, never FastAPI's 422.
Anything else that escapes a route is a bug here (500), or, for a model served over the
network, its server's failure (502): `as_user_error`.

A refusal for want of room carries `Retry-After` (seconds), as RFC 9110 has it for 429 and 503:
429 when the queue is full (--max-queue requests running or waiting), with the time until
enough places are likely free, from how long requests have held theirs lately (Little's law:
metrics.retry_after; 1 to 60 s), or 1 s where nothing is known yet (a remote model, a fresh
engine); 503 when the engine is shutting down: 5 s (a restart takes seconds).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Allowed:
    """What a field takes, in words, where no one type says it (a string or a list of them, a
    name or an object): put in the field's Annotated declaration, it is the sentence a refusal
    of the field reads, "'stop' must be <text>". `within`: also for what is wrong inside its
    value (False: only for the value as a whole, and an entry's own range still named)."""

    text: str
    within: bool = True


def _number(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _describe(node: dict) -> str:
    """A number's declared range as the messages write it: [0, 2], (0, 1], one of 0, 2."""
    if "enum" in node:
        return "one of " + ", ".join(_number(c) for c in node["enum"])
    low = node.get("exclusiveMinimum", node.get("minimum"))
    high = node.get("exclusiveMaximum", node.get("maximum"))
    left = "(-inf" if low is None else ("(" if "exclusiveMinimum" in node else "[") + _number(low)
    right = "inf)" if high is None else _number(high) + (")" if "exclusiveMaximum" in node else "]")
    return f"{left}, {right}"


def _resolve(node: dict | None, defs: dict) -> dict | None:
    """A JSON Schema node with its $ref followed and its null alternative dropped; a node of
    several alternatives is returned as it is (what is inside it is not one place)."""
    while node is not None:
        if "$ref" in node:
            node = defs.get(node["$ref"].rsplit("/", 1)[-1])
            continue
        alternatives = [n for n in node.get("anyOf", ()) if n != {"type": "null"}]
        if len(alternatives) != 1:
            return node
        node = alternatives[0]
    return None


def _place(loc: tuple, schema: dict | None) -> tuple[str, dict | None]:
    """Where an error is, as OpenAI's `param` writes it ("messages[0].role", a dict's key in
    brackets: "logit_bias[5]"), and the declared schema of the value there, read from the
    request's JSON Schema (None where the path leaves it: a union's alternatives)."""
    defs = (schema or {}).get("$defs", {})
    node, out = schema, ""
    for part in loc:
        node = _resolve(node, defs)
        tags = ((node or {}).get("discriminator") or {}).get("mapping", {})
        if isinstance(part, str) and part in tags:  # a tagged union's tag: not a field
            node = {"$ref": tags[part]}
            continue
        if node is not None and isinstance(part, int) and isinstance(node.get("items"), dict):
            node = node["items"]
        elif node is not None and part in node.get("properties", {}):
            node = node["properties"][part]
        elif node is not None and isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
            out += f"[{part}]"
            continue
        else:
            node = None
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out, _resolve(node, defs)


def _refused_number(field: str, value, node: dict) -> str:
    """A number outside its declaration, in the sentence every numeric setting has (the kind
    first, then the range): "'top_p' must be a number (0, 1], got 'all'"."""
    whole = node.get("type") == "integer"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a whole number" if whole else "a number"
    elif whole and isinstance(value, float) and not value.is_integer():
        kind = "a whole number"
    elif isinstance(value, float) and not math.isfinite(value):
        kind = "a finite number"
    else:
        kind = "" if "enum" in node else "in"
    return f"'{field}' must be {kind + ' ' if kind else ''}{_describe(node)}, got {value!r}"


def explain(
    errors: list[dict], schema: dict | None = None, allowed: dict[str, Allowed] | None = None
) -> UserError:
    """The first problem pydantic found in a request body, as the API's 400: the one place its
    findings become sentences naming the field (`param`) and what it allows. A UserError a
    check raised (a rule across fields, what no type can say) is carried as it is. Else the
    sentence comes from pydantic's error type, the value sent and the field's declaration:
    `schema` is the request's JSON Schema (the ranges it documents are the ones stated),
    `allowed` the Allowed of the request's fields, by name."""
    if not errors:
        return APIError("the request body is not valid")
    first = next((e for e in errors if e["type"] == "missing"), errors[0])
    own = (first.get("ctx") or {}).get("error")
    if isinstance(own, UserError):
        return own
    kind, ctx, value = first["type"], first.get("ctx") or {}, first.get("input")
    loc = tuple(first.get("loc", ()))
    loc = loc[1:] if loc[:1] == ("body",) else loc
    if kind == "json_invalid":
        return APIError("the request body is not valid JSON")
    if not loc:
        return APIError("the request body must be a JSON object")
    field, node = _place(loc, schema)
    said = (allowed or {}).get(loc[0]) if isinstance(loc[0], str) else None
    if kind == "too_long" and node is not None and "max_length" in ctx:
        items = "entries" if node.get("type") == "object" else "items"
        items = "strings" if node.get("items", {}).get("type") == "string" else items
        return APIError(
            f"'{field}' may hold at most {ctx['max_length']} {items}, got {len(value)}", field
        )
    if said is not None and (len(loc) == 1 or said.within or node is None):
        return APIError(f"'{loc[0]}' must be {said.text}", loc[0])
    if kind == "missing":
        return APIError(f"'{field}' is required", field)
    if node is not None and ("enum" in node or node.get("type") in ("integer", "number")):
        if all(isinstance(c, (int, float)) for c in node.get("enum", ())):
            return APIError(_refused_number(field, value, node), field)
    if kind == "bool_type" or (node or {}).get("type") == "boolean":
        return APIError(f"'{field}' must be true or false", field)
    if kind == "string_type":
        return APIError(f"'{field}' must be a string", field)
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return APIError(f"'{field}' must be an object", field)
    if kind == "string_too_short" and ctx.get("min_length") == 1:
        return APIError(f"'{field}' must be a non-empty string", field)
    message = str(own) if own is not None else first.get("msg", "is not valid")
    return APIError(f"'{field}': {message}", field)


def from_validation(error: RequestValidationError) -> UserError:
    """What FastAPI found wrong with a request (a body that is not JSON, or not an object), or
    what the request's model refused (protocol.py: already the sentence `explain` made), as
    the API's 400."""
    return explain(error.errors())
