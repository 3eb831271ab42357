"""The real app in a real headless Chromium: chat streaming, presets, Stop, benchmarks,
inspector, compare."""

import os
import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from miniserve.ui.chat_tab import DRAFT_KEPT, STILL_STREAMING

pytestmark = pytest.mark.browser
SHOTS = Path(__file__).resolve().parent.parent / "docs"
# The "still streaming" toast while a 1,500-token reply streams (several seconds): the passes
# hold both cores, and under a full suite's load the page's event once took longer than
# expect's default 5 s to come back
WARNED_WITHIN = 15_000


@pytest.fixture
def page(browser, app_server):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(app_server.url)
    page.get_by_role("button", name="Send").wait_for()
    yield page
    page.close()


def number(page, label):
    return page.get_by_role("spinbutton", name=f"number input for {label}")


def set_number(page, label, value):
    box = number(page, label) if label != "Seed" else page.get_by_label("Seed")
    box.fill(str(value))
    box.press("Enter")


def bot_text(page):
    bots = page.locator("[data-testid='bot']")
    return bots.last.inner_text() if bots.count() else ""


def status(page):
    return page.locator("#status").inner_text()


def test_send_streams_a_reply(page):
    set_number(page, "Max new tokens", 60)
    page.get_by_label("Message", exact=True).fill("Write a few sentences about the ocean.")
    page.get_by_role("button", name="Send").click()
    page.locator("[data-testid='user']").filter(has_text="about the ocean").wait_for(timeout=10000)
    seen = set()
    deadline = time.time() + 120
    while time.time() < deadline and "tokens/s" not in status(page):
        text = bot_text(page).strip()
        if text:
            seen.add(text)
        time.sleep(0.05)
    final = bot_text(page).strip()
    assert "tokens/s" in status(page) and "prompt tokens" in status(page)
    assert final, "a reply appeared"
    partial = [t for t in seen if t != final]
    assert partial, "text appeared piece by piece before the reply was complete"
    assert all(final.startswith(t.rstrip("…").strip()[:10]) for t in partial)
    if os.environ.get("MINISERVE_SCREENSHOTS"):
        SHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOTS / "chat.png"))


def test_enter_sends_and_shift_enter_adds_a_line(page):
    """As in chat apps: Shift+Enter adds a line, Enter sends the message with its lines; an
    Enter an input method is composing with sends nothing; the placeholder says so."""
    from playwright.sync_api import expect

    expect(page.locator("html")).to_have_attribute("data-ms-keys", "on")
    set_number(page, "Max new tokens", 8)
    box = page.get_by_label("Message", exact=True)
    expect(box).to_have_attribute("placeholder", re.compile(r"Enter sends, Shift\+Enter adds"))
    box.press_sequentially("Name a fruit")
    # the Enter that commits an input method's text: its keydown and keypress say isComposing
    box.evaluate("""el => { for (const type of ["keydown", "keypress"])
        el.dispatchEvent(new KeyboardEvent(type, {key: "Enter", code: "Enter", bubbles: true,
                                                  cancelable: true, isComposing: true})); }""")
    box.press("Shift+Enter")
    box.press_sequentially("and a colour.")
    expect(box).to_have_value("Name a fruit\nand a colour.")
    box.press("Enter")
    expect(box).to_have_value("")
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=60000)
    users = page.locator("[data-testid='user']")
    expect(users).to_have_count(1)  # one message: the composing Enter sent nothing
    lines = [line.strip() for line in users.first.inner_text().splitlines() if line.strip()]
    assert lines == ["Name a fruit", "and a colour."], lines
    expect(page.locator("[data-testid='bot']")).to_have_count(1)
    assert bot_text(page).strip(), "a reply arrived"


def test_a_message_with_html_tags_shows_as_written(page):
    """Text that looks like HTML is shown, not laid out or dropped: "<div>" in prose, a bold
    tag, a model's "<<Title>>" (an <a> tag to the browser); code keeps its text too."""
    from playwright.sync_api import expect

    set_number(page, "Max new tokens", 4)
    typed = "What does <div> do, and <b>this</b>? <<A Title>> `<p>` & a < b"
    page.get_by_label("Message", exact=True).fill(typed)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=60000)
    shown = page.locator("[data-testid='user']").first.inner_text().strip()
    assert shown == typed.replace("`", "")  # (the code span's text, in code type)


# texts written in a message, for the page's functions against render.py's
AS_TYPED = [
    "a <div> b",
    "<b>x</b> <<A Title>> <!-- c --> <T> a < b &lt;b> &amp;lt;i> &amp;amp;lt;p>",
    "`<div>` ``<div>` &lt;p> `a\n\n<div>\n\nb`",
    "```html\n<div>x</div>\n```\n<p>",
    "```\r\n<b>\r\n```\r\n<i> ~~~\n<p>",
    "streaming ```\n```js\n<div>",
    "x" + "`" * 3000 + " <div>",
    "<div",
    "a\r```\n<div> b\u2028```\n<p>",  # a fence starts after "\n" only
    # where Python's \s and the page's differ: a tag name ends at HTML's whitespace alone
    "say <b\ufeff hi &lt;b\x85 c <p\x1c> <i\x0b>",
]


def test_copy_puts_a_message_on_the_clipboard_as_written(page):
    """The Chatbot's Copy button copies the text the Chatbot was given, where a tag's "<" is
    "&lt;": the page undoes that as typed_text does (the same text for each case, code and
    fences included), and a message copied with its button is the message as typed."""
    from miniserve.ui.render import shown_text, typed_text

    cases = AS_TYPED + [shown_text(text) for text in AS_TYPED]
    page.wait_for_function("() => !!window.msTypedText")
    assert page.evaluate("(xs) => xs.map(window.msTypedText)", cases) == [
        typed_text(c) for c in cases
    ]
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    set_number(page, "Max new tokens", 4)
    typed = "Is <div> a block, and `<p>`? &lt;b> <b>bold</b>\n```html\n&lt;p>hi&lt;/p>\n```"
    page.get_by_label("Message", exact=True).fill(typed)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=60000)
    user = page.locator("[data-testid='user']").last
    user.hover()
    page.locator("#chatbot").get_by_role("button", name="Copy message").first.click()
    assert page.evaluate("navigator.clipboard.readText()") == typed
    # a code block's own Copy button: its text as the block shows it, left alone
    user.locator(".copy_code_button").click()
    assert page.evaluate("navigator.clipboard.readText()") == "&lt;p>hi&lt;/p>"


def export_json(page):
    """The open conversation as the sidebar's Export writes it (its whole tree, as saved)."""
    import json

    page.get_by_text("This conversation").click()
    page.get_by_role("button", name="Export", exact=True).click()
    link = page.locator("#export-file a").first
    expect(link).to_be_visible()
    with page.expect_download() as download:
        link.click()
    return json.loads(Path(download.value.path()).read_text(encoding="utf-8"))


TO_EDIT = "What does <div> do? &lt;b> is typed, `a<b` is code, &amp;lt;i> is too"


def edit_a_message(page):
    """Send TO_EDIT and open its Edit box: the box."""
    set_number(page, "Max new tokens", 4)
    page.get_by_label("Message", exact=True).fill(TO_EDIT)
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=60000)
    page.locator("[data-testid='user']").first.hover()
    page.locator("#chatbot").get_by_role("button", name="Edit").click()
    return page.locator("#chatbot textarea.edit-textarea")


def submit_edit(page, box, text):
    """Put `text` in the open Edit box and submit it: the user messages saved."""
    box.fill(text)
    page.locator("#chatbot").get_by_role("button", name="Submit").click()
    expect(page.locator("#branches")).to_contain_text("your message #1 (now 2 of 2)")
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=60000)
    return [m["content"] for m in export_json(page)["messages"] if m["role"] == "user"]


def test_edit_shows_a_message_as_typed_and_saves_the_box_as_it_is(page):
    """A message's Edit box holds the message as typed ("<div>", and a typed "&lt;b>" as
    "&lt;b>", not the "&lt;div>" and "&amp;lt;b>" the Chatbot is given); what the box holds
    on Submit is what is saved, and it shows as written. The page converts both ways as
    shown_text and typed_text do (the same text for each case), and back again exactly."""
    from miniserve.ui.render import shown_text

    page.wait_for_function("() => !!window.msShownText")
    assert page.evaluate("(xs) => xs.map(window.msShownText)", AS_TYPED) == [
        shown_text(text) for text in AS_TYPED
    ]
    assert page.evaluate("(xs) => xs.map((x) => msTypedText(msShownText(x)))", AS_TYPED) == (
        AS_TYPED
    )
    box = edit_a_message(page)
    expect(box).to_have_value(TO_EDIT)
    edited = TO_EDIT.replace("What does", "What do")
    assert submit_edit(page, box, edited) == [TO_EDIT, edited]
    user = page.locator("[data-testid='user']").first
    lines = [line for line in user.inner_text().splitlines() if line.strip()]
    assert lines == [edited.replace("`", ""), "‹ 2/2 ›"]  # (the code span in code type)


def test_edit_without_the_page_script_still_saves_what_was_meant(browser, app_server):
    """A box the page's script did not convert (opened before it ran; here it never runs)
    shows the text as the Chatbot was given it, and that is what the server undoes."""
    from miniserve.ui.render import shown_text

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.add_init_script("window.msTypedText = (text) => text")  # the script then stops
        page.goto(app_server.url)
        box = edit_a_message(page)
        expect(box).to_have_value(shown_text(TO_EDIT))
        edited = shown_text(TO_EDIT).replace("What does", "What do")
        saved = submit_edit(page, box, edited)
        assert saved == [TO_EDIT, TO_EDIT.replace("What does", "What do")]
    finally:
        page.close()


def number_value(value) -> re.Pattern:
    """A number box's value as the page writes it: 1, 1.0 or 1.00 alike."""
    whole = int(value) if float(value).is_integer() else None
    text = str(whole) if whole is not None else re.escape(str(value))
    return re.compile(rf"^{text}(\.0*)?$" if whole is not None else rf"^{text}0*$")


def test_factual_preset_moves_the_sliders(page):
    page.get_by_label("Preset").click()
    page.get_by_role("option", name="factual").click()
    for label, value in [
        ("Temperature", 0),
        ("Top-k", 0),
        ("Top-p", 1),
        ("Min-p", 0),
        ("Repetition penalty", 1),
        ("Max new tokens", 256),
    ]:
        expect(number(page, label)).to_have_value(number_value(value), timeout=10_000)
    page.get_by_label("Preset").click()
    page.get_by_role("option", name="creative").click()
    expect(number(page, "Temperature")).to_have_value(number_value(1), timeout=10_000)
    expect(number(page, "Top-k")).to_have_value(number_value(80))


def test_stop_keeps_what_was_written(page):
    set_number(page, "Max new tokens", 1500)
    set_number(page, "Temperature", 0)
    page.get_by_label("Message", exact=True).fill(
        "Write a very long story about a dragon and a knight."
    )
    page.get_by_role("button", name="Send").click()
    expect(page.locator("[data-testid='bot']").last).to_have_text(
        re.compile(r"(\S+\s+){5}"), timeout=60_000
    )
    expect(page.get_by_text(STILL_STREAMING)).to_have_count(0)  # the first Send: no warning
    # the next message, typed while the reply streams, stays in the box; Enter, and a second
    # click on Send (which Gradio drops without a word), say that a reply is still streaming
    # and send nothing
    message = page.get_by_label("Message", exact=True)
    message.press_sequentially("Hi", delay=100)
    message.press("Enter")
    expect(page.get_by_text(STILL_STREAMING)).to_be_visible(timeout=WARNED_WITHIN)
    expect(message).to_have_value("Hi")
    page.locator(".toast-close").first.click()  # the toast closed, to see the next one
    expect(page.get_by_text(STILL_STREAMING)).to_have_count(0)
    page.get_by_role("button", name="Send").click()
    expect(page.get_by_text(STILL_STREAMING)).to_be_visible(timeout=WARNED_WITHIN)
    expect(message).to_have_value("Hi")
    page.get_by_role("button", name="Stop").click()
    expect(page.locator("#status")).to_contain_text("cancelled", timeout=30_000)
    kept = bot_text(page)
    assert len(kept.split()) >= 5
    new_tokens = int(re.search(r"(\d+) new tokens", status(page)).group(1))
    assert new_tokens < 1500
    time.sleep(1)  # (not a wait: nothing may change in this second)
    assert bot_text(page) == kept, "nothing more was written after Stop"
    # the app keeps serving: the message kept in the box gets a reply
    expect(message).to_have_value("Hi")
    set_number(page, "Max new tokens", 8)
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(
        "document.querySelectorAll(\"[data-testid='bot']\").length >= 2 && "
        "document.querySelector('#status').innerText.includes('tokens/s')",
        timeout=60000,
    )
    # Undo takes that turn back: "Hi" returns to the box, above what was typed there since
    message.fill("and then?")
    page.get_by_role("button", name="Undo", exact=True).click()
    expect(page.locator("#status")).to_contain_text(DRAFT_KEPT)
    expect(message).to_have_value("Hi\n\nand then?")
    expect(page.locator("[data-testid='bot']")).to_have_count(1)


def test_empty_message_is_a_readable_error_and_keeps_the_chat(page):
    set_number(page, "Max new tokens", 6)
    page.get_by_label("Message", exact=True).fill("Hello")
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(
        "document.querySelector('#status').innerText.includes('tokens/s')", timeout=60000
    )
    page.get_by_label("Message", exact=True).fill("   ")
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(
        "document.querySelector('#status').innerText.includes('empty')", timeout=10000
    )
    assert page.locator("[data-testid='user']").count() == 1
    assert page.locator("[data-testid='bot']").count() == 1
    huge = "a long message " * 3000  # ~9,000 tokens: more than the context window
    page.get_by_label("Message", exact=True).fill(huge)
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(
        "document.querySelector('#status').innerText.includes('too long')", timeout=30000
    )
    assert page.locator("[data-testid='user']").count() == 1  # the conversation is kept
    assert page.get_by_label("Message", exact=True).input_value() == huge  # and the text too


def test_inspector_shows_alternatives_on_hover(page):
    set_number(page, "Max new tokens", 12)
    set_number(page, "Seed", 1)
    page.get_by_label("Token inspector").check()
    page.get_by_label("Message", exact=True).fill("Name a colour.")
    page.get_by_role("button", name="Send").click()
    from playwright.sync_api import expect

    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=120000)
    tokens = page.locator(".ms-inspector .ms-tok")
    expect(tokens.first).to_be_visible()
    token = tokens.nth(min(1, tokens.count() - 1))  # the second: a sampled one
    popup = token.locator(".ms-pop")
    expect(popup).to_be_hidden()
    token.evaluate("e => e.scrollIntoView({block: 'start'})")  # room below it for the popup
    token.hover()
    # a chart: five alternatives (and the chosen token), each a bar before -> after the stages
    expect(popup).to_be_visible()
    expect(popup).to_contain_text("before the stages")
    rows = popup.locator(".ms-row")
    assert 5 <= rows.count() <= 6 and rows.filter(has_text="→").count() == rows.count()
    expect(popup.locator(".ms-row.ms-chosen")).to_have_count(1)
    track = rows.first.locator(".ms-bars").bounding_box()
    assert track["width"] > 50 and track["height"] > 5
    # the bars' lengths are the probabilities: the first row's are drawn from its numbers
    size = rows.first.locator(".ms-bars").evaluate("e => getComputedStyle(e).backgroundSize")
    before = float(rows.first.get_attribute("data-before"))
    after = float(rows.first.get_attribute("data-after"))
    # (the browser writes its own form of a length: "3%" for the page's "3.0%")
    drawn = re.findall(r"([0-9.]+)% 5px", size)
    assert len(drawn) >= 2, size
    assert abs(float(drawn[0]) - 100 * before) <= 0.051, size
    assert abs(float(drawn[1]) - 100 * after) <= 0.051, size
    box = popup.bounding_box()
    assert box["width"] > 200 and box["height"] > 60
    # drawn on top of the page, not cut off by the box around the inspector
    last = rows.last.bounding_box()
    on_top = page.evaluate(
        "([x, y]) => !!document.elementFromPoint(x, y).closest('.ms-pop')",
        [last["x"] + last["width"] / 2, last["y"] + last["height"] / 2],
    )
    assert on_top, "the popup's last row is visible"
    if os.environ.get("MINISERVE_SCREENSHOTS"):
        area = page.locator("#inspector").bounding_box()
        page.screenshot(
            path=str(SHOTS / "inspector.png"),
            clip={
                "x": area["x"],
                "y": area["y"],
                "width": max(area["width"], box["width"] + 20),
                "height": box["y"] + box["height"] - area["y"] + 10,
            },
        )
    page.mouse.move(0, 0)
    expect(popup).to_be_hidden()


def test_benchmark_tab_shows_rows_for_each_mode(page):
    page.get_by_role("tab", name="Benchmark").click()
    page.get_by_label("Prompt lengths (tokens)").fill("16,64")
    set_number(page, "New tokens", 6)
    page.get_by_role("button", name="Run benchmark").click()
    from playwright.sync_api import expect

    expect(page.locator("body")).to_contain_text(
        "follow the float64 reference over the file's blocks: yes", timeout=180000
    )
    expect(page.locator("body")).to_contain_text("hf_generate", timeout=30000)
    body = page.locator("body").inner_text()
    assert "native runner" in body  # the engine's default on this CPU, named with the table
    for mode in ("no_cache", "cache", "hf_generate"):  # one row per (prompt length, mode)
        lengths = re.findall(rf"(\d+)\s+{mode}\s+(?:b?float|bfloat|q\w+ as stored)", body)
        assert sorted(map(int, lengths)) == [16, 64], (mode, body[-1500:])
    if os.environ.get("MINISERVE_SCREENSHOTS"):
        page.screenshot(path=str(SHOTS / "benchmark.png"), full_page=True)


def test_benchmark_tables_show_their_headers_before_a_run(page):
    """Before any run, each table shows its headers (words with units, not field names)."""
    from playwright.sync_api import expect

    from miniserve.ui.bench_tab import BENCH_COLUMNS, CONCURRENCY_COLUMNS

    page.get_by_role("tab", name="Benchmark").click()
    for table, columns in (
        ("#bench-table", BENCH_COLUMNS),
        ("#concurrency-table", CONCURRENCY_COLUMNS),
    ):
        headers = page.locator(f"{table} thead th")
        expect(headers.first).to_be_visible(timeout=10000)
        expect(page.locator(table)).to_contain_text(list(columns.values())[0])
        for header in columns.values():
            expect(page.locator(table)).to_contain_text(header)
        for field in columns:
            if "_" in field:
                expect(page.locator(table)).not_to_contain_text(field)


def test_concurrency_benchmark_shows_a_row_per_preset_and_level(page):
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Benchmark").click()
    page.get_by_label("Concurrency levels").fill("1,2")
    set_number(page, "Stream prompt tokens", 16)
    set_number(page, "Stream new tokens", 6)
    page.get_by_role("button", name="Run concurrency benchmark").click()
    expect(page.locator("body")).to_contain_text(
        "16-token prompts, 6 new tokens a stream", timeout=180000
    )
    table = page.locator("#concurrency-table")
    expect(table).to_contain_text("Aggregate tokens/s", timeout=30000)
    rows = re.findall(r"\b(greedy|balanced)\s+(\d+)\s+\d", table.inner_text())
    assert sorted(rows) == [
        ("balanced", "1"),
        ("balanced", "2"),
        ("greedy", "1"),
        ("greedy", "2"),
    ], table.inner_text()[-1500:]
    page.get_by_label("Concurrency levels").fill("1,x")
    page.get_by_role("button", name="Run concurrency benchmark").click()
    expect(page.locator("body")).to_contain_text(
        "Concurrency: write whole numbers separated by commas", timeout=30000
    )


def test_compare_tab_shows_one_column_per_preset(page):
    page.get_by_role("tab", name="Compare").click()
    page.get_by_label("balanced").uncheck()  # factual + creative stay checked
    set_number(page, "Tokens per column", 12)
    page.get_by_role("button", name="Compare", exact=True).click()
    from playwright.sync_api import expect

    expect(page.locator("body")).to_contain_text(
        "same prompt, seed 42, 2 presets as one batch", timeout=120000
    )
    columns = page.locator(".block.ms-column:visible")
    assert columns.count() == 2
    texts = columns.all_inner_texts()
    assert texts[0].startswith("factual") and texts[1].startswith("creative")
    assert not any("Error" in t for t in texts)
    assert all("tokens/s" in t for t in texts)


def test_two_tabs_chat_at_once_without_mixing(browser, app_server):
    """Two browsers' replies stream at the same time, in the engine's shared forward passes:
    the second tab's first text appears while the first tab is still writing its reply (had
    the second waited its turn, the first would be complete by then). Stop in each tab ends
    its own reply; neither tab shows the other's conversation."""
    from playwright.sync_api import expect

    pages = []
    for question in ("Write a long story about a planet.", "Write a long story about a river."):
        p = browser.new_page(viewport={"width": 1200, "height": 900})
        p.goto(app_server.url)
        p.get_by_role("button", name="Send").wait_for()
        set_number(p, "Max new tokens", 400)
        set_number(p, "Temperature", 0)
        p.get_by_label("Message", exact=True).fill(question)
        pages.append((p, question))
    for p, _ in pages:  # both requests are in flight together
        p.get_by_role("button", name="Send").click()
    (first, _), (second, _) = pages
    expect(second.locator("[data-testid='bot']").last).to_contain_text(
        re.compile(r"\w"), timeout=120000
    )
    expect(first.locator("#status")).to_contain_text("generating…", timeout=1000)
    # Gradio's progress marks the Chatbot only: no other output pulses all through a reply
    # (the page's repainting would take a share of the cores the model runs on)
    assert first.locator(".generating:not(#chatbot *)").count() == 0
    expect(first.locator("[data-testid='bot']").last).to_contain_text(
        re.compile(r"\w"), timeout=10000
    )
    for p, question in pages:
        p.get_by_role("button", name="Stop").click()
        expect(p.locator("#status")).to_contain_text("tokens/s", timeout=60000)
        users = p.locator("[data-testid='user']").all_inner_texts()
        assert [u.strip() for u in users] == [question]
        assert bot_text(p).strip()
        p.close()


def test_json_schema_output_format_gives_a_reply_that_follows_it(page):
    """Choose JSON schema, paste a schema, send: the reply parses as JSON and validates."""
    import json

    import jsonschema
    from playwright.sync_api import expect

    schema = {
        "type": "object",
        "properties": {
            "colour": {"type": "string", "maxLength": 12},
            "bright": {"type": "boolean"},
        },
        "required": ["colour", "bright"],
        "additionalProperties": False,
    }
    set_number(page, "Max new tokens", 40)
    set_number(page, "Temperature", 0)
    schema_box = page.get_by_role("textbox", name=re.compile(r"^Schema"))
    expect(schema_box).to_be_hidden()  # free text needs no box
    page.get_by_role("combobox", name="Output format", exact=True).first.click()
    page.get_by_role("option", name="JSON schema", exact=True).click()
    expect(schema_box).to_be_visible()
    schema_box.fill(json.dumps(schema, indent=2))
    page.get_by_label("Message", exact=True).fill("Name a colour and say if it is bright.")
    page.get_by_role("button", name="Send").click()
    expect(page.locator("#status")).to_contain_text("tokens/s", timeout=120000)
    assert "Error" not in status(page) and "incomplete" not in status(page), status(page)
    jsonschema.validate(json.loads(bot_text(page)), schema)
