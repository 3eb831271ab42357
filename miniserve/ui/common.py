"""What the tabs share: chat history as plain messages, the status and error lines, the number
boxes' values, the preset and sampling controls, the Output format control, the Model dropdown
and loading a model with its progress on the status line, the token inspector's HTML, and the
cancel events of each browser session (Stop ends what it runs)."""

from __future__ import annotations

import html
import json
import queue
import threading
import time
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import gradio as gr

from miniserve.core.errors import Unavailable, UserError
from miniserve.engine.chat import ChatError
from miniserve.core.config import FIELDS, ConfigError, Constraint, SamplingParams, check_seed
from miniserve.engine.engine import EngineBusy, RequestTooLarge
from miniserve.engine.grammar import GrammarError
from miniserve.models.registry import Models, UnknownModel

# Repaint a streaming reply at most this often: ~12 updates a second reads as smooth, and each
# repaint costs browser CPU that a 2-core machine would otherwise give to the model.
PAINT_INTERVAL_S = 0.08
ERROR_PREFIX = "**Error:**"


class Reading:
    """A reply's stream as a tab paints it: iterating gives the text so far, at most every
    PAINT_INTERVAL_S while it streams (not for the last chunk); afterwards `text` is all of
    it and `last` the last chunk (done=True when the reply completed)."""

    def __init__(self, stream):
        self.stream, self.text, self.last = stream, "", None

    def __iter__(self) -> Iterator[str]:
        last_paint = time.perf_counter()
        for self.last in self.stream:
            self.text += self.last.text
            if self.last.done:
                return
            if self.last.text and time.perf_counter() - last_paint >= PAINT_INTERVAL_S:
                last_paint = time.perf_counter()
                yield self.text
# The events that run the engine (Send, Regenerate, Compare) share one Gradio concurrency group:
# as many run at once as the engine admits (the app's queue sets the limit to its max_queue),
# so the replies of many browsers advance in the same forward passes; past it they wait their
# turn in Gradio's queue.
ENGINE_EVENTS = "engine"
# The benchmarks run one at a time: two at once would measure each other.
BENCHMARK_EVENTS = "benchmark"


class ModelUnavailable(Unavailable, RuntimeError):
    """A model that could not be loaded (a bad file, an unreachable server): the message names
    it and says why; the app's other models keep working."""

    def __init__(self, name: str, cause: BaseException):
        self.name = name
        reason = str(cause) or type(cause).__name__
        super().__init__(f"model '{name}' could not be loaded: {reason}")


# What a user can fix or wait out (a setting, the conversation, a full queue, a request larger
# than the KV budget, a schema or pattern the grammar library refuses, a model not served or
# not loadable): the message is shown (user_message); anything else with its type's name.
USER_ERRORS = (UserError,)


def error(message: str) -> str:
    """A status line that reads as an error in the Markdown it is shown in."""
    return f"{ERROR_PREFIX} {html.escape(message)}"


def is_error(status: str) -> bool:
    return status.startswith(ERROR_PREFIX)


def user_message(e: Exception) -> str:
    """One of USER_ERRORS as the status says it: a schema, pattern or grammar the library
    refuses is named as the output format, with the library's reason."""
    return e.describe() if isinstance(e, UserError) else str(e)


def message_text(content) -> str:
    """Chatbot message content as plain text (Gradio may hand back content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", content.get("value", "")))
    if isinstance(content, list):
        return "".join(message_text(part) for part in content)
    return "" if content is None else str(content)


def whole(value):
    """A number box's value: an int when it is a whole number, else as given (so that the
    settings' checks name a fraction instead of it being cut off silently)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def seed_from(value) -> int | None:
    """The Seed box: empty or negative means a random seed; else a whole number."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass  # check_seed names it
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        return None
    return check_seed(value)


def params_from(settings, seed, output_format=None, format_text="") -> SamplingParams:
    """The sliders (in FIELDS order), the Seed box and the Output format control as checked
    sampling settings."""
    fields = {name: whole(value) for name, value in zip(FIELDS, settings)}
    return SamplingParams(seed=seed_from(seed), constraint=constraint_from(output_format,
                                                                           format_text),
                          **fields)


# -- Output format ----------------------------------------------------------------------------
# The dropdown's choices: the constraint kind each holds the reply to (config.Constraint), and
# for those that need text, the text box's label and a placeholder example.
FREE_TEXT = "Free text"


class Format(NamedTuple):
    kind: str | None
    box: str = ""          # the text box's label ("": no box)
    example: str = ""


FORMATS = {
    FREE_TEXT: Format(None),
    "JSON": Format("json_object"),
    "JSON schema": Format("json_schema", "Schema (a JSON Schema the reply must follow)",
                          '{"type": "object", "properties": {"name": {"type": "string"}, '
                          '"age": {"type": "integer"}}, "required": ["name", "age"]}'),
    "Regex": Format("regex", "Pattern (the whole reply must match it)",
                    r"(yes|no)\. [A-Z][a-z ]{10,60}\."),
    "Choice": Format("choice", "Choices (one per line, or separated by commas)",
                     "red\ngreen\nblue"),
    "Grammar": Format("grammar", "Grammar (GBNF with ::=, or Lark)",
                      'root ::= "The answer is " ("yes" | "no") "."'),
}
JSON_KINDS = ("json_object", "json_schema")


def format_label(constraint: Constraint | None) -> str:
    """The dropdown's name for a constraint's kind ("Free text" for None)."""
    kind = constraint.kind if constraint is not None else None
    return next(label for label, f in FORMATS.items() if f.kind == kind)


def constraint_from(output_format, text) -> Constraint | None:
    """The Output format control's values as a Constraint (None: free text). Raises
    ConfigError for an unknown format and for text the format cannot start from: an empty or
    non-JSON schema, an empty pattern or grammar, no choices. Whether the grammar library can
    enforce it is checked when the reply starts (GrammarError)."""
    fmt = FORMATS.get(output_format or FREE_TEXT)
    if fmt is None:
        raise ConfigError(f"unknown output format {output_format!r} (choose one of "
                          f"{', '.join(FORMATS)})", "constraint")
    text = str(text if text is not None else "")
    if fmt.kind in (None, "json_object"):
        return Constraint(fmt.kind) if fmt.kind else None
    if fmt.kind == "choice":
        lines = text.splitlines() if "\n" in text.strip() else text.split(",")
        choices = [c.strip() for c in lines if c.strip()]
        if not choices:
            raise ConfigError("no choices given: write them one per line or separated by "
                              "commas", "constraint")
        return Constraint("choice", json.dumps(choices))
    if not text.strip():
        what = {"json_schema": "the JSON schema is empty: paste a JSON Schema",
                "regex": "the regex pattern is empty: write the pattern the reply must match",
                "grammar": "the grammar is empty: write one in GBNF (root ::= ...) or Lark"}
        raise ConfigError(f"{what[fmt.kind]}, like {fmt.example}", "constraint")
    if fmt.kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"the JSON schema is not JSON: {e.msg} (line {e.lineno}, column "
                              f"{e.colno})", "constraint") from None
        return Constraint("json_schema", json.dumps(schema))
    # a pattern as typed, less the line breaks a text box adds around it
    return Constraint(fmt.kind, text.strip("\r\n") if fmt.kind == "regex" else text)


def format_note(constraint: Constraint | None, finish_reason: str) -> str:
    """What a finished reply's end means for its output format ("" when nothing to say)."""
    if constraint is None:
        return ""
    if finish_reason == "length":
        return ("incomplete JSON (cut by max new tokens)" if constraint.kind in JSON_KINDS
                else "incomplete: cut by max new tokens before the format was complete")
    if finish_reason == "no_token_allowed":
        return ("ended early: the output format allowed no next token, so the reply may be "
                "incomplete")
    return ""


def format_box(output_format) -> dict:
    """The text box under the dropdown: shown with its label and example when the format
    needs text."""
    fmt = FORMATS.get(output_format, FORMATS[FREE_TEXT])
    return gr.update(visible=bool(fmt.box), label=fmt.box or "Format",
                     placeholder=fmt.example)


class OutputFormat(NamedTuple):
    """The control's components; `inputs` in the order constraint_from takes them."""
    format: gr.Dropdown
    text: gr.Textbox

    @property
    def inputs(self) -> list:
        return [self.format, self.text]


def build_output_format() -> OutputFormat:
    """The Output format dropdown and its text box (call inside a layout block)."""
    fmt = gr.Dropdown(list(FORMATS), value=FREE_TEXT, label="Output format",
                      info="hold the reply to a format: at each step the sampler masks every "
                           "token that would break it")
    text = gr.Textbox(visible=False, lines=3, max_lines=12, label="Format")
    fmt.change(format_box, fmt, text, queue=False)
    return OutputFormat(fmt, text)


# -- Presets and sampling controls -----------------------------------------------------------
assert list(FIELDS) == ["temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                        "max_new_tokens"], "the handlers take the sliders in this order"
SLIDER_MAX = {"top_k": 200}  # the slider's range; larger values are still valid via CLI/API
SLIDER_STEP = {"temperature": 0.05, "top_k": 1, "top_p": 0.01, "min_p": 0.01,
               "repetition_penalty": 0.01, "max_new_tokens": 1}


def preset_values(presets: dict[str, SamplingParams], name) -> list:
    """The sliders' values (FIELDS order) of a preset."""
    preset = presets[name]
    return [getattr(preset, k) for k in FIELDS]


class SamplingControls(NamedTuple):
    """The Preset dropdown, the sliders (FIELDS order) and the Seed box."""
    preset: gr.Dropdown
    sliders: list
    seed: gr.Number

    @property
    def inputs(self) -> list:
        """In the order the handlers take them: preset, the sliders, seed."""
        return [self.preset, *self.sliders, self.seed]


def build_sampling(presets: dict[str, SamplingParams], default_preset: str, apply,
                   seed_info: str) -> SamplingControls:
    """The Preset dropdown, a slider per sampling setting and the Seed box (call inside a
    layout block); choosing a preset moves the sliders (`apply(name)` -> their values)."""
    start = presets[default_preset]
    preset = gr.Dropdown(choices=list(presets), value=default_preset, label="Preset")
    sliders = [gr.Slider(minimum=spec.low, maximum=SLIDER_MAX.get(k, spec.high),
                         value=getattr(start, k), step=SLIDER_STEP[k], label=spec.label,
                         info=spec.help)
               for k, spec in FIELDS.items()]
    seed = gr.Number(label="Seed", value=-1, precision=0, info=seed_info)
    preset.change(apply, preset, sliders)
    return SamplingControls(preset, sliders, seed)


# -- Models -----------------------------------------------------------------------------------

def picker_info(models: Models, name) -> str:
    """The line under a Model dropdown: what the chosen model is and where it runs."""
    try:
        return model_details(models, name).strip("()")
    except UnknownModel as e:
        return str(e)


def build_model_picker(models: Models) -> gr.Dropdown:
    """The Model dropdown (call inside a layout block); `follow_picker` wires it once the
    tab's runs exist. Shown only when the app serves more than one model: with one, the
    header names it and a dropdown of one choice does nothing."""
    return gr.Dropdown(models.names, value=models.default, label="Model",
                       visible=len(models.names) > 1, elem_classes=["ms-model"],
                       info=picker_info(models, models.default))


def follow_picker(models: Models, picker: gr.Dropdown, runs=()) -> None:
    """The dropdown's line describes its choice: redrawn when the choice changes (by the user
    or by a handler) and after each of the tab's `runs` (a model loaded by one is then
    described in full)."""
    def describe(name):
        return gr.update(info=picker_info(models, name))

    picker.change(describe, picker, picker, queue=False, show_progress="hidden")
    for run in runs:
        run.then(describe, picker, picker, queue=False, show_progress="hidden")


def start_load(models: Models, name: str, messages: queue.Queue) -> None:
    """Load `name` on a thread of its own, putting (name, item) on `messages`: each progress
    line, then None when it is loaded or the exception when the load failed."""
    def load():
        try:
            models.get(name, progress=lambda m: messages.put((name, str(m))))
            messages.put((name, None))
        except Exception as e:  # noqa: BLE001 -- said on the status line, not raised here
            messages.put((name, e))

    threading.Thread(target=load, name=f"load-{name}", daemon=True).start()


def load_messages(models: Models, name: str,
                  cancel: threading.Event | None = None) -> Iterator[str]:
    """Load a model that is not loaded (on a thread), yielding its progress for the tab's
    status line; nothing when it is loaded. Raises UnknownModel, or ModelUnavailable when the
    load fails. A set `cancel` (Stop, Undo) ends the waiting, not the load, which goes on."""
    name = models.resolve(name)
    if models.is_loaded(name):
        return
    messages: queue.Queue = queue.Queue()
    start_load(models, name, messages)
    yield f"loading model {name}…"
    while not (cancel is not None and cancel.is_set()):
        try:
            _, item = messages.get(timeout=0.1)
        except queue.Empty:
            continue
        if item is None:
            return
        if isinstance(item, BaseException):
            raise ModelUnavailable(name, item) from item
        yield f"loading model {name}: {item.strip()}"


def load_together(models: Models, names: list[str]) -> Iterator[tuple[dict, dict]]:
    """Load the models of `names` that are not loaded, all at once (a thread each), so that a
    slow or failing one delays none of the others. Yields (progress, failed) after each
    message: the last progress line of each model still loading, and the reason of each that
    failed (ModelUnavailable's message); nothing when all are loaded."""
    waiting = [n for n in dict.fromkeys(models.resolve(n) for n in names)
               if not models.is_loaded(n)]
    messages: queue.Queue = queue.Queue()
    for name in waiting:
        start_load(models, name, messages)
    progress = {name: "" for name in waiting}
    failed: dict[str, str] = {}
    if waiting:
        yield dict(progress), dict(failed)
    while progress:
        name, item = messages.get()
        if item is None:
            del progress[name]
        elif isinstance(item, BaseException):
            del progress[name]
            failed[name] = str(ModelUnavailable(name, item))
        else:
            progress[name] = item.strip()
        yield dict(progress), dict(failed)


def loading_line(progress: dict, failed: dict) -> str:
    """The status line while models load together: each one's progress or why it failed."""
    return " · ".join([f"loading model {n}" + (f": {m}" if m else "…")
                       for n, m in progress.items()]
                      + [error(reason) for reason in failed.values()])


def where(info: dict) -> str:
    """Where and how a loaded local model runs, and its context."""
    precision = info["dtype"] + (f" weights, {info['compute_dtype']} arithmetic"
                                 if info["compute_dtype"] != info["dtype"] else "")
    return (f"on {info['device']} ({precision}, {info['runner']} runner"
            + (f", {info['kernels']} kernels" if info["kernels"] else "")
            + f"), context {info['context_length']} tokens")


def header(info: dict) -> str:
    """The line above the tabs for a loaded local model: where and how it runs, its context."""
    return f"## MiniServeLM · {info['name']} {where(info)}"


BASE_MODEL = "a base model: it continues text (Notebook tab), it does not chat"


def model_details(models: Models, name: str | None = None) -> str:
    """What a served model is, after its name: where it runs and its context, or that it
    loads when first used; a base model says so. Drawing it never loads a model."""
    name = models.resolve(name)
    spec, engine = models.specs[name], models.loaded_engine(name)
    if engine is not None and engine.capabilities.local_tokens:
        return where(engine.info()) + ("" if engine.has_chat_template else f" · {BASE_MODEL}")
    if spec.remote:
        context = engine.context_length if engine is not None else spec.context
        return f"on the server {spec.source}" + (f", context {context} tokens" if context
                                                  else "")
    return "(loads when first used)"


def model_header(models: Models, name: str | None = None) -> str:
    """The line above the tabs for one served model (the default: None)."""
    return f"## MiniServeLM · {models.resolve(name)} {model_details(models, name)}"


def app_header(models: Models) -> str:
    """The line above the tabs: the model, where it runs and its context, with one; with
    several, how many and the default (the model each tab uses until its Model dropdown
    chooses another). It names no tab's choice: each dropdown's line describes the model it
    chooses, and each status line names the model that answered."""
    if len(models.names) == 1:
        return model_header(models)
    return f"## MiniServeLM · {len(models.names)} models served · default {models.default}"


class ModelHeader:
    """The line above the tabs (`app_header`), redrawn after each run of any tab: with one
    model, a run may have loaded it, which is then described in full."""

    def __init__(self, models: Models):
        self.models = models
        self.markdown = gr.Markdown(app_header(models), elem_id="model-header")

    def show(self) -> str:
        return app_header(self.models)

    def refresh_after(self, runs) -> None:
        for run in runs:
            run.then(self.show, None, self.markdown, queue=False, show_progress="hidden")


@contextmanager
def using(models: Models, name: str):
    """`models.use(name)` (the engine is not unloaded while the block streams from it), with a
    failed load as ModelUnavailable."""
    lease = models.use(name)
    try:
        engine = lease.__enter__()
    except UnknownModel:
        raise
    except Exception as e:  # noqa: BLE001 -- a load that failed (unloaded meanwhile)
        raise ModelUnavailable(models.resolve(name), e) from e
    try:
        yield engine
    finally:
        lease.__exit__(None, None, None)


# -- Keyboard ---------------------------------------------------------------------------------
# What the keys do, as in chat apps and editors. Chat's message box is a one-line Textbox that
# grows (lines=1, max_lines>1): Gradio sends it on Enter, and Shift+Enter is left to the
# browser, which adds a line. Gradio sends on the Enter's `keypress` even while an input method
# is composing (a Japanese or Chinese IME commits its text with Enter), so that Enter is held
# back here, for every text box. Ctrl+Enter (Cmd+Enter) in a box of class CTRL_ENTER clicks
# the nearest button of class CTRL_ENTER_TARGET (the Notebook's Generate). Installed once per
# page, on load; <html data-ms-keys="on"> says it is.
CTRL_ENTER = "ms-ctrl-enter"
CTRL_ENTER_TARGET = "ms-ctrl-enter-target"
KEYS_JS = """
() => {
  if (window.msKeys) return;
  window.msKeys = true;
  let composing = false;  // the last Enter's keydown came from an input method
  window.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" && e.keyCode !== 229) return;
    composing = e.isComposing || e.keyCode === 229;
    if (composing || e.key !== "Enter" || !(e.ctrlKey || e.metaKey)) return;
    const box = e.target.closest && e.target.closest(".%(box)s");
    if (!box) return;
    let around = box.parentElement;
    while (around && !around.querySelector(".%(target)s")) around = around.parentElement;
    const button = around && around.querySelector(".%(target)s");
    if (!button) return;
    e.preventDefault();
    button.click();
  }, true);
  window.addEventListener("keypress", (e) => {
    if (e.key === "Enter" && (e.isComposing || composing)) e.stopPropagation();
  }, true);
  document.documentElement.dataset.msKeys = "on";
}
""" % {"box": CTRL_ENTER, "target": CTRL_ENTER_TARGET}


def install_keys(demo: gr.Blocks) -> None:
    """The page's keys (KEYS_JS), set up when the page loads; call inside `demo`."""
    demo.load(None, None, None, js=KEYS_JS)


# -- Token inspector --------------------------------------------------------------------------
BENT = 0.01  # a step the grammar bent: its mask took at least this share of the probability


def grammar_line(steps) -> str:
    """The inspector's summary of an output format's grammar: at how many of the reply's steps
    its mask took probability away, and the most it took ("" without a grammar)."""
    masses = [s.masked_mass for s in steps if s.masked_mass is not None]
    if not masses:
        return ""
    bent = sum(m >= BENT for m in masses)
    return (f"grammar bent {bent} of {len(masses)} steps, up to {max(masses):.0%} of the "
            f"probability (a step counts when its mask removed ≥ {BENT:.0%}; hover an "
            f"underlined token for what it removed)")


def inspector_html(inspector) -> str:
    """What the Token inspector box shows for a finished generation ("" when it was off)."""
    if inspector is None:
        return ""
    line = grammar_line(inspector.steps)
    return (f'<div class="ms-grammar">{html.escape(line)}</div>' if line else "") + \
        inspector.as_html()


def counts_from(text, what: str, example: str) -> list[int]:
    """A comma-separated list of whole numbers ("32,128,512"). Raises ConfigError naming
    `what` and showing `example` when it is anything else."""
    parts = [p for p in str(text if text is not None else "").replace(" ", "").split(",") if p]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        counts = []
    if not counts:
        raise ConfigError(f"{what}: write whole numbers separated by commas, like {example} "
                          f"(got {str(text or '').strip()!r})")
    return counts


def session_of(request) -> str:
    """The browser session a request comes from ("default" when called without one)."""
    return getattr(request, "session_hash", None) or "default"


class Cancel(threading.Event):
    """A run's cancel event. `taken_over` is set when a button that acts after the run (the
    Notebook's Undo and Regenerate) stopped it: the run's last output must then leave the page
    as it is, since Gradio may deliver that output (its completion message) after the
    button's."""

    def __init__(self):
        super().__init__()
        self.taken_over = False


class Run(NamedTuple):
    """One reply, generation or comparison of a browser session: its cancel event; `ended`,
    set once it has written its last output; `kind`, the tab that runs it."""
    cancel: Cancel
    ended: threading.Event
    kind: str


class Sessions:
    """The runs of each browser session: every reply, generation or comparison a session runs
    watches a cancel event of its own, and Stop sets all of the session's events (a comparison
    started meanwhile does not hide a chat reply from Stop). A button that acts after a run of
    its tab (the Notebook's Undo and Regenerate) takes it over: it stops that kind only and
    waits for it to end."""

    def __init__(self):
        self._lock = threading.Lock()  # handlers of many sessions run on Gradio's threads
        self._runs: dict[str, list[Run]] = {}

    @contextmanager
    def running(self, request, kind: str = "") -> Iterator[Cancel]:
        session = session_of(request)
        run = Run(Cancel(), threading.Event(), kind)
        with self._lock:
            self._runs.setdefault(session, []).append(run)
        try:
            yield run.cancel
        finally:
            with self._lock:
                runs = self._runs.get(session, [])
                runs.remove(run)
                if not runs:
                    self._runs.pop(session, None)
            run.ended.set()

    def _runs_of(self, request, kind: str | None = None) -> list[Run]:
        with self._lock:
            return [r for r in self._runs.get(session_of(request), ())
                    if kind is None or r.kind == kind]

    def stop(self, request) -> bool:
        """Cancel everything the request's session is running; False when it runs nothing."""
        runs = self._runs_of(request)
        for run in runs:
            run.cancel.set()
        return bool(runs)

    def take_over(self, request, kind: str, wait: float) -> bool:
        """Stop the session's runs of `kind` (marked taken over) and wait up to `wait` seconds
        for them to end: each ends within one engine step of its cancel, once Gradio has taken
        its last output. False when none was running."""
        runs = self._runs_of(request, kind)
        for run in runs:
            run.cancel.taken_over = True
            run.cancel.set()
        deadline = time.monotonic() + wait
        for run in runs:
            run.ended.wait(max(0.0, deadline - time.monotonic()))
        return bool(runs)
