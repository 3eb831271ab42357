"""One chat turn, the same for the web app's Chat tab and the terminal chat (which only render
it): the messages sent (system prompt, the conversation so far, the new user message), a seed
drawn when the settings have none (used, saved and shown, so the reply can be repeated), the
stream started (a refusal here is the request's: nothing is saved), the user's message saved
once the engine has taken the request, and the reply saved when it ends, finished or stopped,
with the settings and stats that made it, its reasoning and its tool calls.

A thinking model's reply comes in parts (engine.Chunk): the reasoning first, then the answer
and any tool calls. The turn keeps each apart (`reasoning_so_far`, `text_so_far`,
`calls_so_far`) and when the reasoning ended (`reasoning_s`: seconds from the request queued to
the first piece of the answer), so that a surface can fold the reasoning once the answer starts.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

from miniserve.core.config import RANDOM_SEEDS, SamplingParams
from miniserve.engine.chat import ChatOptions
from miniserve.store.store import Message, Store


def with_seed(params: SamplingParams) -> SamplingParams:
    """The settings as they are, or with a seed drawn for this reply when they have none."""
    return (
        params if params.seed is not None else params.replace(seed=secrets.randbelow(RANDOM_SEEDS))
    )


def history_of(path: list[Message]) -> list[dict]:
    """Saved messages as the history `chat_messages` takes: role, content, and a reply's
    reasoning and tool calls (as the store keeps them)."""
    return [
        {
            "role": m.role,
            "content": m.content,
            "reasoning": m.reasoning,
            "tool_calls": list(m.tool_calls),
        }
        for m in path
    ]


def openai_calls(calls) -> list[dict]:
    """Saved tool calls ({"id", "name", "arguments"}) in OpenAI's shape, as templates read
    them."""
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for c in calls
    ]


def _sent(m: dict, reasoning: bool) -> dict:
    out = {"role": m["role"], "content": m["content"]}
    if m["role"] == "assistant":
        if reasoning and m.get("reasoning"):
            out["reasoning_content"] = m["reasoning"]
        if m.get("tool_calls"):
            out["tool_calls"] = openai_calls(m["tool_calls"])
    return out


def chat_messages(
    system: str | None, history: list[dict], text: str | None, reasoning: bool = True
) -> list[dict]:
    """What the model is sent: the system prompt (if any), the history, the new message.
    A reply of the history carries its reasoning as `reasoning_content` (with `reasoning`;
    the model's template keeps or drops it: Qwen3's drops the reasoning of the turns before
    the last user message) and its tool calls as OpenAI's `tool_calls`."""
    return (
        ([{"role": "system", "content": system}] if (system or "").strip() else [])
        + [_sent(m, reasoning) for m in history]
        + ([{"role": "user", "content": text}] if text is not None else [])
    )


def _merge_calls(calls: list[dict], deltas) -> None:
    """OpenAI's streamed delta.tool_calls added to the calls so far ({"id", "name",
    "arguments"} each, by the delta's index)."""
    for d in deltas:
        i = d.get("index", len(calls))
        while len(calls) <= i:
            calls.append({"id": "", "name": "", "arguments": ""})
        fn = d.get("function") or {}
        if d.get("id"):
            calls[i]["id"] = d["id"]
        if fn.get("name"):
            calls[i]["name"] = fn["name"]
        calls[i]["arguments"] += fn.get("arguments") or ""


class ChatTurn:
    """A reply being streamed to `text` (None: a new reply to the last user message of
    `history`). Iterate it for the engine's chunks; `text_so_far`, `reasoning_so_far`,
    `calls_so_far`, `last` and `stopped` say where it is. (`cancel` may also be set by the
    caller's own stop button.) `options`: thinking on/off and the reasoning budget (and what
    else engine.chat takes); None sends none. `progress`: the engine's chunks that say how
    far the prompt is read too (Chunk.prompt_read)."""

    def __init__(
        self,
        engine,
        params: SamplingParams,
        *,
        system: str | None,
        history: list[dict],
        text: str | None,
        preset: str | None = None,
        observer=None,
        cancel: threading.Event | None = None,
        options: ChatOptions | None = None,
        progress: bool = False,
    ):
        self.engine, self.system, self.text, self.preset = engine, system or "", text, preset
        self.params = with_seed(params)
        self.options = options
        self.cancel = cancel or threading.Event()
        # a local thinking model's template decides about earlier reasoning; a remote server
        # is not sent it (some refuse reasoning_content in a request)
        self.messages = chat_messages(
            system, history, text, reasoning=getattr(engine, "thinks", False)
        )
        extra = {"options": options} if options is not None else {}
        if progress:  # the local engine's prompt_read chunks (a remote one sends none)
            extra["progress"] = True
        self.stream = engine.chat(
            self.messages, self.params, cancel=self.cancel, observer=observer, **extra
        )
        self.started = time.perf_counter()  # the request is queued: its reply's time starts
        self.text_so_far, self.reasoning_so_far, self.last, self.stopped = "", "", None, False
        self.calls_so_far: list[dict] = []
        self.reasoning_tokens = 0  # while it streams: the tokens of the reasoning's chunks
        self.reasoning_s: float | None = None  # set when the answer (or a call) starts
        self.conversation: str | None = None
        self.question: str | None = None  # the saved user message the reply answers

    @property
    def thinking(self) -> bool:
        """The reply is inside its reasoning (it has some, and no answer yet)."""
        return bool(self.reasoning_so_far) and self.reasoning_s is None

    def __iter__(self) -> Iterator:
        for self.last in self.stream:  # noqa: B020 -- keeps the last chunk
            chunk = self.last
            if chunk.reasoning:
                self.reasoning_so_far += chunk.reasoning
                if self.reasoning_s is None:
                    self.reasoning_tokens += len(chunk.token_ids)
            if (chunk.text or chunk.tool_calls) and self.reasoning_s is None:
                if self.reasoning_so_far:
                    self.reasoning_s = time.perf_counter() - self.started
                else:
                    self.reasoning_s = 0.0
            self.text_so_far += chunk.text
            _merge_calls(self.calls_so_far, chunk.tool_calls)
            if chunk.done:
                if chunk.calls:
                    self.calls_so_far = [
                        {"id": c.id, "name": c.name, "arguments": c.arguments} for c in chunk.calls
                    ]
                if chunk.stats.reasoning_tokens:
                    self.reasoning_tokens = chunk.stats.reasoning_tokens
                if self.reasoning_so_far and self.reasoning_s is None:  # it never answered
                    self.reasoning_s = time.perf_counter() - self.started
            yield chunk

    def stop(self) -> None:
        """The user stopped the reply: the engine ends it within one step; saved as stopped."""
        self.stopped = True
        self.cancel.set()

    # -- saving -----------------------------------------------------------------------------
    def save_question(
        self, store: Store, owner: str, conversation: str | None, under: str | None
    ) -> str | None:
        """Open (or create) the conversation, keep its system prompt, and save the user's
        message under the message `under`; with no new text, the reply answers `under`."""
        if conversation is None:
            conversation = store.create(owner, system=self.system)
        elif self.system != store.get(owner, conversation).system:
            store.set_system(owner, conversation, self.system)
        self.conversation = conversation
        self.question = (
            store.add(owner, conversation, under, "user", self.text).id
            if self.text is not None
            else under
        )
        return self.question

    def details(self) -> dict:
        """What is saved with the reply: whether it finished, the settings that made it (the
        preset, the sampling fields with the seed, the system prompt, the model, and with
        options the think switch and the reasoning budget) and stats (with a reasoning, how
        long it took: `reasoning_s`)."""
        stats = self.last.stats if self.last is not None else None
        stopped = self.stopped or (stats is not None and stats.finish_reason == "cancelled")
        thinking = (
            {
                "thinking": self.options.thinking,
                "reasoning_budget": self.options.reasoning_budget,
            }
            if self.options is not None
            else {}
        )
        timing = (
            {"reasoning_s": round(self.reasoning_s, 3)}
            if self.reasoning_so_far and self.reasoning_s is not None
            else {}
        )
        return {
            "status": "stopped" if stopped else "complete",
            "settings": {
                "preset": self.preset,
                **self.params.as_dict(),
                "system": self.system,
                "model": self.engine.name,
                **thinking,
            },
            "stats": {**stats.as_dict(), **timing} if stats is not None else {},
        }

    def reply_fields(self) -> dict:
        """Everything saved with the reply besides its text: details(), its reasoning and its
        tool calls ({"id", "name", "arguments"} each)."""
        calls = [c for c in self.calls_so_far if c["name"]]
        return {
            **self.details(),
            "reasoning": self.reasoning_so_far,
            "tool_calls": [{**c, "id": c["id"] or f"call_{i}"} for i, c in enumerate(calls)],
        }

    def save_reply(self, store: Store, owner: str) -> Message:
        return store.add(
            owner,
            self.conversation,
            self.question,
            "assistant",
            self.text_so_far,
            **self.reply_fields(),
        )
