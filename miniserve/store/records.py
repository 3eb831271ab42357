"""What the store holds and says: messages, conversation summaries, branches, its errors, and
text as it is stored."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from miniserve.core.errors import NotServed, UserError
from miniserve.core.text import clean_text

ROLES = ("user", "assistant")
STATUSES = ("complete", "stopped")
TITLE_CHARS = 60


class StoreError(UserError, ValueError):
    """What a user can be told as it is: a conversation not found, a bad import, a bad title."""


class NotFound(StoreError, NotServed):
    pass


class BadImport(StoreError):
    pass


@dataclass(frozen=True)
class Message:
    id: str
    conversation_id: str
    parent_id: str | None
    role: str
    content: str
    created: float
    status: str = "complete"
    settings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Summary:
    id: str
    title: str
    system: str
    created: float
    updated: float
    leaf: str | None
    messages: int


@dataclass(frozen=True)
class Branch:
    """Where a message sits among its siblings: `index` of `count` (1-based)."""

    index: int
    count: int


def clean(text: str) -> str:
    """Text as it is stored: valid UTF-8, no control characters but newlines and tabs."""
    return clean_text(text)


def title_from(text: str) -> str:
    """A conversation's title from its first message: the first line, cut to TITLE_CHARS."""
    line = next((ln.strip() for ln in clean(text).splitlines() if ln.strip()), "")
    line = " ".join(line.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def as_dict(message: Message) -> dict:
    return asdict(message)
