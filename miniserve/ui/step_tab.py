"""The Step tab: decode one token at a time and see the distribution through every sampling
stage (miniserve/engine/step.py holds the session on the engine). Step, Run N, Run to the end
(stoppable), Back, Reset; a click on a candidate bar takes it instead of the draw, a click on an
earlier token goes back to just before it; sliders, preset, logit bias and output format re-run
only the stages on the kept logits.

The text, the chart (a small inline SVG) and the costs are drawn by miniserve/ui/render.py;
this module holds the handlers and the tab's layout.

`StepHandlers` holds what the buttons call (plain methods, Run's a generator), callable without
a browser; each browser tab's session is kept by its Gradio session id and released on Reset,
when the tab closes (`demo.unload`), or after step.IDLE_S without use."""

from __future__ import annotations

import inspect
import threading
import time
from typing import TYPE_CHECKING

import gradio as gr

from miniserve.core.config import parse_logit_bias
from miniserve.engine.step import IDLE_S, TOP, StepError, StepSession, remote_note
from miniserve.models.registry import Models
from miniserve.ui.common import (
    USER_ERRORS,
    Sessions,
    engine_event,
    error,
    session_of,
    user_message,
)
from miniserve.ui.model_picker import build_model_picker, follow_picker
from miniserve.ui.render import chart_html, costs_html, text_html
from miniserve.ui.widgets import (
    build_output_format,
    build_sampling,
    params_from,
    preset_values,
    setting_names,
)

if TYPE_CHECKING:
    from miniserve.ui import TabContext

CHAT, RAW = "Chat (template)", "Completion (no template)"
STEP = "step"  # the kind of run (common.Sessions) Stop ends
RUN_PAINT_S = 0.25  # Run repaints at most this often
REAP_EVERY_S = 30.0


# -- logit bias as typed ----------------------------------------------------------------------
def logit_bias_from_text(text) -> tuple:
    """ "13:-100, 42:2.5" as checked (id, bias) pairs; ConfigError saying how to write it."""
    return parse_logit_bias(text, "Logit bias")


def _quiet(_) -> None:
    """An action that adds nothing to the status line."""
    return None


# -- the handlers -------------------------------------------------------------------------------
class _Held:
    """One browser tab's session, what it was started from, and a release not yet said."""

    def __init__(self, session: StepSession, key: tuple, shown: str):
        self.session, self.key, self.shown = session, key, shown
        self.said = False  # the idle release was shown on the status line


class StepHandlers:
    """The Step tab's handlers. The settings arrive as: mode, prompt, the sliders in FIELDS
    order, seed, logit bias text, output format, its text, candidates shown, model. Each
    returns (text HTML, chart HTML, costs HTML, status)."""

    def __init__(self, models, presets, sessions: Sessions | None = None, idle_s: float = IDLE_S):
        self.models = Models.of(models)
        self.presets = presets
        self.sessions = sessions or Sessions()
        self.idle_s = idle_s
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None

    def apply_preset(self, name) -> list:
        return preset_values(self.presets, name)

    # -- sessions ------------------------------------------------------------------------------
    def _get(self, request) -> _Held | None:
        with self._lock:
            return self._held.get(session_of(request))

    def _drop(self, request, why: str = "released (Reset)") -> None:
        with self._lock:
            held = self._held.pop(session_of(request), None)
        if held is not None:
            held.session.release(why)

    def reap(self) -> None:
        """Release the sessions idle past their timeout (a tab that went away without closing,
        or left open); the tab's status line says so at its next poll."""
        with self._lock:
            idle = [h.session for h in self._held.values() if h.session.idle()]
        for session in idle:
            session.release(
                f"this step session was released after {self.idle_s / 60:g} "
                "minutes without use (its KV cache went back to the budget): "
                "Step starts again, Reset clears it"
            )

    def _reap(self) -> None:
        while True:
            time.sleep(min(REAP_EVERY_S, max(self.idle_s, 1.0)))
            self.reap()

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="step-reaper", daemon=True)
            self._reaper.start()

    def _params(self, settings):
        mode, prompt, *rest = settings
        n = len(setting_names())
        sliders, (seed, bias, fmt, fmt_text, top, model) = rest[:n], rest[n:]
        params = params_from(sliders, seed, fmt, fmt_text).replace(
            logit_bias=logit_bias_from_text(bias)
        )
        return mode, prompt, params, int(top or TOP), model

    def _session(self, settings, request, start: bool) -> tuple[_Held | None, object]:
        """The tab's session under these settings (updated: the stages re-run, no pass), or a
        new one when the model, the mode or the prompt changed and `start` is set."""
        mode, prompt, params, top, model = self._params(settings)
        name = self.models.resolve(model)
        key = (name, mode, prompt)
        held = self._get(request)
        if held is not None and (held.key == key or not start):
            if held.session.released and start:
                self._drop(request, held.session.released)
                held = None
            else:
                held.session.update(params)
                return held, top
        if not start:
            return None, top
        engine = self.models.get(name)
        if not engine.capabilities.local_tokens:
            raise StepError(remote_note(name))
        if not (prompt or "").strip():
            raise StepError("write a prompt first: Step continues it one token at a time")
        if mode == RAW:
            ids = engine.prompt_ids(prompt, params)
        else:
            ids = engine.chat_prompt([{"role": "user", "content": prompt}], params)
        self._drop(request, "released (a new prompt)")
        session = StepSession(engine, ids, params, idle_s=self.idle_s)
        shown = prompt if mode == RAW else ""
        held = _Held(session, key, shown)
        with self._lock:
            self._held[session_of(request)] = held
        self._start_reaper()
        return held, top

    def _show(self, held: _Held | None, top: int, status: str):
        s = held.session if held is not None else None
        return text_html(s, held.shown if held else ""), chart_html(s, top), costs_html(s), status

    def _status(self, held: _Held, note: str = "") -> str:
        s = held.session
        parts = [
            f"{len(s.tokens)} token{'s' * (len(s.tokens) != 1)} taken",
            f"seed {s.params.seed}",
            f"prompt {s.prompt_len} tokens" + (" (chat template)" if not held.shown else ""),
        ]
        if s.finish:
            parts.append(s.finished_note())
        if note:
            parts.append(note)
        return " · ".join(parts)

    def _fail(self, e: Exception, held=None, top: int = TOP):
        message = (
            str(e)
            if isinstance(e, StepError)
            else user_message(e)
            if isinstance(e, USER_ERRORS)
            else f"{type(e).__name__}: {e}"
        )
        if held is None:
            return gr.update(), gr.update(), gr.update(), error(message)
        *views, _ = self._show(held, top, "")
        return (*views, error(message))

    def _act(self, settings, request, action, start: bool = False):
        held, top = None, TOP
        try:
            held, top = self._session(settings, request, start)
            if held is None:
                raise StepError("press Step first: there is no text to act on yet")
            note = action(held.session, top) or ""
            return self._show(held, top, self._status(held, note))
        except (StepError, *USER_ERRORS) as e:
            return self._fail(e, held, top)
        except Exception as e:  # noqa: BLE001 -- one line, never a traceback on the page
            return self._fail(e, held, top)

    # -- what the buttons call -------------------------------------------------------------------
    def step(self, *settings, request: gr.Request | None = None):
        """One token: the draw (the first Step reads the prompt first)."""
        return self._act(settings, request, lambda s, top: _quiet(s.step()), start=True)

    def back(self, *settings, request: gr.Request | None = None):
        return self._act(settings, request, lambda s, top: s.back() or "one token back")

    def restage(self, *settings, request: gr.Request | None = None):
        """New settings: the stages re-run on the kept logits, no forward pass."""
        held = self._get(request)
        if held is None or not held.session.positions or held.session.released:
            return gr.update(), gr.update(), gr.update(), gr.update()
        return self._act(settings, request, lambda s, top: None)

    def act(self, action, *settings, request: gr.Request | None = None):
        """A click in the page: "pick:ID" (a candidate row), "back:I" (a token chip)."""
        kind, _, value = str(action or "").partition(":")
        value = value.split("@")[0]  # "@<time>": the same click twice is still a change
        if kind == "pick" and value.isdigit():
            return self._act(settings, request, lambda s, top: _quiet(s.step(int(value))))
        if kind == "back" and value.isdigit():
            return self._act(
                settings,
                request,
                lambda s, top: (
                    s.back_to(int(value)) or f"back to just before token {int(value) + 1}"
                ),
            )
        return gr.update(), gr.update(), gr.update(), gr.update()

    def take_text(self, text, *settings, request: gr.Request | None = None):
        """Take the token a typed text is (one token, or an error listing its pieces)."""
        return self._act(
            settings, request, lambda s, top: _quiet(s.step(s.token_for_text(text or "")))
        )

    def run(self, count, *settings, request: gr.Request | None = None):
        """Run N steps, repainting as it goes; Stop ends it."""
        if (
            not isinstance(count, (int, float))
            or not float(count).is_integer()
            or not 1 <= count <= 4096
        ):
            yield self._fail(
                StepError(f"Run N takes a whole number of tokens from 1 to 4096, got {count!r}")
            )
            return
        yield from self._run(int(count), settings, request)

    def run_to_end(self, *settings, request: gr.Request | None = None):
        """Step until the end token, the output format complete or Max new tokens."""
        yield from self._run(None, settings, request)

    def _run(self, count, settings, request):
        with self.sessions.running(request, STEP) as cancel:
            held, top = None, TOP
            try:
                held, top = self._session(settings, request, True)
                s = held.session
                if s.finish:
                    raise StepError(s.finished_note())
                painted = time.perf_counter()
                for done in s.run(count, cancel):
                    if time.perf_counter() - painted >= RUN_PAINT_S:
                        painted = time.perf_counter()
                        yield self._show(held, top, self._status(held, f"running… {done}"))
                note = "stopped by you" if cancel.is_set() else ""
                yield self._show(held, top, self._status(held, note))
            except Exception as e:  # noqa: BLE001 -- StepError, a user error or other: one line
                yield self._fail(e, held, top)

    def stop(self, request: gr.Request | None = None) -> None:
        self.sessions.stop(request)

    def reset(self, request: gr.Request | None = None):
        self.sessions.stop(request)
        self._drop(request)
        return (
            text_html(None),
            chart_html(None),
            "",
            "reset: the session was released; Step starts again from the prompt",
        )

    def closed(self, request: gr.Request | None = None) -> None:
        """The browser tab closed: its session goes (its run stops with the page's others:
        Sessions.closed)."""
        self._drop(request, "released (the tab closed)")

    def poll(self, request: gr.Request | None = None):
        """Now and then: say so when the idle timeout released this tab's session."""
        held = self._get(request)
        if held is None or not held.session.released or held.said:
            return gr.update()
        held.said = True
        return error(held.session.released)


# -- the page -----------------------------------------------------------------------------------
# A click on a candidate row or a token chip is written to a hidden box (with the time, so the
# same click twice is a change) and a hidden button sends it; Ctrl+Enter in the tab steps.
ON_LOAD = """
() => {
  if (window.msStepWired) return;
  window.msStepWired = true;
  const send = (value) => {
    const box = document.querySelector('#step-action textarea, #step-action input');
    if (!box) return;
    box.value = value + '@' + Date.now();
    box.dispatchEvent(new Event('input', {bubbles: true}));
    setTimeout(() => document.querySelector('#step-act').click(), 0);
  };
  document.addEventListener('click', (e) => {
    const pick = e.target.closest('#step-chart [data-pick]');
    if (pick) { send('pick:' + pick.getAttribute('data-pick')); return; }
    const chip = e.target.closest('#step-text [data-back]');
    if (chip) send('back:' + chip.getAttribute('data-back'));
  });
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey) && e.target.closest('#step-tab')) {
      e.preventDefault();
      document.querySelector('#step-step').click();
    }
  });
}
"""
CSS = """
#step-action, #step-act {display: none !important}
#step-text .ms-step-text {font-family: var(--font-mono); white-space: pre-wrap; line-height: 1.9}
#step-text .ms-step-prompt {color: #666}
#step-text .ms-chip {background: rgba(74,123,208,0.12); border-radius: 3px; cursor: pointer;
                     padding: 1px 0; margin-right: 1px}
#step-text .ms-chip:hover {outline: 1px solid #333}
#step-text .ms-picked {outline: 2px dashed #2a7ab8}
#step-chart .ms-pick:hover {fill: rgba(0,0,0,0.06)}
.ms-step-summary, .ms-step-cost {font-size: 0.9em; opacity: 0.85; margin: 2px 0}
"""


def with_request(fn):
    """`fn(*values, request=...)` as Gradio can call it with the browser's request: Gradio
    hands the request only to a parameter before *values (one after is left at its default:
    every tab's Step session was then the one "default" session, and Stop could not find the
    run it should end). The name stays, as the event's API name is made from it."""
    if inspect.isgeneratorfunction(fn):

        def wired(request: gr.Request, *values):
            yield from fn(*values, request=request)

    else:

        def wired(request: gr.Request, *values):
            return fn(*values, request=request)

    wired.__name__ = wired.__qualname__ = fn.__name__
    return wired


def build_step_tab(app: TabContext, label: str) -> None:
    """The Step tab and its events, under `label`; call inside the app's `gr.Blocks` (its
    `demo`: to release a tab's session when it closes, and to wire the page's clicks at load)."""
    handlers = StepHandlers(app.models, app.presets, app.sessions)
    with gr.Tab(label, elem_id="step-tab"):
        with gr.Row():
            with gr.Column(scale=4):
                with gr.Row():
                    mode = gr.Radio([CHAT, RAW], value=CHAT, label="Mode", scale=1)
                    prompt = gr.Textbox(
                        label="Prompt",
                        lines=2,
                        scale=3,
                        value="Write one sentence about a cat.",
                        info="chat: your message, with the chat template; "
                        "completion: the text to continue",
                    )
                with gr.Row():
                    step_btn = gr.Button("Step", variant="primary", elem_id="step-step")
                    count = gr.Number(value=10, precision=0, label="N", min_width=90, scale=0)
                    run_btn = gr.Button("Run N")
                    end_btn = gr.Button("Run to the end")
                    stop_btn = gr.Button("Stop", variant="stop")
                    back_btn = gr.Button("Back")
                    reset_btn = gr.Button("Reset")
                status = gr.Markdown(
                    "Step reads the prompt and takes one token (Ctrl+Enter); "
                    "click a bar's row to take that token instead, click a "
                    "token to go back before it",
                    elem_id="step-status",
                    elem_classes=["ms-status"],
                )
                text = gr.HTML(text_html(None), elem_id="step-text", js_on_load=None)
                chart = gr.HTML(chart_html(None), elem_id="step-chart", js_on_load=None)
                with gr.Row():
                    typed = gr.Textbox(
                        label="Take a token by its text",
                        scale=3,
                        placeholder=" the  (one token, leading space included)",
                    )
                    take_btn = gr.Button("Take", scale=1)
                costs = gr.HTML(elem_id="step-costs", js_on_load=None)
                action = gr.Textbox(elem_id="step-action", show_label=False, container=False)
                act_btn = gr.Button("act", elem_id="step-act")
            with gr.Column(scale=1):
                model = build_model_picker(handlers.models)
                sampling = build_sampling(
                    handlers.presets,
                    app.default_preset,
                    handlers.apply_preset,
                    "-1 = random (the seed drawn is shown); kept per "
                    "position, so Back then Step draws the same token",
                )
                bias = gr.Textbox(
                    label="Logit bias",
                    placeholder="13:-100, 42:2.5",
                    info="token ID:BIAS, comma-separated; -100 bans a token",
                )
                output = build_output_format()
                top = gr.Slider(5, 50, value=TOP, step=1, label="Candidates shown")
    settings = [mode, prompt, *sampling.sliders, sampling.seed, bias, *output.inputs, top, model]
    outs = [text, chart, costs, status]
    engine = engine_event(outs, text)
    # one token is one pass (tens of milliseconds): sent straight rather than through Gradio's
    # queue, whose round trip cost more than the pass (the engine's own queue still admits it)
    one = dict(outputs=outs, queue=False, show_progress="hidden")
    step, back, act, take_text, restage, run, run_to_end = (
        with_request(fn)
        for fn in (
            handlers.step,
            handlers.back,
            handlers.act,
            handlers.take_text,
            handlers.restage,
            handlers.run,
            handlers.run_to_end,
        )
    )
    runs = [
        step_btn.click(step, settings, **one),
        run_btn.click(run, [count, *settings], **engine),
        end_btn.click(run_to_end, settings, **engine),
        back_btn.click(back, settings, **one),
        act_btn.click(act, [action, *settings], **one),
        take_btn.click(take_text, [typed, *settings], **one),
        typed.submit(take_text, [typed, *settings], **one),
    ]
    stop_btn.click(handlers.stop, None, None, queue=False)
    reset_btn.click(handlers.reset, None, **one)
    follow_picker(handlers.models, model, runs, app.demo)
    # the stages alone take milliseconds and no forward pass: sent straight, not queued behind
    # the engine's events (Gradio's queue adds a round trip of its own)
    quiet = dict(outputs=outs, show_progress="hidden", queue=False)
    for slider in [*sampling.shaping, top]:  # max new tokens changes no distribution
        if isinstance(slider, gr.Slider):
            # dragged or typed: each input re-runs the stages; the page holds the newest
            # while one runs (always_last), so a drag redraws at the pace of the round trip
            # and the last value is always drawn (typing fires no release)
            slider.input(restage, settings, trigger_mode="always_last", **quiet)
            slider.release(restage, settings, **quiet)
        elif isinstance(slider, gr.Textbox):  # typed: once done, not at each key
            slider.submit(restage, settings, **quiet)
            slider.blur(restage, settings, **quiet)
        else:
            slider.input(restage, settings, **quiet)
    # a preset moves the sliders (build_sampling), then the stages re-run on the new values
    sampling.preset.change(handlers.apply_preset, sampling.preset, sampling.sliders).then(
        restage, settings, **quiet
    )
    output.format.change(restage, settings, **quiet)
    sampling.named("max_new_tokens").release(restage, settings, **quiet)
    for box in (sampling.seed, output.text, bias):  # typed: once done, not at each key
        box.submit(restage, settings, **quiet)
        box.blur(restage, settings, **quiet)
    timer = gr.Timer(15)
    timer.tick(handlers.poll, None, status, show_progress="hidden", queue=False)
    app.demo.load(None, None, None, js=ON_LOAD)
    app.demo.unload(handlers.closed)
