"""The Compare tab: one prompt answered by several presets with the same seed, every column
streaming, all held to the Output format; optionally each preset also without it, to see what
the format changes. The engine runs the columns as one batch: each step advances all of them."""

from __future__ import annotations

import html
import time

import gradio as gr

from miniserve.config import SamplingParams
from miniserve.engine import Engine
from miniserve.ui.common import (ENGINE_EVENTS, FREE_TEXT, PAINT_INTERVAL_S, USER_ERRORS,
                                 Sessions, build_output_format, constraint_from, error,
                                 format_label, format_note, seed_from, user_message, whole)

ABOUT = ("One prompt, several presets, the same seed: see what greedy, top-k and top-p change. "
         "The columns run as one batch: each engine step advances every column by a token.")
DEFAULT_CHOICE = ("factual", "balanced", "creative")


class CompareHandlers:
    """The Compare tab's handler over one engine and its presets. Its columns are `slots`:
    (preset, False) for each preset under the output format, then (preset, True) for each
    preset without it."""

    def __init__(self, engine: Engine, presets: dict[str, SamplingParams],
                 sessions: Sessions | None = None):
        self.engine = engine
        self.presets = presets
        self.sessions = sessions or Sessions()
        self.slots = [(n, False) for n in presets] + [(n, True) for n in presets]

    def compare(self, prompt, chosen, seed, max_tokens, output_format=FREE_TEXT,
                format_text="", also_free=False, request: gr.Request | None = None):
        """Answer `prompt` with each preset named in `chosen`, held to the output format; with
        `also_free` (and a format), each preset a second time without it, in the same batch.
        Yields [status, one update per slot]: a column that runs visible with its text and
        its tokens/s, the others hidden. A bad value yields one error status instead."""
        names = [n for n in self.presets if n in (chosen or [])]
        hidden = [gr.update(visible=False, value="") for _ in self.slots]
        if not (prompt or "").strip() or not names:
            yield [error("type a prompt and choose at least one preset")] + hidden
            return
        with self.sessions.running(request) as cancel:
            try:
                seed = seed_from(seed)
                constraint = constraint_from(output_format, format_text)
                runs = [(n, False) for n in names]  # the batch's columns, as slots
                if also_free and constraint is not None:
                    runs += [(n, True) for n in names]
                settings = [self.presets[n].replace(seed=seed, max_new_tokens=whole(max_tokens),
                                                    constraint=None if free else constraint)
                            for n, free in runs]
                ids = self.engine.chat_prompt([{"role": "user", "content": prompt}], settings[0])
                texts, footers = {r: "" for r in runs}, {r: "" for r in runs}
                batch = self.batch(names, runs, constraint)
                note = (" · “Also without the output format” needs an output format"
                        if also_free and constraint is None else "")
                last_paint = 0.0
                for col, chunk, _ in self.engine.compare(ids, settings, cancel=cancel):
                    run = runs[col]
                    texts[run] += chunk.text
                    stats = chunk.stats
                    ending = format_note(settings[col].constraint, stats.finish_reason)
                    footers[run] = (f"{stats.new_tokens} tokens · "
                                    f"{stats.decode_tokens_per_s:.1f} tokens/s"
                                    + (f" · {stats.finish_reason}" if chunk.done else "")
                                    + (f" · {ending}" if chunk.done and ending else ""))
                    if chunk.done or time.perf_counter() - last_paint >= PAINT_INTERVAL_S:
                        last_paint = time.perf_counter()
                        yield [f"comparing {batch}…"] + self.columns(texts, footers, constraint)
                yield ([f"same prompt, seed {seed if seed is not None else 'random'}, {batch}"
                        f"{note}"] + self.columns(texts, footers, constraint))
            except USER_ERRORS as e:
                yield [error(user_message(e))] + hidden
            except Exception as e:  # noqa: BLE001 -- show it; the app keeps serving
                yield [error(f"{type(e).__name__}: {e}")] + hidden

    @staticmethod
    def batch(names, runs, constraint) -> str:
        """What runs as one batch, for the status line."""
        presets = f"{len(names)} preset{'s' if len(names) != 1 else ''}"
        if constraint is None:
            return f"{presets} as one batch"
        label = format_label(constraint)
        if len(runs) > len(names):
            return (f"{presets} with and without the {label} format, {len(runs)} replies as "
                    f"one batch")
        return f"{presets} as one batch, output format {label}"

    def columns(self, texts, footers, constraint) -> list:
        """One update per slot: those that run show their settings, text and footer; under an
        output format each title says whether its column has it."""
        out = []
        for slot in self.slots:
            if slot not in texts:
                out.append(gr.update(visible=False, value=""))
                continue
            name, free = slot
            p = self.presets[name]
            title = name + (f" · {format_label(None if free else constraint)}"
                            if constraint is not None else "")
            head = (f"### {title}\n`T={p.temperature:g} top_k={p.top_k} top_p={p.top_p:g} "
                    f"min_p={p.min_p:g} rep={p.repetition_penalty:g}`\n\n")
            out.append(gr.update(visible=True, value=head + html.escape(texts[slot]) +
                                 f"\n\n*{footers[slot]}*"))
        return out


def build_compare_tab(compare: CompareHandlers) -> None:
    """The Compare tab and its event; call inside the app's `gr.Blocks`."""
    presets = compare.presets
    with gr.Tab("Compare"):
        gr.Markdown(ABOUT)
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", scale=3, value="Write one sentence about a cat.")
            chosen = gr.CheckboxGroup(choices=list(presets), label="Presets",
                                      value=[n for n in DEFAULT_CHOICE if n in presets])
        with gr.Row():
            seed = gr.Number(label="Compare seed", value=42, precision=0, info="-1 = random")
            tokens = gr.Slider(minimum=1, maximum=512, value=48, step=1,
                               label="Tokens per column")
            button = gr.Button("Compare", variant="primary")
        with gr.Row():
            with gr.Column(scale=3):
                output = build_output_format()
            also_free = gr.Checkbox(label="Also without the output format", scale=1,
                                    info="each preset twice in the same batch: with the "
                                         "format and without it, side by side")
        status = gr.Markdown()
        with gr.Row():  # each preset's column beside its column without the format
            slots = {slot: gr.Markdown(visible=False, elem_classes=["ms-column"])
                     for name in presets for slot in ((name, False), (name, True))}
    button.click(compare.compare, [prompt, chosen, seed, tokens, *output.inputs, also_free],
                 [status, *(slots[slot] for slot in compare.slots)],
                 concurrency_id=ENGINE_EVENTS)
