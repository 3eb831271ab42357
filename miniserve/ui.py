"""The Gradio web app: Chat, Compare and Benchmark tabs. No generation logic lives here:
widget values become `SamplingParams`, and what the engine yields is rendered."""

from __future__ import annotations

import html
import threading
import time

import gradio as gr
import pandas as pd

from miniserve.bench import BenchConfig, describe_run, run_bench, to_dict
from miniserve.chat import ChatError
from miniserve.config import FIELDS, ConfigError, SamplingParams, check_seed
from miniserve.engine import Engine, EngineBusy
from miniserve.inspector import Inspector

assert list(FIELDS) == ["temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                        "max_new_tokens"], "the handlers below take the sliders in this order"
SLIDER_MAX = {"top_k": 200}  # the slider's range; larger values are still valid via CLI/API
SLIDER_STEP = {"temperature": 0.05, "top_k": 1, "top_p": 0.01, "min_p": 0.01,
               "repetition_penalty": 0.01, "max_new_tokens": 1}
# Repaint a streaming reply at most this often: ~12 updates a second reads as smooth, and each
# repaint costs browser CPU that a 2-core machine would otherwise give to the model.
PAINT_INTERVAL_S = 0.08
CSS = """
#status {font-size: 0.9em; opacity: 0.85}
.ms-inspector .ms-tok:hover {outline: 1px solid #333}
"""


def _text(content) -> str:
    """Chatbot message content as plain text (Gradio may hand back content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", content.get("value", "")))
    if isinstance(content, list):
        return "".join(_text(part) for part in content)
    return "" if content is None else str(content)


def _history(chatbot) -> list[dict]:
    return [{"role": m["role"], "content": _text(m["content"])} for m in (chatbot or [])
            if isinstance(m, dict) and m.get("role") in ("user", "assistant")]


def _status(stats, dropped: int, note: str = "") -> str:
    trimmed = (f" · history trimmed: {dropped} older messages dropped to fit the context"
               if dropped else " · history not trimmed")
    return stats.summary(" · ") + trimmed + (f" · {note}" if note else "")


def _seed(value) -> int | None:
    """The Seed box: empty or negative means a random seed."""
    return None if value is None or value == "" or float(value) < 0 else check_seed(float(value))


def _error(message: str) -> str:
    return f"**Error:** {html.escape(message)}"


def build_ui(engine: Engine, presets: dict[str, SamplingParams],
             default_preset: str = "balanced") -> gr.Blocks:
    default_preset = default_preset if default_preset in presets else next(iter(presets))
    start = presets[default_preset]
    cancels: dict[str, threading.Event] = {}  # one per browser session

    def params_from(values, seed) -> SamplingParams:
        fields = dict(zip(FIELDS, values))
        fields = {k: (int(v) if FIELDS[k].kind is int and v is not None and float(v).is_integer()
                      else v) for k, v in fields.items()}
        return SamplingParams(seed=_seed(seed), **fields)

    def generate_reply(history: list[dict], system: str, settings, seed, inspect_on, request):
        """Shared by Send and Regenerate: stream the assistant's reply to `history`."""
        session = getattr(request, "session_hash", None) or "default"
        cancel = cancels[session] = threading.Event()
        shown = [*history, {"role": "assistant", "content": ""}]
        try:
            params = params_from(settings, seed)
            messages = ([{"role": "system", "content": system}] if system.strip() else []) + history
            inspector = Inspector(engine.tokenizer, params) if inspect_on else None
            stream = engine.chat(messages, params, cancel=cancel,
                                 observer=inspector.observe if inspector else None)
            reply = ""
            yield shown, "generating…", ""
            last_paint = time.perf_counter()
            for chunk in stream:
                reply += chunk.text
                shown[-1] = {"role": "assistant", "content": reply}
                if chunk.done:
                    note = "stopped by you" if chunk.stats.finish_reason == "cancelled" else ""
                    yield (shown, _status(chunk.stats, chunk.dropped_messages, note),
                           inspector.as_html() if inspector else "")
                elif chunk.text and time.perf_counter() - last_paint >= PAINT_INTERVAL_S:
                    last_paint = time.perf_counter()
                    yield shown, "generating…", ""
        except (ConfigError, ChatError, EngineBusy) as e:
            yield history, _error(str(e)), ""
        except Exception as e:  # noqa: BLE001 -- show it, keep the conversation
            yield history, _error(f"{type(e).__name__}: {e}"), ""
        finally:
            cancels.pop(session, None)

    # explicit parameters: Gradio injects `request` only into functions without *args
    def send(message, chatbot, system, temperature, top_k, top_p, min_p, repetition_penalty,
             max_new_tokens, seed, inspect_on, request: gr.Request):
        settings = [temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens]
        history = _history(chatbot)
        if not (message or "").strip():
            yield chatbot, message, _error("the message is empty; type something to send"), ""
            return
        pending = [*history, {"role": "user", "content": message}]
        for shown, status, insp in generate_reply(pending, system, settings, seed, inspect_on,
                                                  request):
            failed = status.startswith("**Error")
            # on an error the typed message stays in the box, the conversation as it was
            yield (chatbot if failed else shown), (message if failed else ""), status, insp

    def regenerate(chatbot, system, temperature, top_k, top_p, min_p, repetition_penalty,
                   max_new_tokens, seed, inspect_on, request: gr.Request):
        settings = [temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens]
        history = _history(chatbot)
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if not history:
            yield chatbot, _error("nothing to regenerate yet"), ""
            return
        for shown, status, insp in generate_reply(history, system, settings, seed, inspect_on,
                                                  request):
            yield (chatbot if status.startswith("**Error") else shown), status, insp

    def stop(request: gr.Request):
        event = cancels.get(getattr(request, "session_hash", None) or "default")
        if event is not None:
            event.set()

    def undo(chatbot):
        history = _history(chatbot)
        text = ""
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if history and history[-1]["role"] == "user":
            text = history.pop()["content"]
        return history, text, "last turn removed" if text else "nothing to undo"

    def apply_preset(name):
        p = presets[name]
        return [getattr(p, k) for k in FIELDS]

    def compare(prompt, chosen, seed, max_tokens, request: gr.Request):
        """Answer one prompt with several presets; every column streams with its own speed."""
        names = [n for n in presets if n in (chosen or [])]
        hidden = [gr.update(visible=False, value="") for _ in presets]
        if not (prompt or "").strip() or not names:
            yield [_error("type a prompt and choose at least one preset")] + hidden
            return
        session = getattr(request, "session_hash", None) or "default"
        cancel = cancels[session] = threading.Event()
        try:
            seed = _seed(seed)
            settings = [presets[n].replace(seed=seed, max_new_tokens=int(max_tokens))
                        for n in names]
            ids = engine.chat_prompt([{"role": "user", "content": prompt}], settings[0])
            texts, footers = {n: "" for n in names}, {n: "" for n in names}
            last_paint = 0.0
            for col, chunk, busy in engine.compare(ids, settings, cancel=cancel):
                name = names[col]
                texts[name] += chunk.text
                rate = chunk.stats.new_tokens / busy if busy else 0.0
                footers[name] = (f"{chunk.stats.new_tokens} tokens · {rate:.1f} tokens/s"
                                 + (f" · {chunk.stats.finish_reason}" if chunk.done else ""))
                if chunk.done or time.perf_counter() - last_paint >= PAINT_INTERVAL_S:
                    last_paint = time.perf_counter()
                    yield ["comparing…"] + _columns(names, texts, footers)
            yield [f"same prompt, seed {seed if seed is not None else 'random'}, "
                   f"{len(names)} presets"] + _columns(names, texts, footers)
        except (ConfigError, ChatError, EngineBusy) as e:
            yield [_error(str(e))] + hidden
        finally:
            cancels.pop(session, None)

    def _columns(names, texts, footers):
        out = []
        for name, p in presets.items():
            if name not in names:
                out.append(gr.update(visible=False, value=""))
                continue
            head = (f"### {name}\n`T={p.temperature:g} top_k={p.top_k} top_p={p.top_p:g} "
                    f"min_p={p.min_p:g} rep={p.repetition_penalty:g}`\n\n")
            out.append(gr.update(visible=True, value=head + html.escape(texts[name]) +
                                 f"\n\n*{footers[name]}*"))
        return out

    def benchmark(lengths_text, new_tokens, repeat, progress=gr.Progress()):
        try:
            lengths = [int(x) for x in str(lengths_text).replace(" ", "").split(",") if x]
            config = BenchConfig(prompt_tokens=lengths, new_tokens=int(new_tokens),
                                 repeat=int(repeat))
        except ValueError as e:
            return None, None, _error(f"Prompt lengths: {e}" if "invalid literal" in str(e)
                                      else str(e))
        result = run_bench(engine, config, progress=lambda f, m: progress(f, desc=m))
        table = pd.DataFrame(to_dict(result)["rows"])
        return table, table, describe_run(result)

    info = engine.info()
    with gr.Blocks(title="MiniServeLM") as demo:
        precision = info["dtype"] + (f" weights, {info['compute_dtype']} arithmetic"
                                     if info["compute_dtype"] != info["dtype"] else "")
        gr.Markdown(f"## MiniServeLM · {info['name']} on {info['device']} ({precision}, "
                    f"{info['runner']} runner"
                    + (f", {info['kernels']} kernels" if info["kernels"] else "")
                    + f"), context {info['context_length']} tokens")
        with gr.Tab("Chat"):
            with gr.Row():
                with gr.Column(scale=3):
                    chatbot = gr.Chatbot(label="Conversation", height=460, buttons=["copy"])
                    message = gr.Textbox(label="Message", placeholder="Type a message and press "
                                         "Enter", lines=2, autofocus=True)
                    with gr.Row():
                        send_btn = gr.Button("Send", variant="primary")
                        stop_btn = gr.Button("Stop", variant="stop")
                        regen_btn = gr.Button("Regenerate")
                        undo_btn = gr.Button("Undo")
                        clear_btn = gr.Button("Clear")
                    status = gr.Markdown("ready", elem_id="status")
                    inspect_on = gr.Checkbox(label="Token inspector", value=False,
                                             info="shade each token by its probability; hover "
                                                  "for the top-5 alternatives")
                    inspector_view = gr.HTML(elem_id="inspector")
                with gr.Column(scale=1):
                    preset = gr.Dropdown(choices=list(presets), value=default_preset,
                                         label="Preset")
                    sliders = [gr.Slider(minimum=spec.low, maximum=SLIDER_MAX.get(k, spec.high),
                                         value=getattr(start, k), step=SLIDER_STEP[k],
                                         label=spec.label, info=spec.help)
                               for k, spec in FIELDS.items()]
                    seed = gr.Number(label="Seed", value=-1, precision=0,
                                     info="-1 = random; a fixed seed repeats a sampled reply")
                    system = gr.Textbox(label="System prompt", lines=3,
                                        placeholder="(the model's default)")
        with gr.Tab("Compare"):
            gr.Markdown("One prompt, several presets, the same seed: see what greedy, top-k "
                        "and top-p change. The columns advance one token each in turn.")
            with gr.Row():
                compare_prompt = gr.Textbox(label="Prompt", scale=3,
                                            value="Write one sentence about a cat.")
                compare_presets = gr.CheckboxGroup(choices=list(presets), label="Presets",
                                                   value=[n for n in ("factual", "balanced",
                                                                      "creative") if n in presets])
            with gr.Row():
                compare_seed = gr.Number(label="Compare seed", value=42, precision=0,
                                         info="-1 = random")
                compare_tokens = gr.Slider(minimum=1, maximum=512, value=48, step=1,
                                           label="Tokens per column")
                compare_btn = gr.Button("Compare", variant="primary")
            compare_status = gr.Markdown()
            with gr.Row():
                columns = [gr.Markdown(visible=False, elem_classes=["ms-column"])
                           for _ in presets]
        with gr.Tab("Benchmark"):
            gr.Markdown("Manual decoding with and without the KV cache, and transformers' "
                        "`generate()` as the reference, greedy, over several prompt lengths.")
            with gr.Row():
                lengths = gr.Textbox(label="Prompt lengths (tokens)", value="32,128,512")
                bench_new = gr.Slider(minimum=2, maximum=256, value=24, step=1, label="New tokens")
                bench_repeat = gr.Slider(minimum=1, maximum=5, value=1, step=1,
                                         label="Repeats (median)")
            bench_btn = gr.Button("Run benchmark", variant="primary")
            bench_status = gr.Markdown()
            bench_table = gr.Dataframe(label="Results", interactive=False)
            bench_plot = gr.LinePlot(x="prompt_tokens", y="decode_tokens_per_s", color="mode",
                                     title="Decode tokens/s by prompt length",
                                     x_title="prompt tokens", y_title="decode tokens/s")

        settings = [*sliders, seed, inspect_on]
        send_args = dict(fn=send, inputs=[message, chatbot, system, *settings],
                         outputs=[chatbot, message, status, inspector_view])
        send_btn.click(**send_args)
        message.submit(**send_args)
        regen_btn.click(regenerate, [chatbot, system, *settings],
                        [chatbot, status, inspector_view])
        stop_btn.click(stop, None, None, queue=False)
        undo_btn.click(undo, chatbot, [chatbot, message, status])
        clear_btn.click(lambda: ([], "", "conversation cleared", ""), None,
                        [chatbot, message, status, inspector_view])
        preset.change(apply_preset, preset, sliders)
        compare_btn.click(compare, [compare_prompt, compare_presets, compare_seed, compare_tokens],
                          [compare_status, *columns])
        bench_btn.click(benchmark, [lengths, bench_new, bench_repeat],
                        [bench_table, bench_plot, bench_status])
    demo.queue(max_size=engine.max_queue * 4)
    return demo
