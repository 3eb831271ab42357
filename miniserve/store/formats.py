"""The formats conversations leave and enter the store in: miniserve's own export (the whole
tree, settings and stats, replies' reasoning and tool calls; `miniserve.conversation(s)`,
version EXPORT_VERSION, documented in README.md), Markdown, plain text and an OpenAI
`messages` list of the open branch; imports of the first and the last, checked completely
before anything is written (BadImport names where).

A reply's reasoning and tool calls: in the export, "reasoning" and "tool_calls" on every
message ("" and [] for none; an export without them, as older versions wrote, imports with
none); in the OpenAI list, "reasoning_content" and "tool_calls" in OpenAI's shape (content
null when a reply with tool calls has no text); in Markdown, a folded "Thinking" block above
the reply and a fenced json block per tool call; in plain text, a "Thinking:" section."""

from __future__ import annotations

import json
import re
import time

from miniserve.core.config import MAX_IMPORT_BYTES
from miniserve.store.records import (
    ROLES,
    STATUSES,
    BadImport,
    Message,
    StoreError,
    Summary,
    clean,
    reply_extras,
    title_from,
)

EXPORT_FORMAT = "miniserve.conversation"  # one conversation
EXPORT_ALL_FORMAT = "miniserve.conversations"  # all of an owner's
EXPORT_VERSION = 1


# -- writing ----------------------------------------------------------------------------------
def export_tree(conv: Summary, rows) -> dict:
    """The whole tree, settings and stats included. Message ids are positions in the list;
    a parent always comes before its children. `rows`: the conversation's messages in the
    order they were added."""
    index = {r["id"]: i for i, r in enumerate(rows)}
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "title": conv.title,
        "system": conv.system,
        "created": conv.created,
        "updated": conv.updated,
        "current": index.get(conv.leaf),
        "messages": [
            {
                "id": i,
                "parent": index.get(r["parent_id"]),
                "role": r["role"],
                "content": r["content"],
                "created": r["created"],
                "status": r["status"],
                "settings": json.loads(r["settings"]),
                "stats": json.loads(r["stats"]),
                "reasoning": r["reasoning"],
                "tool_calls": json.loads(r["tool_calls"]),
            }
            for i, r in enumerate(rows)
        ],
    }


def export_all(trees: list[dict]) -> dict:
    return {"format": EXPORT_ALL_FORMAT, "version": EXPORT_VERSION, "conversations": trees}


def openai_messages(conv: Summary, path: list[Message]) -> list[dict]:
    """The open branch as an OpenAI `messages` list (the system prompt first). A reply's
    reasoning is its "reasoning_content"; its tool calls are "tool_calls" in OpenAI's shape,
    with content null when it has no text."""
    return ([{"role": "system", "content": conv.system}] if conv.system else []) + [
        _openai_message(m) for m in path
    ]


def _openai_message(m: Message) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["content"] = m.content or None
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in m.tool_calls
        ]
    return out


def _fence(text: str) -> str:
    """A code fence longer than any run of backticks in `text`."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _code(text: str) -> str:
    """`text` as inline code, whatever backticks it holds."""
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def markdown(conv: Summary, path: list[Message]) -> str:
    """The open branch as Markdown. A reply's reasoning is a folded <details> block
    ("Thinking") above its text; each tool call a fenced json block of its arguments under
    its name."""
    parts = [f"# {conv.title or 'Conversation'}", ""]
    if conv.system:
        parts += ["**System:**", "", conv.system, ""]
    for m in path:
        parts += [
            f"**{m.role.capitalize()}:**" + (" *(stopped)*" if m.status == "stopped" else ""),
            "",
        ]
        if m.reasoning:
            # a line of the reasoning that closed the block would end it early
            folded = m.reasoning.replace("</details>", "&lt;/details&gt;")
            parts += ["<details><summary>Thinking</summary>", "", folded, "", "</details>", ""]
        if m.content or not m.tool_calls:
            parts += [m.content, ""]
        for c in m.tool_calls:
            fence = _fence(c["arguments"])
            parts += [
                f"**Tool call:** {_code(c['name'])}",
                "",
                f"{fence}json",
                c["arguments"],
                fence,
                "",
            ]
    return "\n".join(parts)


def plain_text(conv: Summary, path: list[Message]) -> str:
    """The open branch as plain text. A reply's reasoning is a "Thinking:" section, indented,
    above its text; each tool call a line with its name and arguments."""
    parts = [conv.title or "Conversation", ""]
    if conv.system:
        parts += ["System:", conv.system, ""]
    for m in path:
        parts.append(f"{m.role.capitalize()}:" + (" (stopped)" if m.status == "stopped" else ""))
        if m.reasoning:
            parts += ["Thinking:", *("    " + ln if ln else "" for ln in m.reasoning.split("\n"))]
            parts.append("")
        if m.content or not m.tool_calls:
            parts += [m.content, ""]
        for c in m.tool_calls:
            parts += [f"Tool call {c['name']}: {c['arguments']}", ""]
    return "\n".join(parts)


def as_text(kind: str, tree, conv: Summary, path: list[Message]) -> tuple[str, str]:
    """An export as a file's text and suffix: "json" (the whole tree, `tree()`), "md" (the
    open branch as Markdown), "txt" (the open branch as plain text) or "openai" (the open
    branch as a `messages` list)."""
    if kind == "json":
        return json.dumps(tree(), indent=2, ensure_ascii=False), ".json"
    if kind == "md":
        return markdown(conv, path), ".md"
    if kind == "txt":
        return plain_text(conv, path), ".txt"
    if kind == "openai":
        return json.dumps(
            openai_messages(conv, path), indent=2, ensure_ascii=False
        ), ".messages.json"
    raise StoreError(f"unknown export {kind!r} (json, md, txt or openai)")


# -- reading ----------------------------------------------------------------------------------
def read_import(data) -> list[dict]:
    """An export (one conversation or all), or a plain OpenAI `messages` list (a JSON list, or
    an object with "messages"), as bytes, str or parsed JSON: the trees to insert. Any fault
    raises BadImport naming where."""
    if isinstance(data, (bytes, bytearray, str)):
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        if len(raw) > MAX_IMPORT_BYTES:
            raise BadImport(
                f"the file is {len(raw) / 1e6:.1f} MB; an import may be at most "
                f"{MAX_IMPORT_BYTES / 1e6:.0f} MB"
            )
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise BadImport("the file is not text (UTF-8 JSON expected)") from None
        except json.JSONDecodeError as e:
            raise BadImport(
                f"the file is not JSON: {e.msg} at line {e.lineno}, column {e.colno}"
            ) from None
        except RecursionError:
            raise BadImport("the file's JSON is nested too deeply") from None
    return _parse_import(data)


# -- reading imports --------------------------------------------------------------------------
def _parse_import(data) -> list[dict]:
    """Check an import completely before anything is written; the trees to insert."""
    if isinstance(data, list):
        return [_from_openai(data, "messages")]
    if not isinstance(data, dict):
        raise BadImport(f"expected a JSON object or a list of messages, got {type(data).__name__}")
    fmt = data.get("format")
    if fmt is None and "messages" in data:
        return [_from_openai(data["messages"], "messages")]
    if fmt not in (EXPORT_FORMAT, EXPORT_ALL_FORMAT):
        raise BadImport(
            f"'format' must be {EXPORT_FORMAT!r} or {EXPORT_ALL_FORMAT!r} (or give "
            f"an OpenAI 'messages' list), got {fmt!r}"
        )
    if data.get("version") != EXPORT_VERSION:
        raise BadImport(
            f"'version' {data.get('version')!r} is not one this app reads "
            f"(it reads version {EXPORT_VERSION})"
        )
    if fmt == EXPORT_FORMAT:
        return [_tree(data, "")]
    conversations = data.get("conversations")
    if not isinstance(conversations, list):
        raise BadImport("'conversations' must be a list of conversations")
    return [_tree(c, f"conversations[{i}].") for i, c in enumerate(conversations)]


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise BadImport(f"'{where}' {what}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) < 1e13


def _tree(c, at: str) -> dict:
    _need(isinstance(c, dict), at.rstrip(".") or "(top)", "must be an object")
    if at and (c.get("format") != EXPORT_FORMAT or c.get("version") != EXPORT_VERSION):
        raise BadImport(
            f"'{at}format' and 'version' must be {EXPORT_FORMAT!r} and {EXPORT_VERSION}"
        )
    for key in ("title", "system"):
        _need(isinstance(c.get(key, ""), str), at + key, "must be a string")
    for key in ("created", "updated"):
        _need(_is_number(c.get(key)), at + key, "must be a time in seconds since 1970")
    messages = c.get("messages")
    _need(isinstance(messages, list), at + "messages", "must be a list")
    out = []
    for i, m in enumerate(messages):
        where = f"{at}messages[{i}]"
        _need(isinstance(m, dict), where, "must be an object")
        _need(m.get("id") == i, where + ".id", f"must be {i} (its place in the list)")
        parent = m.get("parent")
        _need(
            parent is None
            or (isinstance(parent, int) and not isinstance(parent, bool) and 0 <= parent < i),
            where + ".parent",
            "must be null or the id of an earlier message",
        )
        role = m.get("role")
        _need(role in ROLES, where + ".role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        expected = "user" if parent is None or out[parent]["role"] == "assistant" else "assistant"
        after = "the start" if parent is None else f"a {out[parent]['role']} message"
        _need(
            role == expected,
            where + ".role",
            f"is {role!r} but follows {after}; roles must alternate, starting with the user",
        )
        _need(isinstance(m.get("content"), str), where + ".content", "must be a string")
        _need(
            m.get("status", "complete") in STATUSES,
            where + ".status",
            f"must be one of {', '.join(STATUSES)}",
        )
        _need(_is_number(m.get("created")), where + ".created", "must be a time in seconds")
        for key in ("settings", "stats"):
            _need(isinstance(m.get(key, {}), dict), f"{where}.{key}", "must be an object")
        # absent from exports made before replies kept them: none
        reasoning, calls = reply_extras(
            role, m.get("reasoning", ""), m.get("tool_calls", []), where + ".", BadImport
        )
        out.append(
            {
                "parent": parent,
                "role": role,
                "content": clean(m["content"]),
                "status": m.get("status", "complete"),
                "created": m["created"],
                "settings": m.get("settings", {}),
                "stats": m.get("stats", {}),
                "reasoning": reasoning,
                "tool_calls": calls,
            }
        )
    current = c.get("current")
    _need(
        current is None
        or (isinstance(current, int) and not isinstance(current, bool) and 0 <= current < len(out)),
        at + "current",
        "must be null or the id of a message",
    )
    return {
        "title": clean(c.get("title", ""))[:200],
        "system": clean(c.get("system", "")),
        "created": c["created"],
        "updated": c["updated"],
        "current": current if current is not None else (len(out) - 1 if out else None),
        "messages": out,
    }


def _from_openai(messages, at: str) -> dict:
    """An OpenAI `messages` list: an optional system message, then user and assistant
    messages taking turns, starting with the user."""
    _need(isinstance(messages, list) and messages, at, "must be a non-empty list of messages")
    system = ""
    out = []
    for i, m in enumerate(messages):
        where = f"{at}[{i}]"
        _need(isinstance(m, dict), where, "must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if isinstance(content, list):  # content parts: the text ones
            texts = [
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            ]
            _need(
                all(isinstance(t, str) for t in texts),
                where + ".content",
                "has a text part whose 'text' is not a string",
            )
            content = "".join(texts)
        calls = _openai_tool_calls(m.get("tool_calls"), where + ".tool_calls")
        if content is None and calls:  # a reply that only calls tools
            content = ""
        _need(isinstance(content, str), where + ".content", "must be a string")
        if role == "system":
            _need(i == 0, where + ".role", "'system' may only be the first message")
            system = content
            continue
        expected = "user" if not out or out[-1]["role"] == "assistant" else "assistant"
        _need(
            role == expected,
            where + ".role",
            f"must be {expected!r} (roles take turns, starting with the user), got {role!r}",
        )
        reasoning, calls = reply_extras(
            role, m.get("reasoning_content", ""), calls, where + ".", BadImport, "reasoning_content"
        )
        out.append(
            {
                "parent": len(out) - 1 if out else None,
                "role": role,
                "content": clean(content),
                "status": "complete",
                "created": time.time(),
                "settings": {},
                "stats": {},
                "reasoning": reasoning,
                "tool_calls": calls,
            }
        )
    _need(bool(out), at, "has no user or assistant message")
    now = time.time()
    return {
        "title": title_from(out[0]["content"]),
        "system": clean(system),
        "created": now,
        "updated": now,
        "current": len(out) - 1,
        "messages": out,
    }


def _openai_tool_calls(calls, at: str) -> list:
    """OpenAI's tool calls ([{"id", "type": "function", "function": {"name", "arguments"}}])
    in the store's shape, checked (records.tool_calls checks the rest)."""
    if calls is None:
        return []
    _need(isinstance(calls, list), at, "must be a list of tool calls")
    out = []
    for i, c in enumerate(calls):
        where = f"{at}[{i}]"
        _need(isinstance(c, dict), where, "must be an object with 'id', 'type' and 'function'")
        _need(c.get("type", "function") == "function", where + ".type", "must be 'function'")
        fn = c.get("function")
        _need(isinstance(fn, dict), where + ".function", "must be an object")
        for key, value in (("id", c.get("id")), ("function.name", fn.get("name"))):
            _need(isinstance(value, str), f"{where}.{key}", "must be a string")
        _need(
            isinstance(fn.get("arguments"), str),
            where + ".function.arguments",
            "must be a string (the arguments' JSON text)",
        )
        out.append({"id": c["id"], "name": fn["name"], "arguments": fn["arguments"]})
    return out
