"""The engine surface: what every caller (the web app, the API, the CLI, the benchmark) may
ask of a model, whether it runs here (`engine.Engine`) or on a server
(`models.remote.RemoteEngine`). Callers ask `capabilities` what the engine can do instead of
asking where it runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from miniserve.core.config import SamplingParams


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond generating text."""

    # Its tokenizer and forward pass are in this process: token ids in and out, tokenizing on
    # request, log-probabilities of a prompt's own tokens, its prefix cache, the logits of a
    # step (the Step view, the inspector's stages).
    local_tokens: bool
    # Counting tokens and starting a reply are requests to a server: they block and can fail
    # as the server fails (so an event loop runs them on a thread, and a failure is the
    # server's, HTTP 502).
    over_network: bool


LOCAL = Capabilities(local_tokens=True, over_network=False)
REMOTE = Capabilities(local_tokens=False, over_network=True)


@runtime_checkable
class EngineSurface(Protocol):
    """The calls every engine answers (tests/test_structure.py checks both engines)."""

    capabilities: Capabilities
    name: str
    context_length: int

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def queue_depth(self) -> int: ...

    def info(self) -> dict: ...

    def check(self, params: SamplingParams) -> None: ...

    def trim(self, messages: list[dict], params: SamplingParams): ...

    def chat(self, messages: list[dict], params: SamplingParams, **kwargs) -> Iterator: ...

    def complete_text(
        self, prompt, params: SamplingParams, trim: bool = False, **kwargs
    ) -> Iterator: ...

    def compare_prompt(
        self, prompt: str, settings: list[SamplingParams], *, raw: bool = False, **kwargs
    ): ...

    def close(self) -> None: ...
