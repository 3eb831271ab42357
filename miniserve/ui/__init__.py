"""The Gradio web app: Chat, Notebook, Compare, Step and Benchmark tabs. No generation logic lives
here: widget values become `SamplingParams`, and what the engines yield is rendered.

Each tab has a module: a class holding its handlers (plain methods, the streaming ones
generators, callable without a browser) and a builder that lays the tab out and wires them.
Every builder takes the same arguments, `(app: TabContext, label: str)`: it makes its handlers
from the app's context, lays its tab out under `label` and wires its events. `TABS` lists the
tabs in their order, as (label, builder): adding a tab is one entry there. Every tab asks the
app's `Models` registry for the engine of the model its dropdown names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import miniserve.ui.gradio_import  # noqa: F401 -- first: Gradio's import without its stub writing

# isort: split
import gradio as gr

from miniserve.core.config import MAX_QUEUE, SamplingParams
from miniserve.engine.engine import Engine
from miniserve.models.registry import Models
from miniserve.store.store import Store
from miniserve.ui.bench_tab import BenchmarkHandlers, build_benchmark_tab
from miniserve.ui.chat_tab import ChatHandlers, build_chat_tab
from miniserve.ui.common import Sessions
from miniserve.ui.compare_tab import CompareHandlers, build_compare_tab
from miniserve.ui.model_picker import ModelHeader, app_header, header, model_header
from miniserve.ui.notebook_tab import NotebookHandlers, build_notebook_tab
from miniserve.ui.render import CHATBOT_JS
from miniserve.ui.step_tab import CSS as STEP_CSS
from miniserve.ui.step_tab import build_step_tab
from miniserve.ui.widgets import install_keys

__all__ = [
    "CSS",
    "BenchmarkHandlers",
    "ChatHandlers",
    "CompareHandlers",
    "NotebookHandlers",
    "TABS",
    "TabContext",
    "TabBuilder",
    "build_ui",
    "mount_ui",
    "build_benchmark_tab",
    "build_chat_tab",
    "build_compare_tab",
    "build_notebook_tab",
    "build_step_tab",
    "app_header",
    "header",
    "model_header",
]

SPARE_THREADS = 8  # Gradio threads beyond the engines' queues: Undo, presets, a benchmark
CSS = (
    """
#status, .ms-status {font-size: 0.9em; opacity: 0.85}
.ms-inspector .ms-tok:hover {outline: 1px solid #333}
#notebook-text textarea {font-family: var(--font-mono); font-size: 0.92em; line-height: 1.5}
#conversations label span {overflow-wrap: anywhere}
"""
    + STEP_CSS
)


def mount_ui(app, demo: gr.Blocks, run_history: bool = False):
    """`demo` served at / of the FastAPI `app`, as the launcher serves it (the tests and the
    benchmarks serve it through here too, so that they measure the page people get).

    Gradio's run history stays off: it would keep every event's inputs and outputs (whole
    conversations, the sidebar's list, the owner id, the Step tab's ~25 KB chart) in the
    browser's local storage, in plain text, read and rewritten whole at each event's start and
    end. After ~80 searches of a 1,000-entry list every event took 0.7 s instead of 0.1-0.2
    (BENCHMARKS.md, "Saved conversations"); ten Step slider drags fill it with 1-2 MB, and a Step
    click then takes 2-4x as long (BENCHMARKS.md, "The Step view").
    `run_history=True` only to measure that."""
    return gr.mount_gradio_app(
        app, demo, path="/", css=CSS, footer_links=[], run_history=run_history
    )


def engine_queue(models: Models) -> int:
    """How many requests one model's engine admits: the default model's own when it is loaded,
    else --max-queue's (drawing the page loads nothing)."""
    engine = models.loaded_engine(models.default)
    return engine.max_queue if engine is not None else models.max_queue or int(MAX_QUEUE.default)


@dataclass
class TabContext:
    """What every tab's builder is given: one per app, made by `build_ui` inside its
    `gr.Blocks`. A builder makes its handlers from it (`models`, `presets`, `sessions`,
    `store`), lays its tab out and wires its events."""

    models: Models
    presets: dict[str, SamplingParams]
    default_preset: str  # one of `presets`: the settings panels' first choice
    sessions: Sessions  # shared: Stop in the Chat tab also ends the session's comparison
    header: ModelHeader  # the line above the tabs, redrawn after each tab's runs
    demo: gr.Blocks  # the page: its load and unload events
    store: Store | None = None  # the saved conversations (None: kept in memory only)
    # what a tab wires once every tab is laid out (the Chat tab's page-load events), in order
    after_tabs: list[Callable[[], None]] = field(default_factory=list)


TabBuilder = Callable[[TabContext, str], object]  # (the app's context, the tab's label)
TABS: list[tuple[str, TabBuilder]] = [  # the app's tabs, in this order
    ("Chat", build_chat_tab),
    ("Notebook", build_notebook_tab),
    ("Compare", build_compare_tab),
    ("Step", build_step_tab),
    ("Benchmark", build_benchmark_tab),
]


def build_ui(
    models: Models | Engine,
    presets: dict[str, SamplingParams],
    default_preset: str = "balanced",
    store: Store | None = None,
) -> gr.Blocks:
    """The app over the `models` registry (or a single Engine). `store`: the saved
    conversations (None: kept in memory only)."""
    models = Models.of(models)
    default_preset = default_preset if default_preset in presets else next(iter(presets))
    sessions = Sessions()  # Stop in the Chat tab also ends the session's comparison
    with gr.Blocks(title="MiniServeLM") as demo:
        app = TabContext(
            models, presets, default_preset, sessions, ModelHeader(models), demo, store
        )
        # a closed page's runs stop, whatever tab started them (first: before a tab's own
        # unload handler, the Step tab's, lets its session go)
        demo.unload(sessions.closed)
        for label, build in TABS:
            build(app, label)
        for wire in app.after_tabs:
            wire()
        install_keys(demo)  # Enter sends in Chat, Ctrl+Enter generates in the Notebook
        demo.load(None, None, None, js=CHATBOT_JS)  # Copy and Edit: "<div>", not "&lt;div>"
    # Gradio runs one event of a listener at a time unless told otherwise: the replies of many
    # browsers would then take turns instead of sharing the engine's forward passes. As many
    # engine events run at once as the engines admit (common.ENGINE_EVENTS: each model's
    # engine its own queue), on enough threads for them and the quick events beside them.
    admitted = engine_queue(models) * len(models.names)
    demo.max_threads = max(demo.max_threads, admitted + SPARE_THREADS)
    demo.queue(max_size=admitted * 4, default_concurrency_limit=admitted)
    quiet_when_idle(demo)
    return demo


# Gradio's queue (gradio.queueing.Queue, private) looks for new events every 1 ms while it has
# none, and for progress to send every 10 ms: with no client at all, ~6% of a core (a laptop's
# battery). Polling less often would make every click wait for the next poll. Instead the
# queue's loop waits on a wake-up: `push` (a new event) and the end of each job set it, and the
# wait gives up after IDLE_WAIT_S; while jobs run, progress is sent every PROGRESS_POLL_S as
# before. Idle, the app then uses under 0.5% of a core (BENCHMARKS.md, "Start-up and idle").
# quiet_when_idle fails loudly if the queue's settings or methods it relies on go, and
# tests/test_ui.py checks that events still start at once.
IDLE_WAIT_S = 1.0
PROGRESS_POLL_S = 0.1


class _WakeableClock:
    """gradio.queueing's `asyncio`, with one change: its loops' idle sleeps (IDLE_WAIT_S, set
    as each queue's sleep_when_free and progress_update_sleep_when_free) end early when
    `wake()` is called. Every other name is asyncio's own."""

    def __init__(self, real):
        self._real = real
        self._waiting: set = set()  # an asyncio.Event per idle sleep in progress

    def __getattr__(self, name):
        return getattr(self._real, name)

    def wake(self) -> None:
        for event in list(self._waiting):
            event.set()

    async def sleep(self, delay, result=None):
        if delay != IDLE_WAIT_S:
            return await self._real.sleep(delay, result)
        task = self._real.current_task()
        coro = task.get_coro() if task is not None else None
        frame = getattr(coro, "cr_frame", None)
        queue = frame.f_locals.get("self") if frame is not None else None
        if getattr(coro, "__qualname__", "").endswith("start_progress_updates") and any(
            job is not None for job in getattr(queue, "active_jobs", ())
        ):  # a job runs: send its progress at the usual rate
            return await self._real.sleep(PROGRESS_POLL_S, result)
        event = self._real.Event()  # registered before this task yields: no wake is missed
        self._waiting.add(event)
        try:
            await self._real.wait_for(event.wait(), delay)
        except TimeoutError:
            pass
        finally:
            self._waiting.discard(event)
        return result


def quiet_when_idle(demo: gr.Blocks) -> None:
    import gradio.queueing as queueing

    queue = demo._queue
    needed = (
        "sleep_when_free",
        "progress_update_sleep_when_free",
        "active_jobs",
        "push",
        "process_events",
        "start_processing",
        "start_progress_updates",
    )
    if not all(hasattr(queue, name) for name in needed) or not hasattr(queueing, "asyncio"):
        raise RuntimeError(
            "this Gradio's queue is not the one quiet_when_idle knows: check "
            "miniserve/ui/__init__.py against gradio/queueing.py"
        )
    if not isinstance(queueing.asyncio, _WakeableClock):  # one clock for every queue
        queueing.asyncio = _WakeableClock(queueing.asyncio)
    clock = queueing.asyncio
    queue.sleep_when_free = queue.progress_update_sleep_when_free = IDLE_WAIT_S
    push, process = queue.push, queue.process_events

    async def push_and_wake(*args, **kwargs):
        try:
            return await push(*args, **kwargs)
        finally:
            clock.wake()

    async def process_and_wake(*args, **kwargs):
        clock.wake()  # a job starts: its progress is now worth sending
        try:
            return await process(*args, **kwargs)
        finally:
            clock.wake()  # a slot is free: the next event may start

    queue.push, queue.process_events = push_and_wake, process_and_wake
