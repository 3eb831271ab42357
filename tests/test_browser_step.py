"""The Step tab in a real headless Chromium, on the embedded model (the app started in this
process, mounted as app.py mounts it): step five tokens, release the temperature slider and see
the bars change, pick the third candidate, go back two tokens, run to the end."""

import os
import re
from pathlib import Path

import pytest
from playwright.sync_api import expect

from conftest import page_at
from servers import app_in_thread

pytestmark = pytest.mark.browser
SHOTS = Path(__file__).resolve().parent.parent / "docs"
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def step_app(engine):
    with app_in_thread(engine) as url:
        yield url


@pytest.fixture
def tab(browser, step_app):
    with page_at(browser, step_app, width=1500, height=1200) as page:
        page.get_by_role("tab", name="Step").click()
        tab = page.locator("#step-tab")
        tab.get_by_role("button", name="Step", exact=True).wait_for()
        yield tab


def set_number(tab, label, value):
    box = (
        tab.get_by_label("Seed")
        if label == "Seed"
        else tab.get_by_role("spinbutton", name=f"number input for {label}")
    )
    box.fill(str(value))
    box.press("Enter")


def test_step_pick_back_and_run_to_the_end(tab):
    page = tab.page
    status, chips = tab.locator("#step-status"), tab.locator("#step-text .ms-chip")
    set_number(tab, "Seed", 3)
    set_number(tab, "Max new tokens", 40)
    # Ctrl+Enter steps, then the button
    tab.get_by_label("Prompt").press("Control+Enter")
    expect(status).to_contain_text("1 token taken", timeout=TIMEOUT_MS)
    for n in range(2, 6):
        tab.get_by_role("button", name="Step", exact=True).click()
        expect(status).to_contain_text(f"{n} tokens taken", timeout=TIMEOUT_MS)
    expect(chips).to_have_count(5)
    chart = tab.locator("#step-chart svg.ms-step-chart")
    expect(chart).to_have_attribute("data-position", "5")
    expect(tab.locator("#step-costs")).to_contain_text("shared the pass with")
    # release the temperature slider: the bars after the temperature change, no new token
    top_bar = tab.locator("#step-chart rect[data-stage='temperature']").first
    before = top_bar.get_attribute("data-p")
    slider = tab.locator("input[type=range]").first  # Temperature, the first slider
    box = slider.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.35, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, y, steps=4)
    page.mouse.move(box["x"] + box["width"] * 0.85, y, steps=4)
    page.mouse.up()
    expect(top_bar).not_to_have_attribute("data-p", before, timeout=TIMEOUT_MS)
    expect(chips).to_have_count(5)
    expect(chart).to_have_attribute("data-position", "5")
    # a smaller top-k (typed: the box's change re-runs the stages too) cuts the tail: ✕ marks;
    # typed twice at once, the second value is the one drawn (typing fires no release)
    set_number(tab, "Top-k", 30)
    set_number(tab, "Top-k", 12)
    expect(tab.locator("#step-chart [data-removed='top-k']").first).to_be_visible(
        timeout=TIMEOUT_MS
    )
    # pick the third candidate: it is taken, marked as a hand pick
    third = tab.locator("#step-chart .ms-pick").nth(2)
    third.click()
    expect(status).to_contain_text("6 tokens taken", timeout=TIMEOUT_MS)
    expect(tab.locator("#step-text .ms-picked")).to_have_count(1)
    expect(tab.locator("#step-text .ms-picked")).to_have_attribute("data-back", "5")
    if os.environ.get("MINISERVE_SCREENSHOTS"):
        SHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOTS / "step.png"), full_page=True)
    # back two tokens: once with Back, once with a click on the last token
    tab.get_by_role("button", name="Back").click()
    expect(chips).to_have_count(5, timeout=TIMEOUT_MS)
    expect(tab.locator("#step-text .ms-picked")).to_have_count(0)
    chips.nth(4).click()
    expect(chips).to_have_count(4, timeout=TIMEOUT_MS)
    expect(status).to_contain_text("back to just before token 5")
    expect(chart).to_have_attribute("data-position", "4")
    # run to the end: the end token or Max new tokens, said on the status line
    tab.get_by_role("button", name="Run to the end").click()
    expect(status).to_contain_text(
        re.compile(
            r"the text is finished|Max new tokens \(40\) "
            r"reached"
        ),
        timeout=TIMEOUT_MS,
    )
    made = chips.count()
    assert 4 < made <= 40
    # Step at the end says so
    tab.get_by_role("button", name="Step", exact=True).click()
    expect(status).to_contain_text(
        re.compile(r"Error.*(the text is finished|Max new tokens)"), timeout=TIMEOUT_MS
    )


STORED = "() => Object.entries(localStorage).map(([k, v]) => [k, v.length])"


def test_slider_drags_leave_nothing_behind(tab):
    """Ten slider releases, each redrawn with its value, then a Step: nothing of them is kept
    in the browser. (With Gradio's run history on, each event's inputs and outputs, the chart
    included, were read and rewritten whole in local storage at its start and end: ~2 MB after
    ten drags, and a Step click took ~350 ms instead of ~130.)"""
    page = tab.page
    status = tab.locator("#step-status")
    step = tab.get_by_role("button", name="Step", exact=True)
    step.click()
    expect(status).to_contain_text("1 token taken", timeout=TIMEOUT_MS)
    stored = page.evaluate(STORED)
    chart = tab.locator("#step-chart svg.ms-step-chart")
    slider = tab.locator("input[type=range]").first  # Temperature
    number = tab.get_by_role("spinbutton", name="number input for Temperature")
    box = slider.bounding_box()
    y = box["y"] + box["height"] / 2
    for i in range(10):
        x = box["x"] + box["width"] * (0.2 + 0.05 * i)
        page.mouse.move(x - 8, y)
        page.mouse.down()
        page.mouse.move(x, y, steps=2)
        page.mouse.up()
        value = f"{float(number.input_value()):g}"
        expect(chart).to_have_attribute("data-temperature", value, timeout=TIMEOUT_MS)
    step.click()
    expect(status).to_contain_text("2 tokens taken", timeout=TIMEOUT_MS)
    expect(chart).to_have_attribute("data-position", "2")
    assert page.evaluate(STORED) == stored
    assert not [k for k, _ in stored if k.startswith("gradio:run-history")]
