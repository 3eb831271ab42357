"""The Gradio web app: Chat, Compare and Benchmark tabs. No generation logic lives here:
widget values become `SamplingParams`, and what the engine yields is rendered.

Each tab has a module: a class holding its handlers (plain methods, the streaming ones
generators, callable without a browser) and a builder that lays the tab out and wires them.
"""

from __future__ import annotations

import gradio as gr

from miniserve.config import SamplingParams
from miniserve.engine import Engine
from miniserve.store import Store
from miniserve.ui.bench_tab import BenchmarkHandlers, build_benchmark_tab
from miniserve.ui.chat_tab import ChatHandlers, build_chat_tab
from miniserve.ui.common import Sessions
from miniserve.ui.compare_tab import CompareHandlers, build_compare_tab

__all__ = ["CSS", "BenchmarkHandlers", "ChatHandlers", "CompareHandlers", "build_ui",
           "build_benchmark_tab", "build_chat_tab", "build_compare_tab", "header"]

SPARE_THREADS = 8  # Gradio threads beyond the engine's queue: Undo, presets, a benchmark
CSS = """
#status {font-size: 0.9em; opacity: 0.85}
.ms-inspector .ms-tok:hover {outline: 1px solid #333}
"""


def header(info: dict) -> str:
    """The line above the tabs: the model, where and how it runs, its context."""
    precision = info["dtype"] + (f" weights, {info['compute_dtype']} arithmetic"
                                 if info["compute_dtype"] != info["dtype"] else "")
    return (f"## MiniServeLM · {info['name']} on {info['device']} ({precision}, "
            f"{info['runner']} runner"
            + (f", {info['kernels']} kernels" if info["kernels"] else "")
            + f"), context {info['context_length']} tokens")


def build_ui(engine: Engine, presets: dict[str, SamplingParams],
             default_preset: str = "balanced", store: Store | None = None) -> gr.Blocks:
    """The app. `store`: the saved conversations (None: kept in memory only)."""
    default_preset = default_preset if default_preset in presets else next(iter(presets))
    sessions = Sessions()  # Stop in the Chat tab also ends the session's comparison
    with gr.Blocks(title="MiniServeLM") as demo:
        gr.Markdown(header(engine.info()))
        chat_tab = build_chat_tab(ChatHandlers(engine, presets, sessions, store),
                                  default_preset)
        build_compare_tab(CompareHandlers(engine, presets, sessions))
        build_benchmark_tab(BenchmarkHandlers(engine, presets))
        chat_tab.on_load(demo)
    # Gradio runs one event of a listener at a time unless told otherwise: the replies of many
    # browsers would then take turns instead of sharing the engine's forward passes. As many
    # engine events run at once as the engine admits (common.ENGINE_EVENTS), on enough threads
    # for them and the quick events beside them.
    demo.max_threads = max(demo.max_threads, engine.max_queue + SPARE_THREADS)
    demo.queue(max_size=engine.max_queue * 4, default_concurrency_limit=engine.max_queue)
    return demo
