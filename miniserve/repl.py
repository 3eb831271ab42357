"""The terminal chat behind `python -m miniserve chat`.

Reads one message a line (from a terminal or a pipe), streams each reply, and
understands a few slash commands. Ctrl-C during a reply stops that reply; Ctrl-C
or Ctrl-D at the prompt ends the session.
"""

from __future__ import annotations

import threading
import time

from miniserve.chat import ChatError
from miniserve.config import FIELDS, ConfigError, SamplingParams, check_seed
from miniserve.engine import Engine, EngineBusy

HELP = """commands:
  /help                 this help
  /preset [NAME]        switch preset (lists them without NAME)
  /settings             show the current sampling values
  /set KEY VALUE        change one value ({keys}, seed)
  /system TEXT          set the system prompt (starts a new conversation)
  /reset                start a new conversation
  /model                show the loaded model
  /exit                 leave (also Ctrl-D)"""


class ChatSession:
    def __init__(self, engine: Engine, params: SamplingParams, presets: dict[str, SamplingParams],
                 system: str | None = None, preset_name: str = ""):
        self.engine = engine
        self.params = params
        self.presets = presets
        self.preset_name = preset_name
        self.system = system
        self.history: list[dict] = []
        self.out = None

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    # -- commands ---------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a slash command; False means the session should end."""
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        if name in ("exit", "quit"):
            return False
        handler = {"help": self.cmd_help, "preset": self.cmd_preset, "settings": self.cmd_settings,
                   "set": self.cmd_set, "system": self.cmd_system, "reset": self.cmd_reset,
                   "model": self.cmd_model}.get(name)
        if handler is None:
            self.say(f"unknown command /{name}; /help lists the commands")
        else:
            handler(rest)
        return True

    def cmd_help(self, _):
        self.say(HELP.format(keys=", ".join(FIELDS)))

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
        p = self.params
        return (f"T={p.temperature:g} top_k={p.top_k} top_p={p.top_p:g} min_p={p.min_p:g} "
                f"repetition_penalty={p.repetition_penalty:g} max_new_tokens={p.max_new_tokens} "
                f"seed={p.seed if p.seed is not None else 'random'}")

    def cmd_settings(self, _):
        self.say(f"[{self.preset_name or 'custom'}] " + self.describe())

    def cmd_set(self, rest):
        key, _, value = rest.partition(" ")
        key = key.replace("-", "_")
        value = value.strip()
        try:
            if key == "seed":
                seed = None if value in ("", "none", "random") else check_seed(_number(value, key))
                self.params = self.params.replace(seed=seed)
            elif key in FIELDS:
                self.params = self.params.replace(**{key: _number(value, key)})
            else:
                raise ConfigError(f"unknown setting '{key}' (allowed: {', '.join(FIELDS)}, seed)")
        except ConfigError as e:
            self.say(f"error: {e}")
            return
        self.preset_name = "custom"
        self.say(self.describe())

    def cmd_system(self, text):
        self.system = text or None
        self.history.clear()
        self.say("system prompt set; new conversation" if text else
                 "system prompt cleared; new conversation")

    def cmd_reset(self, _):
        self.history.clear()
        self.say("new conversation")

    def cmd_model(self, _):
        info = self.engine.info()
        self.say(f"{info['name']} on {info['device']} ({info['dtype']}, {info['runner']} "
                 f"runner), context {info['context_length']} tokens, "
                 f"{info['parameters'] / 1e6:.0f}M parameters, "
                 f"from {info['source']}")

    # -- one turn -----------------------------------------------------------------------------
    def reply(self, text: str) -> None:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
            self.history + [{"role": "user", "content": text}]
        cancel = threading.Event()
        parts, last = [], None
        try:
            stream = self.engine.chat(messages, self.params, cancel=cancel)
        except (ChatError, ConfigError) as e:
            self.say(f"error: {e}")
            return
        stopped = False
        try:
            for last in stream:
                parts.append(last.text)
                self.say(last.text, end="")
        except KeyboardInterrupt:
            cancel.set()  # the engine stops within one decoding step
            stopped = True
            self.say(" [stopped]", end="")
        except EngineBusy as e:
            self.say(f"busy: {e}")
            return
        reply = "".join(parts)
        self.say()
        if last is not None and last.dropped_messages:
            self.say(f"[history trimmed: {last.dropped_messages} older messages left out to fit "
                     f"the {self.engine.context_length}-token context]")
        if last is not None and (last.done or stopped):
            s = last.stats  # the engine's own record, final once it has seen the cancel
            deadline = time.monotonic() + 5
            while stopped and s.finish_reason != "cancelled" and time.monotonic() < deadline:
                time.sleep(0.01)
            self.say(f"[{s.summary()}]")
        self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]

    def run(self, stdin, stdout) -> int:
        self.out = stdout
        interactive = stdin.isatty()
        if interactive:
            self.say(f"MiniServeLM chat with {self.engine.name} -- /help for commands, "
                     "Ctrl-D to leave")
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
            if interactive:
                self.say("bot> ", end="")
            self.reply(line)


def _number(value: str, key: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"'{key}' must be a number, got '{value}'", key) from None
    return int(number) if FIELDS.get(key) and FIELDS[key].kind is int and number.is_integer() \
        else number
