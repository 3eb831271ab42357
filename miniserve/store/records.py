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
    # a reply's reasoning (a thinking model's <think> part), kept apart from its text
    reasoning: str = ""
    # the tools a reply called: [{"id": str, "name": str, "arguments": str (JSON text)}]
    tool_calls: list = field(default_factory=list)


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


TOOL_CALL_KEYS = ("id", "name", "arguments")


def tool_calls(value, where: str = "tool_calls", error: type[StoreError] = StoreError) -> list:
    """A reply's tool calls as they are stored: a list of {"id", "name", "arguments"}, each a
    string (the name not empty; the arguments the JSON text the model wrote, kept as written
    even when it does not parse), cleaned like all text. Anything else raises `error` naming
    where (`where`: what the list is called in the message)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise error(f"'{where}' must be a list of tool calls, got {type(value).__name__}")
    out = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise error(
                f"'{at}' must be an object with {', '.join(TOOL_CALL_KEYS)}, "
                f"got {type(call).__name__}"
            )
        extra = sorted(str(k) for k in call if k not in TOOL_CALL_KEYS)
        if extra:
            raise error(
                f"'{at}' has {', '.join(map(repr, extra))}; a tool call has only "
                f"{', '.join(TOOL_CALL_KEYS)}"
            )
        for key in TOOL_CALL_KEYS:
            if not isinstance(call.get(key), str):
                got = "nothing" if key not in call else type(call[key]).__name__
                raise error(f"'{at}.{key}' must be a string, got {got}")
        if not call["name"].strip():
            raise error(f"'{at}.name' is empty; a tool call names the tool it calls")
        out.append({key: clean(call[key]) for key in TOOL_CALL_KEYS})
    return out


def reply_extras(
    role, reasoning, calls, at: str, error, reasoning_key: str = "reasoning"
) -> tuple[str, list]:
    """A message's reasoning and tool calls as they are stored, checked: strings and
    `tool_calls`; only a reply has them. Faults raise `error` naming where (`at`: the
    message's place, with its dot, in an import; "" for Store.add; `reasoning_key`: what the
    reasoning is called there)."""
    if reasoning is None:
        reasoning = ""
    if not isinstance(reasoning, str):
        raise error(f"'{at}{reasoning_key}' must be a string, got {type(reasoning).__name__}")
    calls = tool_calls(calls, at + "tool_calls", error)
    if role != "assistant" and (reasoning or calls):
        key = reasoning_key if reasoning else "tool_calls"
        raise error(
            f"'{at}{key}' is given for a {role} message; only a reply (an assistant "
            "message) has reasoning or tool calls"
        )
    return clean(reasoning), calls


def as_dict(message: Message) -> dict:
    return asdict(message)
