"""Saved conversations in a real headless Chromium: a conversation outlives a reload, a
restart of the app and a crash in the middle of a reply; two browsers never see each other's
conversations; an edit makes a branch that ‹ › switches; Export → Import round-trips; Delete
removes."""

import json

import pytest
from playwright.sync_api import expect
from test_browser import set_number

from servers import Server

pytestmark = pytest.mark.browser
REPLY_TIMEOUT_MS = 90_000
RESTART_TIMEOUT_MS = 240_000  # the server's own start (Server waits up to 180 s) and a reload


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The app with its own history file, started once for these tests."""
    db = tmp_path_factory.mktemp("history") / "history.sqlite3"
    server = Server(["app.py", "--history-db", str(db)])
    yield server
    server.stop()


@pytest.fixture
def context(browser):
    """A browser profile of its own (its own local storage: its own owner id)."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    yield ctx
    ctx.close()


def open_app(context, url):
    page = context.new_page()
    page.goto(url)
    page.get_by_role("button", name="Send").wait_for()
    expect(page.locator("#history-info")).to_contain_text("history:")  # page load has run
    return page


def users(page):
    return page.locator("[data-testid='user']")


def say(page, text, new_tokens=8):
    """Send a message and wait for the whole reply."""
    set_number(page, "Max new tokens", new_tokens)
    before = users(page).count()
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_role("button", name="Send").click()
    expect(users(page)).to_have_count(before + 1, timeout=REPLY_TIMEOUT_MS)
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=REPLY_TIMEOUT_MS)


def conversations(page):
    return page.locator("#conversations")


def test_a_conversation_survives_a_reload_a_restart_and_a_crash(context, app):
    page = open_app(context, app.url)
    say(page, "Remember the word pelican.")
    reply = page.locator("[data-testid='bot']").last.inner_text()
    page.reload()
    expect(users(page)).to_have_text(["Remember the word pelican."])
    expect(conversations(page)).to_contain_text("Remember the word pelican.")
    app.restart()
    page.close()
    page = open_app(context, app.url)  # the same browser profile: the same owner id
    expect(users(page)).to_have_text(["Remember the word pelican."])
    expect(page.locator("[data-testid='bot']")).to_have_text([reply])
    expect(conversations(page)).to_contain_text("Remember the word pelican.")
    # killed (SIGKILL) in the middle of the next reply: what was saved before is all there
    set_number(page, "Max new tokens", 2000)
    page.get_by_label("Message", exact=True).fill("Write a very long story about a pelican.")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_contain_text("generating", timeout=REPLY_TIMEOUT_MS)
    expect(page.locator("[data-testid='bot']").nth(1)).not_to_have_text(
        "", timeout=REPLY_TIMEOUT_MS
    )
    # the open tab loses its stream, says "Connection Lost", polls, and reloads itself once
    # the app answers again (a page.goto of ours would race that reload)
    with page.expect_navigation(timeout=RESTART_TIMEOUT_MS):
        app.restart(kill=True)
    expect(users(page)).to_have_text(
        ["Remember the word pelican.", "Write a very long story about a pelican."]
    )
    expect(page.locator("[data-testid='bot']")).to_have_text([reply])


def test_two_browsers_do_not_see_each_others_conversations(browser, app):
    one = browser.new_context(viewport={"width": 1400, "height": 1000})
    two = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        first = open_app(one, app.url)
        say(first, "My secret plan about turnips.")
        second = open_app(two, app.url)
        say(second, "Ideas for a garden party.")
        expect(conversations(second)).to_contain_text("garden party")
        expect(conversations(second)).not_to_contain_text("turnips")
        second.get_by_label("Search").fill("turnips")
        expect(second.locator("#search-status")).to_contain_text("0 conversations match")
        first.reload()
        expect(conversations(first)).to_contain_text("turnips")
        expect(conversations(first)).not_to_contain_text("garden party")
    finally:
        one.close()
        two.close()


def test_an_edit_makes_a_branch_and_the_arrows_switch(context, app):
    page = open_app(context, app.url)
    say(page, "Name a fruit.")
    users(page).first.hover()
    page.get_by_role("button", name="Edit").first.click()
    page.locator("#chatbot textarea").fill("Name a vegetable.")
    page.get_by_role("button", name="Submit").click()
    expect(page.locator("#branches")).to_contain_text(
        "your message #1 (now 2 of 2)", timeout=REPLY_TIMEOUT_MS
    )
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=REPLY_TIMEOUT_MS)
    expect(users(page).first).to_contain_text("Name a vegetable.")
    expect(users(page).first).to_contain_text("‹ 2/2 ›")
    page.get_by_role("button", name="‹", exact=True).click()
    expect(users(page).first).to_contain_text("Name a fruit.")
    expect(users(page).first).to_contain_text("‹ 1/2 ›")
    page.get_by_role("button", name="›", exact=True).click()
    expect(users(page).first).to_contain_text("Name a vegetable.")


def export_json(page):
    page.get_by_role("button", name="Export", exact=True).click()
    link = page.locator("#export-file a").first
    expect(link).to_be_visible()
    with page.expect_download() as download:
        link.click()
    return json.loads(open(download.value.path(), encoding="utf-8").read())


def test_export_then_import_round_trips_exactly_and_delete_removes(context, app, tmp_path):
    page = open_app(context, app.url)
    say(page, "Tell me about owls.")
    page.get_by_text("This conversation").click()
    exported = export_json(page)
    assert exported["format"] == "miniserve.conversation" and exported["version"] == 1
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    saved = tmp_path / "owls.json"
    saved.write_text(json.dumps(exported))
    page.locator("input[type=file]").set_input_files(str(saved))
    expect(page.locator("#status")).to_contain_text("imported 1 conversation")
    expect(conversations(page).get_by_text("Tell me about owls.")).to_have_count(2)
    assert export_json(page) == exported  # the imported copy, exported again
    # a file that is not an export: one message, nothing imported
    bad = tmp_path / "bad.json"
    bad.write_text('[{"role": "assistant", "content": "out of order"}]')
    page.locator("input[type=file]").set_input_files(str(bad))
    expect(page.locator("#status")).to_contain_text("import failed, nothing was imported")
    expect(conversations(page).get_by_text("Tell me about owls.")).to_have_count(2)
    # Delete removes the open one; the list and a reload agree
    page.get_by_role("button", name="Delete", exact=True).click()
    expect(page.locator("#status")).to_contain_text("deleted")
    expect(conversations(page).get_by_text("Tell me about owls.")).to_have_count(1)
    page.reload()
    expect(conversations(page).get_by_text("Tell me about owls.")).to_have_count(1)
