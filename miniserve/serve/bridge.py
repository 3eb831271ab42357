"""The bridge from the engine's threads to the event loop: each choice's chunks, posted by the
engine thread (or a remote reply's reader thread), handed to the coroutine writing the reply.
No thread waits per request or per choice; one wake-up of the loop delivers every chunk that
arrived meanwhile, and one wake-up serves every request made ready in the same engine step.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from dataclasses import dataclass


@dataclass
class Choice:
    recorder: object | None  # shapes.LogprobRecorder: what the choice's logprobs are


class Choices:
    """The engine requests of one request's choices. The engine calls each choice's sink on
    its own thread; the sink appends (choice, chunk, error) to one deque and asks the loop's
    Waker to wake this request only when no wake-up for it is already pending, so one
    wake-up delivers every chunk that arrived meanwhile, and the response writes them at
    once. (choice, None, None) marks the end of a choice. One event cancels them all."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.choices: list[Choice] = []
        self.cancel = threading.Event()
        self._waker = Waker.of(loop)
        self._items: deque = deque()
        self._wake_pending = False
        self._waiter: asyncio.Future | None = None
        self._open = 0
        self._on_stop: list = []

    @property
    def running(self) -> bool:
        return self._open > 0

    def started(self, recorder) -> None:  # event loop
        self.choices.append(Choice(recorder))
        self._open += 1

    def stop(self) -> None:
        """Cancel every choice still generating (a no-op for those that finished)."""
        self.cancel.set()
        while self._on_stop:
            try:
                self._on_stop.pop()()
            except Exception:  # noqa: BLE001 -- a stream already closed
                pass

    def on_stop(self, fn) -> None:
        """Also call fn at stop (a remote choice's stream: closed, not waited out)."""
        self._on_stop.append(fn)
        if self.cancel.is_set():
            self.stop()

    def sink(self, i: int):
        """What the engine calls with choice i's items: Chunks, an exception, then None."""
        post = self._post

        def sink(item) -> None:  # the engine thread: must return at once and never raise
            if item is None:
                post((i, None, None))
            elif isinstance(item, BaseException):
                post((i, None, item))
            else:
                post((i, item, None))

        return sink

    def _post(self, item) -> None:  # the engine thread
        self._items.append(item)
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self._waker.wake(self)
            except Exception:  # noqa: BLE001 -- the event loop is gone: nobody is listening
                self.stop()

    def _wake(self) -> None:  # event loop
        self._wake_pending = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_batch(self) -> list[tuple]:
        """Everything the engine posted since the last call (waits for at least one)."""
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch = []
        while self._items:
            item = self._items.popleft()
            if item[1] is None and item[2] is None:
                self._open -= 1
            batch.append(item)
        return batch


class Waker:
    """One per event loop. The engine thread asks it to wake a request; it asks the loop (a
    write to its self-pipe) only when no wake-up is already pending, then wakes every request
    that became ready meanwhile: when the engine emits one chunk for each of many streams in
    one step, the loop wakes once, not once per stream."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Waker] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # a strong one would keep the loop as a key for ever
        self._ready: deque = deque()
        self._pending = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Waker:  # called on the loop's thread
        waker = cls._by_loop.get(loop)
        if waker is None:
            waker = cls._by_loop[loop] = cls(loop)
        return waker

    def wake(self, choices: Choices) -> None:  # the engine thread
        self._ready.append(choices)
        if not self._pending:
            self._pending = True
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:  # the event loop
        self._pending = False
        while self._ready:
            self._ready.popleft()._wake()


async def until_disconnect(receive) -> None:
    """Return when the client has gone away (after the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def read_remote(stream, sink) -> None:
    """Hand a remote reply's items to the sink from a thread of its own (Chunks, an exception
    if it failed, then None). Closing the stream (Stop) ends it."""

    def run() -> None:
        try:
            for chunk in stream:
                sink(chunk)
        except BaseException as e:  # noqa: BLE001 -- reported to the client
            sink(e)
        finally:
            sink(None)

    threading.Thread(target=run, name="miniserve-remote-reply", daemon=True).start()
