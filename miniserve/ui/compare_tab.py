"""The Compare tab: one prompt answered by several presets with the same seed, every column
streaming, all held to the Output format; optionally each preset also without it, to see what
the format changes; and, when the app serves several models, by each chosen model. Each
model's engine runs its columns as one batch (each step advances all of them), and the models
run at the same time, each on its own engine. A base model (no chat template) continues the
prompt as text (completion mode), and its columns say so."""

from __future__ import annotations

import html
import queue
import threading
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING

import gradio as gr

from miniserve.core.config import SamplingParams
from miniserve.core.samplers import describe
from miniserve.engine.engine import Engine
from miniserve.models.registry import Models
from miniserve.ui.common import (
    PAINT_INTERVAL_S,
    USER_ERRORS,
    Sessions,
    engine_event,
    error,
    user_message,
)
from miniserve.ui.model_picker import load_together, loading_line, using
from miniserve.ui.widgets import (
    FREE_TEXT,
    build_output_format,
    constraint_from,
    format_label,
    format_note,
    seed_from,
    whole,
)

if TYPE_CHECKING:
    from miniserve.ui import TabContext

ABOUT = (
    "One prompt, several presets, the same seed: see what greedy, top-k and top-p change. "
    "The columns run as one batch: each engine step advances every column by a token."
)
ABOUT_MODELS = (
    " With several models chosen, each model runs its columns on its own engine, "
    "at the same time as the others (and those not loaded yet load at the same "
    "time); a base model (no chat template) continues the prompt as text."
)
DEFAULT_CHOICE = ("factual", "balanced", "creative")
COMPLETION = "completion mode (no chat template)"


COMPARE = "compare"  # the kind of this tab's runs (Sessions)


class CompareHandlers:
    """The Compare tab's handler over the app's models and presets. Its columns are `slots`:
    (model, preset, False) for each model and preset under the output format, then
    (model, preset, True) for each without it."""

    def __init__(
        self,
        models: Models | Engine,
        presets: dict[str, SamplingParams],
        sessions: Sessions | None = None,
    ):
        self.models = Models.of(models)
        self.presets = presets
        self.sessions = sessions or Sessions()
        self.slots = [
            (m, n, free) for free in (False, True) for m in self.models.names for n in presets
        ]

    def compare(
        self,
        prompt,
        chosen,
        seed,
        max_tokens,
        output_format=FREE_TEXT,
        format_text="",
        also_free=False,
        models=None,
        request: gr.Request | None = None,
    ):
        """Answer `prompt` with each preset named in `chosen`, held to the output format, by
        each model in `models` (None: the default model); with `also_free` (and a format),
        each preset a second time without it, in the same batch. Yields [status, one update
        per slot]: a column that runs visible with its text and its tokens/s, the others
        hidden. A bad value yields one error status instead; a model that cannot run (not
        loadable, or it refuses the request) has its columns say why while the others run,
        or the error is the status when no model can run."""
        names = [n for n in self.presets if n in (chosen or [])]
        hidden = [gr.update(visible=False, value="") for _ in self.slots]
        if not (prompt or "").strip() or not names:
            yield [error("type a prompt and choose at least one preset")] + hidden
            return
        if models is not None and not models:
            yield [error("choose at least one model")] + hidden
            return
        try:
            seed = seed_from(seed)
            constraint = constraint_from(output_format, format_text)
            runs = [(n, False) for n in names]  # each model's batch: (preset, free)
            if also_free and constraint is not None:
                runs += [(n, True) for n in names]
            settings = [
                self.presets[n].replace(
                    seed=seed,
                    max_new_tokens=whole(max_tokens),
                    constraint=None if free else constraint,
                )
                for n, free in runs
            ]
            chosen_models = list(dict.fromkeys(self.models.resolve(m) for m in (models or [None])))
        except USER_ERRORS as e:
            yield [error(user_message(e))] + hidden
            return
        # the models not loaded yet load at the same time, each saying its own progress; one
        # that fails has its columns say why, and delays none of the others
        failed: dict[str, str] = {}
        for progress, failed in load_together(self.models, chosen_models):
            yield [loading_line(progress, failed)] + hidden
        with self.sessions.running(request, COMPARE) as cancel, ExitStack() as held:
            streams = {}
            for name in chosen_models:
                if name in failed:
                    continue
                try:
                    engine = held.enter_context(using(self.models, name))
                    raw = not engine.has_chat_template
                    # a cancel event per model: a stream that ends sets its own event
                    stop = threading.Event()
                    streams[name] = (
                        raw,
                        stop,
                        engine.compare_prompt(prompt, settings, raw=raw, cancel=stop),
                    )
                except USER_ERRORS as e:
                    failed[name] = user_message(e)
                except Exception as e:  # noqa: BLE001 -- show it; the other models run
                    failed[name] = f"{type(e).__name__}: {e}"
            if not streams:
                reasons = [
                    failed[m] if len(failed) == 1 else f"{m}: {failed[m]}" for m in chosen_models
                ]
                yield [error("; ".join(reasons))] + hidden
                return
            batch = self.batch(names, runs, constraint)
            if len(chosen_models) > 1:
                batch = f"{len(chosen_models)} models at the same time, each with {batch}"
            note = (
                " · “Also without the output format” needs an output format"
                if also_free and constraint is None
                else ""
            )
            yield from self._stream(
                streams,
                chosen_models,
                runs,
                settings,
                constraint,
                failed,
                cancel,
                batch,
                f"same prompt, seed {seed if seed is not None else 'random'}, {batch}{note}",
            )

    def _stream(
        self, streams, chosen_models, runs, settings, constraint, failed, cancel, batch, summary
    ):
        """Read every model's stream on a thread of its own, repainting the columns as their
        text arrives; Stop (the session's cancel event) ends them all."""
        arrived: queue.Queue = queue.Queue()

        def read(name, stream):
            try:
                for col, chunk, _ in stream:
                    arrived.put((name, col, chunk))
            except Exception as e:  # noqa: BLE001 -- shown in the model's columns
                arrived.put((name, None, e))
            arrived.put((name, None, None))

        texts = {(m, *run): "" for m in streams for run in runs}
        footers = {key: "" for key in texts}
        raw = {m: r for m, (r, _, _) in streams.items()}
        for name, (_, _, stream) in streams.items():
            threading.Thread(
                target=read, args=(name, stream), daemon=True, name=f"compare-{name}"
            ).start()
        running, last_paint = set(streams), 0.0
        try:
            while running:
                try:
                    name, col, item = arrived.get(timeout=0.1)
                except queue.Empty:
                    item = col = name = None
                if cancel.is_set():  # Stop: every model's stream ends within a step
                    for _, stop, _ in streams.values():
                        stop.set()
                if name is None:
                    continue
                if col is None:
                    if isinstance(item, BaseException):
                        failed[name] = (
                            user_message(item)
                            if isinstance(item, USER_ERRORS)
                            else f"{type(item).__name__}: {item}"
                        )
                    else:
                        running.discard(name)
                    continue
                key = (name, *runs[col])
                texts[key] += item.text
                footers[key] = self.footer(item, settings[col].constraint)
                if item.done or time.perf_counter() - last_paint >= PAINT_INTERVAL_S:
                    last_paint = time.perf_counter()
                    yield [f"comparing {batch}…"] + self.columns(
                        texts, footers, constraint, raw, failed, chosen_models, runs
                    )
        finally:  # the page went away: the streams stop too
            for _, stop, _ in streams.values():
                stop.set()
        note = (
            f" · {len(failed)} of {len(chosen_models)} models did not run (their columns say why)"
            if failed
            else ""
        )
        if cancel.is_set():
            note += " · stopped: the columns end where Stop found them"
        yield [summary + note] + self.columns(
            texts, footers, constraint, raw, failed, chosen_models, runs
        )

    def stop(self, request: gr.Request | None = None) -> bool:
        """Stop: the session's comparison ends within a step (a chat reply goes on); False
        when none runs."""
        return self.sessions.stop(request, COMPARE)

    def stop_pressed(self, request: gr.Request | None = None) -> None:
        """The Stop button: no output of its own (the comparison's last columns say it
        stopped; a value returned to no output made Gradio warn at each press)."""
        self.stop(request)

    @staticmethod
    def footer(chunk, constraint) -> str:
        stats = chunk.stats
        ending = format_note(constraint, stats.finish_reason)
        return (
            f"{stats.new_tokens} tokens · {stats.decode_tokens_per_s:.1f} tokens/s"
            + (f" · {stats.finish_reason}" if chunk.done else "")
            + (f" · {ending}" if chunk.done and ending else "")
        )

    @staticmethod
    def batch(names, runs, constraint) -> str:
        """What runs as one batch, for the status line."""
        presets = f"{len(names)} preset{'s' if len(names) != 1 else ''}"
        if constraint is None:
            return f"{presets} as one batch"
        label = format_label(constraint)
        if len(runs) > len(names):
            return (
                f"{presets} with and without the {label} format, {len(runs)} replies as one batch"
            )
        return f"{presets} as one batch, output format {label}"

    def columns(self, texts, footers, constraint, raw, failed, chosen_models, runs) -> list:
        """One update per slot: those that run show their settings, text and footer; under an
        output format each title says whether its column has it; with several models each
        title names its model, and a base model's says it continues the prompt as text. The
        columns of a model that failed show why."""
        several = len(chosen_models) > 1
        out = []
        for slot in self.slots:
            model, name, free = slot
            if model not in chosen_models or (name, free) not in runs:
                out.append(gr.update(visible=False, value=""))
                continue
            p = self.presets[name]
            title = (
                (f"{model} · " if several else "")
                + name
                + (
                    f" · {format_label(None if free else constraint)}"
                    if constraint is not None
                    else ""
                )
                + (f" · {COMPLETION}" if raw.get(model) else "")
            )
            head = f"### {title}\n`{describe(p)}`\n\n"
            if model in failed:
                body = error(failed[model])
            else:
                body = html.escape(texts[slot]) + f"\n\n*{footers[slot]}*"
            out.append(gr.update(visible=True, value=head + body))
        return out


def build_compare_tab(app: TabContext, label: str) -> None:
    """The Compare tab and its event, under `label`; call inside the app's `gr.Blocks`. The
    app's header (the line above the tabs) is redrawn after a comparison (it may have loaded
    the default model)."""
    compare = CompareHandlers(app.models, app.presets, app.sessions)
    presets, models = compare.presets, compare.models
    several = len(models.names) > 1
    with gr.Tab(label):
        gr.Markdown(ABOUT + (ABOUT_MODELS if several else ""))
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", scale=3, value="Write one sentence about a cat.")
            chosen = gr.CheckboxGroup(
                choices=list(presets),
                label="Presets",
                value=[n for n in DEFAULT_CHOICE if n in presets],
            )
        # shown only when the app serves several models (with one there is nothing to choose)
        chosen_models = gr.CheckboxGroup(
            choices=models.names,
            value=[models.default],
            label="Models",
            visible=several,
            info="each chosen model answers with every chosen "
            "preset; a model not loaded yet loads first",
        )
        with gr.Row():
            seed = gr.Number(label="Compare seed", value=42, precision=0, info="-1 = random")
            tokens = gr.Slider(minimum=1, maximum=512, value=48, step=1, label="Tokens per column")
            button = gr.Button("Compare", variant="primary")
            stop_btn = gr.Button("Stop", variant="stop")
        with gr.Row():
            with gr.Column(scale=3):
                output = build_output_format()
            also_free = gr.Checkbox(
                label="Also without the output format",
                scale=1,
                info="each preset twice in the same batch: with the "
                "format and without it, side by side",
            )
        status = gr.Markdown()
        # one row: a preset's columns side by side, each model's next to the others', each
        # beside its column without the format; a narrow page wraps them
        with gr.Row():
            slots = {
                (m, n, free): gr.Markdown(visible=False, elem_classes=["ms-column"], min_width=240)
                for n in presets
                for m in models.names
                for free in (False, True)
            }
    columns = [slots[slot] for slot in compare.slots]
    run = button.click(
        compare.compare,
        [prompt, chosen, seed, tokens, *output.inputs, also_free, chosen_models],
        **engine_event([status, *columns], columns),
    )
    stop_btn.click(compare.stop_pressed, None, None, queue=False)  # not queued behind it
    app.header.refresh_after([run])
