"""The hand-written decode loop: token ids in, one chosen token id out per step.

    prompt ids --forward--> logits --sample--> id --forward(id)--> logits --sample--> id ...

With the KV cache, the first step (prefill) runs the prompt through the model once and
keeps every layer's keys and values; each later step feeds only the newest token. Without it,
every step runs the whole sequence again (the textbook O(n^2) loop, kept for
comparison). Both share one loop and differ only in what they feed the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from miniserve.core.config import SamplingParams
from miniserve.engine.sampling import NoTokenAllowed, SamplerState, make_generator, sample
from miniserve.runners.hf import as_runner

# A hook that sees each step's raw logits, the ids so far, the chosen id, the grammar's mask
# of allowed tokens (None when the reply is not constrained) and the reply's sampling state
# (its draws at this step): the token inspector.
LogitsObserver = Callable[
    ["torch.Tensor", "torch.Tensor", int, "torch.Tensor | None", "SamplerState"], None
]


class Matcher(Protocol):
    """A grammar's state for one sequence (miniserve/engine/grammar.py): which tokens may come next,
    the token that came, and whether the text is complete."""

    def allowed(self, width: int) -> torch.Tensor: ...  # bool, shape (1, width)

    def accept(self, token_id: int) -> None: ...

    @property
    def done(self) -> bool: ...


@dataclass
class GenerationStats:
    """Filled in while tokens are generated; read it during or after the loop."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from an earlier request
    new_tokens: int = 0
    reasoning_tokens: int = 0  # of new_tokens, those a thinking model chose inside its reasoning
    drafted: int = 0  # prompt-lookup draft tokens verified (speculation)
    accepted: int = 0  # of those, the ones the sampling drew (each a step saved)
    draft_steps: int = 0  # steps that verified drafts
    ttft_s: float = 0.0  # prompt in -> first token chosen (prefill + one sample)
    total_s: float = 0.0
    # "eos" | "length" | "stop" (a stop string, or the grammar complete) | "cancelled" |
    # "tool_calls" (the reply ended with tool calls) |
    # "no_token_allowed" (the grammar and the logit bias left no token to choose)
    finish_reason: str = ""
    started: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (prefill excluded)."""
        decode_s = self.total_s - self.ttft_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self, sep: str = ", ") -> str:
        """The line the web app, the terminal chat and `generate` show after a reply."""
        return sep.join(
            [
                f"{self.prompt_tokens} prompt tokens ({self.reused_tokens} reused from cache)",
                f"{self.new_tokens} new tokens",
                f"first token {self.ttft_s:.2f} s",
                f"{self.decode_tokens_per_s:.1f} tokens/s",
                f"finish: {self.finish_reason}",
            ]
            + (
                [
                    f"speculation: accepted {self.accepted / self.draft_steps:.1f} of "
                    f"{self.drafted / self.draft_steps:.1f} a step"
                ]
                if self.draft_steps
                else []
            )
        )

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "new_tokens": self.new_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "draft_steps": self.draft_steps,
            "ttft_s": round(self.ttft_s, 4),
            "total_s": round(self.total_s, 4),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "finish_reason": self.finish_reason,
        }


def crop_cache(cache, keep: int) -> None:
    """Keep the first `keep` positions. A negative argument means "remove that many" in
    every transformers version (5.x accepts only that form)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def generate(
    model,
    prompt_ids: list[int] | torch.Tensor,
    params: SamplingParams,
    *,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    use_cache: bool = True,
    cache=None,
    cancel: threading.Event | None = None,
    generator: torch.Generator | None = None,
    stats: GenerationStats | None = None,
    max_length: int | None = None,
    observer: LogitsObserver | None = None,
    prompt_logits: torch.Tensor | None = None,
    matcher: Matcher | None = None,
    sampler: SamplerState | None = None,
) -> Iterator[int]:
    """Yield new token ids one at a time until EOS, the token budget, or `cancel`.

    `cache` may already hold the keys/values of a prefix of `prompt_ids` (prefix reuse);
    only the rest is prefilled. When it holds the whole prompt, `prompt_logits` are the
    logits that prompt produced before (a repeated prompt): step 0 then needs no forward
    pass, and the reply is computed exactly as the first one was. `stats` is updated as the
    loop runs. The caller stops on stop strings simply by not asking for the next token.
    `matcher`: the grammar the reply must follow (its mask is a stage of the sampling); the
    loop ends when the grammar is complete.
    """
    model = as_runner(model)  # a transformers model is wrapped (miniserve/runners/hf.py)
    stats = stats if stats is not None else GenerationStats()
    stats.started = time.perf_counter()
    device = model.device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    stats.prompt_tokens = ids.shape[1]
    budget = params.max_new_tokens
    if max_length is not None:
        budget = min(budget, max_length - ids.shape[1])
    if generator is None and params.seed is not None and not params.greedy:
        generator = make_generator(params.seed, device)
    if use_cache and cache is None:
        cache = model.new_cache()
    sampler = sampler if sampler is not None else SamplerState()
    if sampler.prompt_len is None:  # where the reply's own tokens start (presence penalty)
        sampler.prompt_len = ids.shape[1]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    reused = cache.get_seq_length() if use_cache else 0
    if prompt_logits is not None and reused != ids.shape[1]:
        raise ValueError("prompt_logits need a cache that holds the whole prompt")
    if prompt_logits is None and reused >= ids.shape[1]:
        raise ValueError("the cache holds the whole prompt: pass its logits, or crop it")
    stats.reused_tokens = reused
    stats.finish_reason = "length"

    reply = Reply(params, eos_ids, stats, generator, observer, matcher, sampler)
    try:
        yield from _loop(model, ids, budget, use_cache, cache, cancel, prompt_logits, reply)
    finally:
        stats.total_s = time.perf_counter() - stats.started


@dataclass
class Reply:
    """What choosing a reply's tokens reads and updates, step after step: its settings, end
    tokens, stats, random generator, observer (the inspector), grammar and sampling state.
    The scheduler's Sequence has the same attributes."""

    params: SamplingParams
    eos_ids: frozenset
    stats: GenerationStats
    generator: torch.Generator | None = None
    observer: LogitsObserver | None = None
    matcher: Matcher | None = None
    sampler: SamplerState | None = None


def _loop(model, ids, budget, use_cache, cache, cancel, prompt_logits, reply) -> Iterator[int]:
    stats, matcher = reply.stats, reply.matcher
    # Step 0: the prompt (or its uncached tail) goes through the model once.
    pending = ids[:, stats.reused_tokens :] if use_cache else ids
    for index in range(max(budget, 0)):
        if cancel is not None and cancel.is_set():
            stats.finish_reason = "cancelled"
            break
        # inference_mode per step, never across a `yield`: grad mode is thread state, and
        # interleaved generators would otherwise switch it for each other.
        with torch.inference_mode():
            if index == 0 and prompt_logits is not None:
                logits = prompt_logits  # the whole prompt is cached, and what it produced
            else:
                logits = model.forward(pending, cache if use_cache else None)
            token_id, ids = choose(logits, ids, reply)
            if ids is None:  # an end token, or no token allowed
                break
            # Next step's input: only the new token with a cache, everything without.
            pending = ids[:, -1:] if use_cache else ids
        yield token_id
        if matcher is not None and matcher.done:
            stats.finish_reason = "stop"
            break


def choose(
    logits: torch.Tensor, ids: torch.Tensor, reply: Reply, drawn=None
) -> tuple[int | None, torch.Tensor | None]:
    """One step's choice, the same in this loop and in the scheduler: sample (the repetition
    penalty sees every id so far; the grammar's mask is a stage; greedy skips the softmax),
    time it, show it to the observer, advance the grammar. Returns (token id, ids with it
    appended), or (token id, None) for an end token (stats.finish_reason = "eos"), or
    (None, None) when the grammar and the logit bias allow no token
    (stats.finish_reason = "no_token_allowed"). `drawn`: what sampling.sample_rows gave this
    row with others (a token, or NoTokenAllowed), where it did."""
    stats, matcher, sampler = reply.stats, reply.matcher, reply.sampler
    allowed = matcher.allowed(logits.shape[-1]) if matcher is not None else None
    try:
        if isinstance(drawn, NoTokenAllowed):
            raise drawn
        token = (
            drawn
            if drawn is not None
            else sample(logits, reply.params, ids, reply.generator, allowed, sampler)
        )
    except NoTokenAllowed:
        stats.finish_reason = "no_token_allowed"
        return None, None
    token_id = int(token.item())  # the one host sync per step
    now = time.perf_counter()
    if not stats.ttft_s:
        stats.ttft_s = now - stats.started
    stats.total_s = now - stats.started
    if reply.observer is not None:
        reply.observer(logits, ids, token_id, allowed, sampler)
    if matcher is not None:
        matcher.accept(token_id)
    if token_id in reply.eos_ids:
        stats.finish_reason = "eos"
        return token_id, None
    stats.new_tokens += 1
    return token_id, torch.cat([ids, token.view(1, 1)], dim=1)
