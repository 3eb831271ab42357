"""What the tabs share: chat history as plain messages, the status and error lines, the number
boxes' values, the Output format control, and the cancel events of each browser session (Stop
ends what it runs)."""

from __future__ import annotations

import html
import json
import threading
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import gradio as gr

from miniserve.chat import ChatError
from miniserve.config import FIELDS, ConfigError, Constraint, SamplingParams, check_seed
from miniserve.engine import EngineBusy, RequestTooLarge
from miniserve.grammar import GrammarError

# Repaint a streaming reply at most this often: ~12 updates a second reads as smooth, and each
# repaint costs browser CPU that a 2-core machine would otherwise give to the model.
PAINT_INTERVAL_S = 0.08
ERROR_PREFIX = "**Error:**"
# The events that run the engine (Send, Regenerate, Compare) share one Gradio concurrency group:
# as many run at once as the engine admits (the app's queue sets the limit to its max_queue),
# so the replies of many browsers advance in the same forward passes; past it they wait their
# turn in Gradio's queue.
ENGINE_EVENTS = "engine"
# The benchmarks run one at a time: two at once would measure each other.
BENCHMARK_EVENTS = "benchmark"
# What a user can fix or wait out (a setting, the conversation, a full queue, a request larger
# than the KV budget, a schema or pattern the grammar library refuses): the message is shown
# (user_message); anything else with its type's name.
USER_ERRORS = (ConfigError, ChatError, EngineBusy, RequestTooLarge, GrammarError)


def error(message: str) -> str:
    """A status line that reads as an error in the Markdown it is shown in."""
    return f"{ERROR_PREFIX} {html.escape(message)}"


def is_error(status: str) -> bool:
    return status.startswith(ERROR_PREFIX)


def user_message(e: Exception) -> str:
    """One of USER_ERRORS as the status says it: a schema, pattern or grammar the library
    refuses is named as the output format, with the library's reason."""
    if isinstance(e, GrammarError):
        return f"the output format cannot be used: {e}"
    return str(e)


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


class Sessions:
    """The cancel events of each browser session: every reply or comparison a session runs
    watches an event of its own, and Stop sets all of the session's events (a comparison
    started meanwhile does not hide a chat reply from Stop)."""

    def __init__(self):
        self._lock = threading.Lock()  # handlers of many sessions run on Gradio's threads
        self._cancels: dict[str, set[threading.Event]] = {}

    @contextmanager
    def running(self, request) -> Iterator[threading.Event]:
        session = session_of(request)
        cancel = threading.Event()
        with self._lock:
            self._cancels.setdefault(session, set()).add(cancel)
        try:
            yield cancel
        finally:
            with self._lock:
                running = self._cancels.get(session, set())
                running.discard(cancel)
                if not running:
                    self._cancels.pop(session, None)

    def stop(self, request) -> bool:
        """Cancel everything the request's session is running; False when it runs nothing."""
        with self._lock:
            cancels = list(self._cancels.get(session_of(request), ()))
        for cancel in cancels:
            cancel.set()
        return bool(cancels)
