"""The scheduler: many sequences, one forward pass per step (continuous batching).

    submit ─▶ waiting ──admit: a free slot (max_batch) and room in the KV budget──▶ running
                                                                                    │
      each step:  rows = one decode row per running sequence past its prompt
                       + chunks of prompts still being read, up to step_tokens rows in all
                  runner.step(rows) ── one pass over every row
                  per sequence with a new last row: sample (its params, its generator, its
                  ids so far, its grammar's mask) ─▶ observer ─▶ emit ─▶ EOS / stop /
                  grammar complete / budget / cancel? ─▶ retire

KV policy: reserve at admission. A sequence is admitted only when its prompt plus its token
budget (max_new_tokens, within the context) fits in what the budget has left, counting the
positions the prefix cache holds, which are given up first (oldest first). It then runs to
its end without ever being cut off or preempted; until it fits, it waits in order; a request
that could not fit even in an empty budget is refused when it is submitted. Sequences join
and leave at any step.

Every sequence yields exactly the tokens `decode.generate` yields for it alone: the native
runner computes each row in a fixed order whatever shares its pass (kernels/decode.cpp), and
each sequence samples from its own logits with its own generator, in the loop's order.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from miniserve.core.config import KV_BUDGET, MAX_BATCH, STEP_TOKENS, SamplingParams
from miniserve.core.errors import UserError
from miniserve.engine.decode import GenerationStats, LogitsObserver, Matcher, choose
from miniserve.engine.sampling import make_generator


class RequestTooLarge(UserError, ValueError):
    """A request whose prompt and token budget cannot fit in the KV budget at all."""

    field = "max_tokens"
    code = "context_length_exceeded"


@dataclass(eq=False)
class Sequence:
    """One request in the scheduler. `emit(token_id) -> bool` receives each new token (False:
    a stop string ended the reply); `finish(error)` is called once at the end."""

    prompt: list[int]
    params: SamplingParams
    budget: int  # new tokens at most (max_new_tokens, within the context)
    emit: Callable[[int], bool]
    finish: Callable[[BaseException | None], None]
    eos_ids: frozenset = frozenset()
    cancel: threading.Event = field(default_factory=threading.Event)
    observer: LogitsObserver | None = None
    matcher: Matcher | None = None  # the grammar the reply follows (its own state)
    reuse_prefix: bool = True
    stats: GenerationStats = field(default_factory=GenerationStats)
    # set by the scheduler
    cache: object = None
    done_prompt: int = 0  # prompt positions in the cache
    pending_logits: torch.Tensor | None = None  # what the cached whole prompt produced
    first_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    ids: torch.Tensor | None = None  # prompt + tokens, for the repetition penalty
    held: int = 0  # KV positions held while running (>= reserve)
    generator: torch.Generator | None = None

    @property
    def reserve(self) -> int:
        """KV positions held from admission to the end."""
        return len(self.prompt) + max(self.budget, 0)

    @property
    def prefilling(self) -> bool:
        return self.done_prompt < len(self.prompt) and self.pending_logits is None


class Scheduler:
    def __init__(
        self,
        runner,
        *,
        prefix_cache=None,
        max_batch: int = MAX_BATCH.default,
        step_tokens: int = STEP_TOKENS.default,
        kv_budget: int = KV_BUDGET.default,
    ):
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.max_batch = max_batch
        self.step_tokens = max(step_tokens, max_batch)  # every running sequence gets its row
        self.kv_budget = kv_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # what happened so far, for tests and the curious: passes run, the most sequences and
        # rows one pass held, the most KV positions ever reserved
        self.passes = self.widest = self.tallest = self.peak_kv = 0
        # the last pass: its seconds and how many sequences it held (a Step session's cost)
        self.last_pass_s, self.last_width = 0.0, 0
        # KV positions Step sessions (engine/step.py) hold between their passes, by session:
        # counted against the budget like a running sequence's
        self.kept: dict[object, int] = {}
        # draft tokens speculation proposed and accepted, all sequences together (/metrics)
        self.spec_drafted = self.spec_accepted = 0
        # called on the engine thread after each sequence's finish, with (sequence, error): each
        # must return at once and never raise (/metrics counts tokens and times there)
        self.on_finish: list[Callable[[Sequence, BaseException | None], None]] = []

    # -- bookkeeping --------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_used(self) -> int:
        """Positions of KV memory held: by running sequences (what they reserved, or the
        capacity of a larger cache they reused) and by the prefix cache's kept caches."""
        cached = self.prefix_cache.held_positions() if self.prefix_cache is not None else 0
        return sum(s.held for s in self.running) + sum(self.kept.values()) + cached

    def check(self, seq: Sequence) -> None:
        """Refuse now a request that could never be admitted."""
        if seq.reserve > self.kv_budget:
            raise RequestTooLarge(
                f"this request needs {seq.reserve} positions of KV cache ({len(seq.prompt)} "
                f"prompt + {seq.budget} new tokens) but the KV budget is {self.kv_budget} "
                "(--kv-budget): shorten the prompt or max_tokens, or raise the budget"
            )

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        seq.stats.prompt_tokens = len(seq.prompt)
        seq.stats.finish_reason = "length"
        self.waiting.append(seq)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> None:
        """Admit what fits, run one pass over every running sequence, sample, retire."""
        self._drop_cancelled()
        self._admit()
        rows = self._rows()
        ready = [s for s in self.running if s.pending_logits is not None]
        logits = None
        self.peak_kv = max(self.peak_kv, self.kv_used())
        if rows:
            self.passes += 1
            self.widest = max(self.widest, len({id(s) for s, _ in rows}))
            self.tallest = max(self.tallest, sum(len(chunk) for _, chunk in rows))
            self.last_width = len({id(s) for s, _ in rows})
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    logits = self._forward(rows)
                self.last_pass_s = time.perf_counter() - started
            except Exception as e:  # noqa: BLE001 -- the pass's sequences end with the error
                for seq in {id(s): s for s, _ in rows}.values():
                    self._retire(seq, error=e)
                return
        with torch.inference_mode():
            for seq in ready:
                seq_logits, seq.pending_logits = seq.pending_logits, None
                self._advance_or_fail(seq, seq_logits)
            for i, (seq, chunk) in enumerate(rows):
                seq.done_prompt = min(len(seq.prompt), seq.done_prompt + len(chunk))
                if not seq.prefilling:  # its prompt is in, or it is decoding
                    self._advance_or_fail(seq, logits[i : i + 1])

    def _advance_or_fail(self, seq: Sequence, logits: torch.Tensor) -> None:
        try:
            self._advance(seq, logits)
        except Exception as e:  # noqa: BLE001 -- a bad observer or sink ends its sequence only
            if seq in self.running:
                self._retire(seq, error=e)

    def fail_all(self, error: BaseException) -> None:
        """End every sequence with `error` (the engine thread caught something unexpected)."""
        for seq in [*self.waiting, *self.running]:
            self._retire(seq, error=error)

    def _forward(self, rows) -> torch.Tensor:
        entries = [(chunk, seq.cache) for seq, chunk in rows]
        return self.runner.step(entries)

    def _rows(self) -> list[tuple[Sequence, list[int]]]:
        """Decode rows first (every running sequence advances each step), then prompt chunks
        in admission order while the step has rows left."""
        rows = [
            (s, s.tokens[-1:])
            for s in self.running
            if not s.prefilling and s.pending_logits is None
        ]
        left = self.step_tokens - len(rows)
        for s in self.running:
            if s.prefilling and left > 0:
                chunk = s.prompt[s.done_prompt : s.done_prompt + left]
                rows.append((s, chunk))
                left -= len(chunk)
        return rows

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            running = sum(s.held for s in self.running) + sum(self.kept.values())
            if running + seq.reserve > self.kv_budget:
                return  # it waits, in order, until running sequences leave
            self.waiting.popleft()
            try:
                self._start(seq, running)
            except Exception as e:  # noqa: BLE001 -- e.g. no memory for its cache
                self._retire(seq, error=e)

    def _start(self, seq: Sequence, running: int) -> None:
        cache, reused, logits = None, 0, None
        if seq.cache is not None:  # a held cache (a Step session's) with the first positions
            cache, reused = seq.cache, seq.cache.get_seq_length()
        elif seq.reuse_prefix and self.prefix_cache is not None:
            cache, reused, logits = self.prefix_cache.take(seq.prompt)
        capacity = cache.capacity if cache is not None else 0
        seq.held = max(seq.reserve, capacity)
        # room: give up kept caches, oldest first (the one just taken is no longer among them)
        while (
            self.prefix_cache is not None
            and self.prefix_cache.entries
            and (running + seq.held + self.prefix_cache.held_positions() > self.kv_budget)
        ):
            self.prefix_cache.entries.popitem(last=False)
        if cache is None:
            cache = self.runner.new_cache(seq.reserve)
        else:
            cache.reserve(seq.reserve, exact=True)
        seq.cache, seq.done_prompt, seq.pending_logits = cache, reused, logits
        seq.stats.reused_tokens = reused
        seq.ids = torch.tensor([seq.prompt], dtype=torch.long, device=self.runner.device)
        if seq.params.seed is not None and not seq.params.greedy:
            seq.generator = make_generator(seq.params.seed, self.runner.device)
        self.running.append(seq)
        if seq.budget <= 0:  # the prompt fills the context
            self._retire(seq)

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Choose the sequence's next token from its logits, as decode.generate does."""
        if seq.first_logits is None:  # kept with its cache: not a view of the pass's logits
            seq.first_logits = logits.clone()
        token_id, ids = choose(
            logits,
            seq.params,
            seq.ids,
            seq.generator,
            seq.eos_ids,
            seq.stats,
            seq.observer,
            seq.matcher,
        )
        if ids is None:  # an end token, or no token allowed
            return self._retire(seq)
        seq.ids = ids
        seq.tokens.append(token_id)
        if not seq.emit(token_id) or (seq.matcher is not None and seq.matcher.done):
            seq.stats.finish_reason = "stop"  # a stop string, or the grammar complete
            return self._retire(seq)
        if len(seq.tokens) >= seq.budget:
            self._retire(seq)  # finish_reason stays "length"

    def _drop_cancelled(self) -> None:
        for seq in [s for s in (*self.waiting, *self.running) if s.cancel.is_set()]:
            seq.stats.finish_reason = "cancelled"
            self._retire(seq)

    def _retire(self, seq: Sequence, error: BaseException | None = None) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            if error is None and seq.reuse_prefix and self.prefix_cache is not None:
                held = seq.cache.get_seq_length()
                self.prefix_cache.put(
                    (seq.prompt + seq.tokens)[:held], seq.cache, len(seq.prompt), seq.first_logits
                )
        seq.stats.total_s = time.perf_counter() - seq.stats.started
        try:
            seq.finish(error)
        finally:
            for hook in self.on_finish:
                hook(seq, error)
