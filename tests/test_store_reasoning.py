"""A reply's reasoning and tool calls in the conversation store: schema version 3 opening a
history file that the version 2 store wrote (tests/data/store_v2.sqlite3, with what that store
read back from it in store_v2.json; tests/data/make_store_v2.py made both), saving and reading
them, search, and every export and import. Real SQLite files under tmp_path, no model."""

import json
import shutil
import sqlite3
from dataclasses import FrozenInstanceError, asdict
from pathlib import Path

import pytest
from test_store import good_tree, refused_as_newer

from miniserve.store.records import as_dict
from miniserve.store.store import (
    SCHEMA_VERSION,
    BadImport,
    NotFound,
    Store,
    StoreError,
    open_store,
)

DATA = Path(__file__).resolve().parent / "data"
A, B = "alice", "bob"
NEW = ("reasoning", "tool_calls")
WEATHER = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
TIME = {"id": "call_2", "name": "get_time", "arguments": '{"zone": "Europe/Paris"}'}


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "history.sqlite3")
    yield s
    s.close()


@pytest.fixture
def v2(tmp_path):
    """A copy of the history file the version 2 store wrote, and what it read back from it."""
    path = tmp_path / "history.sqlite3"
    shutil.copyfile(DATA / "store_v2.sqlite3", path)
    return path, json.loads((DATA / "store_v2.json").read_text(encoding="utf-8"))


def user_version(path) -> int:
    db = sqlite3.connect(path)
    try:
        return db.execute("PRAGMA user_version").fetchone()[0]
    finally:
        db.close()


def without_new(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in NEW}


def old_shape(export: dict) -> dict:
    """An export (one conversation or all) as the version 2 store wrote it: no reasoning or
    tool calls on its messages. Asserts that they were empty."""
    if "conversations" in export:
        return {**export, "conversations": [old_shape(c) for c in export["conversations"]]}
    for m in export["messages"]:
        assert (m["reasoning"], m["tool_calls"]) == ("", [])
    return {**export, "messages": [without_new(m) for m in export["messages"]]}


def thinking_chat(s, owner=A, system="Be exact."):
    """A conversation whose open branch has a reply with reasoning and tool calls and no
    text, then a reply with reasoning and text; beside it a regenerated reply with
    neither. (id, messages of the open branch)."""
    cid = s.create(owner, system=system)
    u1 = s.add(owner, cid, None, "user", "What is the weather in Paris?", created=100.0)
    a1 = s.add(
        owner,
        cid,
        u1.id,
        "assistant",
        "",
        reasoning="The user wants the weather.\nI should call get_weather.",
        tool_calls=[WEATHER, TIME],
        settings={"temperature": 0.6},
        stats={"tokens": 30},
        created=101.0,
    )
    s.add(owner, cid, u1.id, "assistant", "I cannot know that.", created=102.0)
    s.set_leaf(owner, cid, a1.id)
    u2 = s.add(owner, cid, a1.id, "user", "It is 18 °C and sunny.", created=103.0)
    a2 = s.add(
        owner,
        cid,
        u2.id,
        "assistant",
        "Paris is sunny, 18 °C.",
        reasoning="Summarise the tool result: a quokka-free answer.",
        status="stopped",
        created=104.0,
    )
    return cid, [u1, a1, u2, a2]


def fields(messages):
    """What a message says, without the ids a store gives it."""
    return [
        (
            m.role,
            m.content,
            m.reasoning,
            m.tool_calls,
            m.status,
            m.settings,
            m.stats,
            m.created,
        )
        for m in messages
    ]


# -- the schema: a version 2 file opened by version 3 ------------------------------------------
def test_a_version_2_file_opens_with_everything_it_had(v2):
    path, seen = v2
    assert user_version(path) == 2 == SCHEMA_VERSION - 1
    s = open_store(path)
    assert s.notice is None and not s.in_memory
    assert s.version == SCHEMA_VERSION == 3
    assert s.secret() == seen["secret"]
    # the conversation the version 2 store had deleted (kept for undo) is gone at reopen
    with pytest.raises(NotFound):
        s.get(A, seen["deleted"])
    for owner, old in seen["owners"].items():
        now = s.conversations(owner)
        assert [asdict(c) for c in now] == [c["summary"] for c in old["conversations"]]
        for c, was in zip(now, old["conversations"]):
            path_ = s.path(owner, c.id)
            assert [without_new(as_dict(m)) for m in path_] == was["path"]
            assert all(m.reasoning == "" and m.tool_calls == [] for m in path_)
            assert [asdict(b) for b in s.branches(owner, path_)] == was["branches"]
            assert s.export_markdown(owner, c.id) == was["markdown"]
            assert s.export_openai(owner, c.id) == was["openai"]
        assert old_shape(s.export_all(owner)) == old["export_all"]
        for query, found in old["search"].items():
            assert [c.id for c in s.conversations(owner, query)] == found, (owner, query)
    s.close()
    assert user_version(path) == SCHEMA_VERSION
    db = sqlite3.connect(path)
    columns = {r[1]: (r[2], r[3], r[4]) for r in db.execute("PRAGMA table_info(messages)")}
    db.close()
    assert columns["reasoning"] == ("TEXT", 1, "''")
    assert columns["tool_calls"] == ("TEXT", 1, "'[]'")


def test_a_migrated_file_takes_replies_with_reasoning_and_tool_calls(v2):
    path, seen = v2
    s = Store(path)
    narwhal = next(
        c["summary"] for c in seen["owners"][A]["conversations"] if c["summary"]["messages"] == 7
    )
    cid, leaf = narwhal["id"], narwhal["leaf"]
    before = s.path(A, cid)
    u = s.add(A, cid, leaf, "user", "And its weight?")
    a = s.add(
        A,
        cid,
        u.id,
        "assistant",
        "",
        reasoning="Look it up: the okapi-sized answer.",
        tool_calls=[WEATHER],
    )
    # a regenerated old reply: a sibling of a version 2 message, with reasoning
    first_user = before[0]
    again = s.add(A, cid, first_user.id, "assistant", "Spiral tusk.", reasoning="Short answer.")
    assert s.branch(A, again.id).count == 3
    s.set_leaf(A, cid, a.id)
    s.close()

    s = Store(path)  # reopened: nothing runs twice, everything reads back
    assert s.version == SCHEMA_VERSION
    path_ = s.path(A, cid)
    assert [m.id for m in path_] == [m.id for m in before] + [u.id, a.id]
    assert path_[:-2] == before
    assert (path_[-1].reasoning, path_[-1].tool_calls, path_[-1].content) == (
        "Look it up: the okapi-sized answer.",
        [WEATHER],
        "",
    )
    assert s.message(A, again.id).reasoning == "Short answer."
    assert [c.id for c in s.conversations(A, "okapi")] == [cid]
    for query, found in seen["owners"][A]["search"].items():
        assert [c.id for c in s.conversations(A, query)] == found, query  # indexed once
    s.close()


def test_a_file_newer_than_this_store_is_refused_and_kept_aside(v2):
    path, _ = v2
    refused_as_newer(path)
    assert user_version(path) == SCHEMA_VERSION + 1  # refused, not changed
    s = open_store(path)
    assert s.version == SCHEMA_VERSION and not s.in_memory and "kept aside" in s.notice
    assert s.conversations(A) == []
    (aside,) = path.parent.glob("history.sqlite3.corrupt-*")
    assert user_version(aside) == SCHEMA_VERSION + 1
    s.close()


# -- saving and reading ----------------------------------------------------------------------
def test_a_reply_keeps_its_reasoning_and_tool_calls(store):
    cid, (u1, a1, u2, a2) = thinking_chat(store)
    assert (u1.reasoning, u1.tool_calls) == ("", [])
    assert a1.reasoning == "The user wants the weather.\nI should call get_weather."
    assert a1.tool_calls == [WEATHER, TIME] and a1.content == ""
    assert store.message(A, a1.id) == a1 and store.message(A, a2.id) == a2
    assert store.path(A, cid) == [u1, a1, u2, a2]
    assert as_dict(a1)["tool_calls"] == [WEATHER, TIME]
    assert as_dict(a2)["reasoning"].startswith("Summarise")
    with pytest.raises(FrozenInstanceError):
        a1.reasoning = "changed"
    # the regenerated sibling has neither
    other = store.switch(A, a1.id, 1)
    assert (store.message(A, other).reasoning, store.message(A, other).tool_calls) == ("", [])


def test_reasoning_and_tool_calls_are_cleaned_like_text(store):
    cid = store.create(A)
    u = store.add(A, cid, None, "user", "q")
    call = {"id": "c\x001", "name": "f\x07n", "arguments": '{"a":\x1b 1}'}
    a = store.add(
        A, cid, u.id, "assistant", "x", reasoning="th\x00ink\ttab\nline", tool_calls=[call]
    )
    assert a.reasoning == "think\ttab\nline"
    assert a.tool_calls == [{"id": "c1", "name": "fn", "arguments": '{"a": 1}'}]
    assert store.message(A, a.id) == a
    # arguments are kept as the model wrote them, JSON or not
    b = store.add(A, cid, u.id, "assistant", "", tool_calls=[{**WEATHER, "arguments": "{oops"}])
    assert store.message(A, b.id).tool_calls[0]["arguments"] == "{oops"


@pytest.mark.parametrize(
    "role, reasoning, calls, words",
    [
        ("assistant", 5, None, ["'reasoning'", "string", "int"]),
        ("assistant", "", {"id": "x"}, ["'tool_calls'", "list", "dict"]),
        ("assistant", "", ["call"], ["'tool_calls[0]'", "object", "str"]),
        ("assistant", "", [WEATHER, {"name": "f", "arguments": "{}"}], ["'tool_calls[1].id'"]),
        ("assistant", "", [{**WEATHER, "name": 3}], ["'tool_calls[0].name'", "string", "int"]),
        (
            "assistant",
            "",
            [{**WEATHER, "arguments": {"city": "Paris"}}],
            ["'tool_calls[0].arguments'", "string", "dict"],
        ),
        ("assistant", "", [{**WEATHER, "name": "  "}], ["'tool_calls[0].name'", "empty"]),
        ("assistant", "", [{**WEATHER, "type": "function"}], ["'tool_calls[0]'", "'type'"]),
        ("user", "thinking", None, ["'reasoning'", "user message", "reply"]),
        ("user", "", [WEATHER], ["'tool_calls'", "user message"]),
    ],
)
def test_bad_reasoning_or_tool_calls_are_refused_naming_the_fault(
    store, role, reasoning, calls, words
):
    cid = store.create(A)
    parent = None
    if role == "assistant":
        parent = store.add(A, cid, None, "user", "q").id
    before = store.export(A, cid)
    with pytest.raises(StoreError) as info:
        store.add(A, cid, parent, role, "text", reasoning=reasoning, tool_calls=calls)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert store.export(A, cid) == before


def test_search_finds_a_reply_by_its_text_and_reasoning_not_its_tool_calls(store):
    cid, _ = thinking_chat(store)
    other, _ = thinking_chat(store, B)
    assert [c.id for c in store.conversations(A, "quokka")] == [cid]  # reasoning
    assert [c.id for c in store.conversations(A, "sunny")] == [cid]  # text
    assert [c.id for c in store.conversations(A, "get_weather")] == [cid]  # named in reasoning
    assert store.conversations(A, "Europe") == []  # only in a tool call's arguments
    assert [c.id for c in store.conversations(B, "quokka")] == [other]
    store.undo_turn(A, cid)
    assert store.conversations(A, "quokka") == []  # its row went with the reply


# -- exports and imports ---------------------------------------------------------------------
def test_json_export_imports_into_a_fresh_store_as_it_was(tmp_path, store):
    cid, path = thinking_chat(store)
    exported = store.export(A, cid)
    m = exported["messages"]
    assert [x["reasoning"] for x in m] == ["", path[1].reasoning, "", "", path[3].reasoning]
    assert m[1]["tool_calls"] == [WEATHER, TIME] and m[2]["tool_calls"] == []
    everything = store.export_all(A)
    text, suffix = store.export_text(A, cid, "json")
    assert suffix == ".json" and json.loads(text) == exported

    fresh = Store(tmp_path / "fresh.sqlite3")
    (new,) = fresh.import_(A, text.encode())
    assert fresh.export(A, new) == exported
    assert fields(fresh.path(A, new)) == fields(path)
    assert [c.id for c in fresh.conversations(A, "quokka")] == [new]
    other = Store(tmp_path / "other.sqlite3")
    other.import_(A, json.dumps(everything))
    assert other.export_all(A) == everything
    fresh.close()
    other.close()


def test_an_export_without_the_new_keys_still_imports(store):
    """store_v2.json holds what the version 2 store exported: no reasoning, no tool_calls."""
    seen = json.loads((DATA / "store_v2.json").read_text(encoding="utf-8"))
    old = seen["owners"][A]["export_all"]
    assert all(not set(NEW) & set(m) for c in old["conversations"] for m in c["messages"]), (
        "the fixture is an export from before reasoning was kept"
    )
    ids = store.import_(A, json.dumps(old))
    assert len(ids) == len(old["conversations"])
    assert old_shape(store.export_all(A)) == old
    for cid in ids:
        assert all(m.reasoning == "" and m.tool_calls == [] for m in store.path(A, cid))


@pytest.mark.parametrize(
    "data, words",
    [
        (good_tree(reasoning=["x"]), ["'messages[1].reasoning'", "string"]),
        (good_tree(tool_calls="f()"), ["'messages[1].tool_calls'", "list"]),
        (
            good_tree(tool_calls=[{"id": "1", "arguments": "{}"}]),
            ["'messages[1].tool_calls[0].name'", "string"],
        ),
        (
            {**good_tree(), "messages": [{**good_tree()["messages"][0], "reasoning": "hm"}]},
            ["'messages[0].reasoning'", "user message"],
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            ],
            ["messages[1].tool_calls[0].function", "object"],
        ),
        (
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "1", "type": "web", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
            ],
            ["messages[1].tool_calls[0].type", "'function'"],
        ),
        (
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                },
            ],
            ["messages[1].tool_calls[0].function.arguments", "string"],
        ),
        (
            [{"role": "user", "content": "q", "reasoning_content": 3}],
            ["'messages[0].reasoning_content'", "string"],
        ),
        (
            [{"role": "user", "content": "q", "reasoning_content": "hm"}],
            ["'messages[0].reasoning_content'", "user message"],
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
            ["messages[1].content", "string"],
        ),
    ],
)
def test_bad_reasoning_or_tool_calls_in_an_import_change_nothing(store, data, words):
    cid, _ = thinking_chat(store)
    before = store.export_all(A)
    with pytest.raises(BadImport) as info:
        store.import_(A, data)
    for word in words:
        assert word in str(info.value), str(info.value)
    assert store.export_all(A) == before


def test_openai_export_has_reasoning_content_and_tool_calls_and_imports_back(store):
    cid, path = thinking_chat(store)
    messages = store.export_openai(A, cid)
    assert messages == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "The user wants the weather.\nI should call get_weather.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "Europe/Paris"}'},
                },
            ],
        },
        {"role": "user", "content": "It is 18 °C and sunny."},
        {
            "role": "assistant",
            "content": "Paris is sunny, 18 °C.",
            "reasoning_content": "Summarise the tool result: a quokka-free answer.",
        },
    ]
    text, suffix = store.export_text(A, cid, "openai")
    assert suffix == ".messages.json" and json.loads(text) == messages
    (new,) = store.import_(A, text)
    assert store.get(A, new).system == "Be exact."
    got = store.path(A, new)
    assert [(m.role, m.content, m.reasoning, m.tool_calls) for m in got] == [
        (m.role, m.content, m.reasoning, m.tool_calls) for m in path
    ]
    assert store.export_openai(A, new) == messages
    # a reply with text and tool calls keeps its text; an empty reply without any stays ""
    c2 = store.create(A)
    u = store.add(A, c2, None, "user", "q")
    store.add(A, c2, u.id, "assistant", "Checking.", tool_calls=[WEATHER])
    assert store.export_openai(A, c2)[1]["content"] == "Checking."
    store.add(A, c2, u.id, "assistant", "", status="stopped")
    assert store.export_openai(A, c2)[1] == {"role": "assistant", "content": ""}


def test_markdown_folds_the_reasoning_and_fences_each_tool_call(store):
    cid, _ = thinking_chat(store)
    md = store.export_markdown(A, cid)
    assert (
        "**Assistant:**\n\n"
        "<details><summary>Thinking</summary>\n\n"
        "The user wants the weather.\nI should call get_weather.\n\n"
        "</details>\n\n"
        "**Tool call:** `get_weather`\n\n"
        '```json\n{"city": "Paris"}\n```\n\n'
        "**Tool call:** `get_time`\n\n"
        '```json\n{"zone": "Europe/Paris"}\n```\n\n'
        "**User:**\n\nIt is 18 °C and sunny."
    ) in md
    assert md.endswith(
        "**Assistant:** *(stopped)*\n\n"
        "<details><summary>Thinking</summary>\n\n"
        "Summarise the tool result: a quokka-free answer.\n\n"
        "</details>\n\n"
        "Paris is sunny, 18 °C.\n"
    )
    text, suffix = store.export_text(A, cid, "md")
    assert (text, suffix) == (md, ".md")
    # reasoning that would close the block, arguments holding a fence
    c2 = store.create(A)
    u = store.add(A, c2, None, "user", "q")
    store.add(
        A,
        c2,
        u.id,
        "assistant",
        "ok",
        reasoning="a </details> inside",
        tool_calls=[{"id": "1", "name": "run", "arguments": '{"code": "```py\\nx\\n```"}'}],
    )
    md = store.export_markdown(A, c2)
    assert md.count("</details>") == 1 and "a &lt;/details&gt; inside" in md
    assert '````json\n{"code": "```py\\nx\\n```"}\n````' in md


def test_plain_text_export_has_a_thinking_section(store):
    cid, _ = thinking_chat(store)
    text, suffix = store.export_text(A, cid, "txt")
    assert suffix == ".txt"
    assert text.startswith("What is the weather in Paris?\n\nSystem:\nBe exact.\n\nUser:\n")
    assert (
        "Assistant:\n"
        "Thinking:\n"
        "    The user wants the weather.\n"
        "    I should call get_weather.\n\n"
        'Tool call get_weather: {"city": "Paris"}\n\n'
        'Tool call get_time: {"zone": "Europe/Paris"}\n\n'
        "User:\nIt is 18 °C and sunny.\n\n"
        "Assistant: (stopped)\n"
        "Thinking:\n"
        "    Summarise the tool result: a quokka-free answer.\n\n"
        "Paris is sunny, 18 °C.\n"
    ) in text
    plain = store.create(A, title="Plain")
    u = store.add(A, plain, None, "user", "hi")
    store.add(A, plain, u.id, "assistant", "hello")
    assert store.export_text(A, plain, "txt")[0] == "Plain\n\nUser:\nhi\n\nAssistant:\nhello\n"
    with pytest.raises(StoreError, match="txt"):
        store.export_text(A, cid, "pdf")
