"""Saved conversations: a small SQLite store (WAL, FTS5 search) with no UI in it.

A conversation is a tree of messages. Every message has a parent (None for the first user
message); a user message's children are replies, a reply's children are the next user
messages. Editing a user message or regenerating a reply adds a sibling, so the old branch
stays; the conversation remembers which leaf is open (`leaf`). The system prompt belongs to
the conversation; the settings and stats a reply was made with belong to the reply, and so do
its reasoning (a thinking model's <think> part, kept apart from the text) and its tool calls.

Every call names an `owner` (a browser's random id, or "cli"); the store only ever reads or
changes that owner's conversations. Asking for another owner's conversation reads exactly as
asking for one that does not exist.

Each write is its own transaction, committed before the call returns: a process killed
mid-reply loses only the reply being written.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sqlite3
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from miniserve.core.config import MAX_CONVERSATIONS, MAX_IMPORT_BYTES, check_number
from miniserve.store import formats
from miniserve.store.records import (
    ROLES,
    STATUSES,
    BadImport,
    Branch,
    Message,
    NotFound,
    StoreError,
    Summary,
    clean,
    reply_extras,
    title_from,
)

SCHEMA_VERSION = 3

# Each entry takes the database from version i to i + 1 (PRAGMA user_version). A new file runs
# them all, so the first version's path is the one every database has taken.
MIGRATIONS = [
    # 1: conversations as trees of messages
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT NOT NULL DEFAULT '',
        system TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL,
        leaf TEXT);
    CREATE INDEX conversations_by_owner ON conversations (owner, updated);
    CREATE TABLE messages (
        id TEXT PRIMARY KEY,
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        parent_id TEXT REFERENCES messages (id) ON DELETE CASCADE,
        role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL,
        status TEXT NOT NULL DEFAULT 'complete',
        settings TEXT NOT NULL DEFAULT '{}', stats TEXT NOT NULL DEFAULT '{}');
    CREATE INDEX messages_by_parent ON messages (conversation_id, parent_id);
    """,
    # 2: Delete with undo (a deleted conversation is kept until its owner deletes another or
    # the store reopens), and full-text search over titles and messages
    """
    ALTER TABLE conversations ADD COLUMN deleted REAL;
    CREATE VIRTUAL TABLE search USING fts5 (
        text, conversation_id UNINDEXED, message_id UNINDEXED,
        tokenize = 'unicode61 remove_diacritics 2');
    INSERT INTO search (text, conversation_id, message_id)
        SELECT title, id, NULL FROM conversations;
    INSERT INTO search (text, conversation_id, message_id)
        SELECT content, conversation_id, id FROM messages;
    """,
    # 3: a reply's reasoning, apart from its text, and its tool calls (a JSON list of
    # {"id", "name", "arguments"}); the messages before it have neither
    """
    ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT '';
    ALTER TABLE messages ADD COLUMN tool_calls TEXT NOT NULL DEFAULT '[]';
    """,
]
assert len(MIGRATIONS) == SCHEMA_VERSION


def data_dir() -> Path:
    """Where the app keeps its files: $MINISERVE_DATA_DIR, else the platform's data folder."""
    if os.environ.get("MINISERVE_DATA_DIR"):
        return Path(os.environ["MINISERVE_DATA_DIR"])
    if sys.platform == "win32":
        return Path(os.environ.get("APPDATA", Path.home())) / "MiniServeLM"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "MiniServeLM"
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "miniserve"


def default_path() -> Path:
    return data_dir() / "history.sqlite3"


def open_store(
    path: str | Path | None = None, *, enabled: bool = True, max_conversations: int = 0
) -> Store:
    """The app's store. `path` None: the default file in the data folder. `enabled` False
    (--no-history): in memory, gone when the app stops. A file that is not a readable
    database is moved aside (…corrupt-DATE) and a new one started; a file or folder that
    cannot be written: in memory. Either way `store.notice` says what happened, in one line."""
    if not enabled:
        return Store(
            ":memory:",
            max_conversations=max_conversations,
            notice="history is off (--no-history): conversations are kept in memory "
            "until the app stops",
        )
    path = Path(path) if path is not None else default_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return Store(path, max_conversations=max_conversations)
    except sqlite3.DatabaseError as e:
        if not _unreadable(e):
            return _in_memory(path, e, max_conversations)
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            for suffix in ("", "-wal", "-shm"):
                source = Path(str(path) + suffix)
                if source.exists():
                    source.rename(str(aside) + suffix)
            store = Store(path, max_conversations=max_conversations)
        except (OSError, sqlite3.DatabaseError) as again:
            return _in_memory(path, again, max_conversations)
        reason = " ".join(str(e).split())  # one line: quick_check may report several
        store.notice = (
            f"the history file {path} could not be read ({reason}); it was kept "
            f"aside as {aside.name} and a new one started"
        )
        return store
    except OSError as e:
        return _in_memory(path, e, max_conversations)


def _unreadable(error: sqlite3.DatabaseError) -> bool:
    """A file that is not a database (or a damaged one), as opposed to one we may not write."""
    text = str(error).lower()
    return (
        not isinstance(error, sqlite3.OperationalError)
        or "malformed" in text
        or "not a database" in text
        or "newer" in text
        or "integrity" in text
    )


def _in_memory(path, error, max_conversations) -> Store:
    reason = getattr(error, "strerror", None) or str(error)
    return Store(
        ":memory:",
        max_conversations=max_conversations,
        notice=f"cannot write the history file {path} ({reason}); conversations are "
        f"kept in memory until the app stops",
    )


class Store:
    def __init__(self, path: str | Path, *, max_conversations: int = 0, notice: str | None = None):
        self.file = str(path)
        self.in_memory = self.file == ":memory:"
        self.max_conversations = check_number(
            "max_conversations", max_conversations, MAX_CONVERSATIONS
        )
        self.notice = notice
        self._lock = threading.RLock()  # one connection, shared by Gradio's threads
        self._db = sqlite3.connect(self.file, check_same_thread=False, isolation_level=None)
        try:
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA foreign_keys = ON")
            if not self.in_memory:
                self._db.execute("PRAGMA journal_mode = WAL")
                self._db.execute("PRAGMA synchronous = NORMAL")  # WAL: safe from a killed process
                check = self._db.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            self._migrate()
            self._purge_deleted()
        except BaseException:
            self._db.close()
            raise

    # -- schema -----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        version = self.version
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(
                f"schema version {version} is newer than this MiniServeLM reads ({SCHEMA_VERSION})"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            with self._tx() as db:
                db.executescript_in_tx(MIGRATIONS[target - 1])
                db.execute(f"PRAGMA user_version = {target}")

    @contextmanager
    def _tx(self):
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield _Tx(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def secret(self) -> str:
        """A random key kept with the history: what the browser keeps (its owner id) is
        encrypted with it, so it still reads after a restart."""
        with self._tx() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'browser_secret'").fetchone()
            if row:
                return row[0]
            value = secrets.token_hex(32)
            db.execute("INSERT INTO meta VALUES ('browser_secret', ?)", (value,))
            return value

    def size_bytes(self) -> int:
        with self._lock:
            pages = self._db.execute("PRAGMA page_count").fetchone()[0]
            size = self._db.execute("PRAGMA page_size").fetchone()[0]
        wal = Path(self.file + "-wal")
        return pages * size + (wal.stat().st_size if not self.in_memory and wal.exists() else 0)

    def describe(self) -> str:
        """Where the history is and how large, in one line."""
        if self.in_memory:
            return "history in memory only (not saved)"
        return f"history: {self.file} ({self.size_bytes() / 1e6:.2f} MB)"

    # -- conversations ------------------------------------------------------------------------
    def create(self, owner: str, title: str = "", system: str = "") -> str:
        cid = uuid.uuid4().hex
        now = time.time()
        title = title_from(title)
        with self._tx() as db:
            db.execute(
                "INSERT INTO conversations (id, owner, title, system, created, updated) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (cid, owner, title, clean(system), now, now),
            )
            db.index(cid, None, title)
            self._retain(db, owner, keep=cid)
        return cid

    def _retain(self, db, owner: str, keep: str) -> None:
        """Drop the owner's least recently updated conversations beyond max_conversations."""
        if not self.max_conversations:
            return
        extra = db.execute(
            "SELECT id FROM conversations WHERE owner = ? AND deleted IS NULL AND id != ? "
            "ORDER BY updated DESC LIMIT -1 OFFSET ?",
            (owner, keep, self.max_conversations - 1),
        ).fetchall()
        for row in extra:
            db.purge(row["id"])

    def get(self, owner: str, cid) -> Summary:
        with self._lock:
            row = self._db.execute(
                f"{_SUMMARY} WHERE c.id = ? AND c.owner = ? AND c.deleted IS NULL",
                (str(cid), owner),
            ).fetchone()
        if row is None:
            raise NotFound(
                f"no conversation {cid!r} here (it was deleted, or belongs to another user)"
            )
        return _summary(row)

    def conversations(self, owner: str, query: str = "", limit: int = 500) -> list[Summary]:
        """The owner's conversations, most recently updated first; with `query`, those whose
        title or any message contains every word of it (word prefixes match), or, for a query
        without a word (punctuation, emoji: "?!", "🙂"), contains it as written."""
        query = clean(query or "").strip()
        words = re.findall(r"\w+", query)
        with self._lock:
            if query and not words:  # the index keeps words only: each text is read
                rows = self._db.execute(
                    f"{_SUMMARY} WHERE c.owner = ? AND c.deleted IS NULL AND c.id IN "
                    f"(SELECT s.conversation_id FROM search s JOIN conversations o "
                    f"ON o.id = s.conversation_id WHERE o.owner = ? AND instr(s.text, ?) > 0) "
                    f"ORDER BY c.updated DESC LIMIT ?",
                    (owner, owner, query, limit),
                ).fetchall()
            elif not words:
                rows = self._db.execute(
                    f"{_SUMMARY} WHERE c.owner = ? AND c.deleted IS NULL "
                    f"ORDER BY c.updated DESC LIMIT ?",
                    (owner, limit),
                ).fetchall()
            else:
                match = " ".join('"' + w.replace('"', '""') + '"*' for w in words)
                rows = self._db.execute(
                    f"{_SUMMARY} WHERE c.owner = ? AND c.deleted IS NULL AND c.id IN "
                    f"(SELECT conversation_id FROM search WHERE search MATCH ?) "
                    f"ORDER BY c.updated DESC LIMIT ?",
                    (owner, match, limit),
                ).fetchall()
        return [_summary(r) for r in rows]

    def rename(self, owner: str, cid: str, title: str) -> None:
        title = " ".join(clean(title or "").split())
        if not title:
            raise StoreError("the title is empty; type a name for the conversation")
        title = title[:200]
        self.get(owner, cid)
        with self._tx() as db:
            db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, cid))
            db.execute(
                "DELETE FROM search WHERE conversation_id = ? AND message_id IS NULL", (cid,)
            )
            db.index(cid, None, title)

    def set_system(self, owner: str, cid: str, system: str) -> None:
        self.get(owner, cid)
        with self._tx() as db:
            db.execute("UPDATE conversations SET system = ? WHERE id = ?", (clean(system), cid))

    def delete(self, owner: str, cid: str) -> None:
        """Hide a conversation; `restore` brings it back until the owner deletes another one
        (or the store is reopened), when it is removed for good."""
        self.get(owner, cid)
        with self._tx() as db:
            for row in db.execute(
                "SELECT id FROM conversations WHERE owner = ? AND deleted IS NOT NULL", (owner,)
            ).fetchall():
                db.purge(row["id"])
            db.execute("UPDATE conversations SET deleted = ? WHERE id = ?", (time.time(), cid))

    def restore(self, owner: str) -> str | None:
        """Undo the owner's last delete; the conversation's id, or None when there is none."""
        with self._tx() as db:
            row = db.execute(
                "SELECT id FROM conversations WHERE owner = ? AND deleted IS NOT "
                "NULL ORDER BY deleted DESC LIMIT 1",
                (owner,),
            ).fetchone()
            if row is None:
                return None
            db.execute("UPDATE conversations SET deleted = NULL WHERE id = ?", (row["id"],))
            return row["id"]

    def _purge_deleted(self) -> None:
        with self._tx() as db:
            for row in db.execute(
                "SELECT id FROM conversations WHERE deleted IS NOT NULL"
            ).fetchall():
                db.purge(row["id"])

    # -- messages -----------------------------------------------------------------------------
    def add(
        self,
        owner: str,
        cid: str,
        parent_id: str | None,
        role: str,
        content: str,
        *,
        status: str = "complete",
        settings: dict | None = None,
        stats: dict | None = None,
        created: float | None = None,
        reasoning: str = "",
        tool_calls: list | None = None,
    ) -> Message:
        """Add a message under `parent_id` (None: a first message) and open it as the leaf.
        A parent that already has children gets a sibling: a new branch, the old one kept.
        A reply may carry its `reasoning` (text, cleaned like `content`) and `tool_calls`
        (records.tool_calls: a list of {"id", "name", "arguments"}, each a string, the
        arguments the JSON text the model wrote); a user message has neither. A fault in
        either raises StoreError naming it, and nothing is written."""
        conv = self.get(owner, cid)
        if role not in ROLES:
            raise StoreError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if status not in STATUSES:
            raise StoreError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        extras = reply_extras(role, reasoning, tool_calls, "", StoreError)
        with self._tx() as db:
            message = db.add(
                cid,
                parent_id,
                role,
                clean(content),
                status,
                settings or {},
                stats or {},
                created,
                *extras,
            )
            if not conv.title and role == "user":
                title = title_from(content)
                db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, cid))
                db.execute(
                    "DELETE FROM search WHERE conversation_id = ? AND message_id IS NULL", (cid,)
                )
                db.index(cid, None, title)
            db.execute(
                "UPDATE conversations SET leaf = ?, updated = ? WHERE id = ?",
                (message.id, time.time(), cid),
            )
        return message

    def message(self, owner: str, message_id: str) -> Message:
        with self._lock:
            row = self._db.execute(
                "SELECT m.* FROM messages m JOIN conversations c ON c.id = m.conversation_id "
                "WHERE m.id = ? AND c.owner = ? AND c.deleted IS NULL",
                (str(message_id), owner),
            ).fetchone()
        if row is None:
            raise NotFound(f"no message {message_id!r} here")
        return _message(row)

    def path(self, owner: str, cid: str, leaf_id: str | None = None) -> list[Message]:
        """The messages from the first to `leaf_id` (default: the open leaf)."""
        conv = self.get(owner, cid)
        leaf_id = leaf_id or conv.leaf
        if leaf_id is None:
            return []
        with self._lock:
            rows = self._db.execute(
                "WITH RECURSIVE up (id, depth) AS (SELECT ?, 0 UNION ALL "
                "SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id "
                "WHERE m.parent_id IS NOT NULL) "
                "SELECT m.* FROM up JOIN messages m ON m.id = up.id "
                "WHERE m.conversation_id = ? ORDER BY up.depth DESC",
                (leaf_id, cid),
            ).fetchall()
        if not rows or rows[-1]["id"] != leaf_id:
            raise NotFound(f"no message {leaf_id!r} in this conversation")
        return [_message(r) for r in rows]

    def _siblings(self, message: Message) -> list[str]:
        with self._lock:
            return [
                r[0]
                for r in self._db.execute(
                    "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? "
                    "ORDER BY rowid",
                    (message.conversation_id, message.parent_id),
                ).fetchall()
            ]

    def branch(self, owner: str, message_id: str) -> Branch:
        message = self.message(owner, message_id)
        siblings = self._siblings(message)
        return Branch(siblings.index(message.id) + 1, len(siblings))

    def branches(self, owner: str, messages: list[Message]) -> list[Branch]:
        """`branch` of each message of a path, in one query."""
        if not messages:
            return []
        cid = messages[0].conversation_id
        self.get(owner, cid)
        with self._lock:
            rows = self._db.execute(
                "SELECT id, parent_id FROM messages WHERE conversation_id = ? ORDER BY rowid",
                (cid,),
            ).fetchall()
        children: dict[str | None, list[str]] = {}
        for r in rows:
            children.setdefault(r["parent_id"], []).append(r["id"])
        out = []
        for m in messages:
            siblings = children.get(m.parent_id, [m.id])
            out.append(Branch(siblings.index(m.id) + 1, len(siblings)))
        return out

    def switch(self, owner: str, message_id: str, step: int) -> str:
        """Move from `message_id` to its sibling `step` places away (wrapping), then down the
        newest replies to a leaf, which becomes the open one. Returns that leaf's id."""
        message = self.message(owner, message_id)
        siblings = self._siblings(message)
        target = siblings[(siblings.index(message.id) + step) % len(siblings)]
        with self._lock:
            while True:
                child = self._db.execute(
                    "SELECT id FROM messages WHERE parent_id = ? ORDER BY rowid DESC LIMIT 1",
                    (target,),
                ).fetchone()
                if child is None:
                    break
                target = child[0]
        self.set_leaf(owner, message.conversation_id, target)
        return target

    def set_leaf(self, owner: str, cid: str, leaf_id: str | None) -> None:
        self.get(owner, cid)
        if leaf_id is not None:
            self.path(owner, cid, leaf_id)  # it is in this conversation
        with self._tx() as db:
            db.execute("UPDATE conversations SET leaf = ? WHERE id = ?", (leaf_id, cid))

    def undo_turn(self, owner: str, cid: str, leaf_id: str | None = None) -> tuple[str | None, str]:
        """Take back the last turn of a branch (default: the open one): its reply and the
        user message before it. Messages with no other children are deleted; the branch's
        leaf becomes the message before the turn. Returns (new leaf, the user's text)."""
        path = self.path(owner, cid, leaf_id)
        if not path:
            return None, ""
        cut = len(path) - 1
        while cut > 0 and path[cut].role == "assistant":
            cut -= 1
        if path[cut].role != "user":
            return path[-1].id, ""
        new_leaf = path[cut - 1].id if cut > 0 else None
        with self._tx() as db:
            for m in reversed(path[cut:]):
                if db.execute("SELECT 1 FROM messages WHERE parent_id = ?", (m.id,)).fetchone():
                    break  # another branch grows from here: keep it
                db.execute("DELETE FROM search WHERE message_id = ?", (m.id,))
                db.execute("DELETE FROM messages WHERE id = ?", (m.id,))
            if new_leaf is None:  # the first message went: open its newest remaining sibling
                row = db.execute(
                    "SELECT id FROM messages WHERE conversation_id = ? AND "
                    "parent_id IS NULL ORDER BY rowid DESC LIMIT 1",
                    (cid,),
                ).fetchone()
                new_leaf = row[0] if row else None
            db.execute(
                "UPDATE conversations SET leaf = ?, updated = ? WHERE id = ?",
                (new_leaf, time.time(), cid),
            )
        if new_leaf is not None and new_leaf != (path[cut - 1].id if cut > 0 else None):
            new_leaf = self.switch(owner, new_leaf, 0)
        return new_leaf, path[cut].content

    # -- export and import ----------------------------------------------------------------
    def _rows(self, cid: str):
        with self._lock:
            return self._db.execute(
                "SELECT * FROM messages WHERE conversation_id = ? ORDER BY rowid", (cid,)
            ).fetchall()

    def export(self, owner: str, cid: str) -> dict:
        """The whole tree (formats.EXPORT_FORMAT, documented in README.md)."""
        conv = self.get(owner, cid)
        return formats.export_tree(conv, self._rows(cid))

    def export_all(self, owner: str) -> dict:
        return formats.export_all(
            [self.export(owner, c.id) for c in reversed(self.conversations(owner, limit=-1))]
        )

    def export_openai(self, owner: str, cid: str, leaf_id: str | None = None) -> list[dict]:
        return formats.openai_messages(self.get(owner, cid), self.path(owner, cid, leaf_id))

    def export_markdown(self, owner: str, cid: str, leaf_id: str | None = None) -> str:
        return formats.markdown(self.get(owner, cid), self.path(owner, cid, leaf_id))

    def export_text(
        self, owner: str, cid: str, kind: str, leaf_id: str | None = None
    ) -> tuple[str, str]:
        """An export as a file's text and suffix (formats.as_text)."""
        conv = self.get(owner, cid)
        return formats.as_text(
            kind,
            lambda: self.export(owner, cid),
            conv,
            self.path(owner, cid, leaf_id) if kind != "json" else [],
        )

    def import_file(self, owner: str, path: str | Path) -> list[str]:
        """`import_` of a file, its size checked before it is read. OSError when it cannot be
        read."""
        path = Path(path).expanduser()
        size = path.stat().st_size
        if size > MAX_IMPORT_BYTES:
            raise BadImport(
                f"the file is {size / 1e6:.1f} MB; an import may be at most "
                f"{MAX_IMPORT_BYTES / 1e6:.0f} MB"
            )
        return self.import_(owner, path.read_bytes())

    def import_(self, owner: str, data) -> list[str]:
        """Import an export or an OpenAI `messages` list (formats.read_import). All or
        nothing: any fault raises BadImport naming where, and nothing is kept. Returns the new
        conversations' ids."""
        trees = formats.read_import(data)
        ids = []
        with self._tx() as db:
            for tree in trees:
                cid = uuid.uuid4().hex
                db.execute(
                    "INSERT INTO conversations (id, owner, title, system, created, "
                    "updated) VALUES (?, ?, ?, ?, ?, ?)",
                    (cid, owner, tree["title"], tree["system"], tree["created"], tree["updated"]),
                )
                db.index(cid, None, tree["title"])
                new_ids: list[str] = []
                for m in tree["messages"]:
                    parent = new_ids[m["parent"]] if m["parent"] is not None else None
                    new_ids.append(
                        db.add(
                            cid,
                            parent,
                            m["role"],
                            m["content"],
                            m["status"],
                            m["settings"],
                            m["stats"],
                            m["created"],
                            m["reasoning"],
                            m["tool_calls"],
                        ).id
                    )
                leaf = new_ids[tree["current"]] if tree["current"] is not None else None
                db.execute("UPDATE conversations SET leaf = ? WHERE id = ?", (leaf, cid))
                self._retain(db, owner, keep=cid)
                ids.append(cid)
        return ids


_SUMMARY = (
    "SELECT c.*, (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id) "
    "AS n FROM conversations c"
)


def _summary(row) -> Summary:
    return Summary(
        row["id"],
        row["title"],
        row["system"],
        row["created"],
        row["updated"],
        row["leaf"],
        row["n"],
    )


def _message(row) -> Message:
    return Message(
        row["id"],
        row["conversation_id"],
        row["parent_id"],
        row["role"],
        row["content"],
        row["created"],
        row["status"],
        json.loads(row["settings"]),
        json.loads(row["stats"]),
        reasoning=row["reasoning"],
        tool_calls=json.loads(row["tool_calls"]),
    )


class _Tx:
    """The statements a transaction runs (the store's lock is held)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def execute(self, sql, args=()):
        return self.db.execute(sql, args)

    def executescript_in_tx(self, script: str) -> None:
        # executescript would commit the open transaction first: run statement by statement
        for statement in script.split(";"):
            if statement.strip():
                self.db.execute(statement)

    def index(self, cid: str, message_id: str | None, text: str) -> None:
        self.db.execute(
            "INSERT INTO search (text, conversation_id, message_id) VALUES (?, ?, ?)",
            (text, cid, message_id),
        )

    def add(
        self,
        cid,
        parent_id,
        role,
        content,
        status,
        settings,
        stats,
        created,
        reasoning="",
        tool_calls=(),
    ) -> Message:
        """Insert a checked message (content and reasoning cleaned, tool calls as
        records.tool_calls gives them)."""
        if parent_id is None:
            parent_role = None
        else:
            row = self.db.execute(
                "SELECT role FROM messages WHERE id = ? AND conversation_id = ?", (parent_id, cid)
            ).fetchone()
            if row is None:
                raise NotFound(f"no message {parent_id!r} in this conversation")
            parent_role = row[0]
        expected = "user" if parent_role in (None, "assistant") else "assistant"
        if role != expected:
            raise StoreError(
                f"a {role} message cannot follow "
                f"{'the start' if parent_role is None else 'a ' + parent_role + ' message'}"
                f"; expected a {expected} message"
            )
        mid = uuid.uuid4().hex
        created = time.time() if created is None else created
        tool_calls = list(tool_calls)
        self.db.execute(
            "INSERT INTO messages (id, conversation_id, parent_id, role, content, created, "
            "status, settings, stats, reasoning, tool_calls) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                mid,
                cid,
                parent_id,
                role,
                content,
                created,
                status,
                json.dumps(settings),
                json.dumps(stats),
                reasoning,
                json.dumps(tool_calls),
            ),
        )
        # Search finds a reply by its reasoning too: one row per message, the text and then
        # the reasoning. Tool calls (names and JSON arguments) are not searched.
        self.index(cid, mid, f"{content}\n\n{reasoning}" if reasoning else content)
        return Message(
            mid,
            cid,
            parent_id,
            role,
            content,
            created,
            status,
            settings,
            stats,
            reasoning=reasoning,
            tool_calls=tool_calls,
        )

    def purge(self, cid: str) -> None:
        self.db.execute("DELETE FROM search WHERE conversation_id = ?", (cid,))
        self.db.execute("DELETE FROM messages WHERE conversation_id = ?", (cid,))
        self.db.execute("DELETE FROM conversations WHERE id = ?", (cid,))
