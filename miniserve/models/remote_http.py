"""Talking to a remote server (miniserve/models/remote.py): the timeouts, the errors a remote
model raises, and what an answer that is not the one asked for says (an error body's message,
a few words on a body that is not JSON, why the network failed)."""

from __future__ import annotations

import httpx

from miniserve.core.config import ConfigError

# A slow server may take minutes over a long prompt before its first token: reads wait long,
# connecting does not (an address that does not answer is said at once).
TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=30.0)
PROBE_TIMEOUT = httpx.Timeout(connect=5.0, read=15.0, write=15.0, pool=15.0)


class RemoteError(RuntimeError):
    """A remote server failed (unreachable, an error, a reply that is not OpenAI's format, a
    stream cut off). `status`: its HTTP status, when it sent one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteRefused(ConfigError):
    """The server refused the request (400, 413, 422): its own message, and the field it
    named, if any."""


def _json(r: httpx.Response):
    try:
        return r.json()
    except (ValueError, RuntimeError):  # not JSON; or the body could not be read
        return None


def _error_message(data) -> str | None:
    """The message of an error body: OpenAI's {"error": {"message"}}, {"error": "..."},
    vLLM's {"object": "error", "message"}, FastAPI's {"detail": ...}."""
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    if data.get("object") == "error" and data.get("message"):
        return str(data["message"])
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail:  # FastAPI's validation errors
        first = detail[0] if isinstance(detail[0], dict) else {}
        where = ".".join(str(x) for x in first.get("loc", [])[1:])
        return f"'{where}': {first.get('msg', detail[0])}" if where else str(first.get("msg"))
    return None


def _what(r: httpx.Response) -> str:
    """What a body that is not what was asked for looks like, in a few words."""
    kind = r.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    try:
        text = r.text
    except (ValueError, RuntimeError):
        text = ""
    if "html" in kind or text.lstrip()[:15].lower().startswith(("<!doctype", "<html")):
        return "an HTML page"
    return f"{kind}: {_snippet(text)}" if text.strip() else f"an empty {kind} body"


def _snippet(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


def _network_reason(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.ConnectTimeout):
        return f"no answer within {TIMEOUT.connect:.0f} s"
    if isinstance(e, httpx.ConnectError):
        return "connection refused or host unknown (is the server running?)"
    if isinstance(e, httpx.TimeoutException):
        return "it took too long to answer"
    if isinstance(e, httpx.UnsupportedProtocol):
        return "not an http:// or https:// address"
    return f"{type(e).__name__}: {str(e) or 'the connection broke'}"
