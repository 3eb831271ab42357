"""The Compare tab: one prompt answered by several presets with the same seed, every column
streaming. The engine runs the columns as one batch: each step advances all of them."""

from __future__ import annotations

import html
import time

import gradio as gr

from miniserve.config import SamplingParams
from miniserve.engine import Engine
from miniserve.ui.common import (ENGINE_EVENTS, PAINT_INTERVAL_S, USER_ERRORS, Sessions, error,
                                 seed_from, whole)

ABOUT = ("One prompt, several presets, the same seed: see what greedy, top-k and top-p change. "
         "The columns run as one batch: each engine step advances every column by a token.")
DEFAULT_CHOICE = ("factual", "balanced", "creative")


class CompareHandlers:
    """The Compare tab's handler over one engine and its presets."""

    def __init__(self, engine: Engine, presets: dict[str, SamplingParams],
                 sessions: Sessions | None = None):
        self.engine = engine
        self.presets = presets
        self.sessions = sessions or Sessions()

    def compare(self, prompt, chosen, seed, max_tokens, request: gr.Request | None = None):
        """Answer `prompt` with each preset named in `chosen`. Yields [status, one update per
        preset (in the presets' order)]: a chosen preset's column visible with its text and
        its tokens/s, the others hidden. A bad value yields one error status instead."""
        names = [n for n in self.presets if n in (chosen or [])]
        hidden = [gr.update(visible=False, value="") for _ in self.presets]
        if not (prompt or "").strip() or not names:
            yield [error("type a prompt and choose at least one preset")] + hidden
            return
        with self.sessions.running(request) as cancel:
            try:
                seed = seed_from(seed)
                settings = [self.presets[n].replace(seed=seed, max_new_tokens=whole(max_tokens))
                            for n in names]
                ids = self.engine.chat_prompt([{"role": "user", "content": prompt}], settings[0])
                texts, footers = {n: "" for n in names}, {n: "" for n in names}
                batch = f"{len(names)} preset{'s' if len(names) != 1 else ''} as one batch"
                last_paint = 0.0
                for col, chunk, _ in self.engine.compare(ids, settings, cancel=cancel):
                    name = names[col]
                    texts[name] += chunk.text
                    footers[name] = (f"{chunk.stats.new_tokens} tokens · "
                                     f"{chunk.stats.decode_tokens_per_s:.1f} tokens/s"
                                     + (f" · {chunk.stats.finish_reason}" if chunk.done else ""))
                    if chunk.done or time.perf_counter() - last_paint >= PAINT_INTERVAL_S:
                        last_paint = time.perf_counter()
                        yield [f"comparing {batch}…"] + self.columns(names, texts, footers)
                yield ([f"same prompt, seed {seed if seed is not None else 'random'}, {batch}"]
                       + self.columns(names, texts, footers))
            except USER_ERRORS as e:
                yield [error(str(e))] + hidden
            except Exception as e:  # noqa: BLE001 -- show it; the app keeps serving
                yield [error(f"{type(e).__name__}: {e}")] + hidden

    def columns(self, names, texts, footers) -> list:
        """One update per preset: the chosen ones show their settings, text and footer."""
        out = []
        for name, p in self.presets.items():
            if name not in names:
                out.append(gr.update(visible=False, value=""))
                continue
            head = (f"### {name}\n`T={p.temperature:g} top_k={p.top_k} top_p={p.top_p:g} "
                    f"min_p={p.min_p:g} rep={p.repetition_penalty:g}`\n\n")
            out.append(gr.update(visible=True, value=head + html.escape(texts[name]) +
                                 f"\n\n*{footers[name]}*"))
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
        status = gr.Markdown()
        with gr.Row():
            columns = [gr.Markdown(visible=False, elem_classes=["ms-column"]) for _ in presets]
    button.click(compare.compare, [prompt, chosen, seed, tokens], [status, *columns],
                 concurrency_id=ENGINE_EVENTS)
