"""The Gradio web app: Chat, Notebook, Compare, Step and Benchmark tabs. No generation logic lives
here: widget values become `SamplingParams`, and what the engines yield is rendered.

Each tab has a module: a class holding its handlers (plain methods, the streaming ones
generators, callable without a browser) and a builder that lays the tab out and wires them.
Every tab asks the app's `Models` registry for the engine of the model its dropdown names.
"""

from __future__ import annotations

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
from miniserve.ui.step_tab import CSS as STEP_CSS
from miniserve.ui.step_tab import StepHandlers, build_step_tab
from miniserve.ui.widgets import install_keys

__all__ = [
    "CSS",
    "BenchmarkHandlers",
    "ChatHandlers",
    "CompareHandlers",
    "NotebookHandlers",
    "build_ui",
    "build_benchmark_tab",
    "build_chat_tab",
    "build_compare_tab",
    "build_notebook_tab",
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
"""
    + STEP_CSS
)


def engine_queue(models: Models) -> int:
    """How many requests one model's engine admits: the default model's own when it is loaded,
    else --max-queue's (drawing the page loads nothing)."""
    engine = models.loaded_engine(models.default)
    return engine.max_queue if engine is not None else models.max_queue or int(MAX_QUEUE.default)


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
        top = ModelHeader(models)
        chat_tab = build_chat_tab(
            ChatHandlers(models, presets, sessions, store), default_preset, top
        )
        build_notebook_tab(NotebookHandlers(models, presets, sessions), default_preset, top)
        build_compare_tab(CompareHandlers(models, presets, sessions), top)
        build_step_tab(StepHandlers(models, presets, sessions), default_preset, demo)
        build_benchmark_tab(BenchmarkHandlers(models, presets), top)
        chat_tab.on_load(demo)
        install_keys(demo)  # Enter sends in Chat, Ctrl+Enter generates in the Notebook
    # Gradio runs one event of a listener at a time unless told otherwise: the replies of many
    # browsers would then take turns instead of sharing the engine's forward passes. As many
    # engine events run at once as the engines admit (common.ENGINE_EVENTS: each model's
    # engine its own queue), on enough threads for them and the quick events beside them.
    admitted = engine_queue(models) * len(models.names)
    demo.max_threads = max(demo.max_threads, admitted + SPARE_THREADS)
    demo.queue(max_size=admitted * 4, default_concurrency_limit=admitted)
    quiet_when_idle(demo)
    return demo


# Gradio's queue looks for new events every 1 ms while it has none, and for progress to send
# every 10 ms: with no client at all, ~6% of a core (a laptop's battery). Checking every 50 ms
# and 100 ms costs an event at most 50 ms (25 on average) before it starts -- a reply's prompt
# pass takes longer; the Step tab's redraws skip the queue -- and a progress bar a tenth of a
# second; idle, the app then uses under 0.5% of a core (BENCHMARKS.md, "Start-up and idle").
# Private settings of gradio.queueing.Queue: quiet_when_idle fails loudly if they go, and
# tests/test_ui.py checks that they took.
IDLE_POLL_S = 0.05
PROGRESS_POLL_S = 0.1


def quiet_when_idle(demo: gr.Blocks) -> None:
    queue = demo._queue
    if not hasattr(queue, "sleep_when_free") or not hasattr(
        queue, "progress_update_sleep_when_free"
    ):
        raise RuntimeError(
            "this Gradio's queue has no idle poll settings: check "
            "miniserve/ui/__init__.py's quiet_when_idle against it"
        )
    queue.sleep_when_free = max(queue.sleep_when_free, IDLE_POLL_S)
    queue.progress_update_sleep_when_free = max(
        queue.progress_update_sleep_when_free, PROGRESS_POLL_S
    )
