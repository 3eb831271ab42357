"""The Step view's latencies, measured by hand (not a timed test): run it alone on an idle
machine.

    python benchmarks/step_latency.py                         # the embedded model, in Chromium
    python benchmarks/step_latency.py --model gemma-3-270m --no-browser   # server side only
    python benchmarks/step_latency.py --run-history   # with Gradio's run history on (its cost)

Server side (the engine, no browser): one Step (StepSession.step: a pass through the
scheduler, the draw, the bookkeeping) against one streamed decode step of a normal reply (the
gaps between its chunks), and re-running the stages for new settings (update + view: what a
slider's release costs the server; no forward pass). In Chromium (the app in this process, the
Step tab): a click on Step -> chart redrawn in the fresh tab, then slider released -> chart
redrawn, then a click on Step again after those drags, each timed from the pointer's release to
the chart drawn with the new value. Medians over --repeat."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from miniserve.core.config import load_presets  # noqa: E402
from miniserve.engine.engine import start_engine  # noqa: E402
from miniserve.engine.step import StepSession  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."


def ms(values) -> str:
    return (
        f"{statistics.median(values) * 1000:.1f} ms (min {min(values) * 1000:.1f}, n={len(values)})"
    )


def server_side(engine, repeat: int) -> dict:
    params = load_presets()["balanced"].replace(seed=1, max_new_tokens=4 * repeat + 8)
    messages = [{"role": "user", "content": PROMPT}]
    ids = (
        engine.chat_prompt(messages, params)
        if engine.has_chat_template
        else engine.prompt_ids(PROMPT, params)
    )  # a base model (Gemma 3 270M): completion mode
    s = StepSession(engine, ids, params)
    s.step()  # the prompt
    steps = []
    for _ in range(repeat):
        started = time.perf_counter()
        s.step()
        steps.append(time.perf_counter() - started)
    restage = []
    for t in [0.3 + 0.1 * (i % 12) for i in range(repeat)]:
        started = time.perf_counter()
        s.update(params.replace(temperature=round(t, 2)))
        s.view()
        restage.append(time.perf_counter() - started)
    s.release()
    gaps, last = [], None
    for chunk in engine.complete(ids, params.replace(max_new_tokens=repeat + 2)):
        now = time.perf_counter()
        if last is not None and chunk.token_ids and not chunk.done:
            gaps.append((now - last) / len(chunk.token_ids))
        last = now
    return {"step": steps, "decode": gaps, "restage": restage}


DRAWN = """([name, value]) => {
  const svg = document.querySelector('#step-chart svg.ms-step-chart');
  return !!svg && svg.dataset[name] === value;
}"""


def in_browser(engine, repeat: int, run_history: bool = False) -> dict:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    from miniserve.ui.step_tab import RAW

    from conftest import CHROMIUM
    from servers import app_in_thread

    out = {"fresh": [], "release": [], "click": []}
    with app_in_thread(engine, run_history=run_history) as url, sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page(viewport={"width": 1500, "height": 1200})
        page.goto(url)
        page.get_by_role("tab", name="Step").click()
        tab = page.locator("#step-tab")
        if not engine.has_chat_template:  # a base model (Gemma 3 270M): completion mode
            tab.get_by_label(RAW).check()
        tab.get_by_label("Prompt").fill(PROMPT)
        step = tab.get_by_role("button", name="Step", exact=True)
        status = tab.locator("#step-status")
        step.click()
        status.filter(has_text="1 token taken").wait_for(timeout=60_000)
        chart = tab.locator("#step-chart svg.ms-step-chart")

        def timed(release, name: str, value) -> float:
            """Seconds from `release()` (the pointer's release: a slider let go, a click) to
            the chart drawn with `value` as its data-`name`, the page polled at each animation
            frame. `value` is read before the release (reading the page takes Playwright a
            round trip of 50-300 ms, which must not count), and the click is the DOM's own
            (Playwright's locator.click first checks the button is visible, stable and not
            covered: ~250 ms that no person's click pays)."""
            want = value() if callable(value) else value
            started = time.perf_counter()
            release()
            try:
                page.wait_for_function(
                    f"({DRAWN})([{name!r}, {want!r}])", timeout=60_000, polling="raf"
                )
            except PlaywrightTimeout:
                raise SystemExit(
                    f"the chart's data-{name} stayed {chart.get_attribute('data-' + name)!r}, "
                    f"not {want!r}; the status line: {status.inner_text()!r}"
                ) from None
            return time.perf_counter() - started

        button = step.element_handle()

        def clicks(into: list) -> None:
            for _ in range(repeat):
                position = int(chart.get_attribute("data-position"))
                into.append(
                    timed(lambda: button.evaluate("b => b.click()"), "position", str(position + 1))
                )

        clicks(out["fresh"])
        slider = tab.locator("input[type=range]").first
        number = tab.get_by_role("spinbutton", name="number input for Temperature")
        box = slider.bounding_box()
        y = box["y"] + box["height"] / 2
        for i in range(repeat):
            x = box["x"] + box["width"] * (0.2 + 0.05 * (i % 12))

            page.mouse.move(x - 8, y)
            page.mouse.down()
            page.mouse.move(x, y, steps=2)
            out["release"].append(
                timed(page.mouse.up, "temperature", lambda: f"{float(number.input_value()):g}")
            )
        clicks(out["click"])
        browser.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--no-browser", action="store_true")
    ap.add_argument(
        "--run-history",
        action="store_true",
        help="serve the page with Gradio's run history on (the app never does; its cost)",
    )
    args = ap.parse_args()
    engine = start_engine(args.model, progress=lambda m: None)
    engine.warm_up()
    print(
        f"model {engine.name}, vocabulary {engine.runner.config.vocab_size}, "
        f"{engine.runner_name} runner"
    )
    r = server_side(engine, args.repeat)
    print(f"one Step, server side:         {ms(r['step'])}")
    print(
        f"one streamed decode step:      {ms(r['decode'])}  -> Step / decode = "
        f"{statistics.median(r['step']) / statistics.median(r['decode']):.2f}x"
    )
    print(f"stages re-run (update + view): {ms(r['restage'])}")
    if not args.no_browser:
        b = in_browser(engine, args.repeat, args.run_history)
        print(f"Step clicked -> chart redrawn, fresh tab (Chromium):  {ms(b['fresh'])}")
        print(f"slider released -> chart redrawn (Chromium):          {ms(b['release'])}")
        print(f"Step clicked -> chart redrawn, after drags (Chromium): {ms(b['click'])}")
    engine.close()


if __name__ == "__main__":
    main()
