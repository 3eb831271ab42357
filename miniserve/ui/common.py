"""What the tabs share: chat history as plain messages, the status and error lines, the
streamed reply as a tab paints it, the event groups, and the cancel events of each browser
session (Stop ends what it runs)."""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import gradio as gr

from miniserve.core.config import ConfigError
from miniserve.core.errors import Unavailable, UserError

# Repaint a streaming reply at most this often: ~12 updates a second reads as smooth, and each
# repaint costs browser CPU that a 2-core machine would otherwise give to the model.
PAINT_INTERVAL_S = 0.08
ERROR_PREFIX = "**Error:**"


class Reading:
    """A reply's stream as a tab paints it: iterating gives the text so far, at most every
    PAINT_INTERVAL_S while it streams (not for the last chunk), when a piece of text, of
    reasoning or of a tool call came, and at each chunk that says how far the prompt is read;
    afterwards `text` is all of it and `last` the last chunk (done=True when the reply
    completed)."""

    def __init__(self, stream):
        self.stream, self.text, self.last = stream, "", None

    def __iter__(self) -> Iterator[str]:
        last_paint = time.perf_counter()
        for self.last in self.stream:  # noqa: B020 -- keeps the last chunk
            self.text += self.last.text
            if self.last.done:
                return
            if getattr(self.last, "prompt_read", None) is not None:  # one a pass: each shown
                yield self.text  # (and the reply's first text is not held back for it)
                continue
            grew = (
                self.last.text
                or getattr(self.last, "reasoning", "")
                or getattr(self.last, "tool_calls", None)
            )
            if grew and time.perf_counter() - last_paint >= PAINT_INTERVAL_S:
                last_paint = time.perf_counter()
                yield self.text


STREAMING = "generating…"


def streaming_status(chunk) -> str:
    """The status line while a reply streams, from its last chunk: how far its prompt is read
    (a local engine's Chunk.reading), until the reply starts."""
    reading = getattr(chunk, "reading", None)
    return (reading() if reading else None) or STREAMING


# The events that run the engine (Send, Regenerate, Compare) share one Gradio concurrency group:
# as many run at once as the engine admits (the app's queue sets the limit to its max_queue),
# so the replies of many browsers advance in the same forward passes; past it they wait their
# turn in Gradio's queue.
ENGINE_EVENTS = "engine"


def engine_event(outputs: list, streams_into) -> dict:
    """An event that runs the engine: its outputs, the engine's concurrency group, and Gradio's
    progress on the component(s) the reply streams into only. Gradio's default marks every
    output: the Chat's message box, sidebar, status line and inspector pulsed all through a
    reply, and on a 2-core machine the page's repainting takes a share of the cores the model
    runs on (a Chat reply on the embedded model: a median of 109 against 144 tok/s,
    BENCHMARKS.md). The status line says what runs."""
    return dict(outputs=outputs, concurrency_id=ENGINE_EVENTS, show_progress_on=streams_into)


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


def counts_from(text, what: str, example: str) -> list[int]:
    """A comma-separated list of whole numbers ("32,128,512"). Raises ConfigError naming
    `what` and showing `example` when it is anything else."""
    parts = [p for p in str(text if text is not None else "").replace(" ", "").split(",") if p]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        counts = []
    if not counts:
        raise ConfigError(
            f"{what}: write whole numbers separated by commas, like {example} "
            f"(got {str(text or '').strip()!r})"
        )
    return counts


def session_of(request) -> str:
    """The browser session a request comes from ("default" when called without one)."""
    return getattr(request, "session_hash", None) or "default"


# The button that takes over a run of its tab (Cancel.taken_over): the Notebook's Undo and
# Regenerate, Chat's Undo (and what changes the conversation shown). It waits at most
# STOP_WAIT_S for the stopped run to end: a run ends within one engine step of its cancel; past
# this (the page stopped reading it) it goes on.
UNDO = "undo"
STOP_WAIT_S = 30.0


class Cancel(threading.Event):
    """A run's cancel event. `taken_over` is what stopped the run to act after it: a button's
    name (UNDO, the Notebook's "regenerate") or an action whose outputs the run writes last
    (ChatHandlers.after_reply); None: nothing. `closed` is set once the run has decided its
    last output (Sessions.close): nothing takes it over after that."""

    def __init__(self):
        super().__init__()
        self.taken_over: object = None
        self.closed = False


class Run(NamedTuple):
    """One reply, generation or comparison of a browser session: its cancel event; `ended`,
    set once it has written its last output; `kind`, the tab that runs it; `origin`, the
    event that started it (when the tab tells them apart); `started`, time.monotonic()."""

    cancel: Cancel
    ended: threading.Event
    kind: str
    origin: str = ""
    started: float = 0.0


class Sessions:
    """The runs of each browser session: every reply, generation or comparison a session runs
    watches a cancel event of its own, and Stop sets all of the session's events (a comparison
    started meanwhile does not hide a chat reply from Stop). A button that acts after a run of
    its tab (the Notebook's Undo and Regenerate) takes it over: it stops that kind only and
    waits for it to end."""

    def __init__(self):
        self._lock = threading.Lock()  # handlers of many sessions run on Gradio's threads
        self._runs: dict[str, list[Run]] = {}

    def closed(self, request: gr.Request | None = None) -> None:
        """The page closed (the app's one unload handler): every run of its session stops. A
        benchmark would hold its tab's one slot for every other page until it ended, and a
        reply or a comparison would go on for nobody."""
        self.stop(request)

    @contextmanager
    def running(
        self, request, kind: str = "", alone: bool = False, origin: str = ""
    ) -> Iterator[Cancel | None]:
        """A run of the request's session, as its cancel event. `alone`: None instead when the
        session already runs one of `kind` (checked and registered at once: two events that
        arrive together do not both start). `origin`: the event that starts it (running_for)."""
        session = session_of(request)
        run = Run(Cancel(), threading.Event(), kind, origin, time.monotonic())
        with self._lock:
            runs = self._runs.setdefault(session, [])
            refused = alone and any(r.kind == kind for r in runs)
            if not refused:
                runs.append(run)
        if refused:
            yield None
            return
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
            return [
                r for r in self._runs.get(session_of(request), ()) if kind is None or r.kind == kind
            ]

    def busy(self, request, kind: str) -> bool:
        """Whether the request's session runs something of `kind`."""
        return bool(self._runs_of(request, kind))

    def running_for(self, request, kind: str, origin: str) -> float | None:
        """How long (seconds) the request's session has run its oldest run of `kind` started
        by `origin`; None when it runs none."""
        runs = [r for r in self._runs_of(request, kind) if r.origin == origin]
        return time.monotonic() - min(r.started for r in runs) if runs else None

    def stop(self, request, kind: str | None = None) -> bool:
        """Cancel everything the request's session is running (of `kind` only, when given);
        False when it runs nothing of it."""
        runs = self._runs_of(request, kind)
        for run in runs:
            run.cancel.set()
        return bool(runs)

    def take_over(self, request, kind: str, wait: float, by: object) -> bool:
        """Stop the session's runs of `kind` that have not closed, marked taken over `by` the
        button that calls this, and wait up to `wait` seconds for them to end (each ends within
        one engine step of its cancel, once Gradio has taken its outputs). True when there was
        one: its last output then carries what the button does, and the button writes nothing.
        The page applies each event's outputs in order, but two events' outputs interleave: a
        stopped run's last few outputs, still on their way, may land after the button's.
        False when none was running (or each had closed, or was taken over by another
        button, whose run has then ended, or ended by an error before deciding its last
        output): the button acts itself."""
        with self._lock:
            runs = [
                r
                for r in self._runs.get(session_of(request), ())
                if r.kind == kind and not r.cancel.closed
            ]
            mine = [r for r in runs if r.cancel.taken_over is None]  # one button a run
            for run in mine:
                run.cancel.taken_over = by
                run.cancel.set()
        deadline = time.monotonic() + wait
        for run in runs:  # (one that another button took over: this one acts once it ended)
            run.ended.wait(max(0.0, deadline - time.monotonic()))
        # one that ended without closing (it raised) wrote no last output of the button's: the
        # button acts itself; one still running past the wait carries it when it closes
        return any(r.cancel.closed or not r.ended.is_set() for r in mine)

    def close(self, cancel: Cancel) -> object:
        """Called by a run before its last output: no button takes it over from now on. Returns
        the button that took it over before (None: none), whose action that output carries."""
        with self._lock:
            cancel.closed = True
            return cancel.taken_over
