"""The web app's tabs over several models, called as Gradio calls them but without a browser:
the Notebook (completion mode: Generate, Regenerate, Undo, Stop), Chat on the model the
dropdown names, a model that is not served or does not load, a base model (no chat template),
Compare across models, and the Benchmark tab's model. Two local models over the embedded GGUF
(each its own engine); a base model is imitated by an engine whose tokenizer has no chat
template."""

import copy
import html
import re
import threading
import time

import pytest

from miniserve.core.samplers import describe
from miniserve.engine.engine import Engine
from miniserve.models.registry import EngineOptions, Models, ModelSpec, engine_factory, open_models
from miniserve.ui import (
    BenchmarkHandlers,
    ChatHandlers,
    CompareHandlers,
    NotebookHandlers,
    build_ui,
    model_header,
)
from miniserve.ui.chat_tab import (
    DRAFT_KEPT,
    REPLY_KEPT,
    REPLY_TAKEN_BACK,
    STILL_STREAMING,
    STOPPED_LOADING,
)
from miniserve.ui.conversation import SHOWN, Shown
from miniserve.ui.notebook_tab import TAKEN_BACK
from miniserve.ui.sidebar import SidebarHandlers
from miniserve.ui.widgets import preset_values, setting_names

B = "second"
STORY = "Once upon a time, in a small village by the sea,"
PROMPT = "Write one sentence about a cat."
UNCHANGED = {"__type__": "update"}  # gr.update(): the component stays as it is


@pytest.fixture
def models(two_models):
    """Both models loaded (a test that counts a handler's updates sees no loading lines)."""
    for name in two_models.names:
        two_models.get(name)
    return two_models


@pytest.fixture(scope="module")
def base_engine(two_models):
    """A base model: the second model's weights behind an engine of its own whose tokenizer
    (a copy) has no chat template."""
    engine = Engine(two_models.get(B).loaded, name="base")
    tokenizer = copy.copy(engine.tokenizer)
    tokenizer.chat_template = None
    engine.tokenizer = tokenizer
    yield engine
    engine.close()


def registry(engines: dict, extra=()) -> Models:
    """A registry over engines already started (never closed by it), plus `extra` specs that
    load for real."""
    real = engine_factory(EngineOptions())
    specs = [ModelSpec(name, None) for name in engines] + list(extra)
    return Models(
        specs, lambda spec, progress: engines.get(spec.name) or real(spec, progress), max_loaded=8
    )


@pytest.fixture(scope="module")
def with_base(two_models, base_engine):
    a = two_models.default
    return registry({a: two_models.get(a), "base": base_engine})


def last(generator):
    *_, final = generator
    return final


def values(presets, preset="factual", max_new_tokens=12):
    """The settings panel (widgets.setting_names order) of a preset, with max new tokens."""
    return preset_values({preset: presets[preset].replace(max_new_tokens=max_new_tokens)}, preset)


# -- Loading a model -------------------------------------------------------------------------


def test_a_model_loads_on_first_use_with_its_progress_on_the_status_line(two_models, presets):
    two_models.unload(B)  # (first in this file: B is not loaded yet, and loads once)
    chat = ChatHandlers(two_models, presets)
    browser = SidebarHandlers(chat.conversations).load({}).browser
    updates = list(send(chat, browser, {}, "Hi", presets, B, 4))
    statuses = [u[SHOWN.index("status")] for u in updates]
    assert statuses[0] == f"loading model {B}…"
    assert any(s.startswith(f"loading model {B}: Load") for s in statuses), statuses
    assert "tokens/s" in statuses[-1] and two_models.is_loaded(B)
    assert "loads when first used" not in model_header(two_models, B)


# -- Notebook --------------------------------------------------------------------------------


def generate(
    notebook,
    text,
    history,
    presets,
    preset="factual",
    max_new_tokens=12,
    seed=1,
    model=None,
    inspect=False,
    regenerate=False,
):
    run = notebook.regenerate if regenerate else notebook.generate
    return run(
        text,
        history,
        *values(presets, preset, max_new_tokens),
        seed,
        inspect,
        "Free text",
        "",
        model,
    )


def test_notebook_greedy_generate_continues_the_text_as_complete_text_does(models, presets):
    notebook = NotebookHandlers(models, presets)
    updates = list(generate(notebook, STORY, [], presets, inspect=True))
    text, history, status, inspected = updates[-1]
    engine = models.get(None)
    params = presets["factual"].replace(max_new_tokens=12, seed=1)
    expected = "".join(c.text for c in engine.complete_text(STORY, params, trim=True))
    assert expected.strip() and text == STORY + expected
    assert history == [STORY]  # Undo brings this back
    assert "12 new tokens" in status and "tokens/s" in status and "seed 1" in status, status
    assert updates[0][:3] == (STORY, [STORY], "generating…")
    assert all(u[0].startswith(STORY) and text.startswith(u[0]) for u in updates)
    assert inspected.count('class="ms-tok"') == 12  # the generated part only


def test_notebook_says_how_far_its_text_is_read(models, presets):
    """Before the continuation streams, the status says how much of the text is read."""
    notebook = NotebookHandlers(models, presets)
    text = STORY + " It was the third night of the storm."
    statuses = [status for _, _, status, _ in generate(notebook, text, [], presets)]
    ids = models.get(None).prompt_ids(text, presets["factual"].replace(max_new_tokens=12))
    assert statuses[0] == "generating…"
    assert re.fullmatch(rf"reading the prompt: \d+ of {len(ids)} tokens…", statuses[1])
    assert set(statuses[2:-1]) <= {"generating…"} and "tokens/s" in statuses[-1]


def test_notebook_regenerate_and_undo(models, presets):
    notebook = NotebookHandlers(models, presets)
    first, history, *_ = last(generate(notebook, STORY, [], presets, "creative", 10, seed=3))
    assert first.startswith(STORY) and first != STORY
    edited = first + " The end."  # typed after the generation: Regenerate replaces it
    again, history2, status, _ = last(
        generate(notebook, edited, history, presets, "creative", 10, seed=3, regenerate=True)
    )
    assert again == first, "the same seed from the same text"
    # Undo brings back what Regenerate replaced, typing included (it was lost), then the text
    # before the generation
    assert history2 == [STORY, [STORY, edited]]
    text, back, _ = notebook.undo(again, history2)
    assert (text, back) == (edited, [STORY]) and notebook.undo(text, back)[:2] == (STORY, [])
    other, *_ = last(
        generate(notebook, edited, history, presets, "creative", 10, seed=4, regenerate=True)
    )
    assert other.startswith(STORY) and other != first
    # a second generation on top; Undo steps back through both
    second, history3, *_ = last(generate(notebook, first, history, presets, max_new_tokens=6))
    assert second.startswith(first) and history3 == [STORY, first]
    text, history4, status = notebook.undo(second, history3)
    assert (text, history4) == (first, [STORY]) and "taken back" in status
    text, history5, _ = notebook.undo(text, history4)
    assert (text, history5) == (STORY, [])
    text, history6, status = notebook.undo(text, history5)
    assert text == {"__type__": "update"} and history6 == [] and status == "nothing to undo"
    update, history7, status, _ = last(generate(notebook, STORY, [], presets, regenerate=True))
    assert update == {"__type__": "update"} and status.startswith(
        "**Error:** nothing to regenerate yet"
    )


def test_notebook_stop_keeps_what_was_written(models, presets):
    notebook = NotebookHandlers(models, presets)
    updates = generate(notebook, STORY, [], presets, "balanced", 1500)
    for text, *_ in updates:
        if len(text) > len(STORY) + 15:  # the continuation is under way
            break
    notebook.stop()  # no request: the "default" session, the one it runs in
    text, history, status, _ = last(updates)
    assert "finish: cancelled" in status and "stopped by you" in status, status
    assert int(re.search(r"(\d+) new tokens", status).group(1)) < 1500
    assert text.startswith(STORY) and len(text) > len(STORY) + 15 and history == [STORY]
    assert notebook.undo(text, history)[0] == STORY


def streaming(updates):
    """Read a handler's updates on a thread, as Gradio does, into `shown` (the outputs in the
    order they are yielded, the order the page applies them in); returns (thread, shown, an
    event set once the text has grown past STORY by 15 characters)."""
    shown, growing = [], threading.Event()

    def page():
        for update in updates:
            shown.append(update[:3])
            if isinstance(update[0], str) and len(update[0]) > len(STORY) + 15:
                growing.set()

    thread = threading.Thread(target=page, daemon=True)
    thread.start()
    return thread, shown, growing


def test_notebook_undo_during_a_generation_stops_it_and_it_writes_undos_result(models, presets):
    """Undo pressed while the continuation streams: the generation is stopped, and its own
    last output, written before Undo returns, is Undo's result. Undo writes nothing: the page
    applies each event's outputs in order, but a stopped generation's last outputs on their
    way could land after Undo's and show the generation again."""
    notebook = NotebookHandlers(models, presets)
    thread, shown, growing = streaming(generate(notebook, STORY, [], presets, "balanced", 1500))
    try:
        assert growing.wait(60), "the generation did not start"
        text, history, _ = shown[-1]
        shown.append(notebook.undo(text, history))
        thread.join(timeout=5)
        assert not thread.is_alive(), "the generation still streams after Undo returned"
        assert shown[-2] == (STORY, [], TAKEN_BACK), shown[-2]
        assert shown[-1] == (UNCHANGED,) * 3, shown[-1]
        assert [s[2] for s in shown].count(TAKEN_BACK) == 1
    finally:
        notebook.stop()
        thread.join()


def test_notebook_regenerate_during_a_generation_stops_it_first(models, presets):
    """Regenerate pressed while the continuation streams: the running generation ends before
    the new one writes, and the new one starts from the text before the first."""
    notebook = NotebookHandlers(models, presets)
    thread, shown, growing = streaming(generate(notebook, STORY, [], presets, "balanced", 1500))
    try:
        assert growing.wait(60), "the generation did not start"
        pressed, history, _ = shown[-1]
        again = generate(notebook, pressed, history, presets, regenerate=True)
        first = next(again)
        thread.join(timeout=5)
        assert not thread.is_alive(), "the first generation still streams beside the new one"
        # the first generation writes no last word (a status of its own) that could land after
        # the new one's outputs; Undo would bring back the box as Regenerate found it
        replaced = [STORY, [STORY, pressed]]
        assert shown[-1][2] == "generating…" and first[:3] == (STORY, replaced, "generating…")
        text, history, status, _ = last(again)
        params = presets["factual"].replace(max_new_tokens=12, seed=1)
        expected = "".join(c.text for c in models.get(None).complete_text(STORY, params, trim=True))
        assert text == STORY + expected and history == replaced and "stopped" not in status
    finally:
        notebook.stop()
        thread.join()


@pytest.mark.parametrize(
    "text, settings, message",
    [
        ("", {}, "the Text box is empty; give the text to continue"),
        (STORY, {"temperature": 5}, "&#x27;temperature&#x27; must be in [0, 2]"),
    ],
)
def test_notebook_bad_values_leave_the_text(models, presets, text, settings, message):
    notebook = NotebookHandlers(models, presets)
    sliders = values(presets)
    for name, value in settings.items():
        sliders[setting_names().index(name)] = value  # the panel's order (widgets.py)
    updates = list(notebook.generate(text, ["before"], *sliders, 1, False))
    assert len(updates) == 1
    box, history, status, _ = updates[0]
    assert box == history == {"__type__": "update"}  # nothing written, nothing to undo
    assert status.startswith("**Error:**") and message in status, status


def test_notebook_and_chat_on_a_base_model(with_base, base_engine, presets):
    """A base model continues text in the Notebook; in Chat it is the NoChatTemplate message,
    which points to the Notebook, and nothing is saved."""
    notebook = NotebookHandlers(with_base, presets)
    text, _, status, _ = last(generate(notebook, STORY, [], presets, model="base"))
    params = presets["factual"].replace(max_new_tokens=12, seed=1)
    expected = "".join(c.text for c in base_engine.complete_text(STORY, params, trim=True))
    assert text == STORY + expected and "model base" in status, status
    chat = ChatHandlers(with_base, presets)
    browser = SidebarHandlers(chat.conversations).load({}).browser
    *shown, box, _ = last(send(chat, browser, {}, "Hello", presets, "base"))
    shown = Shown(*shown)
    assert shown.status.startswith("**Error:** model &#x27;base&#x27; has no chat template")
    assert "the Notebook tab" in shown.status and box == "Hello" and shown.chatbot == []
    assert chat.store.conversations(browser["owner"]) == []


# -- Chat ------------------------------------------------------------------------------------


def send(chat, browser, view, message, presets, model, max_new_tokens=12):
    return chat.send(
        message,
        browser,
        view,
        "",
        "",
        "factual",
        *values(presets, max_new_tokens=max_new_tokens),
        1,
        False,
        "Free text",
        "",
        model,
    )


def test_chat_is_answered_by_the_model_chosen_and_a_switch_keeps_the_conversation(models, presets):
    a = models.default
    chat = ChatHandlers(models, presets)
    engines = {name: models.get(name) for name in (a, B)}
    held = {name: e.prefix_cache.total_tokens() for name, e in engines.items()}
    browser = SidebarHandlers(chat.conversations).load({}).browser
    one = Shown(*last(send(chat, browser, {}, "Name a colour.", presets, a))[:8])
    assert "model " + a in one.status
    after_a = {name: e.prefix_cache.total_tokens() for name, e in engines.items()}
    assert after_a[B] == held[B], "B's engine did not see A's reply"
    # the next reply of the same conversation, on B: B's engine takes the whole conversation
    two = Shown(*last(send(chat, one.browser, one.view, "And another one?", presets, B))[:8])
    assert "model second" in two.status and len(two.chatbot) == 4
    assert engines[B].prefix_cache.total_tokens() > held[B], "B's engine answered"
    assert engines[a].prefix_cache.total_tokens() == after_a[a], "A's engine was not asked"
    saved = chat.store.path(two.browser["owner"], two.view["cid"])
    assert [m.settings.get("model") for m in saved if m.role == "assistant"] == [a, B]
    prompt_tokens = int(re.search(r"(\d+) prompt tokens", two.status).group(1))
    assert prompt_tokens > int(re.search(r"(\d+) prompt tokens", one.status).group(1))


def chat_streaming(chat, presets):
    """A first turn, then a second question whose long reply streams on a thread, read as
    Gradio does: (the first turn's Shown, the question, the thread, the outputs so far, an
    event set once the reply has some text)."""
    browser = SidebarHandlers(chat.conversations).load({}).browser
    one = Shown(*last(send(chat, browser, {}, "Name a colour.", presets, None))[:8])
    question = "Write a long story about a dragon who learns to bake bread."
    shown, growing = [], threading.Event()

    def page():
        for update in send(chat, one.browser, one.view, question, presets, None, 1500):
            shown.append(update)
            rows = update[SHOWN.index("chatbot")]
            if isinstance(rows, list) and len(rows) == 4 and len(rows[-1]["content"]) > 20:
                growing.set()

    thread = threading.Thread(target=page, daemon=True)
    thread.start()
    return one, question, thread, shown, growing


def test_a_message_sent_while_a_reply_streams_is_refused_and_the_reply_runs_on(models, presets):
    """One reply at a time in a page (its outputs would interleave with the other's): a second
    message, Regenerate or an edit while a reply streams says so in a warning and changes
    nothing; the streaming reply is not stopped."""
    chat = ChatHandlers(models, presets)
    one, question, thread, shown, growing = chat_streaming(chat, presets)
    try:
        assert growing.wait(60), "the reply did not start"
        streaming = Shown(*shown[-1][:8])
        with pytest.warns(UserWarning, match=re.escape(STILL_STREAMING)):
            again = list(send(chat, streaming.browser, streaming.view, "And?", presets, None))
        assert again == [(UNCHANGED,) * (len(SHOWN) + 2)]
        assert thread.is_alive() and Shown(*shown[-1][:8]).status == "generating…"
    finally:
        chat.stop()
        thread.join()
    final = Shown(*shown[-1][:8])
    assert "stopped by you" in final.status and len(final.chatbot) == 4


def test_a_new_chat_while_a_reply_streams_stops_and_keeps_the_reply_and_is_shown_last(
    models, presets
):
    """Clear (as any event that changes the conversation shown: ChatHandlers.after_reply)
    while a reply streams: the reply stops and is saved as Stop saves it, and its own last
    output is the new chat, so that no chunk of it on its way can paint the old one back."""
    chat = ChatHandlers(models, presets)
    one, question, thread, shown, growing = chat_streaming(chat, presets)
    clear = chat.after_reply(chat.clear, len(SHOWN) + 2)
    try:
        assert growing.wait(60), "the reply did not start"
        streaming = Shown(*shown[-1][:8])
        assert clear(streaming.browser, "") == (UNCHANGED,) * (len(SHOWN) + 2)
        thread.join(timeout=5)
        assert not thread.is_alive(), "the reply still streams after Clear returned"
        fresh = Shown(*shown[-1][:8])
        assert fresh.status == f"new chat · {REPLY_KEPT}"
        assert fresh.chatbot == [] and fresh.view["cid"] is None
        assert "stopped by you" in Shown(*shown[-2][:8]).status
        saved = chat.store.path(one.browser["owner"], one.view["cid"])
        assert [m.role for m in saved] == ["user", "assistant"] * 2
        assert saved[2].content == question and saved[3].content.strip()
        # with no reply streaming, the event is the handler itself
        again = clear(fresh.browser, "")
        assert Shown(*again[:8]).status == "new chat"
    finally:
        chat.stop()
        thread.join()


def test_an_event_after_a_reply_acts_on_the_view_the_reply_left(models, presets):
    """An event that takes a streaming reply over (ChatHandlers.after_reply) acts on the view
    the stopped reply left, its saved reply the branch's end, not on the view clicked on (the
    question's): a Send after it goes under the reply."""
    chat = ChatHandlers(models, presets)
    one, question, thread, shown, growing = chat_streaming(chat, presets)
    seen = []

    def probe(browser, view, query="", request=None):
        seen.append(view)
        return chat.conversations.show(browser, view, "probed", query)

    try:
        assert growing.wait(60), "the reply did not start"
        streaming = Shown(*shown[-1][:8])
        wrapped = chat.after_reply(probe, len(SHOWN))
        assert wrapped(streaming.browser, streaming.view, "") == (UNCHANGED,) * len(SHOWN)
        thread.join(timeout=5)
        assert not thread.is_alive()
        saved = chat.store.path(one.browser["owner"], one.view["cid"])
        assert len(seen) == 1 and seen[0]["leaf"] == saved[-1].id != streaming.view["leaf"]
        last_output = shown[-1]
        assert Shown(*last_output[:8]).status == f"probed · {REPLY_KEPT}"
        assert len(last_output) == len(SHOWN) + 2
        assert last_output[8:] == (UNCHANGED, UNCHANGED)
    finally:
        chat.stop()
        thread.join()


def test_chat_undo_during_a_reply_stops_it_and_the_reply_takes_its_turn_back(models, presets):
    """Undo pressed while a reply streams: the reply is stopped and not kept, and its own last
    output is Undo's result (the conversation without the turn, the question back in the
    box, above what was typed there meanwhile); Undo itself writes nothing
    (common.Sessions.take_over says why)."""
    chat = ChatHandlers(models, presets)
    one, question, thread, shown, growing = chat_streaming(chat, presets)
    try:
        assert growing.wait(60), "the reply did not start"
        streaming = Shown(*shown[-1][:8])
        undone = chat.undo(streaming.browser, streaming.view, "", "typed meanwhile")
        thread.join(timeout=5)
        assert not thread.is_alive(), "the reply still streams after Undo returned"
        assert undone == (UNCHANGED,) * (len(SHOWN) + 1)
        back, box = Shown(*shown[-1][:8]), shown[-1][8]
        assert back.status == f"{REPLY_TAKEN_BACK}: {DRAFT_KEPT}"
        assert box == f"{question}\n\ntyped meanwhile"  # the draft is not lost
        assert back.chatbot == one.chatbot and back.view["leaf"] == one.view["leaf"]
        saved = chat.store.path(one.browser["owner"], one.view["cid"])  # the open branch
        assert [m.role for m in saved] == ["user", "assistant"]
        assert saved[0].content == "Name a colour." and saved[-1].id == one.view["leaf"]
    finally:
        chat.stop()
        thread.join()


def test_chat_stop_or_undo_while_the_model_loads_sends_nothing(models, presets):
    """A message sent to a model that is still loading (its load held until the test lets it
    go): Stop ends the send there, nothing saved and the message still in the box; Undo pressed
    during another such load takes back the turn before (the reply had not begun), with the
    unsent message kept below it in the box. Before the run began ahead of the load, the send
    went on once the model had loaded, its question saved under the turn Undo had removed."""
    a = models.default
    releases = {"slow": threading.Event(), "slower": threading.Event()}

    def factory(spec, progress):
        if spec.name == a:
            return models.get(a)
        progress("reading the weights")
        releases[spec.name].wait(30)
        return models.get(B)

    held = Models([ModelSpec(n, None) for n in (a, *releases)], factory, max_loaded=8)
    chat = ChatHandlers(held, presets)
    browser = SidebarHandlers(chat.conversations).load({}).browser
    one = Shown(*last(send(chat, browser, {}, "Name a colour.", presets, a))[:8])
    owner, cid = one.browser["owner"], one.view["cid"]

    def sending(model):  # a send on a thread, read as Gradio does; set once it shows the load
        outputs, loading = [], threading.Event()

        def page():
            for update in send(chat, one.browser, one.view, "And another?", presets, model):
                outputs.append(update)
                if "loading model" in str(update[SHOWN.index("status")]):
                    loading.set()

        thread = threading.Thread(target=page, daemon=True)
        thread.start()
        assert loading.wait(30), outputs
        return outputs, thread

    try:
        outputs, thread = sending("slow")
        chat.stop()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the send waited for the load after Stop"
        stopped, box = Shown(*outputs[-1][:8]), outputs[-1][8]
        assert stopped.status == f"{STOPPED_LOADING}; the message is in the box"
        assert box == "And another?"
        assert [m.content for m in chat.store.path(owner, cid)][0] == "Name a colour."
        assert len(chat.store.path(owner, cid)) == 2, "a message was saved after Stop"

        outputs, thread = sending("slower")
        undone = chat.undo(one.browser, one.view, "", "And another?")
        thread.join(timeout=10)
        assert not thread.is_alive(), "the send waited for the load after Undo"
        assert undone == (UNCHANGED,) * (len(SHOWN) + 1)
        back, box = Shown(*outputs[-1][:8]), outputs[-1][8]
        assert back.status == f"last turn removed: {DRAFT_KEPT}", back.status
        assert box == "Name a colour.\n\nAnd another?"
        assert chat.store.path(owner, cid) == [] and not back.chatbot
    finally:
        for release in releases.values():
            release.set()
    assert held.get("slow") is models.get(B)  # the loads went on, for the next message


def test_opening_a_saved_conversation_chooses_the_model_of_its_last_reply(models, presets):
    a = models.default
    chat = ChatHandlers(models, presets)
    side = SidebarHandlers(chat.conversations)
    browser = side.load({}).browser
    on_b = Shown(*last(send(chat, browser, {}, "Hi", presets, B, 3))[:8])
    on_a = Shown(*last(send(chat, on_b.browser, {}, "Hello", presets, a, 3))[:8])
    for saved, current in ((on_b, a), (on_a, B)):
        opened = side.open(on_a.browser, saved.view["cid"])
        model, status = chat.saved_model(opened.browser, opened.view, current, opened.status)
        other = B if current == a else a
        assert model == {"__type__": "update", "value": other}
        assert status == {"__type__": "update"}
    # an app that no longer serves B (the same history): the choice stays, the status says why
    only_a = ChatHandlers(registry({a: models.get(a)}), presets, store=chat.store)
    opened = SidebarHandlers(only_a.conversations).open(on_a.browser, on_b.view["cid"])
    model, status = only_a.saved_model(opened.browser, opened.view, a, "restored")
    assert model == {"__type__": "update"}
    assert status == (
        f"restored · its last reply was made with model &#x27;{B}&#x27;, which "
        f"is not served here: replies now come from {a}"
    )
    # a new chat (no reply yet) leaves the dropdown as it is
    assert chat.saved_model(on_a.browser, {}, B, "") == (
        {"__type__": "update"},
        {"__type__": "update"},
    )


def test_switching_to_a_loaded_model_answers_at_once(models, presets):
    """Measured, not asserted as a time: a new conversation on the other loaded model, from
    the handler's call to its first streamed text."""
    chat = ChatHandlers(models, presets)
    browser = SidebarHandlers(chat.conversations).load({}).browser
    for name in (models.default, B):
        assert models.is_loaded(name) or models.get(name)
        start = time.perf_counter()
        for update in send(chat, browser, {}, "Tell me about the moon.", presets, name, 24):
            chatbot = update[SHOWN.index("chatbot")]
            if chatbot and chatbot[-1]["role"] == "assistant" and chatbot[-1]["content"]:
                first = time.perf_counter() - start
                break
        print(f"\nfirst text from {name}: {first * 1000:.0f} ms after Send")
        assert first < 30  # generous: only that it streamed


def test_an_unknown_or_broken_model_is_the_error_line_and_the_others_keep_working(
    models, presets, tmp_path
):
    a = models.default
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    models = registry({a: models.get(a)}, [ModelSpec("broken", str(bad))])
    chat = ChatHandlers(models, presets)
    browser = SidebarHandlers(chat.conversations).load({}).browser
    for model, message in (
        ("nope", f"model &#x27;nope&#x27; is not served here; choose one of: {a}, broken"),
        ("broken", "model &#x27;broken&#x27; could not be loaded: "),
    ):
        *shown, box, _ = last(send(chat, browser, {}, "Hi", presets, model))
        status = Shown(*shown).status
        assert status.startswith("**Error:** " + message) and box == "Hi", status
        assert "Traceback" not in status
        text, _, status, _ = last(
            NotebookHandlers(models, presets).generate(
                STORY, [], *values(presets), 1, False, "Free text", "", model
            )
        )
        assert status.startswith("**Error:** " + message) and text == {"__type__": "update"}
    assert chat.store.conversations(browser["owner"]) == []
    ok = Shown(*last(send(chat, browser, {}, "Hi", presets, a, 4))[:8])
    assert "tokens/s" in ok.status and len(ok.chatbot) == 2
    # Compare: the broken model's column says why; the other model answers
    compare = CompareHandlers(models, presets)
    status, *columns = last(compare.compare(PROMPT, ["factual"], 42, 6, models=[a, "broken"]))
    assert status.endswith("1 of 2 models did not run (their columns say why)"), status
    shown = {slot[0]: col["value"] for slot, col in zip(compare.slots, columns) if col["visible"]}
    assert "could not be loaded" in shown["broken"] and "tokens/s" in shown[a]
    status, *_ = last(compare.compare(PROMPT, ["factual"], 42, 6, models=["broken"]))
    assert status.startswith("**Error:** model &#x27;broken&#x27; could not be loaded")


# -- Compare ---------------------------------------------------------------------------------


def test_compare_loads_the_models_at_the_same_time_and_a_failing_one_waits_for_none(
    models, presets, tmp_path
):
    """Two models not loaded yet: a slow one (B's engine, its load held until the test lets it
    go) and a broken file. The broken one's error shows while the slow one is still loading,
    each with its own line; then the slow one answers."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    real, release = engine_factory(EngineOptions()), threading.Event()

    def factory(spec, progress):
        if spec.name != "slow":
            return real(spec, progress)
        progress("reading the weights")
        release.wait(10)  # without loads at once, the broken one's load waits all of this
        return models.get(B)

    both = Models(
        [ModelSpec("slow", None), ModelSpec("broken", str(bad))], factory, max_loaded=8
    )  # never unloads B's engine, which the fixture owns
    compare = CompareHandlers(both, presets)
    updates = compare.compare(PROMPT, ["factual"], 42, 6, models=["slow", "broken"])
    seen = []
    for status, *_ in updates:
        seen.append(status)
        if "could not be loaded" in status:
            break
    assert not release.is_set() and "loading model slow" in status, status
    assert "**Error:** model &#x27;broken&#x27; could not be loaded" in status, status
    release.set()
    for status, *columns in updates:  # noqa: B007 -- the last is read below
        seen.append(status)
    assert any("loading model slow: reading the weights" in s for s in seen), seen
    assert status.endswith("1 of 2 models did not run (their columns say why)"), status
    shown = {slot[0]: col["value"] for slot, col in zip(compare.slots, columns) if col["visible"]}
    assert "could not be loaded" in shown["broken"] and "tokens/s" in shown["slow"]


def test_compare_across_two_models_runs_them_at_the_same_time(models, presets):
    a = models.default
    compare = CompareHandlers(models, presets)
    engines = [models.get(a), models.get(B)]
    updates = compare.compare(PROMPT, ["factual", "creative"], 42, 24, models=[a, B])
    first = next(updates)
    assert first[0] == "comparing 2 models at the same time, each with 2 presets as one batch…"
    # both engines hold their requests at once (neither waited for the other)
    assert all(e.queue_depth == 2 for e in engines), [e.queue_depth for e in engines]
    status, *columns = last(updates)
    assert status == (
        "same prompt, seed 42, 2 models at the same time, each with 2 presets as one batch"
    )
    shown = {slot: col["value"] for slot, col in zip(compare.slots, columns) if col["visible"]}
    assert set(shown) == {(m, n, False) for m in (a, B) for n in ("factual", "creative")}
    for (model, name, _), value in shown.items():
        head = f"### {model} · {name}\n`{describe(presets[name].replace(seed=42))}`"
        assert value.startswith(head), value
        assert "tokens/s" in value.split("\n\n")[-1]
    # greedy on the same weights: the two models write the same reply, as chat_text does
    alone, _ = engines[0].chat_text(
        [{"role": "user", "content": PROMPT}],
        presets["factual"].replace(seed=42, max_new_tokens=24),
    )
    assert shown[(a, "factual", False)].split("\n\n")[1] == html.escape(alone)
    assert shown[(B, "factual", False)].split("\n\n")[1] == html.escape(alone)


def test_compare_a_base_model_continues_the_prompt_and_says_so(with_base, base_engine, presets):
    compare = CompareHandlers(with_base, presets)
    status, *columns = last(
        compare.compare(STORY, ["factual"], 42, 8, models=[with_base.default, "base"])
    )
    shown = {slot[0]: col["value"] for slot, col in zip(compare.slots, columns) if col["visible"]}
    head, text = shown["base"].split("\n\n")[:2]
    assert head.startswith("### base · factual · completion mode (no chat template)\n"), head
    assert "completion mode" not in shown[with_base.default].split("\n")[0]
    params = presets["factual"].replace(seed=42, max_new_tokens=8)
    expected = "".join(c.text for c in base_engine.complete_text(STORY, params))
    assert text == html.escape(expected)


# -- Benchmark, header -----------------------------------------------------------------------


def test_benchmark_runs_the_model_chosen_and_explains_a_remote_one(models, presets):
    bench = BenchmarkHandlers(models, presets)
    table, _, status = bench.concurrency("1", ["greedy"], 16, 4, B)
    assert list(table["Streams at once"]) == [1] and not status.startswith("**Error"), status
    far = Models(
        [ModelSpec("far", "http://127.0.0.1:9/v1", remote=True)],
        factory=lambda spec, progress: pytest.fail("a remote model is not contacted"),
    )
    bench = BenchmarkHandlers(far, presets)
    for table, plot, status in (
        bench.benchmark("16", 4, 1, "far"),
        bench.concurrency("1", ["greedy"], 16, 4, "far"),
    ):
        assert table is None and plot is None
        assert status.startswith("**Error:** model &#x27;far&#x27; runs on a remote server")
        assert "Only a measurement at the client applies" in status
    assert "remote server" in bench.model_note("far")
    _, _, status = BenchmarkHandlers(models, presets).benchmark("16", 4, 1, "nope")
    assert "model &#x27;nope&#x27; is not served here" in status


def test_drawing_the_app_loads_no_model(presets):
    models = open_models(["default", f"{B}=default"])
    demo = build_ui(models, presets)
    assert models.loaded() == []
    labels = {getattr(block, "label", None) for block in demo.blocks.values()}
    assert {"Chat", "Notebook", "Compare", "Benchmark", "Model", "Models", "Text"} <= labels
    assert model_header(models) == (
        "## MiniServeLM · SmolLM2-135M-Instruct (loads when first used)"
    )
    pickers = [b for b in demo.blocks.values() if getattr(b, "label", None) == "Model"]
    assert len(pickers) == 4 and all(
        p.visible
        and p.choices
        == [  # Chat, Notebook, Step, Bench
            ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
            (B, B),
        ]
        for p in pickers
    )


def test_the_header_names_the_default_and_the_count_each_dropdown_its_own_model(models, presets):
    """One header for every tab: the default model and how many are served, whatever a tab's
    dropdown chooses; each dropdown's line describes the model it chooses."""
    from miniserve.ui import app_header
    from miniserve.ui.model_picker import picker_info

    demo = build_ui(models, presets)
    top = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "model-header")
    info = models.get(B).info()
    details = (
        f"on {info['device']} ({info['dtype']}"
        if info["dtype"] == info["compute_dtype"]
        else f"on {info['device']} ({info['dtype']} weights"
    )
    assert (
        top.value
        == app_header(models)
        == ("## MiniServeLM · 2 models served · default SmolLM2-135M-Instruct")
    )
    assert picker_info(models, B).startswith(details) and picker_info(models, B).endswith(
        f"context {info['context_length']} tokens"
    )
    fresh = open_models(["default", f"{B}=default"])
    assert picker_info(fresh, B) == "loads when first used"
    # with one model there is no dropdown: the header describes it
    assert app_header(Models.single(models.get(B))) == (
        f"## MiniServeLM · {B} {picker_info(models, B)}"
    )
