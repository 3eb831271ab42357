"""What the tabs share: chat history as plain messages, the status and error lines, the number
boxes' values, and the cancel events of each browser session (Stop ends what it runs)."""

from __future__ import annotations

import html
import threading
from contextlib import contextmanager
from typing import Iterator

from miniserve.chat import ChatError
from miniserve.config import FIELDS, ConfigError, SamplingParams, check_seed
from miniserve.engine import EngineBusy, RequestTooLarge

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
# than the KV budget): the message is shown as it is; anything else with its type's name.
USER_ERRORS = (ConfigError, ChatError, EngineBusy, RequestTooLarge)


def error(message: str) -> str:
    """A status line that reads as an error in the Markdown it is shown in."""
    return f"{ERROR_PREFIX} {html.escape(message)}"


def is_error(status: str) -> bool:
    return status.startswith(ERROR_PREFIX)


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


def params_from(settings, seed) -> SamplingParams:
    """The sliders (in FIELDS order) and the Seed box as checked sampling settings."""
    fields = {name: whole(value) for name, value in zip(FIELDS, settings)}
    return SamplingParams(seed=seed_from(seed), **fields)


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
