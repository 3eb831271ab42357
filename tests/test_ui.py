"""The web app's handlers, called as Gradio calls them but without a browser, on the real
engine: what each tab shows for good values, and the readable error for a bad one."""

import html
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import jsonschema
import pytest

from miniserve.core.config import ConfigError, Constraint, SamplingParams
from miniserve.core.samplers import default_order, describe
from miniserve.engine.engine import Engine
from miniserve.store.store import open_store
from miniserve.ui import BenchmarkHandlers, ChatHandlers, CompareHandlers, build_ui
from miniserve.ui.bench_tab import BENCH_COLUMNS, CONCURRENCY_COLUMNS
from miniserve.ui.chat_tab import DRAFT_KEPT
from miniserve.ui.common import Sessions
from miniserve.ui.conversation import SHOWN, Shown, new_view
from miniserve.ui.render import shown_text, typed_text
from miniserve.ui.sidebar import SidebarHandlers, file_name
from miniserve.ui.widgets import (
    FORMATS,
    constraint_from,
    format_note,
    params_from,
    preset_values,
    seed_from,
    setting_names,
)

PROMPT = "Write one sentence about a cat."


@pytest.fixture
def chat(engine, presets):
    return ChatHandlers(engine, presets)


@pytest.fixture
def compare(engine, presets):
    return CompareHandlers(engine, presets)


def sliders(chat, preset="factual", max_new_tokens=12):
    values = chat.apply_preset(preset)
    values[setting_names().index("max_new_tokens")] = max_new_tokens
    return values


def last(generator):
    *_, final = generator
    return final


# -- Compare ---------------------------------------------------------------------------------


def test_compare_shows_one_column_per_chosen_preset(compare, presets):
    updates = list(compare.compare(PROMPT, ["factual", "creative"], 42, 8))
    status, *columns = updates[-1]
    assert status == "same prompt, seed 42, 2 presets as one batch"
    assert all(u[0].startswith("comparing 2 presets as one batch") for u in updates[:-1])
    assert len(columns) == 2 * len(presets)  # each preset with, then without the format
    assert not any(c["visible"] for c in columns[len(presets) :])  # no format: no second run
    shown = {name: col for name, col in zip(presets, columns) if col["visible"]}
    assert list(shown) == ["factual", "creative"]
    for name, col in shown.items():
        head, *body = col["value"].split("\n\n")
        assert head == f"### {name}\n`{describe(presets[name].replace(seed=42))}`", head
        text, footer = "\n\n".join(body[:-1]), body[-1]
        assert text.strip(), name
        assert footer.startswith("*") and "tokens/s" in footer, footer


def test_compare_stop_ends_the_comparison_and_says_so(compare):
    """The Compare tab's own Stop: its columns end within a step (512 tokens a column would take
    tens of seconds) and the status says they were stopped; nothing to stop afterwards."""
    assert not compare.stop()
    updates = compare.compare(PROMPT, ["factual", "creative"], 42, 512)
    first = next(updates)  # the comparison is running
    assert first[0].startswith("comparing")
    assert compare.stop()
    started = time.monotonic()
    status, *columns = list(updates)[-1]
    assert time.monotonic() - started < 20
    assert status.endswith("stopped: the columns end where Stop found them"), status
    assert not compare.stop()


def test_compare_columns_show_each_chunks_own_tokens_per_s(compare, engine, monkeypatch):
    """The footer's tokens/s is the column's decode rate from its chunk's stats, as the
    engine reports it, not a rate the tab works out itself."""
    finals = []
    real = engine.compare

    def recording(*args, **kwargs):
        for col, chunk, seconds in real(*args, **kwargs):
            if chunk.done:
                finals.append(chunk.stats.decode_tokens_per_s)
            yield col, chunk, seconds

    monkeypatch.setattr(engine, "compare", recording)
    status, factual, *_ = last(compare.compare(PROMPT, ["factual"], 1, 6))
    assert len(finals) == 1 and finals[0] > 0
    assert factual["value"].endswith(f"6 tokens · {finals[0]:.1f} tokens/s · length*")


def test_compare_greedy_column_is_the_single_reply(compare, engine, presets):
    status, *columns = last(compare.compare(PROMPT, ["factual"], 3, 10))
    params = presets["factual"].replace(seed=3, max_new_tokens=10)
    alone, _ = engine.chat_text([{"role": "user", "content": PROMPT}], params)
    factual = columns[list(presets).index("factual")]["value"]
    assert factual.split("\n\n")[1] == html.escape(alone)


@pytest.mark.parametrize(
    "prompt, chosen, seed, tokens, message",
    [
        ("", ["factual"], 42, 8, "type a prompt and choose at least one preset"),
        ("   ", ["factual"], 42, 8, "type a prompt and choose at least one preset"),
        (PROMPT, [], 42, 8, "type a prompt and choose at least one preset"),
        (PROMPT, None, 42, 8, "type a prompt and choose at least one preset"),
        (PROMPT, ["factual"], 1.5, 8, "&#x27;seed&#x27; must be a whole number"),
        (PROMPT, ["factual"], "abc", 8, "&#x27;seed&#x27; must be a whole number"),
        (PROMPT, ["factual"], 42, 2.5, "&#x27;max_new_tokens&#x27; must be a whole number"),
        (PROMPT, ["factual"], 42, 0, "&#x27;max_new_tokens&#x27; must be in [1, 4096]"),
    ],
)
def test_compare_bad_values_read_as_one_error(
    compare, presets, prompt, chosen, seed, tokens, message
):
    updates = list(compare.compare(prompt, chosen, seed, tokens))
    assert len(updates) == 1
    status, *columns = updates[0]
    assert status.startswith("**Error:**") and message in status, status
    assert len(columns) == 2 * len(presets) and not any(c["visible"] for c in columns)


def test_compare_negative_seed_is_random(compare):
    status, *_ = last(compare.compare(PROMPT, ["balanced"], -1, 4))
    assert status == "same prompt, seed random, 1 preset as one batch"


def test_compare_with_and_without_the_output_format_doubles_the_columns(compare, presets):
    """The output format holds every column; "Also without" runs each preset a second time
    without it, in the same batch, and the titles say which column is which."""
    status, *columns = last(
        compare.compare(PROMPT, ["factual", "creative"], 42, 6, "JSON", "", False)
    )
    assert status == "same prompt, seed 42, 2 presets as one batch, output format JSON"
    assert sum(c["visible"] for c in columns) == 2
    status, *columns = last(
        compare.compare(PROMPT, ["factual", "creative"], 42, 6, "JSON", "", True)
    )
    assert status == (
        "same prompt, seed 42, 2 presets with and without the JSON format, 4 replies as one batch"
    )
    shown = {
        slot[1:]: col["value"] for slot, col in zip(compare.slots, columns) if col["visible"]
    }  # slots: (model, preset, without the format)
    assert set(shown) == {
        ("factual", False),
        ("creative", False),
        ("factual", True),
        ("creative", True),
    }
    for (name, free), value in shown.items():
        head, text = value.split("\n\n")[:2]
        assert head.startswith(f"### {name} · {'Free text' if free else 'JSON'}\n"), head
        if not free:
            assert html.unescape(text).startswith("{"), text
            assert value.endswith("incomplete JSON (cut by max new tokens)*"), value
    # the free factual column is the free comparison's column: the format changed the reply
    _, *alone = last(compare.compare(PROMPT, ["factual"], 42, 6))
    free = shown[("factual", True)].split("\n\n")[1]
    assert free == alone[list(presets).index("factual")]["value"].split("\n\n")[1]
    assert free != shown[("factual", False)].split("\n\n")[1]
    # the checkbox without a format runs the presets once and says why
    status, *columns = last(compare.compare(PROMPT, ["factual"], 42, 4, "Free text", "", True))
    assert status.endswith("“Also without the output format” needs an output format")
    assert sum(c["visible"] for c in columns) == 1


def test_compare_bad_output_format_reads_as_one_error(compare):
    updates = list(compare.compare(PROMPT, ["factual"], 42, 4, "Regex", "[a-", True))
    assert len(updates) == 1
    status, *columns = updates[0]
    assert (
        status.startswith("**Error:** the output format cannot be used: ")
        and "unclosed character class" in status
    ), status
    assert not any(c["visible"] for c in columns)


# -- Chat ------------------------------------------------------------------------------------
# The handlers return SHOWN values (browser, view, chatbot, conversations, title, system,
# branches, status), the generating ones + (message box, inspector HTML).


def send(
    chat,
    browser,
    view,
    message,
    *output_format,
    preset="factual",
    max_new_tokens=12,
    seed=1,
    inspect=False,
    system="",
):
    """Send `message`; `output_format`: the Output format and its text box (none: the
    handler's default, free text)."""
    return chat.send(
        message,
        browser,
        view,
        "",
        system,
        preset,
        *sliders(chat, preset, max_new_tokens),
        seed,
        inspect,
        *output_format,
    )


def first_visit(chat):
    shown = SidebarHandlers(chat.conversations).load({})
    return shown.browser, shown.view


def contents(chatbot):
    return [m["content"] for m in chatbot]


def test_a_long_prompt_shows_how_far_it_is_read(loaded, presets):
    """While a prompt is read (24 rows a pass here), the status says how much of it is in,
    rising; then "generating…" as the reply streams; then the stats."""
    engine = Engine(loaded, step_tokens=24)
    try:
        chat = ChatHandlers(engine, presets)
        browser, view = first_visit(chat)
        updates = list(send(chat, browser, view, "Tell me about the moon. " * 12))
        statuses = [u[SHOWN.index("status")] for u in updates]
        reading = [s for s in statuses if s.startswith("reading the prompt: ")]
        total = updates[-1][SHOWN.index("status")].split(" prompt tokens")[0].split()[-1]
        counts = [int(s.split()[3].replace(",", "")) for s in reading]
        assert len(counts) >= 4 and counts == sorted(counts) and counts[0] == 0
        assert all(s.endswith(f" of {total} tokens…") for s in reading), (reading, total)
        after = statuses[statuses.index(reading[-1]) + 1 :]
        assert set(after[:-1]) <= {"generating…"} and "tokens/s" in after[-1]
    finally:
        engine.close()


def test_send_streams_then_shows_the_stats(chat):
    browser, view = first_visit(chat)
    updates = list(send(chat, browser, view, "Name a colour."))
    assert updates[0][SHOWN.index("status")] == "generating…"
    # then how far its prompt is read (unless the prefix cache holds all of it), the reply
    statuses = [u[SHOWN.index("status")] for u in updates[1:-1]]
    reading = [s for s in statuses if s.startswith("reading the prompt: ")]
    assert statuses[len(reading) :] and set(statuses[len(reading) :]) == {"generating…"}
    *shown, box, inspected = updates[-1]
    shown = Shown(*shown)
    assert [m["role"] for m in shown.chatbot] == ["user", "assistant"]
    assert shown.chatbot[0]["content"] == "Name a colour." and shown.chatbot[1]["content"].strip()
    # the message leaves the box when the reply starts; what is typed there meanwhile stays
    boxes = [u[len(SHOWN)] for u in updates]
    taken = next(i for i, u in enumerate(updates) if u[SHOWN.index("status")] == "generating…")
    assert boxes[taken] == "" and all(b == {"__type__": "update"} for b in boxes[taken + 1 :])
    assert inspected == ""
    assert "prompt tokens" in shown.status and "tokens/s" in shown.status
    assert "history not trimmed" in shown.status and "seed 1" in shown.status
    assert shown.title == "Name a colour." and shown.browser["open"] == shown.view["cid"]
    assert shown.conversations["value"] == shown.view["cid"]


def test_send_with_the_inspector_returns_its_html(chat):
    browser, view = first_visit(chat)
    *_, inspected = last(
        send(chat, browser, view, "Name a colour.", max_new_tokens=4, seed=-1, inspect=True)
    )
    assert "ms-tok" in inspected


def test_a_reply_is_saved_with_its_settings_stats_and_the_seed_drawn(chat):
    """Seed box -1 (random): a seed is drawn, used, saved and shown; the saved settings
    reproduce the reply."""

    def answer(seed):
        """A new chat's reply to the same question, preset and system prompt, with `seed`."""
        browser, view = first_visit(chat)
        settings = {"preset": "creative", "system": "Answer in one word."}
        return Shown(*last(send(chat, browser, view, "Name an animal.", seed=seed, **settings))[:8])

    shown = answer(-1)
    owner, cid = shown.browser["owner"], shown.view["cid"]
    user, reply = chat.store.path(owner, cid)
    assert (user.role, user.content) == ("user", "Name an animal.")
    seed = reply.settings["seed"]
    assert isinstance(seed, int) and f"seed {seed}" in shown.status
    assert reply.settings["preset"] == "creative" and reply.settings["temperature"] == 1.0
    assert reply.settings["system"] == "Answer in one word." and reply.status == "complete"
    assert reply.stats["new_tokens"] >= 1 and reply.stats["finish_reason"] in ("eos", "length")
    assert chat.store.get(owner, cid).system == "Answer in one word."
    # the same settings and seed again: the same reply
    again = answer(seed)
    assert again.chatbot[-1]["content"] == reply.content


def test_regenerate_and_edit_make_branches_and_the_arrows_switch(chat):
    browser, view = first_visit(chat)
    shown = Shown(*last(send(chat, browser, view, "Name a fruit."))[:8])
    first_reply = shown.chatbot[-1]["content"]
    regen = Shown(
        *last(
            chat.regenerate(shown.browser, shown.view, "", "", "factual", *sliders(chat), -1, False)
        )[:8]
    )
    assert regen.chatbot[-1]["content"].endswith("‹ 2/2 ›")
    assert "versions of the reply #2 (now 2 of 2)" in regen.branches
    back = chat.previous_version(regen.browser, regen.view)
    assert back.chatbot[-1]["content"] == first_reply + "\n\n‹ 1/2 ›"
    edited = SimpleNamespace(index=0, value="Name a vegetable.\n\n‹ 1/1 ›", previous_value="")
    outputs = list(
        chat.edit(
            back.browser, back.view, "", "", "factual", *sliders(chat), 1, False, edited=edited
        )
    )
    # the edited text is not the message box's: a draft typed there is neither emptied nor
    # overwritten (each output leaves the box as it is)
    assert all(out[len(SHOWN)] == gr.update() for out in outputs), [o[len(SHOWN)] for o in outputs]
    after = Shown(*outputs[-1][:8])
    assert after.chatbot[0]["content"] == "Name a vegetable.\n\n‹ 2/2 ›"
    assert "versions of your message #1 (now 2 of 2)" in after.branches
    old = chat.previous_version(after.browser, after.view)
    assert contents(old.chatbot)[0] == "Name a fruit.\n\n‹ 1/2 ›"
    # back on the first version of the message, down its newest reply (the regenerated one)
    assert contents(old.chatbot)[1] == regen.chatbot[-1]["content"]
    owner, cid = after.browser["owner"], after.view["cid"]
    assert len(chat.store.export(owner, cid)["messages"]) == 5  # nothing was overwritten


def test_a_turn_from_a_stale_view_becomes_a_branch(chat):
    """Two browser tabs on one conversation: the second sends from where it last looked."""
    browser, view = first_visit(chat)
    one = Shown(*last(send(chat, browser, view, "Hello."))[:8])
    tab_a = tab_b = one.view
    a = Shown(*last(send(chat, one.browser, tab_a, "Name a colour."))[:8])
    b = Shown(*last(send(chat, one.browser, tab_b, "Name a number."))[:8])
    assert contents(b.chatbot)[2] == "Name a number.\n\n‹ 2/2 ›"
    owner, cid = one.browser["owner"], one.view["cid"]
    texts = [m["content"] for m in chat.store.export(owner, cid)["messages"]]
    assert "Name a colour." in texts and "Name a number." in texts and len(texts) == 6
    assert contents(a.chatbot)[2] == "Name a colour."


@pytest.mark.parametrize(
    "message, seed, settings, error",
    [
        ("   ", 1, {}, "the message is empty; type something to send"),
        ("Hi", 1.5, {}, "&#x27;seed&#x27; must be a whole number"),
        ("Hi", "abc", {}, "&#x27;seed&#x27; must be a whole number"),
        ("Hi", 1, {"max_new_tokens": 2.5}, "&#x27;max_new_tokens&#x27; must be a whole number"),
        ("Hi", 1, {"temperature": 5}, "&#x27;temperature&#x27; must be in [0, 2]"),
        ("a long message " * 3000, 1, {}, "too long"),
    ],
)
def test_send_bad_values_keep_the_chat_and_the_message(chat, message, seed, settings, error):
    browser, view = first_visit(chat)
    before = Shown(*last(send(chat, browser, view, "Hello", max_new_tokens=3))[:8])
    values = sliders(chat)
    for name, value in settings.items():
        values[setting_names().index(name)] = value
    updates = list(
        chat.send(message, before.browser, before.view, "", "", "factual", *values, seed, False)
    )
    *shown, box, _ = updates[-1]
    shown = Shown(*shown)
    assert shown.status.startswith("**Error:**") and error in shown.status, shown.status
    assert shown.chatbot == before.chatbot and box == message
    owner, cid = before.browser["owner"], before.view["cid"]
    assert len(chat.store.path(owner, cid)) == 2  # nothing saved


def test_regenerate_with_nothing_to_regenerate(chat):
    browser, view = first_visit(chat)
    *shown, box, inspected = last(
        chat.regenerate(browser, view, "", "", "factual", *sliders(chat), 1, False)
    )
    assert Shown(*shown).status == "**Error:** nothing to regenerate yet"
    assert Shown(*shown).chatbot == []


def under_way(chat):
    """A new chat's reply that would run for 1500 tokens, taken as far as its first three
    words: the rest of its updates."""
    browser, view = first_visit(chat)
    replies = send(
        chat, browser, view, "Write a very long story about a dragon.", max_new_tokens=1500
    )
    for update in replies:
        chatbot = update[SHOWN.index("chatbot")]
        if chatbot and len(chatbot[-1]["content"].split()) >= 3:
            return replies
    raise AssertionError("the reply ended before its third word")


def stopped_by_you(replies) -> Shown:
    """What the reply of under_way shows last, once stopped: cancelled, well short of 1500."""
    shown = Shown(*last(replies)[:8])
    assert "finish: cancelled" in shown.status and "stopped by you" in shown.status
    assert int(shown.status.split(" new tokens")[0].split()[-1]) < 1500
    return shown


def test_stop_ends_the_reply_keeps_its_text_and_saves_it_as_stopped(chat):
    replies = under_way(chat)
    chat.stop()  # no request: the "default" session, the one the reply runs in
    shown = stopped_by_you(replies)
    assert shown.chatbot[-1]["content"].endswith("*(stopped)*")
    reply = chat.store.path(shown.browser["owner"], shown.view["cid"])[-1]
    assert reply.status == "stopped" and len(reply.content.split()) >= 3


class Request:
    def __init__(self, session_hash):
        self.session_hash = session_hash


def test_stop_reaches_only_its_own_session():
    sessions = Sessions()
    with sessions.running(Request("a")) as a, sessions.running(Request("b")) as b:
        assert sessions.stop(Request("a"))
        assert a.is_set() and not b.is_set()
    assert not sessions.stop(Request("a"))


def test_stop_reaches_everything_a_session_runs():
    """A session's chat reply and comparison each watch an event of their own: Stop sets
    both, and one that ends takes only its own event away."""
    sessions = Sessions()
    with sessions.running(Request("a")) as reply:
        with sessions.running(Request("a")) as comparison:
            assert comparison is not reply
        assert sessions.stop(Request("a"))  # the comparison has ended; the reply still runs
        assert reply.is_set() and not comparison.is_set()
        with sessions.running(Request("a")) as again, sessions.running(Request("a")) as other:
            assert not again.is_set()  # a new run starts uncancelled
            assert sessions.stop(Request("a"))
            assert again.is_set() and other.is_set()
    assert not sessions.stop(Request("a"))


@pytest.mark.parametrize(
    "written, shown",
    [
        ("a <div> b", "a &lt;div> b"),
        ("<b>x</b> <<A Title>> <!-- c -->", "&lt;b>x&lt;/b> <&lt;A Title>> &lt;!-- c -->"),
        ("<T> a < b &lt; `<div>`", "<T> a < b &lt; `<div>`"),  # not tags / in a code span
        ("```html\n<div>x</div>\n```\n<p>", "```html\n<div>x</div>\n```\n&lt;p>"),
        ("streaming ```\n```js\n<div>", "streaming ```\n```js\n<div>"),  # fence not closed
        ("``<div>` <path> &lt;b>", "``&lt;div>` &lt;path> &amp;lt;b>"),  # no span: 2 ticks, 1
        ("`a\n\n<div>\n\nb`", "`a\n\n&lt;div>\n\nb`"),  # a span ends with its paragraph
        ("```\r\n<b>\r\n```\r\n<i>", "```\r\n<b>\r\n```\r\n&lt;i>"),
    ],
)
def test_html_tags_outside_code_are_shown_as_written(written, shown):
    """The Chatbot lays out standard HTML tags (or drops them): outside code their "<" goes to
    it as "&lt;", and an edited message comes back as it was written."""
    assert shown_text(written) == shown
    assert typed_text(shown) == written


def test_shown_text_takes_linear_time_on_runs_of_backticks():
    """A model that repeats backticks: finding code spans is one pass over the runs (a regex
    that backtracks took 2 s for 1,000 of them and 124 s for 4,000)."""
    for text in ("x" + "`" * 20_000, "x`" + "a" * 5000 + "``" * 5000, "` <div> " * 5000):
        assert typed_text(shown_text(text)) == text


def test_a_run_alone_is_refused_while_its_session_runs_one_of_its_kind():
    """Chat's one reply at a time: checked and registered in one step, so two sends that
    arrive together (a double click) do not both start; other kinds and sessions go on."""
    sessions = Sessions()
    with sessions.running(Request("a"), "chat", alone=True) as first:
        assert first is not None
        with sessions.running(Request("a"), "chat", alone=True) as second:
            assert second is None
        with sessions.running(Request("a"), "notebook", alone=True) as other_kind:
            assert other_kind is not None
        with sessions.running(Request("b"), "chat", alone=True) as other_session:
            assert other_session is not None
        assert sessions.busy(Request("a"), "chat")
    assert not sessions.busy(Request("a"), "chat")
    with sessions.running(Request("a"), "chat", alone=True) as again:
        assert again is not None


def test_a_second_send_while_its_reply_runs_says_why_it_is_dropped(chat, monkeypatch, recwarn):
    """Send and Enter are one event, which Gradio runs once at a time: a second press while
    its reply runs is dropped in the page, and refused_send (outside the queue) says why. A
    reply that Regenerate began leaves the event free (its handler warns); a press right after
    the first (a double click) says nothing."""
    from miniserve.ui import chat_tab

    with chat.sessions.running(Request("a"), chat_tab.CHAT, origin=chat_tab.SEND):
        chat.refused_send(Request("a"))
        assert not recwarn.list, "a double click is not a second message"
        monkeypatch.setattr(chat_tab, "SECOND_SEND_S", 0.0)
        with pytest.warns(UserWarning, match=re.escape(chat_tab.STILL_STREAMING)):
            chat.refused_send(Request("a"))
        recwarn.clear()
        chat.refused_send(Request("b"))  # another page: nothing runs there
    with chat.sessions.running(Request("a"), chat_tab.CHAT):  # Regenerate's or an edit's
        chat.refused_send(Request("a"))
    chat.refused_send(Request("a"))
    assert not recwarn.list, [str(w.message) for w in recwarn.list]


def test_take_over_stops_one_kind_waits_for_it_to_end_and_leaves_the_others():
    """The Notebook's Undo and Regenerate stop only the session's notebook runs, and return
    once each has ended; the run knows which button took it over, and a run that has closed
    (decided its last output) is not taken over."""
    sessions = Sessions()
    started, written, cancels = threading.Event(), [], []

    def generation():
        with sessions.running(Request("a"), "notebook") as cancel:
            cancels.append(cancel)
            started.set()
            cancel.wait(10)
            written.append(sessions.close(cancel))

    with sessions.running(Request("a"), "chat") as reply:
        thread = threading.Thread(target=generation)
        thread.start()
        assert started.wait(10)
        assert sessions.take_over(Request("a"), "notebook", wait=10, by="undo")
        assert written == ["undo"], "take_over returned before the run had ended"
        assert not reply.is_set(), "the chat reply of the same session runs on"
        assert not sessions.take_over(Request("a"), "notebook", wait=10, by="undo")
        # a second button before the first's run has ended: the run carries the first one's
        # result only, and the second acts itself once the run has ended
        started.clear()
        release = threading.Event()

        def held():
            with sessions.running(Request("a"), "notebook") as cancel:
                started.set()
                release.wait(10)
                written.append(sessions.close(cancel))

        thread = threading.Thread(target=held)
        thread.start()
        assert started.wait(10)
        assert sessions.take_over(Request("a"), "notebook", wait=0, by="undo")  # not waited for
        threading.Timer(0.2, release.set).start()
        assert not sessions.take_over(Request("a"), "notebook", wait=10, by="clear")
        assert written[-1] == "undo", "the second button returned before the run had ended"
        with sessions.running(Request("a"), "notebook") as closing:
            assert sessions.close(closing) is None  # its last output is its own
            assert not sessions.take_over(Request("a"), "notebook", wait=10, by="undo")
            assert not closing.is_set() and closing.taken_over is None
        # a run that fails before deciding its last output does not carry the button's action
        # (Undo would be lost): the button, having waited for it to end, acts itself
        started.clear()

        def failing():
            try:
                with sessions.running(Request("a"), "notebook") as cancel:
                    started.set()
                    cancel.wait(10)
                    raise RuntimeError("the run fails")
            except RuntimeError:
                pass

        thread.join()
        thread = threading.Thread(target=failing)
        thread.start()
        assert started.wait(10)
        assert not sessions.take_over(Request("a"), "notebook", wait=10, by="undo")
        assert not sessions.busy(Request("a"), "notebook"), "returned before the run had ended"
    thread.join()


def test_stop_ends_a_reply_after_a_comparison_of_the_same_session(engine, presets):
    """Chat and Compare share the app's sessions: a comparison started (and finished) while a
    reply streams leaves the reply within Stop's reach."""
    sessions = Sessions()
    chat = ChatHandlers(engine, presets, sessions)
    compare = CompareHandlers(engine, presets, sessions)
    replies = under_way(chat)
    status, *_ = last(compare.compare(PROMPT, ["factual"], 1, 4))
    assert status.startswith("same prompt"), status
    chat.stop()  # the "default" session, which both ran in
    stopped_by_you(replies)


def test_undo_clear_and_presets(chat, presets):
    browser, view = first_visit(chat)
    one = Shown(*last(send(chat, browser, view, "Hi", max_new_tokens=3))[:8])
    *shown, box = chat.undo(one.browser, one.view)
    shown = Shown(*shown)
    assert shown.chatbot == [] and box == "Hi" and shown.status == "last turn removed"
    assert chat.store.path(one.browser["owner"], one.view["cid"]) == []
    *nothing, box = chat.undo(shown.browser, shown.view)
    assert Shown(*nothing).status == "nothing to undo" and box == ""
    # what was typed in the box stays: the turn's message comes back above it
    *nothing, box = chat.undo(shown.browser, shown.view, "", "my draft")
    assert Shown(*nothing).status == "nothing to undo" and box == "my draft"
    again = Shown(*last(send(chat, one.browser, new_view(), "Hi again", max_new_tokens=3))[:8])
    *shown, box = chat.undo(again.browser, again.view, "", "the next question")
    assert box == "Hi again\n\nthe next question"
    assert Shown(*shown).status == f"last turn removed: {DRAFT_KEPT}"
    same = Shown(*last(send(chat, one.browser, new_view(), "Same", max_new_tokens=3))[:8])
    *shown, box = chat.undo(same.browser, same.view, "", "Same ")  # the same text: once
    assert box == "Same" and Shown(*shown).status == "last turn removed"
    two = Shown(*last(send(chat, one.browser, new_view(), "Hello", max_new_tokens=3))[:8])
    *cleared, box, inspected = chat.clear(two.browser)
    cleared = Shown(*cleared)
    assert cleared.chatbot == [] and cleared.view == new_view() and cleared.status == "new chat"
    assert two.view["cid"] in {cid for _, cid in cleared.conversations["choices"]}  # kept
    creative = dict(zip(setting_names(), chat.apply_preset("creative")))
    assert creative["temperature"] == 1.0 and creative["top_k"] == 80
    assert creative["top_p"] == 0.98 and creative["min_p"] == 0.02
    assert creative["repetition_penalty"] == 1.15 and creative["max_new_tokens"] == 512
    assert creative["samplers"] == list(default_order())


def test_a_reload_and_a_restart_bring_back_the_open_conversation(engine, presets, tmp_path):
    store = open_store(tmp_path / "history.sqlite3")
    chat = ChatHandlers(engine, presets, store=store)
    browser, view = first_visit(chat)
    one = Shown(*last(send(chat, browser, view, "Remember me."))[:8])
    reload = SidebarHandlers(chat.conversations).load(one.browser)
    assert reload.chatbot == one.chatbot and reload.view["cid"] == one.view["cid"]
    store.close()
    restarted = ChatHandlers(engine, presets, store=open_store(tmp_path / "history.sqlite3"))
    again = SidebarHandlers(restarted.conversations).load(one.browser)
    assert again.chatbot == one.chatbot and again.title == "Remember me."
    assert restarted.store.secret() == store_secret_of(tmp_path)


def store_secret_of(tmp_path):
    return open_store(tmp_path / "history.sqlite3").secret()


def test_another_browsers_conversation_is_refused(chat):
    browser, view = first_visit(chat)
    mine = Shown(*last(send(chat, browser, view, "My secret.", max_new_tokens=3))[:8])
    other, _ = first_visit(chat)
    side = SidebarHandlers(chat.conversations)
    assert side.load(other).conversations["choices"] == [] or mine.view["cid"] not in {
        c for _, c in side.load(other).conversations["choices"]
    }
    opened = side.open(other, mine.view["cid"])
    assert opened.chatbot == [] and opened.status.startswith("**Error:** no conversation")
    *sent, box, _ = last(
        chat.send("Reply here.", other, mine.view, "", "", "factual", *sliders(chat), 1, False)
    )
    assert Shown(*sent).status.startswith("**Error:** no conversation") and box == "Reply here."
    assert side.export(other, mine.view, "json")[0] is None
    assert len(chat.store.path(mine.browser["owner"], mine.view["cid"])) == 2


def test_sidebar_rename_search_delete_and_undo(chat):
    side = SidebarHandlers(chat.conversations)
    browser, view = first_visit(chat)
    one = Shown(*last(send(chat, browser, view, "Tell me about zebras.", max_new_tokens=3))[:8])
    renamed = side.rename(one.browser, one.view, "Stripes")
    assert renamed.title == "Stripes" and renamed.conversations["choices"][0][0].startswith(
        "Stripes · "
    )
    assert side.rename(one.browser, one.view, "   ").status.startswith("**Error:** the title")
    found, line = side.search(one.browser, one.view, "zebra")
    assert [c for _, c in found["choices"]] == [one.view["cid"]] and line == "1 conversation match"
    assert side.search(one.browser, one.view, "giraffe")[0]["choices"] == []
    gone = side.delete(one.browser, one.view)
    assert gone.chatbot == [] and "Undo delete" in gone.status
    assert gone.conversations["choices"] == []
    back = side.undo_delete(gone.browser, gone.view)
    assert back.view["cid"] == one.view["cid"] and back.title == "Stripes"


def test_export_and_import_round_trip_and_bad_files(chat, tmp_path):
    side = SidebarHandlers(chat.conversations)
    browser, view = first_visit(chat)
    one = Shown(*last(send(chat, browser, view, "Name a bird.", max_new_tokens=4))[:8])
    path, status = side.export(one.browser, one.view, "JSON (whole tree)")
    assert status.startswith("exported") and path.endswith("Name-a-bird.json")
    imported = side.import_file(one.browser, new_view(), path)
    assert imported.status == "imported 1 conversation" and imported.chatbot == one.chatbot
    owner = one.browser["owner"]
    assert chat.store.export(owner, imported.view["cid"]) == json.loads(Path(path).read_text())
    md, _ = side.export(one.browser, one.view, "Markdown (this branch)")
    assert "**User:**" in Path(md).read_text() and md.endswith(".md")
    count = len(chat.store.conversations(owner))
    for content in (
        b"not json",
        b'{"format": "miniserve.conversation", "version": 9}',
        b'[{"role": "assistant", "content": "first?"}]',
    ):
        bad = tmp_path / "bad.json"
        bad.write_bytes(content)
        shown = side.import_file(one.browser, one.view, str(bad))
        assert shown.status.startswith("**Error:** import failed, nothing was imported")
    assert len(chat.store.conversations(owner)) == count


@pytest.mark.parametrize(
    "title, name",
    [
        ("../../etc/passwd", "etc-passwd.json"),
        ("", "conversation.json"),
        ("C:\\x\\y ü", "C-x-y.json"),
    ],
)
def test_export_names_cannot_leave_their_folder(title, name):
    assert file_name(title, ".json") == name


@pytest.mark.parametrize(
    "value, seed",
    [
        (None, None),
        ("", None),
        (-1, None),
        (-1.0, None),
        (7.0, 7),
        ("12", 12),
        (2**63 - 1, 2**63 - 1),
    ],
)
def test_seed_box(value, seed):
    assert seed_from(value) == seed


# -- Output format ---------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"type": "string", "maxLength": 16},
        "legs": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["animal", "legs"],
    "additionalProperties": False,
}
ANIMAL = "Name an animal and its number of legs."


def by_schema(chat, schema: str, inspect=False) -> tuple[Shown, str]:
    """A new chat's whole reply to ANIMAL held to the JSON schema `schema`: what it shows, and
    the inspector's HTML."""
    browser, view = first_visit(chat)
    replies = send(
        chat, browser, view, ANIMAL, "JSON schema", schema, max_new_tokens=48, inspect=inspect
    )
    *shown, _, inspected = last(replies)
    return Shown(*shown), inspected


def test_a_json_schema_reply_parses_validates_and_is_saved_with_its_format(chat):
    shown, inspected = by_schema(chat, json.dumps(SCHEMA, indent=2))
    reply = json.loads(shown.chatbot[-1]["content"])
    jsonschema.validate(reply, SCHEMA)
    assert "finish: stop" in shown.status and "incomplete" not in shown.status, shown.status
    saved = chat.store.path(shown.browser["owner"], shown.view["cid"])[-1]
    assert saved.settings["constraint"] == {"kind": "json_schema", "value": json.dumps(SCHEMA)}
    assert inspected == ""


@pytest.mark.parametrize(
    "fmt, text, note",
    [
        ("JSON", "", "incomplete JSON (cut by max new tokens)"),
        ("JSON schema", json.dumps(SCHEMA), "incomplete JSON (cut by max new tokens)"),
        (
            "Regex",
            "[A-Z][a-z]+( [a-z]+){5,}\\.",
            "incomplete: cut by max new tokens before the format was complete",
        ),
    ],
)
def test_a_reply_cut_by_max_new_tokens_says_its_format_is_incomplete(chat, fmt, text, note):
    browser, view = first_visit(chat)
    shown = Shown(*last(send(chat, browser, view, ANIMAL, fmt, text, max_new_tokens=3))[:8])
    assert "finish: length" in shown.status and shown.status.endswith(note), shown.status


def test_an_empty_reply_says_why_it_is_empty(chat):
    """A format that allows only the empty text: the reply's bubble is empty, and the status
    line says why."""
    browser, view = first_visit(chat)
    shown = Shown(*last(send(chat, browser, view, ANIMAL, "Regex", "(x{0})"))[:8])
    assert contents(shown.chatbot)[-1] == ""
    assert shown.status.endswith(
        "empty reply: its first token was the end (the output format allows an empty text)"
    )
    normal = Shown(*last(send(chat, browser, view, ANIMAL, max_new_tokens=4))[:8])
    assert contents(normal.chatbot)[-1] and "empty reply" not in normal.status


def test_an_empty_replys_note_names_its_cause_and_a_stopped_one_has_none():
    from miniserve.ui.chat_tab import empty_note

    empty = SimpleNamespace(text_so_far=" \n", reasoning_so_far="", calls_so_far=[])
    fmt = constraint_from("Regex", "x*")
    plain, stops = SamplingParams(), SamplingParams(stop=["END"])

    def note(reason, params, turn=empty):
        return empty_note(turn, SimpleNamespace(finish_reason=reason), params)

    assert note("cancelled", plain) == ""  # Stop: "stopped by you" says it
    assert note("stop", stops) == "empty reply: a stop string came first"
    assert note("stop", plain.replace(constraint=fmt)).endswith(
        "the output format was complete before any text"
    )
    assert "a stop string came, or" in note("stop", stops.replace(constraint=fmt))
    assert note("length", plain) == "empty reply: max new tokens ran out before any text"
    assert note("eos", plain) == "empty reply: its first token was the end"
    said = SimpleNamespace(text_so_far="", reasoning_so_far="hmm", calls_so_far=[])
    assert note("length", plain, said) == ""  # its reasoning shows


def test_the_inspector_says_how_much_the_grammar_bent_the_reply(chat):
    shown, inspected = by_schema(chat, json.dumps(SCHEMA), inspect=True)
    steps = int(re.search(r"(\d+) new tokens", shown.status).group(1))
    line = re.search(
        r"grammar bent (\d+) of (\d+) steps, up to (\d+)% of the probability", inspected
    )
    assert line, inspected[:300]
    bent, total, most = map(int, line.groups())
    assert total == steps and 0 < bent <= total and 1 <= most <= 100
    assert inspected.count("data-grammar-removed=") == steps


@pytest.mark.parametrize(
    "fmt, text, message",
    [
        (
            "JSON schema",
            '{"type": "strin"}',
            "the output format cannot be used: Invalid type: strin",
        ),
        ("JSON schema", '{"type": "string", "pattern": "(?=x)"}', "look-around"),
        ("Regex", "[a-", "unclosed character class"),
        ("Grammar", "root ::= missing", "Rule &#x27;missing&#x27; not found"),
        ("JSON schema", "  ", "the JSON schema is empty: paste a JSON Schema, like {"),
        ("JSON schema", '{"type": object}', "the JSON schema is not JSON: Expecting value"),
        ("Regex", "", "the regex pattern is empty"),
        ("Choice", " , ,", "no choices given: write them one per line or separated by commas"),
        ("Grammar", "\n", "the grammar is empty"),
        ("XML", "", "unknown output format &#x27;XML&#x27;"),
    ],
)
def test_a_bad_output_format_is_an_error_line_and_nothing_is_saved(chat, fmt, text, message):
    """In a new chat and in a conversation: the error names the library's reason, the typed
    message stays in the box, nothing is saved (no message, no new conversation)."""
    browser, view = first_visit(chat)
    owner = browser["owner"]
    *shown, box, _ = last(send(chat, browser, view, "Hi", fmt, text))
    shown = Shown(*shown)
    assert shown.status.startswith("**Error:**") and message in shown.status, shown.status
    assert box == "Hi" and shown.chatbot == [] and chat.store.conversations(owner) == []
    before = Shown(*last(send(chat, browser, view, "Hello", max_new_tokens=3))[:8])
    *shown, box, _ = last(send(chat, before.browser, before.view, "Hi", fmt, text))
    shown = Shown(*shown)
    assert shown.status.startswith("**Error:**") and message in shown.status, shown.status
    assert box == "Hi" and shown.chatbot == before.chatbot
    assert len(chat.store.path(owner, before.view["cid"])) == 2
    assert len(chat.store.conversations(owner)) == 1


def test_regenerate_and_edit_follow_the_output_format(chat):
    browser, view = first_visit(chat)
    one = Shown(*last(send(chat, browser, view, "Name a colour.", max_new_tokens=6))[:8])
    choice = ("Choice", "teal\nmauve")
    regen = Shown(
        *last(
            chat.regenerate(
                one.browser, one.view, "", "", "factual", *sliders(chat), 1, False, *choice
            )
        )[:8]
    )
    assert regen.chatbot[-1]["content"].split("\n\n")[0] in ("teal", "mauve")
    edited = SimpleNamespace(index=0, value="Name a fruit.", previous_value="")
    after = Shown(
        *last(
            chat.edit(
                regen.browser,
                regen.view,
                "",
                "",
                "factual",
                *sliders(chat),
                1,
                False,
                "Choice",
                "plum, fig",
                edited=edited,
            )
        )[:8]
    )
    assert after.chatbot[-1]["content"] in ("plum", "fig")


def test_gradio_hands_the_output_format_to_the_handlers(engine, presets):
    """The events pass the Output format's two values, then the Model dropdown (Chat's: then
    the Think switch and the reasoning budget), last (Compare:
    the format, "Also without", the Models); an edit's EditData goes where the handler's
    parameter is, after them (Gradio inserts it by its annotation)."""
    from gradio.helpers import special_args

    demo = build_ui(engine, presets)
    for fn in demo.fns.values():
        if fn.name in ("send", "regenerate", "edit", "generate", "compare"):
            labels = [getattr(b, "label", None) for b in fn.inputs]
            chat_ends = ["Output format", "Format", "Model", "Think", "Reasoning budget"]
            assert (
                labels[-3:] == ["Output format", "Format", "Model"]
                or (fn.name in ("send", "regenerate", "edit") and labels[-5:] == chat_ends)
                or (
                    fn.name == "compare"
                    and labels[-4:]
                    == ["Output format", "Format", "Also without the output format", "Models"]
                )
            ), labels
    chat = ChatHandlers(engine, presets)
    values = [
        {},
        new_view(),
        "",
        "",
        "factual",
        *sliders(chat),
        1,
        False,
        "JSON",
        "",
        "m",
        True,
        -1,
    ]
    data = gr.EventData(None, {"index": 0, "value": "x", "previous_value": ""})
    args, *_ = special_args(chat.edit, values, None, data)
    at = 5 + len(setting_names()) + 2  # after the settings panel, the seed and the inspector
    assert args[at : at + 5] == ["JSON", "", "m", True, -1], args
    assert isinstance(args[at + 5], gr.EditData) and args[at + 5].value == "x"
    assert len(args) == at + 7, args


def test_gradio_hands_the_request_to_every_handler_that_takes_one(engine, presets):
    """Every event whose handler has a `request` parameter gets the browser's request: the
    session a tab's state is kept under (Gradio fills only a parameter before *values; the
    Step tab's handlers, with theirs after, all ran as one "default" session)."""
    import inspect

    from gradio.helpers import special_args

    demo = build_ui(engine, presets)
    request, wanting = object(), []
    for fn in demo.fns.values():
        if fn.fn is None or "request" not in inspect.signature(fn.fn).parameters:
            continue
        wanting.append(fn.name)
        args, *_ = special_args(fn.fn, [None] * len(fn.inputs), request)
        assert request in args, fn.name
    assert {"step", "restage", "act", "run_to_end", "closed"} <= set(wanting)


def test_a_handler_with_no_outputs_returns_nothing(engine, presets):
    """Gradio warns at each call of an event's handler that returns a value to no outputs
    (Compare's Stop returned whether it stopped something)."""
    import inspect

    demo = build_ui(engine, presets)
    silent = [fn for fn in demo.fns.values() if fn.fn is not None and not fn.outputs]
    assert silent
    for fn in silent:
        returns = inspect.signature(fn.fn).return_annotation
        assert returns in (None, "None", inspect.Signature.empty), (fn.name, returns)


def test_output_format_values_become_a_constraint():
    assert constraint_from("Free text", "ignored") is None and constraint_from(None, "") is None
    assert constraint_from("JSON", "ignored") == Constraint("json_object")
    assert constraint_from("JSON schema", '{ "type" : "object" }') == Constraint(
        "json_schema", '{"type": "object"}'
    )
    assert constraint_from("Regex", "\\d+\n") == Constraint("regex", "\\d+")
    assert constraint_from("Choice", "red, green ,blue") == Constraint(
        "choice", '["red", "green", "blue"]'
    )
    assert constraint_from("Choice", "yes, really\nno\n\n") == Constraint(
        "choice", '["yes, really", "no"]'
    )
    assert constraint_from("Grammar", 'root ::= "a"') == Constraint("grammar", 'root ::= "a"')
    with pytest.raises(ConfigError, match="the JSON schema is not JSON"):
        constraint_from("JSON schema", "{")
    params = params_from(sliders_values(), 5, "Regex", "[0-9]+")
    assert params.constraint == Constraint("regex", "[0-9]+") and params.seed == 5
    assert params_from(sliders_values(), 5).constraint is None
    assert set(FORMATS) == {"Free text", "JSON", "JSON schema", "Regex", "Choice", "Grammar"}
    assert format_note(None, "length") == "" and format_note(Constraint("regex", "a"), "stop") == ""
    assert "no next token" in format_note(Constraint("json_object"), "no_token_allowed")


def sliders_values():
    return preset_values({"greedy": SamplingParams(temperature=0.0, max_new_tokens=8)}, "greedy")


# -- Benchmark -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths, new_tokens, repeat, message",
    [
        (
            "16,abc",
            6,
            1,
            "Prompt lengths: write whole numbers separated by commas, like 32,128,512",
        ),
        ("", 6, 1, "Prompt lengths: write whole numbers separated by commas"),
        ("0", 6, 1, "prompt lengths must be whole numbers from 1 to 32768"),
        ("16", 1, 1, "new tokens must be from 2"),
        ("16", 6, 0, "repeat must be from 1 to 20"),
    ],
)
def test_benchmark_bad_values(engine, lengths, new_tokens, repeat, message):
    table, plot, status = BenchmarkHandlers(engine).benchmark(lengths, new_tokens, repeat)
    assert table is None and plot is None
    assert status.startswith("**Error:**") and message in status, status


def test_benchmark_stop_ends_it_within_its_run_and_frees_the_engine(engine):
    """Stop (or the page closing) ends a benchmark: before, nothing stopped it, and it held
    the tab's one slot for every page until its last run. A run of our own loop stops at its
    next step: a no-cache run over a long prompt that would take minutes ends in seconds."""
    bench = BenchmarkHandlers(engine)
    table, _, status = bench.benchmark("8", 2, 1)  # unstopped, it runs every row
    assert table is not None and not status.startswith("stopped"), status
    out = {}
    worker = threading.Thread(
        target=lambda: out.update(
            result=bench.benchmark("1500", 256, 3, progress=lambda *a, **k: None)
        )
    )
    started = time.monotonic()
    worker.start()
    while engine.queue_depth == 0 and worker.is_alive():  # wait for a run to hold the engine
        time.sleep(0.01)
    assert bench.stop().startswith("stopping")
    worker.join(60)
    assert not worker.is_alive() and time.monotonic() - started < 60
    table, plot, status = out["result"]
    assert table is None and plot is None and status.startswith("stopped"), status
    assert engine.queue_depth == 0 and bench.stop() == "nothing to stop"
    # its Stop is the benchmark's: a reply streaming in another tab of the page goes on
    with bench.sessions.running(None, "chat") as reply:
        assert bench.stop() == "nothing to stop" and not reply.is_set()
        # the page closing (the app's unload handler) stops every run of the page
        with bench.sessions.running(None, "bench") as run:
            bench.sessions.closed(None)
            assert reply.is_set() and run.is_set()


def test_the_app_stops_a_closed_pages_runs_once(engine, presets):
    """One unload handler stops the page's runs (each tab's used to, the Benchmark's and the
    Step tab's both); the Step tab's own drops its session."""
    demo = build_ui(engine, presets)
    unloads = [d.fn for d in demo.fns.values() if any(t[1] == "unload" for t in d.targets)]
    stopping = [fn for fn in unloads if getattr(fn, "__name__", "") == "closed"]
    owners = sorted(type(fn.__self__).__name__ for fn in stopping)
    assert owners == ["Sessions", "StepHandlers"], owners


def test_build_ui_lays_out_its_tabs(engine, presets):
    demo = build_ui(engine, presets, "no such preset")
    tabs = [block.label for block in demo.blocks.values() if isinstance(block, gr.Tab)]
    assert tabs == ["Chat", "Notebook", "Compare", "Step", "Benchmark"]  # all, in this order
    labels = {getattr(block, "label", None) for block in demo.blocks.values()}
    assert {
        "Conversation",
        "Text",
        "Presets",
        "Results",
    } <= labels
    # one model: no dropdown to choose it (the header names it)
    assert not any(
        b.visible for b in demo.blocks.values() if getattr(b, "label", None) in ("Model", "Models")
    )


def test_replies_of_many_browsers_run_at_once(engine, presets):
    """Gradio runs one event of a listener at a time unless told otherwise; the app lets as
    many engine events (Send, Regenerate, Generate, Compare) run at once as the engine admits,
    as one group, and the benchmarks one at a time."""
    demo = build_ui(engine, presets)
    assert demo._queue.default_concurrency_limit == engine.max_queue
    assert demo.max_threads >= engine.max_queue
    groups = {}
    for fn in demo.fns.values():
        groups.setdefault(fn.name, set()).add((fn.concurrency_id, fn.concurrency_limit))
    for name in ("send", "regenerate", "generate", "compare"):
        assert groups[name] == {("engine", "default")}, name  # the default: max_queue
    assert groups["benchmark"] == groups["concurrency"] == {("benchmark", 1)}


def test_benchmark_tables_name_every_field_of_their_rows():
    """Each table's columns are the result rows' fields, each under a header without field
    names; the Results table covers every field a benchmark row has."""
    from dataclasses import fields

    from miniserve.bench.bench import ConcurrencyRow, Row

    assert list(BENCH_COLUMNS) == [f.name for f in fields(Row)]
    assert set(CONCURRENCY_COLUMNS) <= {f.name for f in fields(ConcurrencyRow)}
    for header in (*BENCH_COLUMNS.values(), *CONCURRENCY_COLUMNS.values()):
        assert "_" not in header and header[0].isupper(), header
    assert "Aggregate tokens/s" in CONCURRENCY_COLUMNS.values()


def test_concurrency_run_fills_the_table_and_the_plot(engine, presets):
    bench = BenchmarkHandlers(engine, presets)
    table, plot, status = bench.concurrency("1, 2", ["greedy"], 16, 4)
    # the table: the headers a person reads, in the order of CONCURRENCY_COLUMNS
    assert list(table.columns) == list(CONCURRENCY_COLUMNS.values())
    assert list(table["Streams at once"]) == [1, 2] and set(table["Preset"]) == {"greedy"}
    assert (table["Aggregate tokens/s"] > 0).all()
    assert {
        "First token p50 (s)",
        "First token p95 (s)",
        "Inter-token p95 (s)",
        "Share of the ceiling",
    } <= set(table.columns)
    assert not any("_" in c for c in table.columns)
    # the plot: the same numbers under the fields it is drawn from
    assert list(plot["concurrency"]) == [1, 2]
    assert list(plot["aggregate_tokens_per_s"]) == list(table["Aggregate tokens/s"])
    assert "16-token prompts" in status and not status.startswith("**Error")


def test_a_chart_of_one_x_draws_points():
    # one prompt length (or one level of streams) drew an empty line chart: a line needs two
    import pandas as pd

    from miniserve.ui.bench_tab import Trend

    chart = Trend(x="concurrency", y="aggregate_tokens_per_s", color="preset", render=False)
    one = pd.DataFrame({"concurrency": [1, 1], "aggregate_tokens_per_s": [9.0, 7.0]})
    one["preset"] = ["greedy", "balanced"]
    assert chart.postprocess(one).mark == "point"
    two = pd.concat([one, one.assign(concurrency=2)])
    assert chart.postprocess(two).mark == "line" and chart.postprocess(None) is None


@pytest.mark.parametrize(
    "levels, chosen, message",
    [
        ("1,two", ["greedy"], "Concurrency: write whole numbers separated by commas, like 1,2,4,8"),
        ("  ", ["greedy"], "Concurrency: write whole numbers separated by commas"),
        ("0,2", ["greedy"], "concurrency levels must be whole numbers from 1 to 1000"),
        ("1,999", ["greedy"], "concurrency 999 is more than the engine admits at once"),
        ("1,2", [], "name at least one preset"),
        ("1,2", ["no-such-preset"], "unknown preset no-such-preset"),
    ],
)
def test_concurrency_bad_values(engine, presets, levels, chosen, message):
    table, plot, status = BenchmarkHandlers(engine, presets).concurrency(levels, chosen, 16, 4)
    assert table is None and plot is None
    assert status.startswith("**Error:**") and message in status, status


def test_concurrency_offers_greedy_and_the_apps_presets(engine, presets):
    assert "greedy" in presets  # built in
    assert BenchmarkHandlers(engine, presets).preset_names == [
        "greedy",
        *(n for n in presets if n != "greedy"),
    ]


def test_concurrency_runs_the_apps_own_presets(engine):
    """The presets the app loaded (its --presets-file), not the default presets.yaml."""
    own = {"terse": SamplingParams(temperature=0, top_k=0, top_p=1.0, max_new_tokens=3)}
    bench = BenchmarkHandlers(engine, own)
    table, _, status = bench.concurrency("1", ["terse"], 16, 4)
    assert list(table["Preset"]) == ["terse"] and not status.startswith("**Error"), status
    table, _, status = bench.concurrency("1", ["balanced"], 16, 4)  # only in presets.yaml
    assert table is None and "unknown preset balanced (available: terse, greedy)" in status


def test_a_damaged_history_file_is_said_in_the_sidebar(engine, presets, tmp_path):
    bad = tmp_path / "history.sqlite3"
    bad.write_bytes(b"this is not a database" * 100)
    chat = ChatHandlers(engine, presets, store=open_store(bad))
    shown = SidebarHandlers(chat.conversations).load({})
    assert "could not be read" in shown.status and "kept aside" in shown.status
    browser, view = shown.browser, shown.view
    saved = Shown(*last(send(chat, browser, view, "Still works?", max_new_tokens=3))[:8])
    assert len(chat.store.path(saved.browser["owner"], saved.view["cid"])) == 2


def test_gradio_is_imported_without_rewriting_its_stubs():
    """Gradio's metaclass rewrites each component's .pyi stub at every import (~1.3 s of a
    start); importing the UI first puts a no-op in its place before any component is defined.
    Fails if Gradio stops calling the writer by that name (the saving would be lost silently)
    or if the hook comes too late."""
    import subprocess
    import sys

    code = (
        "import miniserve.ui, gradio, gradio.component_meta as meta\n"
        "from miniserve.ui import gradio_import as g\n"
        "assert meta.create_or_modify_pyi is g.no_stub_writing\n"
        "print(g.no_stub_writing.calls, len(gradio.components.Component.__subclasses__()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    calls, direct_subclasses = int(out[0]), int(out[1])
    assert calls >= direct_subclasses > 20  # every component class went through the no-op

    from miniserve.ui import gradio_import

    before = gradio_import.no_stub_writing.calls

    class Probe(gr.Textbox):  # defined in this file: the real writer would write test_ui.pyi
        pass

    assert gradio_import.no_stub_writing.calls == before + 1
    assert not Path(__file__).with_suffix(".pyi").exists()


def test_an_idle_queue_waits_to_be_woken_and_new_work_wakes_it(engine, presets):
    """Gradio's queue polls every 1 ms when free by default (~6% of a core with no client);
    the app makes its idle sleeps wait for a wake-up instead (up to IDLE_WAIT_S), which a new
    event (push) or the end of a job gives: the waiting loop runs again within a few turns of
    the event loop, not after the timeout."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import gradio.queueing as queueing

    from miniserve.ui import IDLE_WAIT_S

    demo = build_ui(engine, presets)
    queue = demo._queue
    assert queue.sleep_when_free == queue.progress_update_sleep_when_free == IDLE_WAIT_S
    clock = queueing.asyncio
    assert clock.Event is asyncio.Event  # every other name is asyncio's own

    async def scenario(wake) -> bool:
        idle = asyncio.create_task(clock.sleep(IDLE_WAIT_S))
        await asyncio.sleep(0)  # the sleep is waiting now
        await wake()
        for _ in range(5):
            await asyncio.sleep(0)
        done = idle.done()
        idle.cancel()
        return done

    async def nothing():
        pass

    async def a_job_ends():
        with pytest.raises(Exception):  # noqa: B017 -- a bogus job fails; its end still wakes
            await queue.process_events(None, False, 0.0, None)

    async def an_event_comes(body=None):
        from types import SimpleNamespace

        await queue.push(SimpleNamespace(fn_index=None), None, None)  # refused, still a wake

    def run(wake) -> bool:  # on a thread of its own: the browser tests leave a loop running here
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, scenario(wake)).result()

    assert not run(nothing)  # no wake: it keeps waiting
    assert run(a_job_ends)
    assert run(an_event_comes)
