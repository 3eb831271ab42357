"""A thinking model's reply in a real headless Chromium: its reasoning streams open (a spinner,
"Thinking…") above the reply, folds under "Thought for N tokens, S s" once the answer starts,
opens on a click, and is there folded after a reload; the Think controls follow the Model
dropdown (shown for the thinking model, hidden for SmolLM2). The app serves the tiny R1-style
model of tests/thinking_models.py (every reply starts inside its reasoning) and the embedded
SmolLM2, which these tests never load."""

import re

import pytest
from playwright.sync_api import expect
from test_browser import set_number
from thinking_models import r1_tiny

from servers import Server

pytestmark = pytest.mark.browser
REPLY_TIMEOUT_MS = 90_000
LOAD_TIMEOUT_MS = 60_000  # the page's load events, on a busy machine
BUDGET = 96  # reasoning tokens: several paints while it streams (32 streamed within one paint
# once in a full run), a few seconds at most

# Records, from the page itself, what the reply's reasoning looked like while it streamed: the
# spinner and the open text on every change of the chat (so no paint between two polls of a
# test is missed).
WATCH_JS = """
() => {
  window.msSeen = {pending: 0, open: 0, texts: []};
  const chat = document.querySelector("#chatbot");
  new MutationObserver(() => {
    const group = chat.querySelector(".thought-group");
    if (!group || !group.querySelector(".loading-spinner")) return;
    window.msSeen.pending += 1;
    const text = group.querySelector(".content");
    if (!text) return;
    window.msSeen.open += 1;
    const last = window.msSeen.texts[window.msSeen.texts.length - 1];
    if (text.innerText !== last) window.msSeen.texts.push(text.innerText);
  }).observe(chat, {childList: true, subtree: true, characterData: true});
}
"""


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    db = tmp_path_factory.mktemp("history") / "history.sqlite3"
    server = Server(
        ["app.py", "--model", f"r1={r1_tiny()}", "--model", "smol=default", "--history-db", str(db)]
    )
    yield server
    server.stop()


@pytest.fixture
def page(browser, app):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(app.url)
    page.get_by_role("button", name="Send").wait_for(timeout=LOAD_TIMEOUT_MS)
    # the page's load has run, and after it the Think controls' check
    expect(page.locator("#history-info")).to_contain_text("history:", timeout=LOAD_TIMEOUT_MS)
    expect(page.locator("#thinking")).to_be_visible(timeout=LOAD_TIMEOUT_MS)  # r1 thinks
    yield page
    context.close()


def letters(text: str) -> str:
    """A text's letters and digits: what markdown leaves of it whatever follows."""
    return re.sub(r"[\W_]+", "", text)


def test_the_reasoning_streams_open_then_folds_and_opens_on_a_click(page):
    set_number(page, "Reasoning budget", BUDGET)
    set_number(page, "Max new tokens", BUDGET + 16)
    page.evaluate(WATCH_JS)
    page.get_by_label("Message", exact=True).fill("Hello there")
    page.get_by_role("button", name="Send").click()

    thought = page.locator("#chatbot .thought-group")
    title, text = thought.locator(".title"), thought.locator(".content")
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=REPLY_TIMEOUT_MS)
    seen = page.evaluate("window.msSeen")
    assert seen["pending"] and seen["open"], seen  # open, with a spinner, while it streamed
    assert len(seen["texts"]) >= 2, seen  # and its text grew piece by piece

    # the answer came: folded under its summary, the answer beside it
    expect(thought).to_have_count(1)
    expect(title).to_contain_text(re.compile(rf"Thought for {BUDGET} tokens, \d+\.\d s"))
    expect(thought.locator(".loading-spinner")).to_have_count(0)
    expect(text).to_have_count(0)
    bots = page.locator("[data-testid='bot']")
    expect(bots).to_have_count(2)  # the reasoning's row and the answer's
    assert bots.last.inner_text().strip(), "an answer arrived"

    title.click()  # opens: the reasoning streamed is what it shows
    expect(text).to_be_visible()
    shown = letters(text.inner_text())
    assert shown.startswith(letters(seen["texts"][0])[:20]), (shown, seen["texts"][0])

    page.reload()  # the saved conversation draws it the same way, folded
    expect(title).to_contain_text(f"Thought for {BUDGET} tokens", timeout=LOAD_TIMEOUT_MS)
    expect(text).to_have_count(0)
    title.click()
    expect(text).to_be_visible()
    assert letters(text.inner_text()) == shown


def test_the_think_controls_follow_the_model_dropdown(page):
    think = page.locator("#thinking")  # shown for r1, the default
    model = page.get_by_role("combobox", name="Model")  # the Chat tab's
    model.click()
    page.get_by_role("option", name="smol").click()
    expect(think).to_be_hidden()
    model.click()
    page.get_by_role("option", name="r1").click()
    expect(think).to_be_visible()
