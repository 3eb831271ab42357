"""The Notebook tab: one text that the model continues in place, in completion mode (no chat
template), so base models and chat models alike write on from where the text ends. Generate,
Stop, Regenerate (the last generation again, from the text as it was before it) and Undo (the
text as it was before the last generation), with Chat's presets and sliders, the seed, the
Output format and the token inspector of the generated part. Undo and Regenerate pressed while a
generation streams first stop it and wait for it to end; the stopped generation's own last output
carries Undo's result (common.Sessions.take_over says why).

`NotebookHandlers` holds what its buttons call; the streaming ones are generators that run
without a browser. The text before each generation is kept per browser tab (`gr.State`), newest
last, so that Undo can step back through several generations."""

from __future__ import annotations

import secrets
from contextlib import ExitStack
from typing import TYPE_CHECKING

import gradio as gr

from miniserve.core.config import RANDOM_SEEDS, SamplingParams
from miniserve.engine.engine import Engine
from miniserve.engine.inspector import Inspector
from miniserve.models.registry import Models
from miniserve.ui.common import (
    STOP_WAIT_S,
    STREAMING,
    UNDO,
    USER_ERRORS,
    Reading,
    Sessions,
    engine_event,
    error,
    streaming_status,
    user_message,
)
from miniserve.ui.model_picker import (
    build_model_picker,
    follow_picker,
    load_messages,
    using,
)
from miniserve.ui.render import inspector_html
from miniserve.ui.widgets import (
    CTRL_ENTER,
    CTRL_ENTER_TARGET,
    GENERATING,
    build_output_format,
    build_sampling,
    format_note,
    params_from,
    preset_values,
    takes_panel,
    unchanged,
)

if TYPE_CHECKING:
    from miniserve.ui import TabContext

# the controls the generating handlers take after the text and its undo history
# (widgets.takes_panel): the settings panel, the seed, the inspector, the output format, the model
PANEL = GENERATING
UNDO_DEPTH = 20  # generations Undo can take back, one after the other


# The undo history's entries, newest last: a generation's start text (Generate: Undo brings it
# back, Regenerate starts from it again), or [start, replaced] (Regenerate: it started from
# `start` and replaced `replaced`, the box's text then, which Undo brings back).
def entry_start(entry) -> str:
    return entry if isinstance(entry, str) else entry[0]


def entry_restores(entry) -> str:
    return entry if isinstance(entry, str) else entry[1]


NOTEBOOK = "notebook"  # the kind of run (common.Sessions) that Undo and Regenerate stop
REGENERATE = "regenerate"  # takes a run over (Cancel.taken_over), as Undo does
TAKEN_BACK = "the generation was stopped and taken back"
PLACEHOLDER = "Write the beginning of a text; Generate (Ctrl+Enter) continues it here."


def notebook_status(stats, note: str = "") -> str:
    """The line under the text after a generation: the stats every tab shows, and notes."""
    return stats.summary(" · ") + (f" · {note}" if note else "")


class NotebookHandlers:
    """The Notebook tab's handlers over the app's models and presets. The generating ones take
    the text, the undo history (texts before each generation, newest last), the settings panel
    (widgets.setting_names order), the Seed box, the inspector checkbox, the Output format's
    two values and the Model dropdown (None: the default model); they yield (text, history,
    status, inspector HTML). `request` (injected by Gradio) names the browser session that
    Stop cancels."""

    def __init__(
        self,
        models: Models | Engine,
        presets: dict[str, SamplingParams],
        sessions: Sessions | None = None,
    ):
        self.models = Models.of(models)
        self.presets = presets
        self.sessions = sessions or Sessions()

    @takes_panel(*PANEL)
    def generate(
        self,
        text,
        history,
        panel,
        request: gr.Request | None = None,
    ):
        """Continue the text as it is; Undo will bring this text back."""
        start = text or ""
        history = [*(history or []), start][-UNDO_DEPTH:]
        yield from self._continue(start, history, panel, request)

    @takes_panel(*PANEL)
    def regenerate(
        self,
        text,
        history,
        panel,
        request: gr.Request | None = None,
    ):
        """The last generation again, from the text as it was before it. What is in the box
        now (that generation's text, and whatever was typed into it since) is replaced: Undo
        brings it back, then the text before the generation."""
        self.sessions.take_over(request, NOTEBOOK, STOP_WAIT_S, REGENERATE)
        if not history:
            yield gr.update(), history, error("nothing to regenerate yet: Generate first"), ""
            return
        start = entry_start(history[-1])
        history = [*history, [start, text or ""]][-UNDO_DEPTH:]
        yield from self._continue(start, history, panel, request)

    def undo(self, text, history, request: gr.Request | None = None):
        """The text as it was before the last generation: (text, history, status). A
        generation still streaming is stopped, has ended when this returns and has written
        that as its last output: this then writes nothing."""
        if self.sessions.take_over(request, NOTEBOOK, STOP_WAIT_S, UNDO):
            return unchanged(3)
        if not history:
            return gr.update(), history, "nothing to undo"
        *history, before = history
        return entry_restores(before), history, "the last generation was taken back"

    def stop(self, request: gr.Request | None = None) -> None:
        self.sessions.stop(request)

    def apply_preset(self, name) -> list:
        """The settings panel's values of a preset."""
        return preset_values(self.presets, name)

    def _continue(self, start: str, history: list, panel, request):
        """Stream the continuation of `start` into the box, after it (`history` ends with
        `start`). On an error the box is left as it is (nothing was written) and the history as
        it was. Undo pressed meanwhile: the last output is the text and history before it."""
        # the run (Stop, Undo, Regenerate end it) starts before the model loads: Undo pressed
        # during the load stops the generation before it writes anything
        with self.sessions.running(request, NOTEBOOK) as cancel:
            yield from self._stream(start, history, panel, cancel)
            if self.sessions.close(cancel) == UNDO:
                yield entry_restores(history[-1]), history[:-1], TAKEN_BACK, ""

    def _stream(self, start: str, history: list, panel, cancel):
        unchanged = gr.update()
        with ExitStack() as held:
            try:
                params = params_from(
                    panel.settings, panel.seed, panel.output_format, panel.format_text
                )
                if params.seed is None:  # a random seed is drawn, used and shown
                    params = params.replace(seed=secrets.randbelow(RANDOM_SEEDS))
                name = self.models.resolve(panel.model)
                for note in load_messages(self.models, name, cancel):
                    yield unchanged, unchanged, note, ""
                if cancel.is_set():
                    if not cancel.taken_over:  # (else Undo's result or Regenerate's run follows)
                        yield unchanged, unchanged, "stopped before it started", ""
                    return
                engine = held.enter_context(using(self.models, name))
                inspector = Inspector(engine.tokenizer, params) if panel.inspect_on else None
                stream = engine.complete_text(
                    start,
                    params,
                    trim=True,
                    cancel=cancel,
                    observer=inspector.observe if inspector else None,
                    progress=True,
                )
            except USER_ERRORS as e:
                said = user_message(e)
                if getattr(e, "field", None) == "prompt":  # the engine's name of the Text box
                    said = said.replace("'prompt'", "the Text box", 1)
                yield unchanged, unchanged, error(said), ""
                return
            except Exception as e:  # noqa: BLE001 -- e.g. a remote server that went away
                yield unchanged, unchanged, error(f"{type(e).__name__}: {e}"), ""
                return
            yield start, history, STREAMING, ""
            reading = Reading(stream)
            try:
                for written in reading:
                    yield start + written, history, streaming_status(reading.last), ""
            except Exception as e:  # noqa: BLE001 -- show it; what was written stays
                yield start + reading.text, history, error(f"{type(e).__name__}: {e}"), ""
                return
            written, last = reading.text, reading.last
            if cancel.taken_over:  # Undo's result or Regenerate's run follows
                return
            if last is None or not last.done:
                yield start + written, history, error("the generation ended without its stats"), ""
                return
            stats = last.stats
            notes = (
                f"model {name}" if len(self.models.names) > 1 else "",
                f"seed {params.seed}",
                "stopped by you" if stats.finish_reason == "cancelled" else "",
                self.trim_note(engine, start, stats.prompt_tokens),
                format_note(params.constraint, stats.finish_reason),
            )
            yield (
                start + written,
                history,
                notebook_status(stats, " · ".join(n for n in notes if n)),
                inspector_html(inspector),
            )

    @staticmethod
    def trim_note(engine, text: str, prompt_tokens: int) -> str:
        """Said when the text was longer than the context leaves room for: the model saw only
        its end ("" otherwise, and for a remote model, whose tokens are not counted here)."""
        if not engine.capabilities.local_tokens:
            return ""
        total = len(engine.tokenizer(text)["input_ids"])
        if total <= prompt_tokens:
            return ""
        return (
            f"the text is {total} tokens: the model saw its last {prompt_tokens} (the "
            f"context is {engine.context_length} with room for max new tokens)"
        )


def build_notebook_tab(app: TabContext, label: str) -> None:
    """The Notebook tab and its events, under `label`; call inside the app's `gr.Blocks`. The
    app's header (the line above the tabs) is redrawn after this tab's runs."""
    notebook = NotebookHandlers(app.models, app.presets, app.sessions)
    history = gr.State([])
    with gr.Tab(label):
        with gr.Row():
            with gr.Column(scale=3):
                text = gr.Textbox(
                    label="Text",
                    lines=22,
                    max_lines=40,
                    placeholder=PLACEHOLDER,
                    elem_id="notebook-text",
                    elem_classes=[CTRL_ENTER],
                )
                with gr.Row():  # Ctrl+Enter in the text: Generate (common.KEYS_JS)
                    generate_btn = gr.Button(
                        "Generate", variant="primary", elem_classes=[CTRL_ENTER_TARGET]
                    )
                    stop_btn = gr.Button("Stop", variant="stop")
                    regen_btn = gr.Button("Regenerate")
                    undo_btn = gr.Button("Undo")
                status = gr.Markdown(
                    "completion mode: the model continues the text as it is, no chat template",
                    elem_id="notebook-status",
                    elem_classes=["ms-status"],
                )
                inspect_on = gr.Checkbox(
                    label="Token inspector",
                    value=False,
                    info="shade each generated token by its probability; "
                    "hover one for a chart of the top-5 "
                    "alternatives before → after the sampling "
                    "stages",
                )
                inspector_view = gr.HTML(elem_id="notebook-inspector")
            with gr.Column(scale=1):
                model = build_model_picker(notebook.models)
                sampling = build_sampling(
                    notebook.presets,
                    app.default_preset,
                    notebook.apply_preset,
                    "-1 = random (the seed drawn is shown); a fixed "
                    "seed repeats a sampled continuation",
                )
                output = build_output_format()
    settings = [*sampling.sliders, sampling.seed, inspect_on, *output.inputs, model]
    generating = engine_event([text, history, status, inspector_view], text)
    runs = [
        generate_btn.click(notebook.generate, [text, history, *settings], **generating),
        regen_btn.click(notebook.regenerate, [text, history, *settings], **generating),
    ]
    stop_btn.click(notebook.stop, None, None, queue=False)
    # queued, as the generation is: Undo stops a running generation, which then writes Undo's
    # result as its own last output (Sessions.take_over), and waits for it to end
    undo_btn.click(notebook.undo, [text, history], [text, history, status])
    follow_picker(notebook.models, model, runs, app.demo)
    app.header.refresh_after(runs)
