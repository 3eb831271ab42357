"""The terminal chat behind `python -m miniserve chat`.

Reads one message a line (from a terminal or a pipe), streams each reply, and
understands a few slash commands. Ctrl-C during a reply stops that reply; Ctrl-C
or Ctrl-D at the prompt ends the session.

With a store (miniserve/store/store.py), /save keeps the conversation under the owner CLI_OWNER;
from then on each message is added to it as it is sent or completes.

Raw mode (`chat --raw`, /raw; what a base model without a chat template needs): no turns, one
running text -- each line typed is added to it and the model continues it, as the web app's
Notebook tab does. /model NAME switches between the models the app was started with.

A thinking model's reasoning is printed first, after "Thinking:" (dimmed on a terminal), then
its answer on a line of its own; /think on|off and /budget N set what it is sent. A reply's
tool calls are printed as lines (the chat runs none).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from miniserve.core.config import FIELDS, ConfigError, SamplingParams, check_seed
from miniserve.core.errors import Busy, UserError
from miniserve.core.samplers import describe
from miniserve.engine.chat import ChatOptions
from miniserve.engine.engine import Engine
from miniserve.engine.turn import ChatTurn, history_of, with_seed
from miniserve.models.registry import Models, UnknownModel
from miniserve.models.remote import RemoteError
from miniserve.runners.loader import ModelLoadError
from miniserve.store.store import Store, StoreError

CLI_OWNER = "cli"  # the store's owner of the terminal chat's conversations
DIM, PLAIN = "\x1b[2m", "\x1b[0m"  # a terminal's faint text (the reasoning), and back
ERASE = "\r\x1b[K"  # back to the line's start, and the line cleared
THINKING = "Thinking: "

HELP = """commands:
  /help                 this help
  /preset [NAME]        switch preset (lists them without NAME)
  /settings             show the current sampling values
  /set KEY VALUE        change one value: {keys}
  /system TEXT          set the system prompt (starts a new, unsaved conversation)
  /reset                start a new, unsaved conversation
  /save [TITLE]         save this conversation (or rename it); later turns are added as they come
  /list                 the saved conversations, newest first
  /load N               continue conversation N of the last /list
  /export FILE          write the saved conversation: FILE.md as Markdown, else JSON
  /import FILE          import a JSON export or an OpenAI messages list
  /model [NAME]         show the model and the others served, or switch to NAME
  /raw                  turn raw mode (continue one running text, no chat template) on or off
  /think on|off         a thinking model reasons before it answers, or answers at once
  /budget N             a thinking model's reasoning tokens at most (-1: no limit, 0: none)
  /exit                 leave (also Ctrl-D)"""


class ChatSession:
    def __init__(
        self,
        models: Models | Engine,
        params: SamplingParams,
        presets: dict[str, SamplingParams],
        system: str | None = None,
        preset_name: str = "",
        store: Store | None = None,
        raw: bool = False,
    ):
        self.models = Models.of(models)
        self.model_name = self.models.default
        self.raw = raw
        self.text = ""  # raw mode: the running text the model continues
        self.params = params
        self.presets = presets
        self.preset_name = preset_name
        self.system = system
        # what the model is sent: {"role", "content"} each, and a reply's "reasoning" and
        # "tool_calls" (as the store keeps them)
        self.history: list[dict] = []
        self.details: list[dict] = []  # beside each: status, settings and stats, for /save
        self.store = store  # None: nothing can be saved
        self.cid: str | None = None  # the saved conversation this session adds to
        self.leaf: str | None = None  # its last message on this session's branch
        self.listing: list[str] | None = None  # the conversations /list numbered last
        self.thinking: bool | None = None  # /think: None is the model's own default (on)
        self.budget: int | None = None  # /budget: reasoning tokens at most (None: no limit)
        self.out = None
        self.prefix = ""  # what starts the reply's line ("bot> " on a terminal)

    @property
    def engine(self):
        return self.models.get(self.model_name)

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def on_terminal(self) -> bool:
        isatty = getattr(self.out, "isatty", None)
        return isatty is not None and isatty()

    def dim(self, text: str) -> str:
        """Text printed faint on a terminal (the reasoning); as it is in a pipe or a file."""
        return f"{DIM}{text}{PLAIN}" if text and self.on_terminal() else text

    def thinks(self) -> bool:
        return bool(getattr(self.engine, "thinks", False))

    def options(self) -> ChatOptions | None:
        """What a thinking model is sent: /think and /budget (None for a model that does
        not think)."""
        if not self.thinks():
            return None
        return ChatOptions(thinking=self.thinking, reasoning_budget=self.budget)

    # -- commands ---------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a slash command; False means the session should end."""
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        if name in ("exit", "quit"):
            return False
        handler = {
            "help": self.cmd_help,
            "preset": self.cmd_preset,
            "settings": self.cmd_settings,
            "set": self.cmd_set,
            "system": self.cmd_system,
            "reset": self.cmd_reset,
            "model": self.cmd_model,
            "save": self.cmd_save,
            "list": self.cmd_list,
            "load": self.cmd_load,
            "export": self.cmd_export,
            "import": self.cmd_import,
            "raw": self.cmd_raw,
            "think": self.cmd_think,
            "budget": self.cmd_budget,
        }.get(name)
        if handler is None:
            self.say(f"unknown command /{name}; /help lists the commands")
        else:
            handler(rest)
        return True

    def cmd_help(self, _):
        self.say(HELP.format(keys=set_keys()))

    def cmd_preset(self, name):
        if name not in self.presets:
            if name:
                self.say(f"unknown preset '{name}'")
            self.say("presets: " + ", ".join(self.presets))
            return
        self.params = self.presets[name].replace(seed=self.params.seed)
        self.preset_name = name
        self.say(f"preset {name}: " + self.describe())

    def describe(self) -> str:
        return settings_line(self.params)

    def cmd_settings(self, _):
        self.say(f"[{self.preset_name or 'custom'}] " + self.describe())
        if self.thinks():
            self.say(self.describe_thinking())

    def describe_thinking(self) -> str:
        budget = "no limit" if self.budget is None else f"{self.budget} tokens"
        return f"think {'off' if self.thinking is False else 'on'}, reasoning budget {budget}"

    def _thinking_note(self) -> str:
        return (
            ""
            if self.thinks()
            else f" ({self.model_name} does not think: this applies to a model that does)"
        )

    def cmd_think(self, value):
        if value not in ("on", "off"):
            self.say(
                f"error: /think takes on or off, got '{value}'; now: {self.describe_thinking()}"
            )
            return
        self.thinking = value == "on"
        self.say(self.describe_thinking() + self._thinking_note())

    def cmd_budget(self, value):
        try:
            budget = int(value)
        except ValueError:
            self.say(
                f"error: /budget takes a whole number of tokens (-1: no limit, 0: none), "
                f"got '{value}'"
            )
            return
        self.budget = None if budget < 0 else budget
        self.say(self.describe_thinking() + self._thinking_note())

    def cmd_set(self, rest):
        try:
            self.params = set_setting(self.params, rest)
        except ConfigError as e:
            self.say(f"error: {e}")
            return
        self.preset_name = "custom"
        self.say(self.describe())

    def cmd_system(self, text):
        if self.raw and text:  # raw mode continues the text as it is: no turns to put it in
            self.say(
                "error: raw mode has no system prompt (it continues the text as it is); /raw first"
            )
            return
        self.system = text or None
        self.new_conversation()
        self.say(
            "system prompt set; new conversation"
            if text
            else "system prompt cleared; new conversation"
        )

    def cmd_reset(self, _):
        self.new_conversation()
        self.say("new conversation")

    def new_conversation(self) -> None:
        """An empty, unsaved conversation (a saved one stays in the store)."""
        self.history, self.details = [], []
        self.cid = self.leaf = None
        self.text = ""

    def cmd_model(self, name):
        if name:
            try:
                name = self.models.resolve(name)
                if not self.models.is_loaded(name):
                    self.say(f"loading {name} ...")
                self.models.get(name, progress=lambda m: self.say(f"  {m}"))
            except UnknownModel as e:
                self.say(f"error: {e}")
                return
            except (ModelLoadError, ValueError, RuntimeError, OSError) as e:  # incl. out of memory
                self.say(f"error: {name} could not be loaded: {e}")
                return
            self.model_name = name
            if not self.engine.has_chat_template and not self.raw:
                self.raw = True
                self.say(f"{name} has no chat template (a base model): raw mode on")
        info = self.engine.info()
        if info.get("remote"):
            self.say(
                f"{info['name']}: remote, {info.get('url', info.get('source', ''))}, "
                f"context {info['context_length']} tokens"
            )
        else:
            self.say(
                f"{info['name']} on {info['device']} ({info['dtype']}, {info['runner']} "
                f"runner), context {info['context_length']} tokens, "
                f"{info['parameters'] / 1e6:.0f}M parameters, from {info['source']}"
                + (", no chat template (raw mode)" if not info.get("chat", True) else "")
            )
        others = [
            n + ("" if self.models.is_loaded(n) else " (not loaded)")
            for n in self.models.names
            if n != self.model_name
        ]
        if others:
            self.say("also served: " + ", ".join(others) + "; /model NAME switches")

    def cmd_raw(self, _):
        if self.raw and not self.engine.has_chat_template:
            self.say(f"{self.model_name} has no chat template: raw mode stays on")
            return
        self.raw = not self.raw
        self.new_conversation()
        self.say(
            "raw mode on: each line is added to one text the model continues; /reset clears it"
            + ("; the system prompt waits for /raw off" if self.system else "")
            if self.raw
            else "raw mode off: chat turns; new conversation"
        )

    # -- saved conversations ------------------------------------------------------------------
    def _no_store(self) -> bool:
        if self.store is None:
            self.say("error: this session has no history store; nothing can be saved")
        return self.store is None

    def _numbers(self, cids: list[str]) -> list[int]:
        """Where `cids` stand in the list as it is now (1-based), which /load N reads next."""
        self.listing = [c.id for c in self.store.conversations(CLI_OWNER, limit=-1)]
        return [self.listing.index(cid) + 1 if cid in self.listing else 0 for cid in cids]

    def cmd_save(self, title):
        if self._no_store():
            return
        try:
            if self.cid is None:
                cid = self.store.create(CLI_OWNER, system=self.system or "")
                try:
                    parent = None
                    for message, details in zip(self.history, self.details):
                        parent = self.store.add(
                            CLI_OWNER, cid, parent, message["role"], message["content"], **details
                        ).id
                    if title:
                        self.store.rename(CLI_OWNER, cid, title)
                except BaseException:
                    self.store.delete(CLI_OWNER, cid)  # no half-saved conversation
                    raise
                self.cid, self.leaf = cid, parent
            elif title:
                self.store.rename(CLI_OWNER, self.cid, title)
            saved = self.store.get(CLI_OWNER, self.cid)
            (number,) = self._numbers([self.cid])
        except (StoreError, sqlite3.Error) as e:
            self.say(f"error: not saved: {e}")
            return
        where = " (in memory only: history is not kept on disk)" if self.store.in_memory else ""
        self.say(f"saved as {number}: {saved.title or '(untitled)'}{where}")

    def cmd_list(self, _):
        if self._no_store():
            return
        conversations = self.store.conversations(CLI_OWNER, limit=-1)
        self.listing = [c.id for c in conversations]
        if not conversations:
            self.say("no saved conversations")
        for i, c in enumerate(conversations, 1):
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            self.say(
                f"{'*' if c.id == self.cid else ' '}{i:3}. {c.title or '(untitled)'}  "
                f"({when}, {c.messages} message{'' if c.messages == 1 else 's'})"
            )

    def cmd_load(self, arg):
        if self._no_store():
            return
        cids = (
            self.listing
            if self.listing is not None
            else [c.id for c in self.store.conversations(CLI_OWNER, limit=-1)]
        )
        try:
            n = int(arg)
        except ValueError:
            self.say(f"error: /load takes the number of a conversation in /list, got '{arg}'")
            return
        if not 1 <= n <= len(cids):
            self.say(f"error: no conversation {n}; /list shows {len(cids) if cids else 'none'}")
            return
        try:
            conversation = self.store.get(CLI_OWNER, cids[n - 1])
            path = self.store.path(CLI_OWNER, conversation.id)
        except (StoreError, sqlite3.Error) as e:
            self.say(f"error: cannot load conversation {n}: {e}")
            return
        unanswered = path.pop() if path and path[-1].role == "user" else None
        self.cid, self.leaf = conversation.id, path[-1].id if path else None
        self.system = conversation.system or None
        self.history = history_of(path)
        self.details = [
            {"status": m.status, "settings": m.settings, "stats": m.stats}
            | (
                {"reasoning": m.reasoning, "tool_calls": m.tool_calls}
                if m.role == "assistant"
                else {}
            )
            for m in path
        ]
        self.say(
            f"loaded {n}: {conversation.title or '(untitled)'} "
            f"({len(path)} message{'' if len(path) == 1 else 's'})"
        )
        if self.system:
            self.say(f"system: {self.system}")
        for m in path:
            if m.reasoning:  # as a reply prints it: the reasoning first, the answer under it
                self.say("bot> " + self.dim(THINKING + m.reasoning))
            self.say(
                ("you> " if m.role == "user" else "" if m.reasoning else "bot> ")
                + m.content
                + (" [stopped]" if m.status == "stopped" else "")
            )
            self.say_calls(m.tool_calls)
        if unanswered is not None:
            self.say(
                "[its last message had no reply and is left out; what you send next "
                "starts a branch beside it]"
            )

    def cmd_export(self, file):
        if self._no_store():
            return
        if not file:
            self.say("error: /export takes a file name (FILE.md for Markdown, else JSON)")
            return
        if self.cid is None:
            self.say("error: this conversation is not saved; /save it first")
            return
        try:
            text, _ = self.store.export_text(
                CLI_OWNER, self.cid, "md" if Path(file).suffix.lower() == ".md" else "json"
            )
            text += "" if text.endswith("\n") else "\n"
            Path(file).expanduser().write_text(text, encoding="utf-8")
        except (StoreError, sqlite3.Error) as e:
            self.say(f"error: cannot export: {e}")
            return
        except OSError as e:
            self.say(f"error: cannot write {file}: {e.strerror or e}")
            return
        self.say(f"wrote {file}")

    def cmd_import(self, file):
        if self._no_store():
            return
        if not file:
            self.say("error: /import takes a file name")
            return
        try:
            cids = self.store.import_file(CLI_OWNER, file)
            numbers = self._numbers(cids)
            titles = [self.store.get(CLI_OWNER, cid).title or "(untitled)" for cid in cids]
        except OSError as e:
            self.say(f"error: cannot read {file}: {e.strerror or e}")
            return
        except (StoreError, sqlite3.Error) as e:
            self.say(f"error: cannot import {file}: {e}")
            return
        self.say(
            f"imported {len(cids)} conversation{'' if len(cids) == 1 else 's'} as "
            + "; ".join(f"{n}: {t}" for n, t in zip(numbers, titles))
        )

    def _save(self, write) -> str | None:
        """Add a message to the saved conversation (if any) with `write()`, which returns its
        id; the id. A store that fails says so in one line and the session goes on unsaved."""
        if self.cid is None:
            return None
        try:
            self.leaf = write()
            return self.leaf
        except (StoreError, sqlite3.Error) as e:
            self.cid = self.leaf = None
            self.say(f"[not saved: {e}; /save saves this conversation again]")
            return None

    def _keep(self, role: str, content: str, **details) -> str | None:
        return self._save(
            lambda: self.store.add(CLI_OWNER, self.cid, self.leaf, role, content, **details).id
        )

    def _keep_question(self, turn: ChatTurn) -> str | None:
        """The user's message saved (if the conversation is), as ChatTurn saves it."""
        return self._save(lambda: turn.save_question(self.store, CLI_OWNER, self.cid, self.leaf))

    def _take_back(self, message_id: str | None, parent_id: str | None) -> None:
        """Remove a user message that got no reply (the engine was busy)."""
        if message_id is None:
            return
        try:
            self.store.undo_turn(CLI_OWNER, self.cid, message_id)
        except (StoreError, sqlite3.Error):
            pass  # left in the store; the next message starts a branch beside it
        self.leaf = parent_id

    # -- one turn -----------------------------------------------------------------------------
    def continue_text(self, line: str) -> None:
        """Raw mode: add the line to the running text and stream its continuation."""
        text = (self.text + "\n" if self.text else "") + line
        cancel = threading.Event()
        params = with_seed(self.params)
        parts, last = [], None
        try:
            for last in self.engine.complete_text(text, params, trim=True, cancel=cancel):
                parts.append(last.text)
                self.say(last.text, end="")
        except KeyboardInterrupt:
            cancel.set()
            self.say(" [stopped]", end="")
        except (UserError, RemoteError) as e:
            self.say(f"error: {e.describe() if isinstance(e, UserError) else e}")
            return
        self.say()
        self.text = text + "".join(parts)
        if last is not None and last.done:
            self.say(f"[{last.stats.summary()}, seed {params.seed}]")

    def say_calls(self, calls) -> None:
        """A reply's tool calls, a line each (nothing is run)."""
        for c in calls:
            self.say(f"[tool call {c['name']}: {c['arguments']} -- not run]")

    def stream(self, turn: ChatTurn) -> None:
        """Print the reply as it comes: its reasoning after "Thinking:" (dimmed on a
        terminal), then its answer on a line of its own. On a terminal, while the prompt is
        read, a line says how far (erased when the reply starts, or ends, or is stopped)."""
        thought = reading = False
        try:
            for chunk in turn:
                line = chunk.reading() if hasattr(chunk, "reading") else None
                if line is not None:
                    self.say(ERASE + self.prefix + self.dim(f"({line})"), end="")
                    reading = True
                    continue
                if reading:
                    self.say(ERASE + self.prefix, end="")
                    reading = False
                if chunk.reasoning:
                    if not thought:
                        self.say(self.dim(THINKING), end="")
                        thought = True
                    self.say(self.dim(chunk.reasoning), end="")
                if chunk.text:
                    if thought:
                        self.say()
                        thought = False
                    self.say(chunk.text, end="")
        finally:
            if reading:
                self.say(ERASE + self.prefix, end="")

    def reply(self, text: str) -> None:
        if self.raw:
            self.continue_text(text)
            return
        try:
            turn = ChatTurn(
                self.engine,
                self.params,
                system=self.system,
                history=self.history,
                text=text,
                preset=self.preset_name,
                options=self.options(),
                progress=self.on_terminal(),
            )
        except UserError as e:
            self.say(f"error: {e.describe()}")
            return
        except RemoteError as e:  # a remote server that does not answer
            self.say(f"error: {e}")
            return
        params = turn.params
        parent = self.leaf
        user_id = self._keep_question(turn)
        stopped = False
        try:
            self.stream(turn)
        except KeyboardInterrupt:
            turn.stop()  # the engine stops within one decoding step
            stopped = True
            self.say(" [stopped]", end="")
        except (Busy, RemoteError) as e:  # lost a race for a place; a server that failed
            self.say(f"busy: {e}" if isinstance(e, Busy) else f"\nerror: {e}")
            self._take_back(user_id, parent)
            return
        reply, last = turn.text_so_far, turn.last
        self.say()
        self.say_calls(turn.reply_fields()["tool_calls"])
        if last is not None and last.dropped_messages:
            self.say(
                f"[history trimmed: {last.dropped_messages} older messages left out to fit "
                f"the {self.engine.context_length}-token context]"
            )
        if last is not None and (last.done or stopped):
            s = last.stats  # the engine's own record, final once it has seen the cancel
            deadline = time.monotonic() + 5
            while stopped and s.finish_reason != "cancelled" and time.monotonic() < deadline:
                time.sleep(0.01)
            thought = f", {s.reasoning_tokens} reasoning tokens" if s.reasoning_tokens else ""
            self.say(f"[{s.summary()}{thought}, seed {params.seed}]")
        details = turn.reply_fields()
        self._keep("assistant", reply, **details)
        self.history += [
            {"role": "user", "content": text},
            {
                "role": "assistant",
                "content": reply,
                "reasoning": details["reasoning"],
                "tool_calls": details["tool_calls"],
            },
        ]
        self.details += [{}, details]

    def run(self, stdin, stdout) -> int:
        self.out = stdout
        interactive = stdin.isatty()
        if interactive:
            self.say(
                f"MiniServeLM chat with {self.engine.name} -- /help for commands, Ctrl-D to leave"
            )
        while True:
            try:
                line = input("you> ") if interactive else stdin.readline()
            except (EOFError, KeyboardInterrupt):
                self.say()
                return 0
            if not interactive and line == "":
                return 0  # end of the pipe
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.startswith("/"):
                if not self.command(line.strip()):
                    return 0
                continue
            self.prefix = "bot> " if interactive else ""
            self.say(self.prefix, end="")
            self.reply(line)


SET_KEYS = "every stage's setting ({keys}), samplers (stage names, e.g. top_k;min_p), seed"


def set_keys() -> str:
    return SET_KEYS.format(keys=", ".join(FIELDS))


def set_setting(params: SamplingParams, rest: str) -> SamplingParams:
    """`/set KEY VALUE` (the chat's and the Step view's): a stage's setting (a number, or a
    JSON list of strings for a list), `samplers` (stage names separated by ; or ,), or `seed`
    (none / random: a new one each reply)."""
    key, _, value = rest.strip().partition(" ")
    key, value = key.replace("-", "_"), value.strip()
    if key == "seed":
        seed = None if value in ("", "none", "random") else check_seed(_number(value, key))
        return params.replace(seed=seed)
    if key == "samplers":
        return params.replace(samplers=value or None)
    spec = FIELDS.get(key)
    if spec is None:
        raise ConfigError(f"unknown setting '{key}' (allowed: {set_keys()})", key)
    if spec.kind is tuple:
        try:
            items = json.loads(value) if value else []
        except json.JSONDecodeError:
            raise ConfigError(
                f"'{key}' takes a JSON list of strings, like {json.dumps(list(spec.default))}",
                key,
            ) from None
        return params.replace(**{key: items})
    return params.replace(**{key: _number(value, key)})


def settings_line(p: SamplingParams) -> str:
    """The settings in one line: the stages that run, with their settings, in their order."""
    seed = p.seed if p.seed is not None else "random"
    return f"{describe(p)} max_new_tokens={p.max_new_tokens} seed={seed}"


def _number(value: str, key: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"'{key}' must be a number, got '{value}'", key) from None
    return (
        int(number)
        if FIELDS.get(key) and FIELDS[key].kind is int and number.is_integer()
        else number
    )
