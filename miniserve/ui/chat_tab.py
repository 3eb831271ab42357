"""The Chat tab: a streaming conversation with sliders, an output format, Stop, Regenerate, Undo,
edits that branch, the token inspector, and the Conversations sidebar (sidebar.py) over the saved
history. A thinking model's reasoning streams open above its reply and folds when the answer
starts; its Think switch and reasoning budget show for such a model only. A reply's tool calls
show as cards (the chat runs none).
`ChatHandlers` holds what its buttons call; each handler is a plain method (the streaming ones
generators) that runs without a browser."""

from __future__ import annotations

import functools
import html
import inspect
from contextlib import ExitStack
from typing import TYPE_CHECKING, NamedTuple

import gradio as gr

from miniserve.core.config import SamplingParams
from miniserve.engine.engine import Engine
from miniserve.engine.inspector import Inspector
from miniserve.engine.turn import ChatTurn, history_of
from miniserve.models.registry import Models
from miniserve.store.store import Store, StoreError, open_store
from miniserve.ui.common import (
    STOP_WAIT_S,
    STREAMING,
    USER_ERRORS,
    Reading,
    Sessions,
    engine_event,
    error,
    message_text,
    streaming_status,
    user_message,
)
from miniserve.ui.conversation import SHOWN, Conversations, Shown, new_view, owner_of, strip_marks
from miniserve.ui.model_picker import (
    build_model_picker,
    follow_picker,
    load_messages,
    using,
)
from miniserve.ui.render import inspector_html, reply_rows, typed_text
from miniserve.ui.sidebar import SidebarHandlers, build_sidebar, wire_sidebar
from miniserve.ui.widgets import (
    GENERATING,
    NO_LIMIT,
    build_output_format,
    build_sampling,
    build_thinking,
    format_note,
    params_from,
    preset_values,
    takes_panel,
    thinking_options,
    unchanged,
)

if TYPE_CHECKING:
    from miniserve.ui import TabContext

# the controls the generating handlers take after the search box (widgets.takes_panel): the
# system prompt, the preset, the settings panel, the seed, the inspector, the output format,
# the model, the Think switch and the reasoning budget; an edit's EditData after them
PANEL = ("system", "preset", *GENERATING, ("think", True), ("budget", NO_LIMIT))
BROWSER_KEY = "miniserve"  # the browser's local-storage key for its owner id and open chat
CHAT = "chat"  # the kind of run (common.Sessions) that Undo stops
REPLY_TAKEN_BACK = "the reply was stopped and its turn taken back"
DRAFT_KEPT = "its message is back in the box, above what you had typed"
SEND = "send"  # the run's origin (Sessions.running) when the message box's Send or Enter began it
# a Send or Enter this long after one began while its reply runs is a second one, which Gradio
# drops (ChatHandlers.refused_send says why); sooner, a double click
SECOND_SEND_S = 0.5
STILL_STREAMING = "a reply is still loading or streaming: wait for it to end, or press Stop"
REPLY_KEPT = "the reply that was streaming was stopped and saved"
STOPPED_LOADING = "stopped while the model loaded: nothing was sent"


class Undo(NamedTuple):
    """Undo, taking over a streaming reply (common.Sessions.take_over): `draft`, what the
    message box held when Undo was pressed, which the turn's message goes back above."""

    draft: str = ""


def with_draft(text: str, draft: str) -> str:
    """What Undo leaves in the message box: the turn's message, and below it what was typed
    there meanwhile (nothing typed is lost); the draft alone where nothing came back."""
    draft = draft or ""
    if not text or not draft.strip() or draft.strip() == text.strip():
        return text or draft
    return f"{text}\n\n{draft}"


def chat_status(stats, dropped: int, note: str = "") -> str:
    """The line under the chat after a reply: its stats and whether old turns were dropped."""
    trimmed = (
        f" · history trimmed: {dropped} older messages dropped to fit the context"
        if dropped
        else " · history not trimmed"
    )
    return stats.summary(" · ") + trimmed + (f" · {note}" if note else "")


def empty_note(turn, stats, params) -> str:
    """Why a finished reply has nothing to show ("" when it has text, reasoning or calls, or
    was stopped): its bubble is empty, and the status line says why."""
    shown = turn.text_so_far.strip() or turn.reasoning_so_far or turn.calls_so_far
    if shown or stats.finish_reason == "cancelled":  # (Stop: "stopped by you" says it)
        return ""
    formatted = params.constraint is not None
    if formatted and params.stop:
        stop = "a stop string came, or the output format was complete, before any text"
    elif formatted:
        stop = "the output format was complete before any text"
    else:
        stop = "a stop string came first"
    why = {
        "eos": "its first token was the end"
        + (" (the output format allows an empty text)" if formatted else ""),
        "stop": stop,
        "length": "max new tokens ran out before any text",
    }.get(stats.finish_reason)
    return "empty reply" + (f": {why}" if why else "")


class ChatHandlers:
    """The Chat tab's handlers over the app's models, its presets and the conversation store.
    Handlers that show a conversation take the browser's state and the tab's view
    (conversation.py) and return `Shown` values; the ones that generate add the message box
    and the inspector's HTML. The settings panel arrives in widgets.setting_names order,
    then the Model dropdown (None: the default model), the Think switch and the reasoning
    budget (used for a model that thinks only); `request` (injected by Gradio) names the
    browser session that Stop cancels."""

    def __init__(
        self,
        models: Models | Engine,
        presets: dict[str, SamplingParams],
        sessions: Sessions | None = None,
        store: Store | None = None,
    ):
        self.models = Models.of(models)
        self.presets = presets
        self.sessions = sessions or Sessions()
        self.store = store if store is not None else open_store(enabled=False)
        self.conversations = Conversations(self.store)

    def _show(self, browser, view, status, query="") -> Shown:
        """The view as it is, or a new chat when its conversation is gone (deleted in another
        tab), or the status alone: never an exception out of a handler (show_safely)."""
        return self.conversations.show_safely(browser, view, status, query)

    def _start(self, browser, request) -> dict:
        """The browser's state with its owner id, given here on a first visit whose page has
        not run its load handler yet (a message sent at once): Conversations.start."""
        return self.conversations.start(browser, request)

    def _respond(
        self,
        browser,
        view,
        query,
        panel,
        request,
        *,
        text: str | None = None,
        under: str | None = None,
        reply_to: str | None = None,
        focus_new: bool = False,
        from_box: bool = True,
    ):
        """Add the user's `text` under the message `under` (None: as a first message) and
        stream the reply to it from `model`; with `text` None, stream a new reply to the user
        message `reply_to` (Regenerate); `output` is the Output format control's (format,
        text), `thinking` the Think switch's and the budget's (for a model that thinks). A
        model not loaded yet loads first, its progress on the status line. The user's message
        is saved when the engine takes the request, the reply when it ends (finished or
        stopped), with its settings (the model, the output format and the thinking among them),
        stats, reasoning and tool calls.
        Yields SHOWN values + (message box, inspector HTML); on an error the conversation as
        it was, the typed message kept in the box, and the error as the status. `from_box`:
        `text` is the message box's (Send), emptied from it once the engine takes it; an edited
        message (False) leaves the box, and a draft typed there, alone."""
        sent = from_box and text is not None  # the box's message
        box = text if sent else gr.update()
        browser = self._start(browser, request)

        def prepare(cancel):
            """The settings, the history, the model loaded (Stop and Undo end the wait): True
            when the reply can begin, False when stopped, None on an error (shown)."""
            nonlocal owner, params, options, name, cid, history
            try:
                owner = owner_of(browser)
                params = params_from(
                    panel.settings, panel.seed, panel.output_format, panel.format_text
                )
                options = thinking_options(panel.think, panel.budget)
                name = self.models.resolve(panel.model)
                cid = view.get("cid")
                before = self.conversations.path(owner, new_view(cid, reply_to or under))
                history = history_of(before)
                for note in load_messages(self.models, name, cancel):
                    yield (*self._show(browser, view, note, query), box, "")
            except (*USER_ERRORS, StoreError) as e:
                yield (*self._show(browser, view, error(user_message(e)), query), box, "")
                return None
            return not cancel.is_set()

        owner = params = options = name = cid = history = None
        asked = saved = False  # the message saved (Undo then takes this turn back); the reply

        def respond(cancel):  # the run's outputs; Undo's result may follow them (below)
            nonlocal view, reply_to, cid, params, asked, saved  # view: what the page shows
            with ExitStack() as held:
                try:
                    engine = held.enter_context(using(self.models, name))
                    inspector = Inspector(engine.tokenizer, params) if panel.inspect_on else None
                    turn = ChatTurn(
                        engine,
                        params,
                        system=panel.system,
                        history=history,
                        text=text,
                        preset=panel.preset,
                        cancel=cancel,
                        observer=inspector.observe if inspector else None,
                        options=options if getattr(engine, "thinks", False) else None,
                        progress=True,
                    )
                    reply_to = turn.save_question(
                        self.store, owner, cid, under if text is not None else reply_to
                    )
                    cid, params, asked = turn.conversation, turn.params, True
                except (*USER_ERRORS, StoreError) as e:
                    yield (*self._show(browser, view, error(user_message(e)), query), box, "")
                    return
                except Exception as e:  # noqa: BLE001 -- e.g. a remote server that went away
                    yield (
                        *self._show(browser, view, error(f"{type(e).__name__}: {e}"), query),
                        box,
                        "",
                    )
                    return
                view = new_view(cid, reply_to, reply_to if focus_new and text is not None else None)
                base = self.conversations.show(browser, view, STREAMING, query)
                streaming = base._replace(
                    conversations=gr.update(), title=gr.update(), system=gr.update()
                )
                shown = [*base.chatbot, {"role": "assistant", "content": ""}]
                # a message sent is taken from the box; then what is typed there meanwhile (the
                # next message, or a draft kept through Regenerate) stays
                kept = gr.update()
                yield (*base._replace(chatbot=shown), "" if sent else kept, "")
                reading = Reading(turn)
                try:
                    for _ in reading:
                        shown = [*base.chatbot, *self.streamed(turn)]
                        now = streaming._replace(chatbot=shown, status=streaming_status(turn.last))
                        yield (*now, kept, "")
                except Exception as e:  # noqa: BLE001 -- show it; the user's message is saved
                    yield (
                        *self._show(browser, view, error(f"{type(e).__name__}: {e}"), query),
                        kept,
                        "",
                    )
                    return
                last = reading.last
                if isinstance(cancel.taken_over, Undo):  # its result follows; the reply is not kept
                    return
                if last is None or not last.done:
                    yield (
                        *self._show(
                            browser, view, error("the reply ended without its stats"), query
                        ),
                        kept,
                        "",
                    )
                    return
                stats = last.stats
                stopped = turn.details()["status"] == "stopped"
                try:
                    reply = turn.save_reply(self.store, owner)
                    saved = True
                except StoreError as e:
                    yield (
                        *self._show(browser, view, error(f"the reply was not saved: {e}"), query),
                        kept,
                        "",
                    )
                    return
                notes = (
                    self.model_note(name),
                    f"seed {params.seed}",
                    "stopped by you" if stopped else "",
                    format_note(params.constraint, stats.finish_reason),
                    empty_note(turn, stats, params),
                )
                note = " · ".join(n for n in notes if n)
                final = self._show(
                    browser,
                    new_view(
                        cid, reply.id, reply.id if focus_new and text is None else view["focus"]
                    ),
                    chat_status(stats, last.dropped_messages, note),
                    query,
                )
                view = final.view
                yield (*final, kept, inspector_html(inspector))

        # the run starts before the model loads: Stop or Undo pressed during a load ends it
        # there, before anything is saved (the load itself goes on, for the next message)
        # one reply at a time (the page shows one): a send while one runs is refused
        origin = SEND if sent else ""
        with self.sessions.running(request, CHAT, alone=True, origin=origin) as cancel:
            if cancel is None:
                gr.Warning(STILL_STREAMING)
                yield unchanged(len(SHOWN) + 2)
                return
            replied = yield from prepare(cancel)
            if replied:
                yield from respond(cancel)
            elif replied is False and cancel.taken_over is None:  # Stop
                said = STOPPED_LOADING + ("; the message is in the box" if sent else "")
                yield (*self._show(browser, view, said, query), box, "")
            taken = self.sessions.close(cancel)  # pressed while it ran: common.Sessions
            if isinstance(taken, Undo):  # the reply's turn, or (none begun) the one before
                said = REPLY_TAKEN_BACK if asked else "last turn removed"
                yield (*self._take_back(browser, view, query, said, taken.draft), "")
            elif callable(taken):  # after_reply's event, on the view this run left
                done = list(taken(view))
                at = SHOWN.index("status")
                if saved and isinstance(done[at], str):  # say where the reply went
                    done[at] = " · ".join(part for part in (done[at], REPLY_KEPT) if part)
                yield (*done, *unchanged(len(SHOWN) + 2 - len(done)))

    @staticmethod
    def streamed(turn: ChatTurn) -> list[dict]:
        """The reply's rows while it streams: its reasoning open with a spinner until the
        answer (or a call) starts, then folded under its summary; its text; its calls."""
        return reply_rows(
            turn.text_so_far,
            turn.reasoning_so_far,
            turn.calls_so_far,
            pending=turn.thinking,
            tokens=turn.reasoning_tokens,
            seconds=turn.reasoning_s,
        )

    def thinks(self, model) -> bool:
        """Whether the model chosen thinks, as far as is known without loading it: a model
        not loaded yet says so once a reply has loaded it."""
        try:
            engine = self.models.loaded_engine(self.models.resolve(model))
        except USER_ERRORS:
            return False
        return bool(getattr(engine, "thinks", False))

    def thinking_controls(self, model):
        """The Think switch and the budget: shown for a model that thinks."""
        return gr.update(visible=self.thinks(model))

    def saved_model(self, browser, view, model, status=""):
        """After a saved conversation opens (the sidebar, a reload, Undo delete, an import):
        the Model dropdown moves to the model that made its last reply when that model is
        served here; when it is not, the choice stays and the status line says so. Returns
        (dropdown update, status update)."""
        try:
            path = self.conversations.path(owner_of(browser), view)
        except StoreError:
            return gr.update(), gr.update()  # the open itself said why
        saved = next(
            (
                m.settings.get("model")
                for m in reversed(path)
                if m.role == "assistant" and (m.settings or {}).get("model")
            ),
            None,
        )
        if not isinstance(saved, str):
            return gr.update(), gr.update()  # no reply yet, or saved without a model
        if saved in self.models.names:
            return gr.update(value=saved), gr.update()
        try:
            current = self.models.resolve(model)
        except USER_ERRORS:
            current = self.models.default
        note = html.escape(
            f"its last reply was made with model '{saved}', which is not served "
            f"here: replies now come from {current}"
        )
        return gr.update(), f"{status} · {note}" if status else note

    def model_note(self, name: str) -> str:
        """The status line names the model that answered when the app serves several."""
        return f"model {name}" if len(self.models.names) > 1 else ""

    @takes_panel(*PANEL)
    def send(
        self,
        message,
        browser,
        view,
        query,
        panel,
        request: gr.Request | None = None,
    ):
        """Send: the message goes under the leaf this tab shows."""
        browser = self._start(browser, request)
        if not (message or "").strip():
            yield (
                *self._show(
                    browser, view, error("the message is empty; type something to send"), query
                ),
                message,
                "",
            )
            return
        yield from self._respond(
            browser,
            view,
            query,
            panel,
            request,
            text=message,
            under=view.get("leaf"),
        )

    @takes_panel(*PANEL)
    def edit(
        self,
        browser,
        view,
        query,
        panel,
        edited: gr.EditData = None,
        request: gr.Request | None = None,
    ):
        """An edited user message: a new version of it (a branch; the old one is kept) and a
        reply to it."""
        browser = self._start(browser, request)
        row = edited.index[0] if isinstance(edited.index, (list, tuple)) else edited.index
        try:
            path, index = self.conversations.message_at(owner_of(browser), view, row)
        except StoreError as e:
            yield (*self._show(browser, view, error(str(e)), query), gr.update(), "")
            return
        # the Chatbot's form of the text, with or without the page's script (render.CHATBOT_JS)
        text = typed_text(strip_marks(message_text(edited.value)))
        if index is None or path[index].role != "user":
            yield (
                *self._show(browser, view, error("only your own messages can be edited"), query),
                gr.update(),
                "",
            )
            return
        if not text.strip():
            yield (
                *self._show(browser, view, error("the edited message is empty"), query),
                gr.update(),
                "",
            )
            return
        yield from self._respond(
            browser,
            view,
            query,
            panel,
            request,
            text=text,
            under=path[index].parent_id,
            focus_new=True,
            from_box=False,
        )

    @takes_panel(*PANEL)
    def regenerate(
        self,
        browser,
        view,
        query,
        panel,
        request: gr.Request | None = None,
    ):
        """A new version of the last reply (a branch; the old reply is kept)."""
        browser = self._start(browser, request)
        try:
            path = self.conversations.path(owner_of(browser), view)
        except StoreError as e:
            yield (*self._show(browser, view, error(str(e)), query), gr.update(), "")
            return
        while path and path[-1].role == "assistant":
            path.pop()
        if not path:
            yield (
                *self._show(browser, view, error("nothing to regenerate yet"), query),
                gr.update(),
                "",
            )
            return
        yield from self._respond(
            browser,
            view,
            query,
            panel,
            request,
            reply_to=path[-1].id,
            focus_new=True,
        )

    def stop(self, request: gr.Request | None = None) -> None:
        self.sessions.stop(request)

    def refused_send(self, request: gr.Request | None = None) -> None:
        """Send or Enter pressed (an event beside Send's): while a reply that Send or Enter began
        runs, Gradio drops a second one without a word (the event runs once at a time), so
        this says why. Sooner than SECOND_SEND_S after it began, a double click: nothing. (A
        reply that Regenerate or an edit began leaves Send's event free: its handler says it.)"""
        age = self.sessions.running_for(request, CHAT, SEND)
        if age is not None and age >= SECOND_SEND_S:
            gr.Warning(STILL_STREAMING)

    def undo(self, browser, view, query="", draft="", request: gr.Request | None = None):
        """Take back the last turn of this branch: SHOWN values + its message back in the box
        (above `draft`, what the box holds: with_draft). A reply still streaming is stopped, has
        ended when this returns and has taken its turn back as its last output: this then
        writes nothing (common.Sessions.take_over)."""
        browser = self._start(browser, request)
        if self.sessions.take_over(request, CHAT, STOP_WAIT_S, Undo(draft or "")):
            return unchanged(len(SHOWN) + 1)
        return self._take_back(browser, view, query, "last turn removed", draft)

    def _take_back(self, browser, view, query, said: str, draft: str = "") -> tuple:
        """Undo's result: the branch without its last turn (SHOWN values, `said` as the
        status), then for the message box that turn's message above `draft` (with_draft)."""
        try:
            if not view.get("leaf"):
                return (*self._show(browser, view, "nothing to undo", query), draft or "")
            leaf, text = self.store.undo_turn(owner_of(browser), view["cid"], view["leaf"])
        except StoreError as e:
            return (*self._show(browser, view, error(str(e)), query), draft or "")
        box = with_draft(text, draft)
        if not text:
            said = "nothing to undo"
        elif box != text:
            said = f"{said}: {DRAFT_KEPT}"
        return (*self._show(browser, new_view(view["cid"], leaf), said, query), box)

    def after_reply(self, handler, outputs: int):
        """`handler` (an event's function; its `outputs` outputs are SHOWN's, then the message
        box's and the inspector's if it has them) as an event that first stops the session's
        streaming reply, kept as Stop keeps it. The reply's own last output is then the
        handler's, and the event writes nothing (common.Sessions.take_over says why): a new
        chat, another conversation, a deletion or another version shown while a reply streams
        would otherwise be painted over by the reply's next chunk."""
        signature = inspect.signature(handler)

        @functools.wraps(handler)
        def event(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)

            def act(view=None):  # run by the reply: on the view it left (its saved reply's)
                if view is not None and "view" in bound.arguments:
                    bound.arguments["view"] = view
                return handler(*bound.args, **bound.kwargs)

            request = bound.arguments.get("request")
            if self.sessions.take_over(request, CHAT, STOP_WAIT_S, act):
                return unchanged(outputs)
            return act()

        return event

    def clear(self, browser, query="", request: gr.Request | None = None):
        """A new chat (the old one stays in the list): SHOWN values, message box, inspector."""
        browser = self._start(browser, request)
        return (*self._show(browser, new_view(), "new chat", query), "", "")

    def choose(
        self, browser, view, query, chosen: gr.SelectData, request: gr.Request | None = None
    ):
        """A click on a message: ‹ › will step through its versions (when it has some)."""
        browser = self._start(browser, request)
        row = chosen.index[0] if isinstance(chosen.index, (list, tuple)) else chosen.index
        try:
            path, index = self.conversations.message_at(owner_of(browser), view, row)
        except StoreError as e:
            return self._show(browser, view, error(str(e)), query)
        focus = path[index].id if index is not None else None
        return self._show(browser, {**view, "focus": focus}, "", query)

    def step(self, browser, view, query, step: int, request: gr.Request | None = None):
        """Show the previous (-1) or next (+1) version of the focused message."""
        browser = self._start(browser, request)
        try:
            owner = owner_of(browser)
            shown = self.conversations.show(browser, view, "", query)
            focus = shown.view["focus"]
            if focus is None:
                return shown._replace(status="this branch has no other versions")
            depth = next(
                i for i, m in enumerate(self.conversations.path(owner, view)) if m.id == focus
            )
            leaf = self.store.switch(owner, focus, step)
            path = self.conversations.path(owner, new_view(view["cid"], leaf))
            return self.conversations.show(
                browser, new_view(view["cid"], leaf, path[depth].id), "", query
            )
        except StoreError as e:
            return self._show(browser, view, error(str(e)), query)

    def previous_version(self, browser, view, query="", request: gr.Request | None = None):
        return self.step(browser, view, query, -1, request)

    def next_version(self, browser, view, query="", request: gr.Request | None = None):
        return self.step(browser, view, query, +1, request)

    def apply_preset(self, name) -> list:
        """The settings panel's values of a preset."""
        return preset_values(self.presets, name)


def build_chat_tab(app: TabContext, label: str) -> ChatTab:
    """The Chat tab, its sidebar and their events, under `label`; call inside the app's
    `gr.Blocks`. The app's header (the line above the tabs) is redrawn after this tab's runs;
    the page-load events (`ChatTab.on_load`) are wired once every tab is laid out."""
    chat = ChatHandlers(app.models, app.presets, app.sessions, app.store)
    side = SidebarHandlers(chat.conversations)
    # what the browser keeps: its owner id and open conversation, encrypted with a key kept in
    # the history database, so it still reads after a restart
    browser = gr.BrowserState(
        {"owner": None, "open": None}, storage_key=BROWSER_KEY, secret=chat.store.secret()
    )
    view = gr.State(new_view())
    with gr.Tab(label):
        with gr.Row():
            with gr.Column(scale=1, min_width=220):
                bar = build_sidebar(side)
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(
                    label="Conversation",
                    height=460,
                    buttons=["copy"],
                    editable="user",
                    elem_id="chatbot",
                )
                with gr.Row(visible=False) as versions:  # shown where a message has versions
                    branches = gr.Markdown("", elem_id="branches")
                    prev_btn = gr.Button("‹", size="sm", scale=0, min_width=40)
                    next_btn = gr.Button("›", size="sm", scale=0, min_width=40)
                # one line that grows: Enter sends, Shift+Enter adds a line (common.KEYS_JS)
                message = gr.Textbox(
                    label="Message",
                    placeholder="Type a message: Enter sends, Shift+Enter adds a line",
                    lines=1,
                    max_lines=8,
                    autofocus=True,
                    elem_id="chat-message",
                )
                with gr.Row():
                    send_btn = gr.Button("Send", variant="primary")
                    stop_btn = gr.Button("Stop", variant="stop")
                    regen_btn = gr.Button("Regenerate")
                    undo_btn = gr.Button("Undo")
                    clear_btn = gr.Button("Clear")
                status = gr.Markdown("ready", elem_id="status")
                inspect_on = gr.Checkbox(
                    label="Token inspector",
                    value=False,
                    info="shade each token by its probability; hover "
                    "one for a chart of the top-5 alternatives "
                    "before → after the sampling stages",
                )
                inspector_view = gr.HTML(elem_id="inspector")
            with gr.Column(scale=1):
                model = build_model_picker(chat.models)
                thinking = build_thinking(chat.thinks(None))
                sampling = build_sampling(
                    chat.presets,
                    app.default_preset,
                    chat.apply_preset,
                    "-1 = random (the seed drawn is shown and saved with "
                    "the reply); a fixed seed repeats a sampled reply",
                )
                system = gr.Textbox(
                    label="System prompt", lines=3, placeholder="(the model's default)"
                )
                output = build_output_format()

    parts = {
        "browser": browser,
        "view": view,
        "chatbot": chatbot,
        "conversations": bar["conversations"],
        "title": bar["title"],
        "system": system,
        "branches": branches,
        "status": status,
    }
    shown = [parts[name] for name in SHOWN]
    q = bar["search"]
    # the handlers' parameters in order; Gradio puts an edit's EditData before the format's
    settings = [system, *sampling.inputs, inspect_on, *output.inputs, model, *thinking.inputs]
    generating = engine_event([*shown, message, inspector_view], chatbot)
    runs = [
        # one event for Send and Enter: a second one while its reply runs is dropped by Gradio
        # (an event runs once at a time), and refused_send, an event of its own, says why
        gr.on(
            [send_btn.click, message.submit],
            chat.send,
            [message, browser, view, q, *settings],
            **generating,
        ),
        regen_btn.click(chat.regenerate, [browser, view, q, *settings], **generating),
        chatbot.edit(chat.edit, [browser, view, q, *settings], **generating),
    ]
    gr.on(  # queued (a toast needs the queue), beside the engine's events, never behind them
        [send_btn.click, message.submit],
        chat.refused_send,
        None,
        None,
        concurrency_limit=None,
        show_progress="hidden",
    )
    follow_picker(chat.models, model, runs, app.demo)
    # the Think controls follow the model: its choice, a reply that loaded it, the page's load
    show_thinking = dict(
        fn=chat.thinking_controls,
        inputs=model,
        outputs=thinking.group,
        queue=False,
        show_progress="hidden",
    )
    model.change(**show_thinking)
    for run in runs:
        run.then(**show_thinking)
    app.header.refresh_after(runs)
    stop_btn.click(chat.stop, None, None, queue=False)
    undo_btn.click(chat.undo, [browser, view, q, message], [*shown, message])
    # what changes the conversation shown stops a streaming reply first (ChatHandlers.after_reply)
    clear = chat.after_reply(chat.clear, len(shown) + 2)
    clear_btn.click(clear, [browser, q], [*shown, message, inspector_view])
    chatbot.clear(clear, [browser, q], [*shown, message, inspector_view])  # its own 🗑
    chatbot.select(chat.choose, [browser, view, q], shown)
    prev_btn.click(chat.after_reply(chat.previous_version, len(shown)), [browser, view, q], shown)
    next_btn.click(chat.after_reply(chat.next_version, len(shown)), [browser, view, q], shown)
    branches.change(lambda line: gr.update(visible=bool(line)), branches, versions, queue=False)
    # a saved conversation that opens moves the Model dropdown to the model of its last reply
    follow_saved = dict(
        fn=chat.saved_model,
        inputs=[browser, view, model, status],
        outputs=[model, status],
        show_progress="hidden",
    )
    for opened in wire_sidebar(side, bar, shown, browser, view, chat.after_reply):
        opened.then(**follow_saved)
    tab = ChatTab(side, browser, shown, q, bar["info"], follow_saved, show_thinking)
    app.after_tabs.append(lambda: tab.on_load(app.demo))
    return tab


class ChatTab(NamedTuple):
    """What the app needs after laying the tab out: the page-load event's parts."""

    sidebar: SidebarHandlers
    browser: gr.BrowserState
    shown: list
    query: gr.Textbox
    info: gr.Markdown
    follow_saved: dict  # the event that moves the Model dropdown to an opened conversation's
    show_thinking: dict  # the event that shows the Think controls for a model that thinks

    def on_load(self, demo: gr.Blocks) -> None:
        """On page load: the browser's owner id (new on a first visit), the list, and the
        conversation it had open before a reload or a restart, on its model. The tab's view
        goes in too: a message sent before the load ran has opened a conversation already."""
        view = self.shown[SHOWN.index("view")]
        loaded = demo.load(self.sidebar.load, [self.browser, self.query, view], self.shown)
        loaded.then(self.sidebar.info, None, self.info)
        loaded.then(**self.follow_saved)
        loaded.then(**self.show_thinking)
