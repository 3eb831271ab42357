"""A thinking model in the chat, without a browser: a reply's reasoning apart from its text in
the turn, the store and the Chat tab (open while it streams, folded once the answer starts,
folded in a saved conversation); what the next turn sends back (the template's rule for
earlier reasoning); the Think switch and the reasoning budget, shown for a model that thinks
only; a saved tool call drawn as a card; the terminal chat's "Thinking:"; and completion mode,
where the tags stay text. On the tiny random-weights models of tests/thinking_models.py."""

import io
from types import SimpleNamespace

import pytest
from thinking_models import qwen3_tiny, r1_tiny

from miniserve.cli.repl import ChatSession
from miniserve.core.config import SamplingParams
from miniserve.engine.chat import ChatOptions
from miniserve.engine.turn import ChatTurn, chat_messages, history_of
from miniserve.models.registry import EngineOptions, Models, ModelSpec, engine_factory
from miniserve.store.store import open_store
from miniserve.ui import ChatHandlers, build_ui
from miniserve.ui import common as ui_common
from miniserve.ui.conversation import Shown
from miniserve.ui.render import THINKING, call_card, reply_rows, thought_title
from miniserve.ui.sidebar import SidebarHandlers
from miniserve.ui.widgets import preset_values, thinking_options

SAMPLED = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, max_new_tokens=24, seed=3)
BUDGET = 6
MARK = "zebra-crossing-reasoning"  # a reasoning written by hand, to look for in prompts
CALL = {"id": "call_7", "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}


@pytest.fixture(scope="module")
def models(engine):
    """r1 (its generation prompt opens <think>), qwen3 (Qwen3's template) and the embedded
    SmolLM2 (the session's engine: it does not think); the first two loaded here."""
    load = engine_factory(EngineOptions())
    specs = [
        ModelSpec("r1", str(r1_tiny())),
        ModelSpec("qwen3", str(qwen3_tiny())),
        ModelSpec("smol", None),
    ]
    registry = Models(
        specs,
        lambda spec, progress: engine if spec.name == "smol" else load(spec, progress),
        max_loaded=8,
    )
    registry.get("r1"), registry.get("qwen3"), registry.get("smol")
    yield registry
    for name in ("r1", "qwen3"):
        registry.get(name).close()


@pytest.fixture
def chat(models, presets):
    return ChatHandlers(models, presets)


def budgeted(budget=BUDGET):
    return ChatOptions(thinking=True, reasoning_budget=budget)


def decoded(engine, messages) -> str:
    return engine.tokenizer.decode(engine.trim(messages, SAMPLED).prompt_ids)


def by_hand(store, owner, reasoning=MARK, calls=None, text="Hello there."):
    """A saved conversation: a question and a reply with the reasoning (and calls) given."""
    cid = store.create(owner)
    user = store.add(owner, cid, None, "user", "Hi!").id
    store.add(owner, cid, user, "assistant", text, reasoning=reasoning, tool_calls=calls)
    return cid, store.path(owner, cid)


# -- The turn and the store ------------------------------------------------------------------


def test_a_budgeted_reply_keeps_its_reasoning_apart_and_saves_and_reloads_both(models):
    engine = models.get("r1")
    store = open_store(enabled=False)
    turn = ChatTurn(engine, SAMPLED, system=None, history=[], text="Hi!", options=budgeted())
    turn.save_question(store, "me", None, None)
    for _ in turn:
        pass
    stats = turn.last.stats
    assert stats.reasoning_tokens == BUDGET and turn.reasoning_tokens == BUDGET
    assert turn.reasoning_so_far.strip() and turn.text_so_far.strip()
    assert "<think>" not in turn.reasoning_so_far + turn.text_so_far
    assert "</think>" not in turn.reasoning_so_far + turn.text_so_far
    assert turn.reasoning_s is not None and 0 < turn.reasoning_s <= stats.total_s + 1

    saved = turn.save_reply(store, "me")
    again = store.path("me", turn.conversation)[-1]
    assert again.id == saved.id
    assert again.reasoning == turn.reasoning_so_far and again.content == turn.text_so_far
    assert again.tool_calls == []
    assert again.settings["thinking"] is True and again.settings["reasoning_budget"] == BUDGET
    assert again.stats["reasoning_tokens"] == BUDGET and again.stats["reasoning_s"] > 0


def test_think_off_on_a_template_without_a_switch_is_a_reply_without_reasoning(models):
    turn = ChatTurn(
        models.get("r1"),
        SAMPLED,
        system=None,
        history=[],
        text="Hi!",
        options=ChatOptions(thinking=False),
    )
    for _ in turn:
        pass
    assert turn.reasoning_so_far == "" and turn.text_so_far.strip()
    assert turn.last.stats.reasoning_tokens == 0
    assert turn.details()["settings"]["thinking"] is False


@pytest.mark.parametrize("name", ["qwen3", "r1"])
def test_the_next_turn_sends_the_reasoning_and_the_template_drops_it(models, name):
    """The history's reply carries its reasoning as reasoning_content, and the template applies
    its own rule: Qwen3's (and the R1-style template built on it, as DeepSeek-R1's own, which
    keeps only what follows </think>) drops the reasoning of a turn before the last user
    message, and keeps it in the turn being continued."""
    engine = models.get(name)
    _, path = by_hand(open_store(enabled=False), "me")
    history = history_of(path)
    sent = chat_messages(None, history, "And now?", reasoning=engine.thinks)
    assert sent[1] == {"role": "assistant", "content": "Hello there.", "reasoning_content": MARK}
    assert "Hello there." in decoded(engine, sent) and MARK not in decoded(engine, sent)
    # the reply continued (the last message is the assistant's): after the last user message,
    # where the template keeps reasoning; so it did reach the template
    assert MARK in decoded(engine, chat_messages(None, history, None, reasoning=True))
    # a server of another kind is not sent it (some refuse reasoning_content)
    assert "reasoning_content" not in chat_messages(None, history, "x", reasoning=False)[1]


def test_a_saved_tool_call_goes_back_to_the_template_as_openai_sends_it(models):
    engine = models.get("qwen3")
    _, path = by_hand(open_store(enabled=False), "me", reasoning="", calls=[CALL], text="")
    sent = chat_messages(None, history_of(path), "Thanks.")
    assert sent[1]["tool_calls"] == [
        {
            "id": "call_7",
            "type": "function",
            "function": {"name": "get_weather", "arguments": CALL["arguments"]},
        }
    ]
    prompt = decoded(engine, sent)
    assert "<tool_call>" in prompt and "get_weather" in prompt and '"Paris"' in prompt


# -- The Chat tab ----------------------------------------------------------------------------


def knobs(model="r1", think=True, budget=BUDGET, max_new_tokens=24):
    """A handler's values after the search box, as Gradio passes them: (system prompt,
    preset, sliders, seed, inspector) and (output format, Model, Think, budget); an edit's
    EditData goes after them."""
    sliders = preset_values({"p": SAMPLED.replace(max_new_tokens=max_new_tokens)}, "p")
    return ["", "balanced", *sliders, 3, False], ["Free text", "", model, think, budget]


def send(chat, browser, view, text, **kwargs):
    before, after = knobs(**kwargs)
    return chat.send(text, browser, view, "", *before, *after)


def first_visit(chat):
    shown = SidebarHandlers(chat.conversations).load({})
    return shown.browser, shown.view


def test_the_chat_streams_the_reasoning_open_then_folds_it_above_the_answer(chat, monkeypatch):
    monkeypatch.setattr(ui_common, "PAINT_INTERVAL_S", 0.0)  # every piece painted
    browser, view = first_visit(chat)
    updates = [Shown(*u[:8]) for u in send(chat, browser, view, "Hi!")]
    final = updates[-1]
    assert "tokens/s" in final.status, final.status
    painted = [u.chatbot[1:] for u in updates if len(u.chatbot) > 1]
    thinking = [rows for rows in painted if rows[0].get("metadata", {}).get("status") == "pending"]
    assert thinking, "the reasoning was shown while it streamed"
    assert all(rows[0]["metadata"]["title"] == THINKING and len(rows) == 1 for rows in thinking)
    answering = [rows for rows in painted if len(rows) == 2]
    assert answering and answering[0][0]["metadata"]["status"] == "done"
    assert answering[0][0]["metadata"]["title"].startswith(f"Thought for {BUDGET} tokens, ")

    user, thought, answer = final.chatbot
    saved = chat.store.path(final.browser["owner"], final.view["cid"])[-1]
    assert thought["content"] == saved.reasoning and answer["content"] == saved.content
    assert thought["metadata"] == {
        "title": thought_title(BUDGET, saved.stats["reasoning_s"]),
        "status": "done",
    }
    assert saved.settings["thinking"] is True and saved.settings["reasoning_budget"] == BUDGET
    # reopened (the sidebar, a reload): the same rows
    assert chat.conversations.open(final.browser, final.view["cid"]).chatbot == final.chatbot


def test_think_off_reaches_the_engine_and_shows_no_reasoning(chat):
    browser, view = first_visit(chat)
    final = Shown(*list(send(chat, browser, view, "Hi!", think=False, budget=-1))[-1][:8])
    assert [m["role"] for m in final.chatbot] == ["user", "assistant"]
    assert "metadata" not in final.chatbot[1]
    saved = chat.store.path(final.browser["owner"], final.view["cid"])[-1]
    assert saved.reasoning == "" and saved.settings["thinking"] is False
    assert saved.settings["reasoning_budget"] is None and saved.stats["reasoning_tokens"] == 0


def test_a_model_that_does_not_think_gets_no_options(chat):
    browser, view = first_visit(chat)
    final = Shown(*list(send(chat, browser, view, "Hi!", model="smol", max_new_tokens=4))[-1][:8])
    assert "tokens/s" in final.status
    saved = chat.store.path(final.browser["owner"], final.view["cid"])[-1]
    assert "thinking" not in saved.settings and saved.reasoning == ""


def test_a_bad_budget_is_the_status_line(chat):
    browser, view = first_visit(chat)
    final = Shown(*list(send(chat, browser, view, "Hi!", budget=2.5))[-1][:8])
    assert "reasoning budget must be a whole number" in final.status
    assert thinking_options(True, -1) == ChatOptions(thinking=True, reasoning_budget=None)
    assert thinking_options(False, 64.0) == ChatOptions(thinking=False, reasoning_budget=64)


def test_the_think_controls_show_for_a_model_that_thinks_and_follow_the_picker(
    chat, models, presets
):
    assert chat.thinking_controls("r1")["visible"] is True
    assert chat.thinking_controls("qwen3")["visible"] is True
    assert chat.thinking_controls("smol")["visible"] is False
    assert chat.thinking_controls(None)["visible"] is True  # the default: r1
    demo = build_ui(models, presets)
    dropdown = next(b for b in demo.blocks.values() if getattr(b, "label", None) == "Model")
    group = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "thinking")
    follows = [fn for fn in demo.fns.values() if fn.name == "thinking_controls"]
    triggers = {(t[0], t[1]) for fn in follows for t in fn.targets}
    assert (dropdown._id, "change") in triggers  # the picker's choice
    after = {fn.trigger_after for fn in follows}
    # the page's load, and each run (a reply that loaded the model)
    loads = [
        i for i, fn in demo.fns.items() if (None, "load") in {(None, t[1]) for t in fn.targets}
    ]
    assert set(loads) & after
    runs = [i for i, fn in demo.fns.items() if fn.name in ("send", "regenerate", "edit")]
    assert len(set(runs) & after) == 3  # Send and Enter (one event), Regenerate, an edit
    assert all([b._id for b in fn.outputs] == [group._id] for fn in follows)
    send_fn = next(fn for fn in demo.fns.values() if fn.name == "send")
    labels = [getattr(b, "label", None) for b in send_fn.inputs]
    assert labels[-3:] == ["Model", "Think", "Reasoning budget"], labels


# -- Drawing saved replies -------------------------------------------------------------------


def test_a_saved_tool_call_is_a_card_and_every_row_belongs_to_its_reply(chat):
    owner = "0" * 32
    store = chat.store
    cid, _ = by_hand(store, owner, reasoning="", calls=[CALL], text="")
    shown = chat.conversations.open({"owner": owner, "open": None}, cid)
    user, card = shown.chatbot
    assert card["metadata"]["title"] == "Tool call: get_weather"
    assert card["content"] == '```json\n{\n  "city": "Paris",\n  "days": 2\n}\n```'

    # reasoning, text and two calls: four rows of one reply, in that order
    cid, path = by_hand(store, owner, calls=[CALL, {**CALL, "id": "c2", "arguments": "{oops"}])
    view = {"cid": cid, "leaf": path[-1].id, "focus": None}
    rows = chat.conversations.show({"owner": owner}, view).chatbot
    kinds = [r.get("metadata", {}).get("title", r["role"]) for r in rows]
    assert kinds == [
        "user",
        "Thought",
        "assistant",
        "Tool call: get_weather",
        "Tool call: get_weather",
    ]
    assert rows[4]["content"] == "```json\n{oops\n```"  # not JSON: as written
    for row in range(1, 5):
        assert chat.conversations.message_at(owner, view, row)[1] == 1
    assert chat.conversations.message_at(owner, view, 5)[1] is None


def test_an_edit_after_a_reply_with_reasoning_edits_the_message_clicked(chat):
    """The Chatbot's rows are not the branch's messages one to one: an edit's row index is
    mapped to its message."""
    browser, view = first_visit(chat)
    one = Shown(*list(send(chat, browser, view, "First."))[-1][:8])
    two = Shown(*list(send(chat, one.browser, one.view, "Second."))[-1][:8])
    rows = [r["content"] for r in two.chatbot]
    row = rows.index("Second.")
    assert row == 3  # First., its reasoning, its answer, Second.
    edited = SimpleNamespace(index=row, value="Second, edited.", previous_value="")
    before, after = knobs(max_new_tokens=12)
    after = Shown(*list(chat.edit(two.browser, two.view, "", *before, *after, edited))[-1][:8])
    assert "tokens/s" in after.status, after.status
    assert after.chatbot[row]["content"] == "Second, edited.\n\n‹ 2/2 ›"
    assert after.chatbot[0]["content"] == "First."


def test_reply_rows_while_it_streams():
    assert reply_rows("") == [{"role": "assistant", "content": ""}]
    (thought,) = reply_rows("", "hm", pending=True, tokens=3)
    assert thought["metadata"] == {"title": THINKING, "status": "pending", "log": "3 tokens"}
    thought, answer, card = reply_rows("Yes.", "hm", [CALL], tokens=1, seconds=0.26)
    assert thought["metadata"] == {"title": "Thought for 1 token, 0.3 s", "status": "done"}
    assert answer == {"role": "assistant", "content": "Yes."}
    assert card == call_card(CALL)
    assert thought_title(None, None) == "Thought"


# -- The terminal chat and completion mode ---------------------------------------------------


def test_the_terminal_chat_prints_the_reasoning_then_the_answer(models, presets):
    session = ChatSession(models, SAMPLED, presets)
    session.model_name = "r1"
    out = io.StringIO()
    script = f"/budget {BUDGET}\nHi!\n/think off\nAgain.\n/settings\n"
    session.run(io.StringIO(script), out)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"think on, reasoning budget {BUDGET} tokens"
    thought = [i for i, line in enumerate(lines) if line.startswith("Thinking: ")]
    assert len(thought) == 1, lines  # the second reply, with think off, has none
    i = thought[0]
    assert lines[i + 1].strip() and not lines[i + 1].startswith("[")  # the answer, on its line
    assert f"{BUDGET} reasoning tokens" in lines[i + 2]
    assert session.history[1]["reasoning"] and session.history[3]["reasoning"] == ""
    assert "think off, reasoning budget 6 tokens" in lines


def test_completion_mode_keeps_the_tags_as_text(models):
    """The Notebook (and the Step view) continue text: nothing is split, the tags are tokens
    like any other."""
    engine = models.get("r1")
    end = engine.tokenizer.get_vocab()["</think>"]
    params = SamplingParams(temperature=0.0, max_new_tokens=3, logit_bias=((end, 100.0),))
    chunks = list(engine.complete_text("<think>\nhm", params))
    assert "".join(c.text for c in chunks) == "</think>" * 3
    assert not any(c.reasoning for c in chunks)
