"""The conversation store (miniserve/store/store.py): real SQLite files under tmp_path, no model."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from miniserve.core import config
from miniserve.store.records import TITLE_CHARS
from miniserve.store.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    BadImport,
    Branch,
    NotFound,
    Store,
    StoreError,
    open_store,
)

ROOT = Path(__file__).resolve().parent.parent
A, B = "alice", "bob"


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "history.sqlite3")
    yield s
    s.close()


def chat(s, owner, *texts, title="", system=""):
    """A conversation whose messages take turns (user first); (id, messages)."""
    cid = s.create(owner, title, system)
    parent, out = None, []
    for i, text in enumerate(texts):
        m = s.add(owner, cid, parent, ("user", "assistant")[i % 2], text)
        out.append(m)
        parent = m.id
    return cid, out


def ids(summaries):
    return [c.id for c in summaries]


def texts(messages):
    return [m.content for m in messages]


def raw_rows(file):
    """Every row of every table, read through a connection of its own."""
    db = sqlite3.connect(file)
    try:
        return {
            t: sorted(map(tuple, db.execute(f"SELECT * FROM {t}").fetchall()), key=repr)
            for t in ("meta", "conversations", "messages", "search")
        }
    finally:
        db.close()


# -- schema and migration ---------------------------------------------------------------------
def test_new_file_has_the_current_schema_in_wal_mode(tmp_path):
    path = tmp_path / "h.sqlite3"
    s = Store(path)
    assert s.version == SCHEMA_VERSION == len(MIGRATIONS)
    assert not s.in_memory and s.notice is None
    assert s.describe().startswith(f"history: {path} (")
    s.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_migration_from_the_first_version_keeps_and_indexes_old_conversations(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("PRAGMA user_version = 1")
    db.execute(
        "INSERT INTO conversations (id, owner, title, system, created, updated, leaf) "
        "VALUES ('old1', ?, 'Ancient voyages', 'Be brief.', 1000.0, 2000.0, 'm4')",
        (A,),
    )
    db.execute(
        "INSERT INTO conversations (id, owner, title, created, updated, leaf) "
        "VALUES ('old2', ?, 'Bobs notes', 1000.0, 1500.0, 'b1')",
        (B,),
    )
    old = [
        ("m1", None, "user", "Tell me about the narwhal"),
        ("m2", "m1", "assistant", "The narwhal has a spiral tusk"),
        ("m3", "m2", "user", "And the walrus?"),
        ("m4", "m3", "assistant", "Walruses have whiskers"),
    ]
    for i, (mid, parent, role, content) in enumerate(old):
        db.execute(
            "INSERT INTO messages (id, conversation_id, parent_id, role, content, "
            "created) VALUES (?, 'old1', ?, ?, ?, ?)",
            (mid, parent, role, content, 1000.0 + i),
        )
    db.execute(
        "INSERT INTO messages (id, conversation_id, parent_id, role, content, created) "
        "VALUES ('b1', 'old2', NULL, 'user', 'narwhal shopping list', 1000.0)"
    )
    db.commit()
    db.close()

    s = open_store(path)
    assert s.notice is None and not s.in_memory
    assert s.version == SCHEMA_VERSION
    conv = s.get(A, "old1")
    assert (conv.title, conv.system, conv.leaf, conv.messages) == (
        "Ancient voyages",
        "Be brief.",
        "m4",
        4,
    )
    path_ = s.path(A, "old1")
    assert [(m.id, m.parent_id, m.role, m.content) for m in path_] == old
    assert all(m.status == "complete" and m.settings == {} and m.stats == {} for m in path_)
    # full-text search covers the old messages and titles, and only the owner's
    assert ids(s.conversations(A, "narwhal")) == ["old1"]
    assert ids(s.conversations(A, "whiskers")) == ["old1"]
    assert ids(s.conversations(A, "ancient")) == ["old1"]
    assert ids(s.conversations(A, "shopping")) == []
    assert ids(s.conversations(B, "narwhal")) == ["old2"]
    # new messages join the old tree; delete and restore work on migrated rows
    m5 = s.add(A, "old1", "m4", "user", "What about seals?")
    assert texts(s.path(A, "old1"))[-1] == "What about seals?" and m5.parent_id == "m4"
    s.delete(A, "old1")
    assert ids(s.conversations(A)) == [] and ids(s.conversations(A, "narwhal")) == []
    assert s.restore(A) == "old1"
    assert len(s.path(A, "old1")) == 5 and ids(s.conversations(A, "seals")) == ["old1"]
    s.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()
    # opening again runs nothing twice
    s = Store(path)
    assert s.version == SCHEMA_VERSION and len(s.path(A, "old1")) == 5
    assert ids(s.conversations(A, "narwhal")) == ["old1"]  # indexed once, found once
    s.close()


def refused_as_newer(path):
    """The history file at `path` marked as a newer store's (schema version one past this
    store's): Store refuses to open it."""
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(sqlite3.DatabaseError, match="newer"):
        Store(path)


def test_a_newer_schema_is_not_opened_but_kept_aside(tmp_path):
    path = tmp_path / "h.sqlite3"
    Store(path).close()
    refused_as_newer(path)
    s = open_store(path)
    assert s.version == SCHEMA_VERSION and not s.in_memory
    assert "kept aside" in s.notice
    assert len(list(tmp_path.glob("h.sqlite3.corrupt-*"))) == 1


# -- owners ------------------------------------------------------------------------------
def test_another_owners_conversation_reads_as_missing_everywhere(store):
    cid, (u1, a1, u2, a2) = chat(
        store, A, "secret plans", "ok", "more secret", "fine", system="private system"
    )
    store.add(A, cid, u1.id, "assistant", "regenerated")
    store.set_leaf(A, cid, a2.id)
    before = store.export(A, cid)
    bcid, (b1,) = chat(store, B, "bob says hi")
    attempts = {
        "get": lambda: store.get(B, cid),
        "path": lambda: store.path(B, cid),
        "path leaf": lambda: store.path(B, bcid, a1.id),
        "add": lambda: store.add(B, cid, a2.id, "user", "intrusion"),
        "add under their parent": lambda: store.add(B, bcid, a1.id, "assistant", "x"),
        "rename": lambda: store.rename(B, cid, "mine now"),
        "delete": lambda: store.delete(B, cid),
        "set_system": lambda: store.set_system(B, cid, "evil"),
        "set_leaf": lambda: store.set_leaf(B, cid, a1.id),
        "set_leaf their message": lambda: store.set_leaf(B, bcid, a1.id),
        "export": lambda: store.export(B, cid),
        "export_markdown": lambda: store.export_markdown(B, cid),
        "export_openai": lambda: store.export_openai(B, cid),
        "undo_turn": lambda: store.undo_turn(B, cid),
        "message": lambda: store.message(B, u1.id),
        "branch": lambda: store.branch(B, a1.id),
        "branches": lambda: store.branches(B, [u1, a1]),
        "switch": lambda: store.switch(B, a1.id, 1),
    }
    for name, attempt in attempts.items():
        with pytest.raises(NotFound):
            attempt()
            pytest.fail(f"{name} did not refuse")
    assert ids(store.conversations(B)) == [bcid]
    for query in ("secret", "plans", "regenerated", "private"):
        assert store.conversations(B, query) == []
    assert store.restore(B) is None
    assert store.export(A, cid) == before  # nothing of A's changed
    assert ids(store.conversations(A)) == [cid] and ids(store.conversations(A, "secret")) == [cid]
    # the error does not tell "someone else's" from "none"
    with pytest.raises(NotFound) as theirs:
        store.get(B, cid)
    with pytest.raises(NotFound) as nobody:
        store.get(B, "0" * 32)
    assert str(theirs.value).replace(cid, "X") == str(nobody.value).replace("0" * 32, "X")


# -- branches -----------------------------------------------------------------------------
def test_regenerate_and_edit_make_branches_and_switch_wraps_and_descends(store):
    cid, (u1, a1) = chat(store, A, "q1", "first answer")
    a1b = store.add(A, cid, u1.id, "assistant", "second answer")  # regenerate
    assert store.get(A, cid).leaf == a1b.id
    assert store.branch(A, a1.id) == Branch(1, 2) and store.branch(A, a1b.id) == Branch(2, 2)
    assert store.branch(A, u1.id) == Branch(1, 1)
    u2 = store.add(A, cid, a1b.id, "user", "q2")
    a2 = store.add(A, cid, u2.id, "assistant", "a2")
    a2x = store.add(A, cid, u2.id, "assistant", "a2 again")
    u2b = store.add(A, cid, a1b.id, "user", "q2 edited")  # edit
    a2b = store.add(A, cid, u2b.id, "assistant", "a2b")
    path = store.path(A, cid)
    assert [m.id for m in path] == [u1.id, a1b.id, u2b.id, a2b.id]
    assert store.branches(A, path) == [Branch(1, 1), Branch(2, 2), Branch(2, 2), Branch(1, 1)]
    assert store.branches(A, []) == []
    assert store.get(A, cid).messages == 8

    # +1 from the last sibling wraps to the first; it has no children: it is the leaf
    assert store.switch(A, a1b.id, +1) == a1.id
    assert store.get(A, cid).leaf == a1.id
    assert texts(store.path(A, cid)) == ["q1", "first answer"]
    # -1 from the first wraps to the last and descends the newest replies
    assert store.switch(A, a1.id, -1) == a2b.id
    assert texts(store.path(A, cid)) == ["q1", "second answer", "q2 edited", "a2b"]
    assert store.switch(A, u2b.id, +1) == a2x.id  # u2's newest reply
    assert store.get(A, cid).leaf == a2x.id
    assert texts(store.path(A, cid)) == ["q1", "second answer", "q2", "a2 again"]
    assert store.switch(A, a2x.id, -1) == a2.id
    assert store.switch(A, a2.id, 5) == a2x.id  # steps wrap modulo the count
    assert store.switch(A, u2.id, 0) == a2x.id  # 0: stay, descend
    # a path to any leaf can be read without opening it
    assert texts(store.path(A, cid, a2b.id))[-1] == "a2b"
    assert store.get(A, cid).leaf == a2x.id
    store.set_leaf(A, cid, u2.id)
    assert texts(store.path(A, cid)) == ["q1", "second answer", "q2"]
    # a message of another of the owner's conversations is not a leaf here
    other, (o1,) = chat(store, A, "elsewhere")
    with pytest.raises(NotFound):
        store.set_leaf(A, cid, o1.id)
    with pytest.raises(NotFound):
        store.path(A, cid, o1.id)
    with pytest.raises(NotFound):
        store.add(A, cid, o1.id, "assistant", "wrong tree")
    assert store.get(A, cid).leaf == u2.id and store.get(A, cid).messages == 8


def test_a_reply_to_a_stale_parent_becomes_a_branch(tmp_path):
    # two views (two tabs, two processes) of the same conversation
    path = tmp_path / "h.sqlite3"
    one, two = Store(path), Store(path)
    cid, (u1, a1) = chat(one, A, "hello", "hi")
    seen_by_two = two.path(A, cid)
    u2 = one.add(A, cid, a1.id, "user", "from tab one")
    a2 = one.add(A, cid, u2.id, "assistant", "answer one")
    u2b = two.add(A, cid, seen_by_two[-1].id, "user", "from tab two")
    for s in (one, two):
        assert s.message(A, u2.id).content == "from tab one"
        assert s.message(A, a2.id).content == "answer one"
        assert s.message(A, u2b.id).parent_id == a1.id
        assert s.branch(A, u2b.id) == Branch(2, 2) and s.branch(A, u2.id) == Branch(1, 2)
        assert s.get(A, cid).messages == 5
        assert texts(s.path(A, cid)) == ["hello", "hi", "from tab two"]
    assert texts(one.path(A, cid, a2.id)) == ["hello", "hi", "from tab one", "answer one"]
    one.close()
    two.close()


def test_roles_must_take_turns_starting_with_the_user(store):
    cid = store.create(A)
    with pytest.raises(StoreError, match="assistant"):
        store.add(A, cid, None, "assistant", "I speak first")
    u1 = store.add(A, cid, None, "user", "hi")
    with pytest.raises(StoreError, match="expected a assistant|expected an? assistant"):
        store.add(A, cid, u1.id, "user", "hi again")
    a1 = store.add(A, cid, u1.id, "assistant", "hello")
    with pytest.raises(StoreError):
        store.add(A, cid, a1.id, "assistant", "and another thing")
    with pytest.raises(StoreError, match="role"):
        store.add(A, cid, a1.id, "system", "be nice")
    with pytest.raises(StoreError, match="status"):
        store.add(A, cid, a1.id, "user", "x", status="exploded")
    with pytest.raises(NotFound):
        store.add(A, cid, "no-such-message", "user", "x")
    with pytest.raises(NotFound):
        store.add(A, "no-such-conversation", None, "user", "x")
    assert store.get(A, cid).messages == 2 and store.get(A, cid).leaf == a1.id
    assert texts(store.path(A, cid)) == ["hi", "hello"]


def test_text_is_cleaned_of_control_characters(store):
    cid, (u1,) = chat(store, A, "a\x00b\x07c\x1b\x7f\nline two\tcol\r\n")
    assert store.message(A, u1.id).content == "abc\nline two\tcol\r\n"


# -- undo ----------------------------------------------------------------------------------
def test_undo_turn_removes_the_last_turn_and_gives_back_the_text(store):
    cid, (u1, a1, u2, a2) = chat(
        store, A, "first question", "first answer", "zebra question", "zebra answer"
    )
    assert store.undo_turn(A, cid) == (a1.id, "zebra question")
    assert texts(store.path(A, cid)) == ["first question", "first answer"]
    assert store.get(A, cid).leaf == a1.id and store.get(A, cid).messages == 2
    for gone in (u2, a2):
        with pytest.raises(NotFound):
            store.message(A, gone.id)
    assert store.conversations(A, "zebra") == []  # out of the search index too
    # a user message that got no reply (stopped before the answer) is a turn too
    u3 = store.add(A, cid, a1.id, "user", "unanswered")
    assert store.undo_turn(A, cid) == (a1.id, "unanswered")
    with pytest.raises(NotFound):
        store.message(A, u3.id)
    # the only turn: the conversation stays, empty
    assert store.undo_turn(A, cid) == (None, "first question")
    assert store.path(A, cid) == [] and store.get(A, cid).messages == 0
    assert store.get(A, cid).leaf is None
    assert store.undo_turn(A, cid) == (None, "")


def test_undo_turn_keeps_messages_another_branch_grows_from(store):
    cid, (u1, a1, u2, a2) = chat(store, A, "q1", "a1", "q2", "a2")
    a2b = store.add(A, cid, u2.id, "assistant", "a2 regenerated")
    assert store.undo_turn(A, cid) == (a1.id, "q2")
    with pytest.raises(NotFound):
        store.message(A, a2b.id)
    assert store.message(A, u2.id).content == "q2"  # a2 still grows from it
    assert store.message(A, a2.id).content == "a2"
    assert store.get(A, cid).messages == 4 and store.get(A, cid).leaf == a1.id
    assert texts(store.path(A, cid, a2.id)) == ["q1", "a1", "q2", "a2"]
    # an explicit branch: undo a2's turn; u2 now has nothing under it and goes too
    assert store.undo_turn(A, cid, a2.id) == (a1.id, "q2")
    assert store.get(A, cid).messages == 2


def test_undo_the_first_turn_opens_a_remaining_first_message(store):
    cid, (u1, a1) = chat(store, A, "original", "reply")
    u1b = store.add(A, cid, None, "user", "edited first")
    store.add(A, cid, u1b.id, "assistant", "reply to edit")
    assert store.branch(A, u1b.id) == Branch(2, 2)
    assert store.undo_turn(A, cid) == (a1.id, "edited first")
    assert store.get(A, cid).leaf == a1.id
    assert texts(store.path(A, cid)) == ["original", "reply"]
    assert store.branch(A, u1.id) == Branch(1, 1) and store.get(A, cid).messages == 2


# -- titles and search ----------------------------------------------------------------------
def test_titles_come_from_the_first_user_message(store):
    cid, _ = chat(store, A, "\n\n   How   do  tides\twork?  \nSecond line", "Moon.", "More?")
    assert store.get(A, cid).title == "How do tides work?"
    long = "word " * 40
    cid2, _ = chat(store, A, long)
    title = store.get(A, cid2).title
    assert len(title) <= TITLE_CHARS and title.endswith("…")
    assert title == long.strip()[: TITLE_CHARS - 1].rstrip() + "…"
    exact = "x" * TITLE_CHARS
    cid3, _ = chat(store, A, exact)
    assert store.get(A, cid3).title == exact
    cid4, _ = chat(store, A, "ignored for the title", title="Given title")
    assert store.get(A, cid4).title == "Given title"


def test_a_search_without_words_finds_its_text_as_written(store):
    """The index keeps words: a query of punctuation or emoji finds the conversations whose
    title or messages hold it as written, not every conversation; only the owner's."""
    smile, _ = chat(store, A, "Say hi 🙂", "Hi there!?!")
    plain, _ = chat(store, A, "Name a colour", "Blue.")
    chat(store, B, "Also 🙂", "?!")
    assert ids(store.conversations(A, "🙂")) == [smile]
    assert ids(store.conversations(A, " ?! ")) == [smile]
    assert ids(store.conversations(A, "...")) == []
    assert ids(store.conversations(A, ".")) == [plain]
    assert sorted(ids(store.conversations(A, "  "))) == sorted([smile, plain])  # no query


def test_rename_and_search_by_title_and_text(store):
    cid, _ = chat(store, A, "Recipe for pancakes", "Flour, eggs, milk")
    store.rename(A, cid, "  Breakfast\n ideas  ")
    assert store.get(A, cid).title == "Breakfast ideas"
    for bad in ("", "   ", "\n\t", None):
        with pytest.raises(StoreError, match="empty"):
            store.rename(A, cid, bad)
    assert store.get(A, cid).title == "Breakfast ideas"
    assert ids(store.conversations(A, "breakfast")) == [cid]
    assert ids(store.conversations(A, "pancakes")) == [cid]  # still in the first message
    store.rename(A, cid, "Weekend brunch")
    assert store.conversations(A, "breakfast") == []
    assert ids(store.conversations(A, "brunch")) == [cid]
    assert len(store.get(A, cid).title) <= 200
    store.rename(A, cid, "y" * 500)
    assert store.get(A, cid).title == "y" * 200


def test_search_words_prefixes_and_all_words(store):
    c1, _ = chat(store, A, "The narwhal has a tusk", "Indeed, a long spiral tusk")
    c2, _ = chat(store, A, "Penguins cannot fly", "They swim")
    time.sleep(0.002)
    c3, _ = chat(store, A, "Un café au lait", "Voilà")
    assert ids(store.conversations(A)) == [c3, c2, c1]  # most recently updated first
    assert ids(store.conversations(A, "narwhal")) == [c1]
    assert ids(store.conversations(A, "NARW")) == [c1]  # prefix, any case
    assert ids(store.conversations(A, "spiral")) == [c1]  # a reply's text
    assert ids(store.conversations(A, "narwhal tusk")) == [c1]
    assert store.conversations(A, "narwhal penguins") == []  # every word must be there
    assert ids(store.conversations(A, "swim")) == [c2]
    assert ids(store.conversations(A, "cafe")) == [c3]  # diacritics do not matter
    assert ids(store.conversations(A, "voila")) == [c3]
    assert ids(store.conversations(A, "   ")) == [c3, c2, c1]
    assert store.conversations(A, "zzzz") == []
    assert ids(store.conversations(A, "", limit=2)) == [c3, c2]
    store.add(A, c1, store.get(A, c1).leaf, "user", "and penguins?")
    assert ids(store.conversations(A)) == [c1, c3, c2]
    assert ids(store.conversations(A, "penguins")) == [c1, c2]


@pytest.mark.parametrize(
    "query",
    [
        '"',
        '""',
        '"narwhal',
        'narwhal"',
        "AND",
        "OR",
        "NOT",
        "narwhal AND",
        "AND narwhal",
        "narwhal OR penguin",
        "NOT narwhal",
        "*",
        "narw*",
        "(",
        ")",
        "(narwhal",
        "NEAR(",
        "NEAR(narwhal tusk, 2)",
        "text:narwhal",
        "-narwhal",
        "^narwhal",
        "{text}: x",
        "+",
        "'",
        "\\",
        "%",
        "_",
        "a_b",
        "narwhal;DROP TABLE messages;--",
        "\x00",
        "\u0301",
        "🦄",
        '"narwhal" (tusk)',
        "narwhal: tusk*",
    ],
)
def test_search_never_raises_on_query_syntax(store, query):
    c1, _ = chat(store, A, "The narwhal has a tusk")
    found = ids(store.conversations(A, query))
    assert found in ([], [c1])
    if query in (
        '"narwhal',
        'narwhal"',
        "(narwhal",
        "-narwhal",
        "^narwhal",
        "narw*",
        '"narwhal" (tusk)',
        "narwhal: tusk*",
    ):
        assert found == [c1]  # the words are searched for, the syntax ignored
    if query in ("narwhal AND", "NEAR(narwhal tusk, 2)", "text:narwhal", "NOT narwhal"):
        assert found == []  # "and", "near", "text", "not" are words like any other
    assert store.get(A, c1).messages == 1  # and nothing was dropped


# -- export and import ------------------------------------------------------------------------
def branched(store, owner=A):
    """A conversation with every kind of field: branches, settings, stats, stopped, system."""
    cid = store.create(owner, system="You are terse. Ünïcödé ✓")
    u1 = store.add(owner, cid, None, "user", "Héllo 🦄 wörld\nsecond line\twith a tab — 日本語")
    settings = {"temperature": 0.7, "top_k": 50, "top_p": 0.95, "seed": 1234}
    stats = {"tokens": 42, "tokens_per_s": 17.25, "ttft_s": 0.031}
    a1 = store.add(owner, cid, u1.id, "assistant", "Hi 👋", settings=settings, stats=stats)
    a1b = store.add(
        owner,
        cid,
        u1.id,
        "assistant",
        "Hello th",
        status="stopped",
        settings={**settings, "temperature": 1.3},
        stats={"tokens": 3},
    )
    u2 = store.add(owner, cid, a1.id, "user", "Go on")
    store.add(owner, cid, u2.id, "assistant", "Done.", settings=settings, stats=stats)
    store.set_leaf(owner, cid, a1b.id)  # the open branch is not the last message
    return cid


def test_export_import_export_is_exact(store):
    cid = branched(store)
    first = store.export(A, cid)
    assert first["format"] == "miniserve.conversation" and first["version"] == 1
    assert first["current"] == 2 and [m["parent"] for m in first["messages"]] == [None, 0, 0, 1, 3]
    assert first["messages"][2]["status"] == "stopped"
    assert first["messages"][1]["stats"]["tokens_per_s"] == 17.25
    for data in (first, json.dumps(first), json.dumps(first, ensure_ascii=False).encode()):
        (new,) = store.import_(A, data)
        assert new != cid
        assert store.export(A, new) == first
    # and into another owner's history, leaving the source alone
    (theirs,) = store.import_(B, json.dumps(first))
    assert store.export(B, theirs) == first and ids(store.conversations(B)) == [theirs]
    assert store.export(A, cid) == first
    imported = store.get(B, theirs)
    assert texts(store.path(B, theirs)) == [
        "Héllo 🦄 wörld\nsecond line\twith a tab — 日本語",
        "Hello th",
    ]
    assert imported.messages == 5
    assert ids(store.conversations(B, "wörld")) == [theirs]  # indexed for search


def test_export_all_imports_every_conversation(tmp_path, store):
    c1 = branched(store)
    c2, _ = chat(store, A, "Second conversation", "yes")
    c3 = store.create(A, title="Empty one")
    chat(store, B, "not alice's")
    everything = store.export_all(A)
    assert everything["format"] == "miniserve.conversations" and everything["version"] == 1
    assert [c["title"] for c in everything["conversations"]] == [
        store.get(A, c).title for c in (c1, c2, c3)
    ]  # oldest first
    other = Store(tmp_path / "other.sqlite3")
    new = other.import_(A, json.dumps(everything).encode())
    assert len(new) == 3
    assert other.export_all(A) == everything
    assert [c.title for c in other.conversations(A)] == [c.title for c in store.conversations(A)]
    assert other.conversations(B) == []
    other.close()


def test_markdown_and_openai_exports_give_the_open_branch(store):
    cid = branched(store)
    md = store.export_markdown(A, cid)
    title = store.get(A, cid).title
    assert md.startswith(f"# {title}\n")
    assert "**System:**\n\nYou are terse. Ünïcödé ✓" in md
    assert "**User:**\n\nHéllo 🦄 wörld\nsecond line" in md
    assert "**Assistant:** *(stopped)*\n\nHello th" in md
    assert "Hi 👋" not in md and "Go on" not in md and "Done." not in md
    assert store.export_openai(A, cid) == [
        {"role": "system", "content": "You are terse. Ünïcödé ✓"},
        {"role": "user", "content": "Héllo 🦄 wörld\nsecond line\twith a tab — 日本語"},
        {"role": "assistant", "content": "Hello th"},
    ]
    leaf = store.switch(A, store.path(A, cid)[-1].id, 1)
    assert [m["content"] for m in store.export_openai(A, cid)][2:] == ["Hi 👋", "Go on", "Done."]
    assert store.export_openai(A, cid, leaf) == store.export_openai(A, cid)
    assert "Go on" in store.export_markdown(A, cid) and "Hello th" not in store.export_markdown(
        A, cid
    )
    plain, _ = chat(store, A, "no system here", "right")
    assert store.export_openai(A, plain) == [
        {"role": "user", "content": "no system here"},
        {"role": "assistant", "content": "right"},
    ]
    assert "System" not in store.export_markdown(A, plain)


def test_openai_messages_import(store):
    messages = [
        {"role": "system", "content": "Speak like a pirate."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Where is "},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "the treasure?"},
            ],
        },
        {"role": "assistant", "content": "Arr, buried."},
        {"role": "user", "content": "Dig!"},
    ]
    (cid,) = store.import_(A, messages)
    conv = store.get(A, cid)
    assert (conv.title, conv.system, conv.messages) == (
        "Where is the treasure?",
        "Speak like a pirate.",
        3,
    )
    assert texts(store.path(A, cid)) == ["Where is the treasure?", "Arr, buried.", "Dig!"]
    assert store.export_openai(A, cid)[0] == {"role": "system", "content": "Speak like a pirate."}
    (cid2,) = store.import_(A, json.dumps({"messages": messages[1:3]}))
    assert texts(store.path(A, cid2)) == ["Where is the treasure?", "Arr, buried."]
    assert store.get(A, cid2).system == ""
    assert set(ids(store.conversations(A, "treasure"))) == {cid, cid2}


def good_tree(**reply):
    """A conversation export of one question and its reply (with `reply`'s fields too)."""
    return {
        "format": "miniserve.conversation",
        "version": 1,
        "title": "T",
        "system": "",
        "created": 1.0,
        "updated": 2.0,
        "current": 1,
        "messages": [
            {"id": 0, "parent": None, "role": "user", "content": "q", "created": 1.0},
            {"id": 1, "parent": 0, "role": "assistant", "content": "a", "created": 1.5, **reply},
        ],
    }


def _bad_cases():
    good = good_tree()

    def changed(edit):
        data = json.loads(json.dumps(good))
        edit(data)
        return data

    def two(data):
        return {"format": "miniserve.conversations", "version": 1, "conversations": [good, data]}

    return [
        ("not json", b'{"format": "miniserve.conversation", ', ["not JSON", "line 1"]),
        ("not utf-8", b"\xff\xfe\x00{\x00}\x80\x81", ["not text", "UTF-8"]),
        ("too large", os.urandom(max(10_000_000, config.MAX_IMPORT_BYTES + 1)), ["MB", "at most"]),
        ("a number", b"42", ["object or a list", "int"]),
        ("wrong format", changed(lambda d: d.update(format="chatgpt")), ["'format'", "chatgpt"]),
        ("wrong version", changed(lambda d: d.update(version=2)), ["'version'", "2"]),
        (
            "roles out of order",
            changed(lambda d: d["messages"][1].update(role="user")),
            ["messages[1].role", "alternate"],
        ),
        (
            "assistant first",
            changed(lambda d: d["messages"][0].update(role="assistant")),
            ["messages[0].role"],
        ),
        (
            "parent forward",
            changed(lambda d: d["messages"][0].update(parent=1)),
            ["messages[0].parent", "earlier"],
        ),
        (
            "parent is itself",
            changed(lambda d: d["messages"][1].update(parent=1)),
            ["messages[1].parent"],
        ),
        (
            "parent true",
            changed(lambda d: d["messages"][1].update(parent=True)),
            ["messages[1].parent"],
        ),
        ("bad current", changed(lambda d: d.update(current=7)), ["'current'"]),
        ("current negative", changed(lambda d: d.update(current=-1)), ["'current'"]),
        (
            "non-string content",
            changed(lambda d: d["messages"][1].update(content=5)),
            ["messages[1].content", "string"],
        ),
        (
            "bad status",
            changed(lambda d: d["messages"][1].update(status="lost")),
            ["messages[1].status"],
        ),
        ("bad id", changed(lambda d: d["messages"][1].update(id=5)), ["messages[1].id"]),
        (
            "settings not object",
            changed(lambda d: d["messages"][1].update(settings=[1])),
            ["messages[1].settings"],
        ),
        ("no created", changed(lambda d: d.pop("created")), ["'created'"]),
        ("nan time", changed(lambda d: d.update(updated=float("nan"))), ["'updated'"]),
        ("title not string", changed(lambda d: d.update(title=3)), ["'title'"]),
        ("messages not list", changed(lambda d: d.update(messages={})), ["'messages'"]),
        (
            "2nd of all bad",
            two(changed(lambda d: d["messages"][1].update(content=None))),
            ["conversations[1].messages[1].content"],
        ),
        ("2nd of all not a conversation", two({"format": "x"}), ["conversations[1].format"]),
        (
            "all not a list",
            {"format": "miniserve.conversations", "version": 1, "conversations": {}},
            ["'conversations'"],
        ),
        (
            "system not first",
            [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
            ["[1].role", "'system'", "first"],
        ),
        (
            "openai roles",
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            ["messages[1].role", "'assistant'"],
        ),
        (
            "openai tool role",
            [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
            ["messages[1].role", "'tool'"],
        ),
        ("openai no content", [{"role": "user", "content": None}], ["messages[0].content"]),
        (
            "openai bad text part",
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            ["messages[0].content"],
        ),
        ("openai empty", [], ["non-empty"]),
        (
            "openai only system",
            {"messages": [{"role": "system", "content": "s"}]},
            ["no user or assistant"],
        ),
        ("nested too deep", b"[" * 200_000, ["deep"]),
        ("lone surrogate", '{"messages": "\ud800"}', ["not text"]),
    ]


@pytest.mark.parametrize("name, data, words", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_imports_name_the_problem_and_change_nothing(store, name, data, words):
    branched(store)
    chat(store, B, "bob's")
    before = raw_rows(store.file)
    exported = store.export_all(A)
    with pytest.raises(BadImport) as info:
        store.import_(A, data)
    for word in words:
        assert word in str(info.value), (name, str(info.value))
    assert raw_rows(store.file) == before
    assert store.export_all(A) == exported and len(store.conversations(A)) == 1


# -- opening the file -------------------------------------------------------------------------
def test_open_store_keeps_a_corrupt_file_aside(tmp_path):
    path = tmp_path / "history.sqlite3"
    garbage = b"this is not sqlite\x00" + os.urandom(16_000)
    path.write_bytes(garbage)
    s = open_store(path)
    assert not s.in_memory and s.version == SCHEMA_VERSION
    (aside,) = [
        p
        for p in tmp_path.iterdir()
        if p.name != path.name and "-wal" not in p.name and "-shm" not in p.name
    ]
    assert aside.name.startswith("history.sqlite3.corrupt-")
    assert aside.read_bytes() == garbage
    assert "kept aside" in s.notice and aside.name in s.notice and "\n" not in s.notice
    cid, _ = chat(s, A, "a fresh start", "indeed")
    s.close()
    again = open_store(path)
    assert again.notice is None and texts(again.path(A, cid)) == ["a fresh start", "indeed"]
    again.close()
    assert aside.read_bytes() == garbage


def test_open_store_keeps_a_damaged_database_aside(tmp_path):
    path = tmp_path / "history.sqlite3"
    s = Store(path)
    for _ in range(20):
        chat(s, A, "x" * 2000, "y" * 2000)
    s.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 40_000
    data[8192 : 8192 + 4096] = b"\xa5" * 4096  # damage page 3: quick_check reports it
    path.write_bytes(bytes(data))
    s = open_store(path)
    assert not s.in_memory and "kept aside" in s.notice and "\n" not in s.notice
    assert s.conversations(A) == []
    (aside,) = tmp_path.glob("history.sqlite3.corrupt-*")
    assert aside.read_bytes() == bytes(data)
    s.close()


def test_open_store_falls_back_to_memory_when_the_file_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for path in (blocker / "history.sqlite3", blocker / "sub" / "history.sqlite3", tmp_path):
        s = open_store(path, max_conversations=2)
        assert s.in_memory and s.file == ":memory:"
        assert str(path) in s.notice and "in memory" in s.notice
        assert s.describe() == "history in memory only (not saved)"
        cid, _ = chat(s, A, "still works", "yes")
        assert texts(s.path(A, cid)) == ["still works", "yes"]
        assert ids(s.conversations(A, "works")) == [cid]
        assert s.max_conversations == 2
        s.close()
    assert blocker.read_text() == "not a folder"


def test_open_store_disabled_keeps_history_in_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISERVE_DATA_DIR", str(tmp_path / "data"))
    s = open_store(enabled=False)
    assert s.in_memory and "--no-history" in s.notice and "memory" in s.notice
    cid, _ = chat(s, A, "ephemeral")
    assert ids(s.conversations(A)) == [cid]
    s.close()
    assert not (tmp_path / "data").exists()
    s = open_store()  # the default: a file in the data folder
    assert s.file == str(tmp_path / "data" / "history.sqlite3") and s.notice is None
    assert Path(s.file).is_file()
    s.close()


# -- retention, durability, secret, delete ----------------------------------------------------
def test_retention_keeps_the_most_recently_updated_per_owner(tmp_path):
    s = open_store(tmp_path / "h.sqlite3", max_conversations=3)
    bobs = [chat(s, B, f"bob {i}")[0] for i in range(3)]
    c1, (u1,) = chat(s, A, "one")
    time.sleep(0.002)
    c2, _ = chat(s, A, "two")
    time.sleep(0.002)
    c3, _ = chat(s, A, "three")
    time.sleep(0.002)
    s.add(A, c1, u1.id, "assistant", "one is used again")  # c1 is now the most recent
    time.sleep(0.002)
    c4, _ = chat(s, A, "four")
    assert ids(s.conversations(A)) == [c4, c1, c3]
    with pytest.raises(NotFound):
        s.get(A, c2)
    assert s.conversations(A, "two") == []
    assert sorted(ids(s.conversations(B))) == sorted(bobs)
    time.sleep(0.002)
    new = s.import_(A, [{"role": "user", "content": "imported five"}])
    assert ids(s.conversations(A)) == new + [c4, c1]
    s.close()
    rows = raw_rows(tmp_path / "h.sqlite3")
    assert len(rows["conversations"]) == 6
    assert not any(r[1] == c2 for r in rows["messages"])
    assert not any(c2 in r for r in rows["search"])


def test_a_killed_process_keeps_every_message_it_added(tmp_path):
    path = tmp_path / "h.sqlite3"
    child = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from miniserve.store.store import Store
        s = Store({str(path)!r})
        cid = s.create("alice")
        print(cid, flush=True)
        parent = None
        for i in range(40):
            m = s.add("alice", cid, parent, ("user", "assistant")[i % 2], f"message {{i}}")
            parent = m.id
            print(m.id, flush=True)
            if i == 24:
                os.kill(os.getpid(), signal.SIGKILL)
        print("not killed", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert run.returncode == -signal.SIGKILL, run.stderr
    cid, *added = run.stdout.split()
    assert len(added) == 25
    s = Store(path)
    path_ = s.path(A, cid)
    assert [m.id for m in path_] == added
    assert texts(path_) == [f"message {i}" for i in range(25)]
    assert s.get(A, cid).leaf == added[-1]
    s.close()


def test_secret_is_kept_with_the_file(tmp_path):
    s = Store(tmp_path / "h.sqlite3")
    secret = s.secret()
    assert len(secret) == 64 and int(secret, 16) >= 0 and s.secret() == secret
    s.close()
    s = open_store(tmp_path / "h.sqlite3")
    assert s.secret() == secret
    s.close()
    other = Store(tmp_path / "other.sqlite3")
    assert other.secret() != secret
    other.close()


def test_delete_restore_and_purge(tmp_path):
    path = tmp_path / "h.sqlite3"
    s = Store(path)
    c1, (u1, a1) = chat(s, A, "apples", "red")
    c2, _ = chat(s, A, "bananas", "yellow")
    c3, _ = chat(s, A, "cherries", "dark")
    b1, _ = chat(s, B, "bob deleted this")
    s.delete(B, b1)
    s.delete(A, c1)
    assert c1 not in ids(s.conversations(A)) and s.conversations(A, "apples") == []
    for attempt in (
        lambda: s.get(A, c1),
        lambda: s.path(A, c1),
        lambda: s.message(A, u1.id),
        lambda: s.add(A, c1, a1.id, "user", "x"),
        lambda: s.export(A, c1),
        lambda: s.delete(A, c1),
    ):
        with pytest.raises(NotFound):
            attempt()
    assert s.restore(A) == c1
    assert texts(s.path(A, c1)) == ["apples", "red"] and ids(s.conversations(A, "apples")) == [c1]
    assert s.restore(A) is None
    # deleting another makes the first one unrecoverable
    s.delete(A, c1)
    s.delete(A, c2)
    assert s.restore(A) == c2
    assert s.restore(A) is None
    with pytest.raises(NotFound):
        s.get(A, c1)
    assert not any(r[0] == c1 for r in raw_rows(path)["conversations"])
    assert not any(c1 in r for r in raw_rows(path)["search"])
    assert sorted(ids(s.conversations(A))) == sorted([c2, c3])
    # the others' deleted conversation waits for them; reopening purges every deleted one
    s.delete(A, c3)
    assert {r[0] for r in raw_rows(path)["conversations"]} == {c2, c3, b1}
    s.close()
    s = Store(path)
    assert s.restore(A) is None and s.restore(B) is None
    assert ids(s.conversations(A)) == [c2]
    rows = raw_rows(path)
    assert [r[0] for r in rows["conversations"]] == [c2]
    assert {r[1] for r in rows["messages"]} == {c2}
    s.close()


def test_set_system_and_threads_share_one_store(store):
    cid, _ = chat(store, A, "hi")
    store.set_system(A, cid, "Be\x00 kind.\nAlways.")
    assert store.get(A, cid).system == "Be kind.\nAlways."
    assert store.export_openai(A, cid)[0] == {"role": "system", "content": "Be kind.\nAlways."}
    errors = []

    def worker(n):
        try:
            for i in range(10):
                chat(store, f"owner{n}", f"thread {n} message {i}", "ok")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for n in range(4):
        convs = store.conversations(f"owner{n}")
        assert len(convs) == 10 and all(c.messages == 2 for c in convs)
