"""The scheduler: many sequences, one forward pass per step (continuous batching).

    submit ─▶ waiting ──admit: a free slot (max_batch) and room in the KV budget──▶ running
                                                                                    │
      each step:  rows = one decode row per running sequence past its prompt
                       + chunks of prompts still being read, up to step_tokens rows in all
                  runner.step(rows) ── one pass over every row
                  the new last rows that share their settings (and follow no grammar): one
                  block through the stages, each drawing from its own generator
                  (sampling.sample_rows); the others one by one
                  per sequence with a new last row: its token (its params, its generator, its
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
each sequence samples from its own logits with its own generator, in the loop's order (a block
of rows gives each row the numbers it gets alone: sampling.sample_rows).
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
from miniserve.engine.decode import GenerationStats, LogitsObserver, Matcher, choose, crop_cache
from miniserve.engine.sampling import SamplerState, batch_key, make_generator, sample_rows


class RequestTooLarge(UserError, ValueError):
    """A request whose prompt and token budget cannot fit in the KV budget at all."""

    field = "max_tokens"
    code = "context_length_exceeded"


@dataclass(eq=False)
class Sequence:
    """One request in the scheduler. `emit(token_id) -> bool` receives each new token (False:
    a stop string ended the reply); `finish(error)` is called once at the end; `on_prompt`, if
    set, with the prompt positions in the cache while a prompt is read: at admission, then
    after each pass that read a part of it but not all."""

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
    sampler: SamplerState = field(default_factory=SamplerState)  # Mirostat's mu, the draws
    speculate: bool = False  # prompt-lookup drafts (set by the engine where they apply)
    drafter: Drafter | None = None
    valid_kv: int | None = None  # while verifying drafts: the cache positions known good
    expect: int | None = None  # while verifying drafts: the draft token at this position
    on_prompt: Callable[[int], None] | None = None
    sample_key: tuple | None = None  # rows with the same key sample together (batch_key)

    @property
    def reserve(self) -> int:
        """KV positions held from admission to the end."""
        return len(self.prompt) + max(self.budget, 0)

    @property
    def prefilling(self) -> bool:
        return self.done_prompt < len(self.prompt) and self.pending_logits is None


SPEC_MAX = 8  # draft tokens a step at most
SPEC_START = 4  # draft tokens of a sequence's first drafting step
SPEC_NGRAMS = (3, 2)  # the lengths of the tail matched, longest first
SPEC_WINDOW = 4  # drafting steps an acceptance rate is measured over
SPEC_MIN_RATE = 0.5  # accepted tokens a drafting step, on average, below which drafting pauses
SPEC_PAUSE = 16  # steps a paused sequence decodes one token at a time (doubled each pause)
SPEC_MAX_PAUSE = 256
# Rows a pass's decode rows and their drafts fill at most: each decoding sequence drafts up to
# (SPEC_ROWS - sequences) // sequences tokens (8 alone, 5 beside one other, 2 beside three,
# none from 7). Up to about this many rows a product costs little more than one row (the
# weights are read once: 2 rows ~1.1x one, 8 rows ~2.3x, Q4_1/Q4_K/Q8_0 on Zen 4); past it each
# row costs its own arithmetic, and a batch that is already wide gains nothing from drafts a
# verification may reject (8 streams measured 0.97x of off with drafts for every stream).
SPEC_ROWS = 12


class Drafter:
    """Prompt-lookup drafts for one sequence: the tokens that followed the most recent earlier
    occurrence of its last 3 tokens (else 2) in its prompt and reply so far, up to k. An index
    of every 2- and 3-gram's most recent end keeps a lookup O(1) a step.

    What a draft costs is its rows' share of the pass, so the drafts follow what pays: k starts
    at SPEC_START, doubles (to SPEC_MAX) after a draft taken whole, and drops to one more than
    what was accepted after one that was not; and drafting pauses (SPEC_PAUSE steps, doubled
    at each pause up to SPEC_MAX_PAUSE) when the last SPEC_WINDOW drafting steps accepted fewer
    than SPEC_MIN_RATE tokens each on average."""

    def __init__(self, ids: list[int]):
        self.ids = list(ids)
        self.ends: dict[tuple, int] = {}
        self.indexed = 0  # grams ending at positions <= indexed are in `ends`
        self.recent: deque[int] = deque(maxlen=SPEC_WINDOW)
        self.paused, self.pause = 0, SPEC_PAUSE
        self.k = SPEC_START
        self.drafted = self.accepted = 0

    def extend(self, ids) -> None:
        self.ids.extend(ids)

    def draft(self, k: int) -> list[int]:
        if k <= 0:
            return []
        if self.paused:
            self.paused -= 1
            return []
        ids, last = self.ids, len(self.ids)
        for end in range(self.indexed + 1, last):  # all but the tail's own grams
            for n in SPEC_NGRAMS:
                if end >= n:
                    self.ends[tuple(ids[end - n : end])] = end
        self.indexed = max(self.indexed, last - 1)
        for n in SPEC_NGRAMS:
            if last >= n and (end := self.ends.get(tuple(ids[last - n :]))) is not None:
                return ids[end : end + min(k, self.k)]
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.recent.append(accepted)
        self.k = min(SPEC_MAX, 2 * self.k) if accepted == drafted else accepted + 1
        if len(self.recent) == SPEC_WINDOW and sum(self.recent) < SPEC_MIN_RATE * SPEC_WINDOW:
            self.paused, self.recent = self.pause, deque(maxlen=SPEC_WINDOW)
            self.pause = min(2 * self.pause, SPEC_MAX_PAUSE)


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
        # rows sampled in a block (sampling.sample_rows), one or many
        self.sampled_together = 0
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
            at = 0  # the pass's logits: one row per entry, a row per token for a draft's
            decoded = []  # (sequence, its row's index) for each row that gives a next token
            for seq, chunk in rows:
                n = len(chunk) if self._drafting(seq, chunk) else 1
                seq_logits, at = logits[at : at + n], at + n
                if n > 1:
                    self._verify(seq, chunk[1:], seq_logits)
                    continue
                seq.done_prompt = min(len(seq.prompt), seq.done_prompt + len(chunk))
                if not seq.prefilling:  # its prompt is in, or it is decoding
                    decoded.append((seq, at - 1))
                else:
                    self._prompt_read(seq)
            drawn = self._sample_together(logits, decoded)
            for seq, row in decoded:
                self._advance_or_fail(seq, logits[row : row + 1], drawn.get(seq))

    def _sample_together(self, logits: torch.Tensor, decoded: list) -> dict:
        """The tokens of the pass's rows that share their settings (sampling.batch_key) and
        follow no grammar, sampled a block at a time (sampling.sample_rows: each row's token
        the one it gets alone; a row alone is a block of one); the other rows sample one at a
        time in `choose`. A block that fails leaves its rows to `choose` too, where each meets
        its own error."""
        groups: dict = {}
        for seq, row in decoded:
            if seq.sample_key is not None and seq.matcher is None:
                groups.setdefault(seq.sample_key, []).append((seq, row))
        drawn = {}
        for members in groups.values():  # one row too: the block's memory, numpy's division
            seqs, at = [s for s, _ in members], [r for _, r in members]
            if at == list(range(at[0], at[0] + len(at))):  # decode rows come first, in order
                block = logits[at[0] : at[0] + len(at)]
            else:
                block = logits[at]
            try:
                tokens = sample_rows(
                    block,
                    seqs[0].params,
                    [s.ids for s in seqs],
                    [s.generator for s in seqs],
                    [s.sampler for s in seqs],
                )
            except Exception:  # noqa: BLE001 -- each row meets it again, alone, in choose
                continue
            drawn.update(zip(seqs, tokens))
            self.sampled_together += len(seqs)
        return drawn

    def _prompt_read(self, seq: Sequence) -> None:
        """Tell a sequence that asked how far its prompt is read; a failing sink ends it."""
        if seq.on_prompt is None:
            return
        try:
            seq.on_prompt(seq.done_prompt)
        except Exception as e:  # noqa: BLE001 -- as a bad sink in _advance
            self._retire(seq, error=e)

    def _advance_or_fail(self, seq: Sequence, logits: torch.Tensor, drawn=None) -> None:
        try:
            self._advance(seq, logits, drawn)
        except Exception as e:  # noqa: BLE001 -- a bad observer or sink ends its sequence only
            if seq in self.running:
                self._retire(seq, error=e)

    def fail_all(self, error: BaseException) -> None:
        """End every sequence with `error` (the engine thread caught something unexpected)."""
        for seq in [*self.waiting, *self.running]:
            self._retire(seq, error=error)

    def _forward(self, rows) -> torch.Tensor:
        entries = [(chunk, seq.cache) for seq, chunk in rows]
        every = [self._drafting(seq, chunk) for seq, chunk in rows]
        if any(every):  # a row of logits for each draft token, one per entry elsewhere
            return self.runner.step(entries, all_logits=every)
        return self.runner.step(entries)

    @staticmethod
    def _drafting(seq: Sequence, chunk: list[int]) -> bool:
        return seq.drafter is not None and not seq.prefilling and len(chunk) > 1

    def _decode_row(self, s: Sequence, room: int = SPEC_MAX) -> list[int]:
        """A decoding sequence's row: its last token, and the drafts to verify (at most `room`,
        and within what its budget has left: the pass then never writes past its reserve)."""
        if not s.speculate or not s.tokens:
            return s.tokens[-1:]
        if s.drafter is None:
            s.drafter = Drafter(s.prompt + s.tokens)
        else:
            s.drafter.extend(s.tokens[len(s.drafter.ids) - len(s.prompt) :])
        return s.tokens[-1:] + s.drafter.draft(min(SPEC_MAX, room, s.budget - len(s.tokens) - 1))

    def _verify(self, seq: Sequence, draft: list[int], logits: torch.Tensor) -> None:
        """Sample position by position from the pass's rows, as a step at a time would (the
        sequence's own generator, grammar and observer), accepting while the token drawn is
        the draft's; the cache keeps the positions up to the last accepted draft."""
        start = seq.cache.get_seq_length() - len(draft) - 1  # where the row's last token went
        accepted = 0
        # counted before any token goes out: the reply's last chunk carries its stats, and a
        # caller woken by it reads them (and these counters) at once
        seq.stats.drafted += len(draft)
        seq.stats.draft_steps += 1
        self.spec_drafted += len(draft)
        for j in range(len(draft) + 1):
            seq.valid_kv = start + 1 + j  # the last token and the drafts accepted so far
            seq.expect = draft[j] if j < len(draft) else None
            before = len(seq.tokens)
            self._advance_or_fail(seq, logits[j : j + 1])
            if seq not in self.running or len(seq.tokens) == before:
                break  # retired (its cache cut to valid_kv there)
            if j == len(draft) or seq.tokens[-1] != draft[j]:
                break
            accepted += 1
        if seq in self.running:
            crop_cache(seq.cache, start + 1 + accepted)
        seq.valid_kv = seq.expect = None
        seq.drafter.verified(len(draft), accepted)

    def _rows(self) -> list[tuple[Sequence, list[int]]]:
        """Decode rows first (every running sequence advances each step: its last token, and
        its drafts when it speculates), then prompt chunks in admission order while the step
        has rows left."""
        decoding = [s for s in self.running if not s.prefilling and s.pending_logits is None]
        room = (SPEC_ROWS - len(decoding)) // max(len(decoding), 1)  # drafts each (SPEC_ROWS)
        rows = [(s, self._decode_row(s, room)) for s in decoding]
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
        seq.sample_key = batch_key(seq.params)
        self.running.append(seq)
        if seq.budget <= 0:  # the prompt fills the context
            self._retire(seq)
        elif seq.prefilling:
            self._prompt_read(seq)

    def _advance(self, seq: Sequence, logits: torch.Tensor, drawn=None) -> None:
        """Choose the sequence's next token from its logits, as decode.generate does (`drawn`:
        the token sample_rows gave this row, if it did)."""
        if seq.first_logits is None:  # kept with its cache: not a view of the pass's logits
            seq.first_logits = logits.clone()
        token_id, ids = choose(logits, seq.ids, seq, drawn)
        if token_id is not None and token_id == seq.expect:  # a draft accepted (see _verify)
            seq.stats.accepted += 1
            self.spec_accepted += 1
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
                if seq.valid_kv is not None:  # mid-verification: the rejected drafts go
                    crop_cache(seq.cache, seq.valid_kv)
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
