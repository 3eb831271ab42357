"""The Notebook tab and the Model dropdown in a real headless Chromium, on an app serving two
models (started in this process: build_ui over the registry, mounted as app.py mounts it)."""

import os
import re
import threading
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from servers import free_port
from test_browser import set_number
from test_ui_models import B, STORY

pytestmark = pytest.mark.browser
SHOTS = Path(__file__).resolve().parent.parent / "docs"
REPLY_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def two_model_app(two_models):
    """The web app over the two models, on a free port, for these tests."""
    import gradio as gr
    import uvicorn
    from fastapi import FastAPI

    from miniserve.config import load_presets
    from miniserve.ui import CSS, build_ui
    for name in two_models.names:  # loaded up front: the tests time replies, not loads
        two_models.get(name)
    demo = build_ui(two_models, load_presets())
    app = gr.mount_gradio_app(FastAPI(), demo, path="/", css=CSS, footer_links=[],
                              run_history=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "the app did not start"
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(timeout=20)


@pytest.fixture
def page(browser, two_model_app):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(two_model_app)
    page.get_by_role("button", name="Send").wait_for()
    yield page
    page.close()


def test_notebook_continues_the_text_in_place_and_undo_restores_it(page):
    page.get_by_role("tab", name="Notebook").click()
    text = page.get_by_label("Text", exact=True)
    status = page.locator("#notebook-status")
    set_number(page, "Max new tokens", 400)
    text.fill(STORY)
    page.get_by_role("button", name="Generate", exact=True).click()
    # the continuation streams into the same box, after the text, while it is generating
    expect(text).to_have_value(re.compile(re.escape(STORY) + r".{30,}", re.S),
                               timeout=REPLY_TIMEOUT_MS)
    expect(status).to_contain_text("generating…")
    page.get_by_role("button", name="Stop").click()
    expect(status).to_contain_text("stopped by you", timeout=REPLY_TIMEOUT_MS)
    expect(status).to_contain_text("tokens/s")
    grown = text.input_value()
    assert grown.startswith(STORY) and len(grown) > len(STORY) + 30
    if os.environ.get("MINISERVE_SCREENSHOTS"):
        page.screenshot(path=str(SHOTS / "notebook.png"))
    page.get_by_role("button", name="Undo").click()
    expect(text).to_have_value(STORY)
    expect(status).to_contain_text("taken back")


def test_chat_switches_model_and_the_reply_comes_from_it(page):
    header = page.locator("#model-header")
    expect(header).to_contain_text("SmolLM2-135M-Instruct on cpu")
    page.get_by_role("combobox", name="Model").click()
    page.get_by_role("option", name=B).click()
    expect(header).to_contain_text(f"MiniServeLM · {B} on cpu")
    set_number(page, "Max new tokens", 16)
    page.get_by_label("Message", exact=True).fill("Name a colour.")
    started = time.perf_counter()
    page.get_by_role("button", name="Send").click()
    expect(page.locator("[data-testid='bot']").last).to_contain_text(re.compile(r"\w"),
                                                                     timeout=REPLY_TIMEOUT_MS)
    print(f"\nfirst text from {B} in the browser: "
          f"{(time.perf_counter() - started) * 1000:.0f} ms after the click")
    expect(page.locator("#status")).to_contain_text(f"model {B}", timeout=REPLY_TIMEOUT_MS)
    expect(page.locator("#status")).to_contain_text("tokens/s")
