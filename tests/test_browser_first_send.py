"""A first visit in a real headless Chromium: a message sent before the page's load handler has
given the browser its history id gets its reply, and the page shows no error.

The race is made certain: the load event's request (the events the app's config names for the
page's load) is held back in the browser (Playwright routes Gradio's queue requests) until the
message's has been answered, so the send always reaches the server first, on a browser without
an id; the load then runs last."""

import json
import urllib.request

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser
REPLY_TIMEOUT_MS = 120_000
MARK = "First message before the page loaded"


def no_error_shown(page):
    """Neither a component's red "Error" badge nor an error toast, nor an error status."""
    expect(page.locator("span.error, .toast-body.error")).to_have_count(0)
    expect(page.locator("#status")).not_to_contain_text("Error")


def load_events(url: str) -> set[int]:
    """The app's events that the page's load starts, and those chained after them (.then),
    by the fn_index a queue request names: read from the app's own config."""
    with urllib.request.urlopen(url + "/config", timeout=30) as r:
        deps = json.load(r)["dependencies"]
    ids = {d["id"] for d in deps if any(t[1] == "load" for t in d["targets"])}
    while more := {d["id"] for d in deps if d.get("trigger_after") in ids} - ids:
        ids |= more
    return ids


def test_a_message_sent_before_the_load_handler_ran_gets_its_reply(browser, app_server):
    loads = load_events(app_server.url)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})  # a first visit
    try:
        page = context.new_page()
        held, released = [], []

        def queue_join(route):
            """Until the reply is in, hold the page's load events, whenever the browser sends
            them; let the message and every other event through."""
            try:
                event = json.loads(route.request.post_data or "{}").get("fn_index")
            except ValueError:  # not an event: let it through
                event = None
            if not released and event in loads:
                held.append(route)
                return
            route.continue_()

        page.route("**/gradio_api/queue/join*", queue_join)
        page.goto(app_server.url)
        box = page.get_by_label("Message", exact=True)
        box.fill(MARK)
        box.press("Enter")

        users, bots = page.locator("[data-testid='user']"), page.locator("[data-testid='bot']")
        listed = page.locator("#conversations").get_by_text(MARK)
        # the message on screen, or an error: whichever comes first
        errors = page.locator("span.error, .toast-body.error")
        expect(users.filter(has_text=MARK).or_(errors).first).to_be_visible(
            timeout=REPLY_TIMEOUT_MS
        )
        no_error_shown(page)
        expect(page.locator("#status")).to_contain_text("tokens/s", timeout=REPLY_TIMEOUT_MS)
        expect(bots).to_have_count(1)
        assert bots.first.inner_text().strip(), "a reply arrived"
        assert held, "the page's load event was held back: the message went first"
        no_error_shown(page)

        released.append(True)
        for route in held:  # now the load handler runs, last
            route.continue_()
        expect(page.locator("#history-info")).to_contain_text("history")
        expect(users).to_have_count(1)  # the load kept the conversation on screen
        expect(bots).to_have_count(1)
        expect(listed).to_have_count(1)
        no_error_shown(page)

        # the id the message was saved under is the browser's: a reload lists and reopens it
        page.unroute("**/gradio_api/queue/join*")
        page.reload()
        expect(listed).to_have_count(1)
        expect(users.filter(has_text=MARK)).to_have_count(1)
        expect(bots).to_have_count(1)
        no_error_shown(page)
    finally:
        context.close()
