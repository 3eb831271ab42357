"""What a person using miniserve should see when something they asked for cannot be done.

Every error meant for the user derives from `UserError`; each surface maps it once:
the HTTP API to a status and OpenAI's error body (`status`, `kind`, `code`, `field`), the web
app to its status line (`describe()`), the CLI to "error: ..." and exit code 2. Anything else
that escapes is a bug, and each surface reports it as one (HTTP 500, a line, exit code 1).
"""

from __future__ import annotations


class UserError(Exception):
    """A request that cannot be served as asked: the message names what (the field, the file,
    the model) and says what is allowed."""

    status = 400  # the HTTP status that means it
    kind = "invalid_request_error"  # OpenAI's error type
    code: str | None = None  # OpenAI's error code, where it has one
    field: str | None = None  # the request field (or flag) at fault, where there is one

    def describe(self) -> str:
        """The sentence a person reads (the UI's status line, the CLI's error line)."""
        return str(self)


class Busy(UserError):
    """Every place is taken: try again in a moment."""

    status = 429
    kind = "rate_limit_error"
    code = "server_busy"


class NotServed(UserError):
    """A thing asked for by name that is not here (a model, a conversation)."""

    status = 404
    code = "not_found"


class Unavailable(UserError):
    """A model that could not be loaded or reached; the others keep working."""

    status = 502
    kind = "server_error"
    code = "model_unavailable"
