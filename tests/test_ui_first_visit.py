"""A first visit's events before the page's load handler has run, called as Gradio calls them
but without a browser: the browser has no owner id yet, and the first event gives it one (the
same one every other event of the page then gets); an error path says what went wrong and
never raises. tests/test_browser_first_send.py does the same in a real Chromium."""

from types import SimpleNamespace

import gradio as gr
import pytest

from miniserve.core.config import load_presets
from miniserve.store.store import open_store
from miniserve.ui import ChatHandlers
from miniserve.ui.common import is_error
from miniserve.ui.conversation import SHOWN, Shown, new_view
from miniserve.ui.sidebar import SidebarHandlers
from miniserve.ui.widgets import setting_names

NO_ID = {"owner": None, "open": None}  # the BrowserState's value before the load handler ran


@pytest.fixture
def chat(engine):
    return ChatHandlers(engine, load_presets())


def page(name: str) -> SimpleNamespace:
    """A gr.Request as the handlers read it: the page's Gradio session."""
    return SimpleNamespace(session_hash=name)


def send(chat, browser, view, message, request):
    values = chat.apply_preset("factual")
    values[setting_names().index("max_new_tokens")] = 6
    *shown, box, _ = list(
        chat.send(message, browser, view, "", "", "factual", *values, 1, False, request=request)
    )[-1]
    return Shown(*shown), box


def test_a_message_sent_before_the_load_is_saved_under_the_id_the_load_then_gives(chat):
    side = SidebarHandlers(chat.conversations)
    shown, box = send(chat, dict(NO_ID), new_view(), "Name a colour.", page("one"))
    assert not is_error(shown.status) and "tokens/s" in shown.status, shown.status
    assert box == {"__type__": "update"}  # (emptied when the reply started)
    assert [m["role"] for m in shown.chatbot] == ["user", "assistant"]
    owner, cid = shown.browser["owner"], shown.view["cid"]
    assert shown.browser["open"] == cid and len(owner) == 32

    # the load handler, run last with what the page had when it opened: the same id, the
    # conversation left on screen as the reply drew it, the list filled in
    loaded = side.load(dict(NO_ID), "", shown.view, request=page("one"))
    assert loaded.browser == {"owner": owner, "open": cid}
    assert loaded.conversations["value"] == cid
    assert [c for _, c in loaded.conversations["choices"]] == [cid]
    kept = {
        name: getattr(loaded, name) for name in SHOWN if name not in ("browser", "conversations")
    }
    assert all(value == gr.update() for value in kept.values()), kept

    # a reload (the id stored) opens it; another page's first visit is another browser
    assert side.load(loaded.browser).view["cid"] == cid
    other = side.load(dict(NO_ID), request=page("two"))
    assert other.browser["owner"] != owner and other.conversations["choices"] == []


def test_a_load_before_the_message_gives_the_id_the_message_is_saved_under(chat):
    side = SidebarHandlers(chat.conversations)
    loaded = side.load(dict(NO_ID), request=page("three"))
    shown, _ = send(chat, dict(NO_ID), new_view(), "Name a fruit.", page("three"))
    assert shown.browser["owner"] == loaded.browser["owner"]
    assert not is_error(shown.status), shown.status


def test_every_event_before_the_load_answers_with_a_message_not_an_exception(chat):
    side = SidebarHandlers(chat.conversations)
    request, view = page("four"), new_view()
    owner = side.load(dict(NO_ID), request=request).browser["owner"]

    def browser():
        return dict(NO_ID)

    shown = [
        chat.undo(browser(), view, "", "", request)[: len(SHOWN)],
        chat.clear(browser(), "", request)[: len(SHOWN)],
        chat.choose(browser(), view, "", SimpleNamespace(index=0), request),
        chat.previous_version(browser(), view, "", request),
        chat.next_version(browser(), view, "", request),
        side.new_chat(browser(), "", request),
        side.open(browser(), "no-such-conversation", "", request),
        side.rename(browser(), view, "A title", "", request),
        side.delete(browser(), view, "", request),
        side.undo_delete(browser(), view, "", request),
    ]
    for values in shown:
        assert Shown(*values).browser["owner"] == owner
    statuses = [Shown(*values).status for values in shown]
    assert statuses[0] == "nothing to undo" and statuses[3] == "this branch has no other versions"
    assert all(is_error(s) for s in (statuses[6], statuses[7], statuses[8])), statuses
    *regenerated, _, _ = list(
        chat.regenerate(
            browser(),
            view,
            "",
            "",
            "factual",
            *chat.apply_preset("factual"),
            1,
            False,
            request=request,
        )
    )[-1]
    assert Shown(*regenerated).status.endswith("nothing to regenerate yet")
    assert side.search(browser(), view, "colour", request)[1] == "0 conversations match"
    assert side.export(browser(), view, "JSON (whole tree)", request)[0] is None


def test_an_error_path_says_the_error_when_the_history_cannot_be_read(engine):
    store = open_store(enabled=False)
    chat = ChatHandlers(engine, load_presets(), store=store)
    browser = chat.conversations.start(dict(NO_ID))
    store.close()  # every read now fails (sqlite3.ProgrammingError)
    shown = chat._show(browser, new_view("gone", "gone"), "**Error:** the first failure")
    assert shown.status == "**Error:** the first failure"
    assert all(v == gr.update() for v in shown[: SHOWN.index("status")])  # the rest as it was
    cleared = Shown(*chat.clear(browser, "")[: len(SHOWN)])
    assert is_error(cleared.status) and "ProgrammingError" in cleared.status
    # and without an id at all (a handler that forgot `start`): a message as well
    assert is_error(chat._show(dict(NO_ID), new_view(), "").status)
