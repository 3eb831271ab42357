"""Tool calls as the model families write them, parsed as the text arrives.

Each family is one `ToolFormat` in `FORMATS`. A reply is content, then possibly *call regions*:
a region starts after the format's opener and ends at its closer, at the next opener, or at
the end of the reply. With `bare_json` (Llama 3, told to answer with the JSON alone) a reply
whose first non-space character is `{` is also a region, from that `{` to the end. Inside a
region the rules are the same for every family:

- a call is a JSON object `{"name": NAME, "arguments": {...}}` (`"parameters"` is taken too;
  other keys are ignored; no arguments means `{}`; arguments given as a JSON string holding an
  object are taken as that string);
- with `args_marker` (Mistral v11+) a call may also be `NAME[ARGS]{...}` — the name is the text
  before its first `[` (so a `[CALL_ID]...` before `[ARGS]` is skipped), then the arguments;
- between calls, whitespace and the list punctuation `[ ] , ;` are skipped, so a region holds
  one call, several in a row (Hermes parallel calls, Llama's `;`), or a JSON list of them
  (Mistral v3);
- anything else in a region (text, bad JSON, a call without a name, arguments that are not an
  object, a region with no call) is an error: the region is not parsed further and the error is
  reported in `errors`, never raised — the caller may then give the whole reply back as text.

Content is the text outside regions; whitespace right before an opener or right after a
region is dropped (it separates calls, it is not text). A reply with no call region comes back
as content unchanged.

The text must be decoded with special tokens KEPT (`<tool_call>`, `<|python_tag|>` and
`[TOOL_CALLS]` are special tokens that `skip_special_tokens` drops), from the first generated
token: `CallStream` takes the whole reply, openers included.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

ARGS_KEYS = ("arguments", "parameters")
_SKIP = " \t\r\n[],;"  # between calls
_NAME = re.compile(r"[\w.:\-]+")
_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """OpenAI's shape of a call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls (see the module's rules for what a region holds)."""

    name: str
    opener: str  # the text (a special token) that opens a call region
    closer: str | None  # the text that closes it; None: the region runs to the reply's end
    markers: tuple[str, ...]  # a chat template holding any of these is this family's
    bare_json: bool = False  # a reply whose first non-space character is `{` is a call region
    args_marker: str | None = None  # between a bare name and its arguments: NAME[ARGS]{...}

    def detect(self, template: str) -> bool:
        return any(marker in template for marker in self.markers)


FORMATS: tuple[ToolFormat, ...] = (
    # Qwen2.5 / Qwen3 / Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>,
    # one block a call; both tags are single added tokens in Qwen's tokenizer.
    ToolFormat("hermes", "<tool_call>", "</tool_call>", ("<tool_call>",)),
    # Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3 tokenizer) or
    # [TOOL_CALLS]name[ARGS]{...}, repeated for parallel calls (v11+ tokenizers: Small 3.2).
    ToolFormat(
        "mistral",
        "[TOOL_CALLS]",
        None,
        ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]"),
        args_marker="[ARGS]",
    ),
    # Llama 3.1 / 3.2 / 3.3 JSON tool calling: the reply is {"name": ..., "parameters": {...}},
    # several separated by `;`, optionally after <|python_tag|>. The markers: 3.1's template
    # holds <|python_tag|>; all of them instruct 'Respond in the format {"name": function
    # name, "parameters": dictionary of argument name and its value}'.
    ToolFormat(
        "llama3",
        "<|python_tag|>",
        None,
        (
            "<|python_tag|>",
            '"parameters": dictionary of argument name',
            "Given the following functions, please respond with a JSON",
        ),
        bare_json=True,
    ),
)


def detect_format(template: str | None) -> ToolFormat | None:
    """The first format whose markers the chat template holds; None without one."""
    return next((f for f in FORMATS if template and f.detect(template)), None)


def get_format(name: str) -> ToolFormat:
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(f"no tool-call format {name!r}; known: {', '.join(f.name for f in FORMATS)}")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments object, as generated (trimmed)

    def to_openai(self) -> dict:
        """The entry of a chat completion message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class Parsed(NamedTuple):
    content: str  # the reply's text outside call regions
    calls: list[ToolCall]  # the calls that parsed, in order
    errors: list[str]  # one line per call region (or part of one) that did not parse


class CallStream:
    """Parses a whole reply piece by piece (openers included, special tokens kept).

    `feed(piece)` and then `finish()` each return `(content, tool_call_deltas)`: the content
    text that is now certain, and OpenAI streaming `delta.tool_calls` entries. A call's first
    entry is `{"index", "id", "type": "function", "function": {"name", "arguments"}}`, sent as
    soon as its name is known; later ones `{"index", "function": {"arguments": piece}}`. The
    arguments stream as raw generated text: what is held back is the trailing whitespace of the
    value, a possible partial closer or opener, and, for arguments given as a JSON string, the
    whole value (sent decoded when it ends). The pieces of a call join to its final `arguments`
    exactly. After `finish()`: `content`, `calls` (each with the id its deltas carried) and
    `errors` (a call that streamed and then failed to parse keeps its index, and is in
    `errors`, not `calls`).
    """

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id):
        self.fmt, self.new_id = fmt, new_id
        self.content = ""
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []
        self._pending = ""  # received, not yet given out as content nor to a region
        self._region: _Region | None = None
        self._undecided = fmt.bare_json  # only whitespace so far: a `{` would open a region
        self._after_call = False  # whitespace that follows a region is dropped
        self._text: list[str] = []
        self._deltas: list[dict] = []
        self._count = 0  # calls begun: the next call's index

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self._pending += piece
        self._run(final=False)
        return self._flush()

    def finish(self) -> tuple[str, list[dict]]:
        self._run(final=True)
        return self._flush()

    def result(self) -> Parsed:
        return Parsed(self.content, list(self.calls), list(self.errors))

    # -- the split into content and call regions

    def _run(self, final: bool) -> None:
        while self._content_step(final) if self._region is None else self._region_step(final):
            pass

    def _content_step(self, final: bool) -> bool:
        """Give out the content before an opener (True: a region opened) or all that is sure."""
        text, opener = self._pending, self.fmt.opener
        if self._undecided:
            if not (text.strip() or final):
                return False
            self._undecided = False
            if text.lstrip().startswith("{"):
                self._pending = text.lstrip()
                self._region = _Region(self)
                return True
        at = text.find(opener)
        if at >= 0:
            self._say(text[:at].rstrip())
            self._pending = text[at + len(opener) :]
            self._region = _Region(self)
            return True
        cut = len(text) if final else len(text[: len(text) - _partial(text, (opener,))].rstrip())
        self._say(text[:cut])
        self._pending = text[cut:]
        return False

    def _region_step(self, final: bool) -> bool:
        """Pass the region its text up to its end (True: it ended, more may follow)."""
        text, closer = self._pending, self.fmt.closer
        ends = [m for m in (closer, self.fmt.opener) if m]
        hits = [(text.find(m), m) for m in ends if m in text]
        if hits:
            at, mark = min(hits)
            self._region.feed(text[:at])
            self._pending = text[at + len(mark) :] if mark == closer else text[at:]
        else:
            cut = len(text) if final else len(text) - _partial(text, ends)
            self._region.feed(text[:cut])
            self._pending = text[cut:]
            if not final:
                return False
        self._region.close()
        self._region, self._after_call = None, True
        return True

    def _say(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            self._after_call = False
            self._text.append(text)
            self.content += text

    def _flush(self) -> tuple[str, list[dict]]:
        text, deltas = "".join(self._text), self._deltas
        self._text, self._deltas = [], []
        return text, deltas

    # -- what regions report

    def _begin(self, name: str) -> tuple[int, str]:
        index, call_id = self._count, self.new_id()
        self._count += 1
        function = {"name": name, "arguments": ""}
        self._deltas.append(
            {"index": index, "id": call_id, "type": "function", "function": function}
        )
        return index, call_id

    def _arguments(self, index: int, piece: str) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += piece
        else:
            self._deltas.append({"index": index, "function": {"arguments": piece}})


def _partial(text: str, marks) -> int:
    """The length of the longest end of `text` that begins one of `marks`."""
    return max((k for m in marks for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


@dataclass
class _Call:
    """Where the scan of one call stands; positions index the region's text."""

    start: int
    depth: int = 0  # JSON nesting, outside strings
    in_str: bool = False
    esc: bool = False
    expect: str = "key"  # at the object's top level: key, key_str, colon, value, in_value
    key: str | None = None
    key_start: int = 0
    val_key: str | None = None
    val_start: int = 0
    val_last: int = 0  # the value's last character that is not whitespace
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    index: int | None = None  # the stream index, once the first delta is out
    id: str = ""
    sent: int = 0  # characters of the arguments given out


class _Region:
    """One call region's text, scanned once, character by character."""

    def __init__(self, stream: CallStream):
        self.stream = stream
        self.text = ""
        self.pos = 0
        self.state = "between"  # between, object, name, value, failed
        self.call: _Call | None = None
        self.count = 0
        self.failure: tuple[str, int] | None = None  # why, and from where

    def feed(self, piece: str) -> None:
        self.text += piece
        while self.pos < len(self.text) and self.state != "failed":
            getattr(self, "_" + self.state)(self.text[self.pos])
            self.pos += 1
        self._send()

    def close(self) -> None:
        if self.state in ("object", "name", "value"):
            self._fail("incomplete call", self.call.start)
        elif self.state == "between" and not self.count:
            self._fail("no call after the opener", 0)
        if self.failure:
            why, at = self.failure
            self.stream.errors.append(f"{why}: {self.text[at:].strip()[:200]!r}")

    def _fail(self, why: str, at: int) -> None:
        self.state, self.failure = "failed", (why, at)

    def _between(self, ch: str) -> None:
        if ch in _SKIP:
            return
        self.call = _Call(start=self.pos)
        self.count += 1
        if ch == "{":
            self.state = "object"
            self._object(ch)
        elif self.stream.fmt.args_marker:
            self.state = "name"
        else:
            self._fail("not a call", self.pos)

    def _json(self, ch: str) -> bool:
        """Track strings and nesting; True where the character is not insignificant space."""
        c = self.call
        if c.in_str:
            if c.esc:
                c.esc = False
            elif ch == "\\":
                c.esc = True
            elif ch == '"':
                c.in_str = False
            return True
        if ch == '"':
            c.in_str = True
        elif ch in "{[":
            c.depth += 1
        elif ch in "}]":
            c.depth -= 1
        return not ch.isspace()

    def _object(self, ch: str) -> None:
        c, pos = self.call, self.pos
        top = not c.in_str and c.depth == 1  # this character is at the object's top level
        significant = self._json(ch)
        if c.expect == "in_value":
            if top and ch in ",}":
                self._value_end()
                c.expect = "key"
            elif significant:
                c.val_last = pos
        elif c.expect == "key" and top and ch == '"':
            c.key_start, c.expect = pos, "key_str"
        elif c.expect == "key_str" and not c.in_str:
            c.key, c.expect = _loads(self.text[c.key_start : pos + 1]), "colon"
        elif c.expect == "colon" and top and ch == ":":
            c.expect = "value"
        elif c.expect == "value" and significant:
            c.val_key, c.val_start, c.val_last, c.expect = c.key, pos, pos, "in_value"
            if c.key in ARGS_KEYS and c.args_start is None:
                c.args_start = pos
        if c.depth == 0:
            self._end_call(obj=_loads(self.text[c.start : pos + 1], None))

    def _value_end(self) -> None:
        c = self.call
        if c.val_key == "name" and c.name is None:
            name = _loads(self.text[c.val_start : c.val_last + 1])
            if isinstance(name, str) and _NAME.fullmatch(name):
                c.name = name
        elif c.val_key in ARGS_KEYS and c.args_start == c.val_start:
            c.args_end = c.val_last

    def _name(self, ch: str) -> None:
        c = self.call
        if ch == "{":
            name = self.text[c.start : self.pos].split("[")[0].strip()
            if not _NAME.fullmatch(name):
                self._fail("not a call", c.start)
                return
            c.name, c.val_key, c.expect = name, "arguments", "in_value"
            c.args_start = c.val_start = c.val_last = self.pos
            self.state = "value"
            self._value(ch)
        elif ch.isspace() or ch in '"}:':
            self._fail("not a call", c.start)

    def _value(self, ch: str) -> None:
        c = self.call
        if self._json(ch):
            c.val_last = self.pos
        if c.depth == 0:
            c.args_end = self.pos
            self._end_call(obj=None)

    def _send(self) -> None:
        """Give out the first delta once the name is known, then the arguments seen so far."""
        c = self.call
        if c is None or c.name is None or self.state == "failed":
            return
        if c.index is None:
            c.index, c.id = self.stream._begin(c.name)
        if c.args_start is None or self.text[c.args_start] == '"':
            return  # no arguments yet, or a JSON string: sent decoded when it ends
        open_args = c.expect == "in_value" and c.val_key in ARGS_KEYS and c.args_end is None
        last = c.val_last if open_args else c.args_end
        if last is not None and last + 1 > c.args_start + c.sent:
            piece = self.text[c.args_start + c.sent : last + 1]
            c.sent += len(piece)
            self.stream._arguments(c.index, piece)

    def _end_call(self, obj) -> None:
        """A call's text is complete: check it, send the rest of its arguments, record it."""
        c = self.call
        self._send()
        arguments, why = self._final_arguments(c, obj)
        if why:
            self._fail(why, c.start)
            return
        if arguments[c.sent :]:
            self.stream._arguments(c.index, arguments[c.sent :])
        self.stream.calls.append(ToolCall(c.id, c.name, arguments))
        self.state, self.call = "between", None

    def _final_arguments(self, c: _Call, obj) -> tuple[str, str | None]:
        """The call's final arguments text, or why the call is malformed."""
        if self.state == "object" and not isinstance(obj, dict):
            return "", "not a JSON object"
        raw = None if c.args_start is None else self.text[c.args_start : c.args_end + 1]
        if self.state == "object":  # the whole call was one JSON object
            if c.name is None or obj.get("name") != c.name:
                return "", "no name (a JSON string of letters, digits, _ . : -)"
            given = next((obj[k] for k in ARGS_KEYS if k in obj), {})
            if raw is not None and not raw.startswith('"') and _loads(raw) != given:
                return "", "arguments given twice"
            if isinstance(given, str):
                raw = given
        text = "{}" if raw is None else raw
        if not isinstance(_loads(text), dict):
            return "", "arguments are not a JSON object"
        return text, None


_NOTHING = object()


def _loads(text: str, default=_NOTHING):
    try:
        return json.loads(text)
    except ValueError:
        return default


def parse(fmt: ToolFormat, text: str, new_id: Callable[[], str] = new_call_id) -> Parsed:
    """A whole reply at once: the same scan as streaming, fed in one piece."""
    stream = CallStream(fmt, new_id)
    stream.feed(text)
    stream.finish()
    return stream.result()
