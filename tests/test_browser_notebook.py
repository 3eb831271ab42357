"""The Notebook tab and the Model dropdown in a real headless Chromium, on an app serving two
models (started in this process: build_ui over the registry, mounted as app.py mounts it)."""

import os
import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect
from test_browser import set_number
from test_ui_models import STORY, B

from miniserve.ui.notebook_tab import TAKEN_BACK

from conftest import page_at
from servers import app_in_thread

pytestmark = pytest.mark.browser
SHOTS = Path(__file__).resolve().parent.parent / "docs"
REPLY_TIMEOUT_MS = 60_000
DEFAULT = "SmolLM2-135M-Instruct"  # the embedded model, the app's first


@pytest.fixture(scope="module")
def two_model_app(two_models):
    """The web app over the two models, on a free port, for these tests."""
    for name in two_models.names:  # loaded up front: the tests time replies, not loads
        two_models.get(name)
    with app_in_thread(two_models) as url:
        yield url


@pytest.fixture
def page(browser, two_model_app):
    with page_at(browser, two_model_app) as page:
        page.get_by_role("button", name="Send").wait_for()
        yield page


def notebook(page):
    """The Notebook tab: (its text box, its status line)."""
    page.get_by_role("tab", name="Notebook").click()
    return page.get_by_label("Text", exact=True), page.locator("#notebook-status")


def test_ctrl_enter_in_the_text_generates(page):
    text, status = notebook(page)
    expect(page.locator("html")).to_have_attribute("data-ms-keys", "on")
    expect(text).to_have_attribute("placeholder", re.compile(r"Ctrl\+Enter"))
    set_number(page, "Max new tokens", 6)
    text.fill("Once upon a time")
    text.press("Enter")  # a plain Enter is a new line, as in any editor
    expect(text).to_have_value("Once upon a time\n")
    text.press("Backspace")
    text.press("Control+Enter")
    expect(status).to_contain_text(re.compile(r"\d+ new tokens"), timeout=REPLY_TIMEOUT_MS)
    assert "Error" not in status.inner_text(), status.inner_text()
    written = text.input_value()
    assert written.startswith("Once upon a time") and len(written) > len("Once upon a time")


def test_notebook_continues_the_text_in_place_and_undo_restores_it(page):
    text, status = notebook(page)
    text.fill(STORY)
    # a whole generation, with the inspector (the picture in docs/)
    set_number(page, "Max new tokens", 48)
    page.get_by_role("checkbox", name="Token inspector").check()
    page.get_by_role("button", name="Generate", exact=True).click()
    # 48 tokens, or fewer where the sampled text reached the model's end token
    expect(status).to_contain_text(
        re.compile(
            r"(48 new tokens .*finish: length|"
            r"\d+ new tokens .*finish: eos)"
        ),
        timeout=REPLY_TIMEOUT_MS,
    )
    expect(status).to_contain_text(f"model {DEFAULT}")
    made = int(re.search(r"(\d+) new tokens", status.inner_text()).group(1))
    assert 0 < made <= 48
    # the inspector shows every step: the new tokens, and the end token where one ended it
    # (its probability is why the text stopped; it is not one of the new tokens)
    ended = "finish: eos" in status.inner_text()
    steps = page.locator("#notebook-inspector .ms-tok")
    expect(steps).to_have_count(made + ended)
    if ended:
        expect(steps.last).to_contain_text(re.compile(r"^<\|[a-z_]+\|>"))
    if os.environ.get("MINISERVE_SCREENSHOTS"):
        page.screenshot(path=str(SHOTS / "notebook.png"), full_page=True)
    page.get_by_role("checkbox", name="Token inspector").uncheck()
    page.get_by_role("button", name="Undo").click()
    expect(text).to_have_value(STORY)
    # a long one, stopped
    set_number(page, "Max new tokens", 400)
    page.get_by_role("button", name="Generate", exact=True).click()
    # the continuation streams into the same box, after the text, while it is generating
    expect(text).to_have_value(
        re.compile(re.escape(STORY) + r".{30,}", re.S), timeout=REPLY_TIMEOUT_MS
    )
    expect(status).to_contain_text("generating…")
    assert page.locator(".generating:not(#notebook-text *)").count() == 0  # progress: the text's
    page.get_by_role("button", name="Stop").click()
    expect(status).to_contain_text("stopped by you", timeout=REPLY_TIMEOUT_MS)
    expect(status).to_contain_text("tokens/s")
    grown = text.input_value()
    assert grown.startswith(STORY) and len(grown) > len(STORY) + 30
    page.get_by_role("button", name="Undo").click()
    expect(text).to_have_value(STORY)
    expect(status).to_contain_text("taken back")


def test_notebook_undo_while_it_streams_stops_the_generation_and_keeps_its_text(page, two_models):
    """The stopped generation writes Undo's result as its own last output: the page applies
    one event's outputs in order but two events' in any order, so an output of the generation
    still on its way could otherwise land after Undo's and show "generating…" for good."""
    text, status = notebook(page)
    text.fill(STORY)
    # long enough that the generation still runs when the page has shown its beginning
    set_number(page, "Max new tokens", 1500)
    page.get_by_role("button", name="Generate", exact=True).click()
    expect(text).to_have_value(
        re.compile(re.escape(STORY) + r".{30,}", re.S), timeout=REPLY_TIMEOUT_MS
    )
    page.get_by_role("button", name="Undo").click()
    expect(status).to_contain_text(TAKEN_BACK, timeout=REPLY_TIMEOUT_MS)
    assert [two_models.get(n).queue_depth for n in two_models.names] == [0, 0]
    expect(text).to_have_value(STORY)


def test_chat_switches_model_and_a_saved_conversation_brings_its_model_back(page):
    header, model = page.locator("#model-header"), page.get_by_role("combobox", name="Model")
    one_header = f"MiniServeLM · 2 models served · default {DEFAULT}"
    expect(header).to_contain_text(one_header)
    model.click()
    page.get_by_role("option", name=B).click()
    set_number(page, "Max new tokens", 16)
    page.get_by_label("Message", exact=True).fill("Name a colour.")
    started = time.perf_counter()
    page.get_by_role("button", name="Send").click()
    expect(page.locator("[data-testid='bot']").last).to_contain_text(
        re.compile(r"\w"), timeout=REPLY_TIMEOUT_MS
    )
    print(
        f"\nfirst text from {B} in the browser: "
        f"{(time.perf_counter() - started) * 1000:.0f} ms after the click"
    )
    expect(page.locator("#status")).to_contain_text(f"model {B}", timeout=REPLY_TIMEOUT_MS)
    expect(page.locator("#status")).to_contain_text("tokens/s")
    # the header names no tab's choice: the same in every tab
    expect(header).to_contain_text(one_header)
    # a new chat on the default model; opening the saved one moves the dropdown back to B
    page.get_by_role("button", name="New chat").click()
    model.click()
    page.get_by_role("option", name=DEFAULT).click()
    expect(model).to_have_value(DEFAULT)
    page.locator("#conversations").get_by_text("Name a colour.").click()
    expect(page.locator("[data-testid='bot']")).to_have_count(1)
    expect(model).to_have_value(B)
