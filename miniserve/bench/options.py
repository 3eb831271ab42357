"""The benchmarks' options and their checks: the modes, the limits, the two configs (a value
out of bounds raises ValueError) and the presets a concurrency run asks for."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from miniserve.core.config import (
    GREEDY,
    MAX_NEW_TOKENS,
    MAX_QUEUE,
    SamplingParams,
    load_presets,
    with_builtins,
)
from miniserve.core.errors import UserError

# The benchmarks' limits, checked by their configs and by the CLI (concurrency levels: the
# engine's queue, config.MAX_QUEUE).
MAX_PROMPT_TOKENS = 32768
REPEAT = range(1, 21)  # runs per row

MODES = ("no_cache", "cache", "cache+json_schema", "hf_generate", "transformers_loop", "lean")
DEFAULT_MODES = ("no_cache", "cache", "cache+json_schema", "hf_generate")
# cache+json_schema: the cached loop with the grammar stage on, under a schema that cannot end
# before the token budget (a string of at least this many characters): what each step's mask
# costs. Its tokens follow the schema, so they are not checked against the free reference.
CONSTRAINED_MODES = ("cache+json_schema",)
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100000}},
    "required": ["text"],
}

Progress = Callable[[float, str], None]


class BenchStopped(UserError):
    """A benchmark stopped before its end (its Stop, or its page closed)."""

    def __init__(self):
        super().__init__("stopped: the benchmark ended before its last run; nothing is shown")


def stoppable(progress: Progress, cancel: threading.Event | None) -> Progress:
    """`progress`, which raises BenchStopped once `cancel` is set: a benchmark calls it before
    each run, so a stop takes effect within the run in progress."""
    if cancel is None:
        return progress

    def tick(fraction: float, message: str) -> None:
        if cancel.is_set():
            raise BenchStopped()
        progress(fraction, message)

    return tick


def check_repeat(repeat) -> None:
    if repeat not in REPEAT:
        raise ValueError(f"repeat must be from {REPEAT.start} to {REPEAT.stop - 1}, got {repeat}")


@dataclass
class BenchConfig:
    prompt_tokens: list[int] = field(default_factory=lambda: [64, 256, 1024])
    new_tokens: int = 64
    repeat: int = 3
    modes: tuple[str, ...] = DEFAULT_MODES
    peer: bool = False  # also llama.cpp (f32, bf16, the file's own type) on its weights
    check: bool = True  # check our tokens against the reference (TokenCheck)
    # prompt-lookup drafts in our rows (off: one token a step, as the rows compared with)
    speculate: bool = False

    def __post_init__(self):
        if not self.prompt_tokens or any(
            not 1 <= n <= MAX_PROMPT_TOKENS for n in self.prompt_tokens
        ):
            raise ValueError(f"prompt lengths must be whole numbers from 1 to {MAX_PROMPT_TOKENS}")
        if not 2 <= self.new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(
                f"new tokens must be from 2 to {MAX_NEW_TOKENS}, got {self.new_tokens}"
            )
        check_repeat(self.repeat)
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(
                f"unknown mode {', '.join(unknown) or '(none)'}; choose from {', '.join(MODES)}"
            )


@dataclass
class ConcurrencyConfig:
    levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    prompt_tokens: int = 64
    new_tokens: int = 128
    presets: tuple[str, ...] = (GREEDY, "balanced")
    repeat: int = 1
    peer: bool = False  # also llama.cpp decoding the same B greedy streams batched
    presets_file: str | None = None  # where `presets` are defined, when no table is given
    # every stream writes all its new tokens (end tokens banned by a -100 logit bias, as
    # llama-bench ignores them): a sampled preset's streams would otherwise end at different
    # steps and its aggregate would measure a shrinking batch, not its sampling
    ignore_eos: bool = True
    speculate: bool = False  # prompt-lookup drafts in our streams (BenchConfig.speculate)

    def __post_init__(self):
        low, high = int(MAX_QUEUE.low), int(MAX_QUEUE.high)
        if not self.levels or any(
            not isinstance(b, int) or not low <= b <= high for b in self.levels
        ):
            raise ValueError(f"concurrency levels must be whole numbers from {low} to {high}")
        if not 2 <= self.prompt_tokens <= MAX_PROMPT_TOKENS:
            raise ValueError(
                f"prompt tokens must be from 2 to {MAX_PROMPT_TOKENS}, got {self.prompt_tokens}"
            )
        if not 2 <= self.new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(
                f"new tokens must be from 2 to {MAX_NEW_TOKENS}, got {self.new_tokens}"
            )
        check_repeat(self.repeat)
        if not self.presets:
            raise ValueError("name at least one preset")


def concurrency_params(
    config: ConcurrencyConfig, presets: dict[str, SamplingParams] | None = None
) -> dict[str, SamplingParams]:
    """The presets to run, by name, asking for new_tokens with no stop strings: from `presets`
    (the table a caller has loaded, the web app's), else from config.presets_file (None: the
    default presets.yaml). `greedy` is built in unless the table defines it."""
    if presets is None:
        presets = load_presets(config.presets_file)
    presets = with_builtins(presets)
    unknown = [p for p in config.presets if p not in presets]
    if unknown:
        raise ValueError(f"unknown preset {', '.join(unknown)} (available: {', '.join(presets)})")
    return {
        name: presets[name].replace(max_new_tokens=config.new_tokens, stop=())
        for name in config.presets
    }
