"""The Chat tab: a streaming conversation with sliders, Stop, Regenerate, Undo and the token
inspector. `ChatHandlers` holds what its buttons call; each handler is a plain method (the
streaming ones generators) that runs without a browser."""

from __future__ import annotations

import time

import gradio as gr

from miniserve.config import FIELDS, SamplingParams
from miniserve.engine import Engine
from miniserve.inspector import Inspector
from miniserve.ui.common import (ENGINE_EVENTS, PAINT_INTERVAL_S, USER_ERRORS, Sessions, error,
                                 is_error, params_from, plain_history)

assert list(FIELDS) == ["temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                        "max_new_tokens"], "the handlers below take the sliders in this order"
SLIDER_MAX = {"top_k": 200}  # the slider's range; larger values are still valid via CLI/API
SLIDER_STEP = {"temperature": 0.05, "top_k": 1, "top_p": 0.01, "min_p": 0.01,
               "repetition_penalty": 0.01, "max_new_tokens": 1}


def chat_status(stats, dropped: int, note: str = "") -> str:
    """The line under the chat after a reply: its stats and whether old turns were dropped."""
    trimmed = (f" · history trimmed: {dropped} older messages dropped to fit the context"
               if dropped else " · history not trimmed")
    return stats.summary(" · ") + trimmed + (f" · {note}" if note else "")


class ChatHandlers:
    """The Chat tab's handlers over one engine and its presets. The sliders arrive in FIELDS
    order; `request` (injected by Gradio) names the browser session that Stop cancels."""

    def __init__(self, engine: Engine, presets: dict[str, SamplingParams],
                 sessions: Sessions | None = None):
        self.engine = engine
        self.presets = presets
        self.sessions = sessions or Sessions()

    def reply(self, history: list[dict], system: str, settings, seed, inspect_on, request=None):
        """Shared by Send and Regenerate: stream the assistant's reply to `history`.
        Yields (messages shown, status line, inspector HTML); on an error, `history` as it was
        and the error as the status."""
        with self.sessions.running(request) as cancel:
            shown = [*history, {"role": "assistant", "content": ""}]
            try:
                params = params_from(settings, seed)
                messages = (([{"role": "system", "content": system}] if (system or "").strip()
                             else []) + history)
                inspector = Inspector(self.engine.tokenizer, params) if inspect_on else None
                stream = self.engine.chat(messages, params, cancel=cancel,
                                          observer=inspector.observe if inspector else None)
                text = ""
                yield shown, "generating…", ""
                last_paint = time.perf_counter()
                for chunk in stream:
                    text += chunk.text
                    shown[-1] = {"role": "assistant", "content": text}
                    if chunk.done:
                        note = "stopped by you" if chunk.stats.finish_reason == "cancelled" else ""
                        yield (shown, chat_status(chunk.stats, chunk.dropped_messages, note),
                               inspector.as_html() if inspector else "")
                    elif chunk.text and time.perf_counter() - last_paint >= PAINT_INTERVAL_S:
                        last_paint = time.perf_counter()
                        yield shown, "generating…", ""
            except USER_ERRORS as e:
                yield history, error(str(e)), ""
            except Exception as e:  # noqa: BLE001 -- show it, keep the conversation
                yield history, error(f"{type(e).__name__}: {e}"), ""

    # explicit parameters: Gradio injects `request` only into functions without *args
    def send(self, message, chatbot, system, temperature, top_k, top_p, min_p,
             repetition_penalty, max_new_tokens, seed, inspect_on,
             request: gr.Request | None = None):
        """Send: yields (chatbot, message box, status, inspector HTML). On an error the typed
        message stays in the box and the conversation as it was."""
        settings = [temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens]
        history = plain_history(chatbot)
        if not (message or "").strip():
            yield chatbot, message, error("the message is empty; type something to send"), ""
            return
        pending = [*history, {"role": "user", "content": message}]
        for shown, status, inspected in self.reply(pending, system, settings, seed, inspect_on,
                                                   request):
            failed = is_error(status)
            yield (chatbot if failed else shown), (message if failed else ""), status, inspected

    def regenerate(self, chatbot, system, temperature, top_k, top_p, min_p, repetition_penalty,
                   max_new_tokens, seed, inspect_on, request: gr.Request | None = None):
        """Regenerate the last reply: yields (chatbot, status, inspector HTML)."""
        settings = [temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens]
        history = plain_history(chatbot)
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if not history:
            yield chatbot, error("nothing to regenerate yet"), ""
            return
        for shown, status, inspected in self.reply(history, system, settings, seed, inspect_on,
                                                   request):
            yield (chatbot if is_error(status) else shown), status, inspected

    def stop(self, request: gr.Request | None = None) -> None:
        self.sessions.stop(request)

    @staticmethod
    def undo(chatbot):
        """Remove the last turn: (chatbot, its message back in the box, status)."""
        history = plain_history(chatbot)
        text = ""
        while history and history[-1]["role"] == "assistant":
            history.pop()
        if history and history[-1]["role"] == "user":
            text = history.pop()["content"]
        return history, text, "last turn removed" if text else "nothing to undo"

    @staticmethod
    def clear():
        """(chatbot, message box, status, inspector HTML) of an empty conversation."""
        return [], "", "conversation cleared", ""

    def apply_preset(self, name) -> list:
        """The sliders' values (FIELDS order) of a preset."""
        preset = self.presets[name]
        return [getattr(preset, k) for k in FIELDS]


def build_chat_tab(chat: ChatHandlers, default_preset: str) -> None:
    """The Chat tab and its events; call inside the app's `gr.Blocks`."""
    start = chat.presets[default_preset]
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
                preset = gr.Dropdown(choices=list(chat.presets), value=default_preset,
                                     label="Preset")
                sliders = [gr.Slider(minimum=spec.low, maximum=SLIDER_MAX.get(k, spec.high),
                                     value=getattr(start, k), step=SLIDER_STEP[k],
                                     label=spec.label, info=spec.help)
                           for k, spec in FIELDS.items()]
                seed = gr.Number(label="Seed", value=-1, precision=0,
                                 info="-1 = random; a fixed seed repeats a sampled reply")
                system = gr.Textbox(label="System prompt", lines=3,
                                    placeholder="(the model's default)")

    settings = [*sliders, seed, inspect_on]
    send_args = dict(fn=chat.send, inputs=[message, chatbot, system, *settings],
                     outputs=[chatbot, message, status, inspector_view],
                     concurrency_id=ENGINE_EVENTS)
    send_btn.click(**send_args)
    message.submit(**send_args)
    regen_btn.click(chat.regenerate, [chatbot, system, *settings],
                    [chatbot, status, inspector_view], concurrency_id=ENGINE_EVENTS)
    stop_btn.click(chat.stop, None, None, queue=False)
    undo_btn.click(chat.undo, chatbot, [chatbot, message, status])
    clear_btn.click(chat.clear, None, [chatbot, message, status, inspector_view])
    preset.change(chat.apply_preset, preset, sliders)
