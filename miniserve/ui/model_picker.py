"""The Model dropdown and loading a model with its progress on the status line; the header
that says where each model runs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import gradio as gr

from miniserve.models.registry import Models, UnknownModel
from miniserve.ui.common import ModelUnavailable, error

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
    return gr.Dropdown(
        models.names,
        value=models.default,
        label="Model",
        visible=len(models.names) > 1,
        elem_classes=["ms-model"],
        info=picker_info(models, models.default),
    )


def follow_picker(models: Models, picker: gr.Dropdown, runs=(), demo: gr.Blocks | None = None):
    """The dropdown's line describes its choice: redrawn when the choice changes (by the user
    or by a handler), after each of the tab's `runs` (a model loaded by one is then described
    in full) and when the page loads (the line written when the page was built said "loads
    when first used" of a model that has loaded since)."""

    def describe(name):
        return gr.update(info=picker_info(models, name))

    picker.change(describe, picker, picker, queue=False, show_progress="hidden")
    for run in runs:
        run.then(describe, picker, picker, queue=False, show_progress="hidden")
    if demo is not None:
        demo.load(describe, picker, picker, queue=False, show_progress="hidden")


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


def load_messages(
    models: Models, name: str, cancel: threading.Event | None = None
) -> Iterator[str]:
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
    waiting = [
        n for n in dict.fromkeys(models.resolve(n) for n in names) if not models.is_loaded(n)
    ]
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
    return " · ".join(
        [f"loading model {n}" + (f": {m}" if m else "…") for n, m in progress.items()]
        + [error(reason) for reason in failed.values()]
    )


def where(info: dict) -> str:
    """Where and how a loaded local model runs, and its context."""
    precision = info["dtype"] + (
        f" weights, {info['compute_dtype']} arithmetic"
        if info["compute_dtype"] != info["dtype"]
        else ""
    )
    return (
        f"on {info['device']} ({precision}, {info['runner']} runner"
        + (f", {info['kernels']} kernels" if info["kernels"] else "")
        + f"), context {info['context_length']} tokens"
    )


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
        return f"on the server {spec.source}" + (f", context {context} tokens" if context else "")
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
