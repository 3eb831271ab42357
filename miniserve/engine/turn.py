"""One chat turn, the same for the web app's Chat tab and the terminal chat (which only render
it): the messages sent (system prompt, the conversation so far, the new user message), a seed
drawn when the settings have none (used, saved and shown, so the reply can be repeated), the
stream started (a refusal here is the request's: nothing is saved), the user's message saved
once the engine has taken the request, and the reply saved when it ends, finished or stopped,
with the settings and stats that made it.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator

from miniserve.core.config import RANDOM_SEEDS, SamplingParams
from miniserve.store.store import Message, Store


def with_seed(params: SamplingParams) -> SamplingParams:
    """The settings as they are, or with a seed drawn for this reply when they have none."""
    return (
        params if params.seed is not None else params.replace(seed=secrets.randbelow(RANDOM_SEEDS))
    )


def chat_messages(system: str | None, history: list[dict], text: str | None) -> list[dict]:
    """What the model is sent: the system prompt (if any), the history, the new message."""
    return (
        ([{"role": "system", "content": system}] if (system or "").strip() else [])
        + [{"role": m["role"], "content": m["content"]} for m in history]
        + ([{"role": "user", "content": text}] if text is not None else [])
    )


class ChatTurn:
    """A reply being streamed to `text` (None: a new reply to the last user message of
    `history`). Iterate it for the engine's chunks; `text_so_far`, `last` and `stopped` say
    where it is. (`cancel` may also be set by the caller's own stop button.)"""

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
    ):
        self.engine, self.system, self.text, self.preset = engine, system or "", text, preset
        self.params = with_seed(params)
        self.cancel = cancel or threading.Event()
        self.messages = chat_messages(system, history, text)
        self.stream = engine.chat(self.messages, self.params, cancel=self.cancel, observer=observer)
        self.text_so_far, self.last, self.stopped = "", None, False
        self.conversation: str | None = None
        self.question: str | None = None  # the saved user message the reply answers

    def __iter__(self) -> Iterator:
        for self.last in self.stream:  # noqa: B020 -- keeps the last chunk
            self.text_so_far += self.last.text
            yield self.last

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
        preset, the sampling fields with the seed, the system prompt, the model) and stats."""
        stats = self.last.stats if self.last is not None else None
        stopped = self.stopped or (stats is not None and stats.finish_reason == "cancelled")
        return {
            "status": "stopped" if stopped else "complete",
            "settings": {
                "preset": self.preset,
                **self.params.as_dict(),
                "system": self.system,
                "model": self.engine.name,
            },
            "stats": stats.as_dict() if stats is not None else {},
        }

    def save_reply(self, store: Store, owner: str) -> Message:
        return store.add(
            owner, self.conversation, self.question, "assistant", self.text_so_far, **self.details()
        )
