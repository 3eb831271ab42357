"""A remote server's streamed reply (miniserve/models/remote.py): its server-sent events read
as the local engine's Chunks -- the text and reasoning deltas, tool calls joined from their
pieces, the logprobs handed to the token inspector, the usage and stats -- and a stream cut
off, or an error event, raised as RemoteError."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx

from miniserve.core.config import ConfigError
from miniserve.core.toolcalls import ToolCall, new_call_id
from miniserve.engine.decode import GenerationStats
from miniserve.engine.engine import Chunk
from miniserve.engine.stream import text_bytes
from miniserve.models.remote_http import (
    TIMEOUT,
    RemoteError,
    _error_message,
    _network_reason,
    _snippet,
)

if TYPE_CHECKING:
    from miniserve.models.remote import RemoteEngine


class RemoteStream:
    """A reply read from the server's event stream, as the local engine's Stream: iterate for
    Chunks (the last has done=True and the stats). Closing it, dropping it or setting `cancel`
    closes the HTTP response at the next chunk, and the last chunk says "cancelled"."""

    def __init__(
        self,
        engine: RemoteEngine,
        response: httpx.Response,
        started: float,
        cancel: threading.Event,
        inspector,
        dropped: int,
        chat: bool,
        prompt_tokens=None,
    ):
        self.engine, self.response, self.cancel = engine, response, cancel
        self.inspector, self.dropped, self.chat = inspector, dropped, chat
        self.prompt_tokens = prompt_tokens
        self.stats = GenerationStats()
        self.stats.started = started
        self._closed = threading.Event()  # this stream only (`cancel` may be shared)
        self._ended = False
        self._end_lock = threading.Lock()
        self._items = self._chunks()

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        return next(self._items)

    def close(self) -> None:
        self._closed.set()
        try:
            self._items.close()
        except ValueError:  # being read on another thread: it stops at its next chunk
            return
        self._end()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- at interpreter exit the client may be gone
            pass

    def _count_prompt(self) -> int:
        try:
            return self.prompt_tokens()
        except (RemoteError, ConfigError, KeyError, TypeError, ValueError):
            return 0  # a count that fails costs the reply nothing

    def _stopping(self) -> bool:
        return self.cancel.is_set() or self._closed.is_set()

    def _end(self) -> None:
        """Close the response and give back the place in the queue, once."""
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
        self.response.close()
        self.engine._release()

    def _chunks(self) -> Iterator[Chunk]:
        stats, finish, done, usage = self.stats, None, False, None
        calls = _Calls()
        try:
            for event in self._events():
                if event is None:  # [DONE]
                    done = True
                    break
                if self._stopping():
                    break
                usage = event.get("usage") or usage
                for text, finish_now, reasoning, deltas in self._take(event):
                    finish = finish_now or finish
                    calls.add(deltas)
                    if text or reasoning or deltas:
                        yield Chunk(text, [], stats, reasoning=reasoning, tool_calls=deltas)
                if self._stopping():
                    break
            if self._stopping() and not done:
                stats.finish_reason = "cancelled"
            elif finish is None and not done:
                raise self.engine._cut()
            else:
                stats.finish_reason = finish or "stop"
            if isinstance(usage, dict):
                stats.prompt_tokens = _int(usage.get("prompt_tokens"), stats.prompt_tokens)
                stats.new_tokens = _int(usage.get("completion_tokens"), stats.new_tokens)
            if (
                not stats.prompt_tokens
                and self.prompt_tokens
                and stats.finish_reason != "cancelled"
            ):  # the server sent no usage
                stats.prompt_tokens = self._count_prompt()
            stats.total_s = time.perf_counter() - stats.started
            yield Chunk(
                "", [], stats, done=True, dropped_messages=self.dropped, calls=calls.whole()
            )
        finally:
            self._end()

    def _events(self) -> Iterator[dict | None]:
        """The stream's JSON events, then None for [DONE]; RemoteError for an error event,
        something that is not JSON, or a connection that broke."""
        try:
            for line in self.response.iter_lines():
                if self._stopping():
                    return
                field, _, value = line.partition(":")
                value = value.strip()
                if field == "data" and value == "[DONE]":
                    yield None
                    return
                if field in ("data", "error"):
                    yield self._event(value, field)
                elif line and not line.startswith(":") and field not in ("event", "id", "retry"):
                    raise self.engine._error(
                        f"it sent a line that is not an event: {_snippet(line)}"
                    )
        except httpx.TimeoutException:
            raise self.engine._error(f"the server sent nothing for {TIMEOUT.read:.0f} s") from None
        except httpx.HTTPError as e:
            if self._stopping():
                return
            raise self.engine._cut(_network_reason(e)) from None

    def _event(self, value: str, field: str) -> dict:
        try:
            event = json.loads(value)
        except json.JSONDecodeError:
            raise self.engine._error(
                f"it sent an event that is not JSON: {_snippet(value)}"
            ) from None
        if not isinstance(event, dict):
            raise self.engine._error(f"it sent an event that is not an object: {_snippet(value)}")
        message = _error_message(event)
        if field == "error" or message:
            raise self.engine._error(f"the server failed: {message or _snippet(value)}")
        if not isinstance(event.get("choices", []), list):
            raise self.engine._error(f"it sent an event without choices: {_snippet(value)}")
        return event

    def _take(self, event: dict) -> Iterator[tuple[str, str | None]]:
        """(text, finish reason) of the event's first choice; counts its tokens, times the
        first one, and hands its logprobs to the inspector."""
        for choice in event.get("choices", [])[:1]:
            if not isinstance(choice, dict):
                continue
            delta = (choice.get("delta") if self.chat else choice) or {}
            text = delta.get("content" if self.chat else "text") or ""
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            deltas = delta.get("tool_calls") or []
            steps = _logprob_steps(choice.get("logprobs"))
            if text or steps or reasoning or deltas:
                now = time.perf_counter()
                if not self.stats.ttft_s:
                    self.stats.ttft_s = now - self.stats.started
                self.stats.total_s = now - self.stats.started
                self.stats.new_tokens += len(steps) or 1
                self._inspect(text, steps, bool(text) or not (reasoning or deltas))
            yield (
                text if isinstance(text, str) else str(text),
                choice.get("finish_reason"),
                reasoning if isinstance(reasoning, str) else "",
                [d for d in deltas if isinstance(d, dict)] if isinstance(deltas, list) else [],
            )

    def _inspect(self, text: str, steps: list, answer: bool) -> None:
        """Hand the event's steps to the inspector, each marked the answer's or not: with
        `answer` (the event carries the answer's text), those from the one its text starts
        with on; the tokens before (a tag, newlines the server left out of the answer) are
        not, nor any of an event of reasoning or calls."""
        if self.inspector is None:
            return
        if not steps:  # the server gave no logprobs: the text, without probabilities
            self.inspector.add_remote_step(text, None, [], answer=answer)
        started = False
        for token, logprob, top in steps:
            started = started or (answer and _starts(text, token))
            self.inspector.add_remote_step(token, logprob, top, answer=started)


def _starts(text: str, token: str) -> bool:
    """Whether an event's text starts with a token's: by the whole characters it holds, and a
    token that holds only a piece of one ("bytes:\\xf0\\x9f") starts a text that opens with a
    character outside ASCII."""
    whole = text_bytes(token).decode("utf-8", "ignore")
    if not whole:
        return bool(text) and not text[0].isascii()
    return text.startswith(whole) or whole.startswith(text)


class _Calls:
    """Tool calls streamed as OpenAI's deltas, joined as the SDK joins them (by index)."""

    def __init__(self):
        self.by_index: dict[int, dict] = {}

    def add(self, deltas: list[dict]) -> None:
        for d in deltas:
            call = self.by_index.setdefault(
                int(d.get("index", 0)), {"id": "", "name": "", "arguments": ""}
            )
            fn = d.get("function") or {}
            call["id"] = d.get("id") or call["id"]
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""

    def whole(self) -> list[ToolCall]:
        return [
            ToolCall(c["id"] or new_call_id(), c["name"], c["arguments"])
            for _, c in sorted(self.by_index.items())
        ]


def _inspector(observer):
    """The Inspector (or API recorder) behind an observer (its bound `observe`), if it takes
    a server's logprobs; None otherwise."""
    owner = getattr(observer, "__self__", None)
    return owner if hasattr(owner, "add_remote_step") else None


def _logprob_steps(logprobs) -> list[tuple[str, float | None, list]]:
    """(token, logprob, [(text, logprob)] alternatives) per token, from chat's
    {"content": [...]} or completions' {"tokens", "token_logprobs", "top_logprobs"}."""
    if not isinstance(logprobs, dict):
        return []
    if isinstance(logprobs.get("content"), list):
        return [
            (
                str(e.get("token", "")),
                _float(e.get("logprob")),
                [
                    (str(t.get("token", "")), _float(t.get("logprob"), -math.inf))
                    for t in e.get("top_logprobs") or []
                    if isinstance(t, dict)
                ],
            )
            for e in logprobs["content"]
            if isinstance(e, dict)
        ]
    tokens = logprobs.get("tokens")
    if not isinstance(tokens, list):
        return []
    values = logprobs.get("token_logprobs") or [None] * len(tokens)
    tops = logprobs.get("top_logprobs") or [{}] * len(tokens)
    return [
        (
            str(t),
            _float(v),
            sorted(
                ((str(k), _float(p, -math.inf)) for k, p in (top or {}).items()),
                key=lambda kv: -kv[1],
            ),
        )
        for t, v, top in zip(tokens, values, tops)
    ]


def _int(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _float(value, default=None):
    return (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
    )
