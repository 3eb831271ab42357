"""The formats conversations leave and enter the store in: miniserve's own export (the whole
tree, settings and stats; `miniserve.conversation(s)`, version EXPORT_VERSION, documented in
README.md), Markdown and an OpenAI `messages` list of the open branch; imports of the first
and the last, checked completely before anything is written (BadImport names where)."""

from __future__ import annotations

import json
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
            }
            for i, r in enumerate(rows)
        ],
    }


def export_all(trees: list[dict]) -> dict:
    return {"format": EXPORT_ALL_FORMAT, "version": EXPORT_VERSION, "conversations": trees}


def openai_messages(conv: Summary, path: list[Message]) -> list[dict]:
    """The open branch as an OpenAI `messages` list (the system prompt first)."""
    return ([{"role": "system", "content": conv.system}] if conv.system else []) + [
        {"role": m.role, "content": m.content} for m in path
    ]


def markdown(conv: Summary, path: list[Message]) -> str:
    parts = [f"# {conv.title or 'Conversation'}", ""]
    if conv.system:
        parts += ["**System:**", "", conv.system, ""]
    for m in path:
        parts += [
            f"**{m.role.capitalize()}:**" + (" *(stopped)*" if m.status == "stopped" else ""),
            "",
            m.content,
            "",
        ]
    return "\n".join(parts)


def as_text(kind: str, tree, conv: Summary, path: list[Message]) -> tuple[str, str]:
    """An export as a file's text and suffix: "json" (the whole tree, `tree()`), "md" (the
    open branch as Markdown) or "openai" (the open branch as a `messages` list)."""
    if kind == "json":
        return json.dumps(tree(), indent=2, ensure_ascii=False), ".json"
    if kind == "md":
        return markdown(conv, path), ".md"
    if kind == "openai":
        return json.dumps(
            openai_messages(conv, path), indent=2, ensure_ascii=False
        ), ".messages.json"
    raise StoreError(f"unknown export {kind!r} (json, md or openai)")


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
        out.append(
            {
                "parent": parent,
                "role": role,
                "content": clean(m["content"]),
                "status": m.get("status", "complete"),
                "created": m["created"],
                "settings": m.get("settings", {}),
                "stats": m.get("stats", {}),
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
        out.append(
            {
                "parent": len(out) - 1 if out else None,
                "role": role,
                "content": clean(content),
                "status": "complete",
                "created": time.time(),
                "settings": {},
                "stats": {},
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
