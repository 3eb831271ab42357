"""One step at a time: a sequence the engine holds while a person decides each token.

    prompt ids ─▶ one pass (KV kept) ─▶ logits of this position (kept, per position)
                                           │ sampling.stages, each recorded (StageView)
                                           ▼
                     draw (the generator's state kept per position), or a hand pick
                                           ▼
                     append ─▶ one pass over the new token ─▶ the next position's logits

A `StepSession`'s passes run on the engine thread inside the scheduler, beside every other
request (so "what shared the pass" is real): each pass is a one-token `Sequence` whose KV cache
is the session's own, already holding every position but the new ones (scheduler._start uses a
sequence's cache when it has one). Between passes the cache's positions stay counted against
--kv-budget (`Scheduler.kept`), as a running sequence's are; a pass takes a place in the queue
(--max-queue) like any request.

What is kept, per position: the raw logits (settings can change and the stages re-run on them
without a forward pass), the random generator's state before the draw (Back then Step draws
the same token; with seed S and no picks the text is the one a normal reply with seed S gets,
because each draw is `sampling.sample` with the same generator, as `decode.choose` draws), and
what the pass cost. Back crops the KV cache (nothing is recomputed) and rolls the grammar back.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from dataclasses import dataclass

import torch

from miniserve.core.config import RANDOM_SEEDS, SamplingParams
from miniserve.engine.decode import GenerationStats
from miniserve.engine.grammar import GrammarError
from miniserve.engine.inspector import filter_stages, removed_by
from miniserve.engine.sampling import NoTokenAllowed, after_draw, make_generator, sample
from miniserve.engine.scheduler import Sequence

TOP = 20  # candidates shown by default
IDLE_S = 600.0  # a session nobody touched for this long is released
ONE_PASS = SamplingParams(temperature=0, max_new_tokens=1)  # the pass's own draw is unused


class StepError(ValueError):
    """Something the person can fix: said in one line, never a traceback."""


def _locked(method):
    """One action of a session at a time (a click while Run streams, the idle reaper)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


@dataclass
class StepCost:
    """What computing one position cost."""

    forward_s: float  # the forward pass that produced its logits (0: none was needed)
    wall_s: float  # asked -> logits here: queue wait, pass, hand-over
    new_rows: int  # positions that pass fed for this session (the prompt, then 1)
    kv_positions: int  # positions in the session's KV cache after it
    kv_bytes: int  # their bytes (keys and values, all layers)
    reused: int  # positions taken from the engine's prefix cache (first pass only)
    shared: int  # other sequences in the same pass


@dataclass
class Position:
    logits: torch.Tensor  # (1, vocab) float32: the raw logits, kept
    gen_state: torch.Tensor | None  # the generator's state before this position's draw
    cost: StepCost
    sampler_before: float | None = None  # the sampling state (Mirostat's mu) before it
    token: int | None = None  # the token taken here (None: not yet)
    drawn: int | None = None  # what the draw gave when it was taken
    picked: bool = False  # taken by hand
    entropy: float = 0.0  # of the raw distribution, bits (when taken)
    prob: float = 0.0  # the taken token's probability in the final distribution


@dataclass
class Row:
    """One candidate token across the stages."""

    token_id: int
    text: str
    probs: list[float]  # per stage (StageView.stages): its probability there
    removed_by: str | None  # the first stage that removed it
    mass_above: float | None = None  # top-p: the mass of the tokens ranked above it there
    why_not: str | None = None  # why it cannot be picked (grammar, a -100 bias)


@dataclass
class StageView:
    """The distribution at one position through every stage: what the chart is drawn from."""

    position: int  # index of the generated token this decides
    stages: list[str]  # "raw", each stage sampling.stages yielded, "final"
    rows: list[Row]
    drawn: int | None  # the token the draw takes (or took) under these settings
    taken: int | None  # the token taken here, when decided
    picked: bool
    rank: int | None  # the drawn token's rank in the raw distribution (1 = top)
    drawn_raw: float
    drawn_final: float
    entropy_raw: float  # bits
    entropy_final: float
    outside_raw: float  # mass outside the shown candidates
    outside_final: float
    top_p: float | None  # the cut, when top-p is on
    greedy: bool
    note: str = ""  # e.g. no token allowed
    temperature: float = 0.0  # the setting the stages ran with (the chart says it)

    def as_dict(self) -> dict:
        return {
            "position": self.position,
            "stages": self.stages,
            "drawn": self.drawn,
            "taken": self.taken,
            "picked": self.picked,
            "rank": self.rank,
            "drawn_raw": self.drawn_raw,
            "drawn_final": self.drawn_final,
            "entropy_raw": self.entropy_raw,
            "entropy_final": self.entropy_final,
            "outside_raw": self.outside_raw,
            "outside_final": self.outside_final,
            "top_p": self.top_p,
            "greedy": self.greedy,
            "note": self.note,
            "rows": [r.__dict__ for r in self.rows],
        }


def entropy_bits(probs: torch.Tensor) -> float:
    """In bits; never below 0 (one token left: -0.0, or -1e-8 from rounding, shown as 0)."""
    p = probs[probs > 0]
    return max(0.0, float(-(p * p.log2()).sum())) if p.numel() else 0.0


def stage_view(
    logits: torch.Tensor,
    params: SamplingParams,
    previous_ids: torch.Tensor,
    allowed: torch.Tensor | None,
    text_of,
    top: int = TOP,
    drawn: int | None = None,
    position: int = 0,
    state=None,
) -> StageView:
    """The stages on kept logits (1, vocab): the top `top` raw candidates (and the drawn token,
    and any token a stage lifted into the final top `top`) with their probability after each
    stage -- `sampling.stages` itself, through inspector.filter_stages (greedy ends with the
    argmax) -- renormalised as the draw sees it. No forward pass."""
    x = logits[0].float()
    mask = allowed[0] if allowed is not None else None
    run = filter_stages(x, params, previous_ids[0], mask, state)
    names = ["raw"] + [name for name, _ in run] + ["final"]
    dists = [x.softmax(-1)] + [s.softmax(-1) for _, s in run]
    final = dists[-1]
    dists.append(final)
    raw = dists[0]
    ids = torch.topk(raw, min(top, raw.numel())).indices.tolist()
    extra = torch.topk(final, min(top, final.numel())).indices.tolist()
    extra = [i for i in extra if final[i] > 0 and i not in ids]
    if drawn is not None and drawn not in ids + extra:
        extra.append(drawn)
    ids += sorted(extra, key=lambda i: -float(raw[i]))
    stage_logits = [x] + [s for _, s in run]
    cuts = {name: s for name, s in run}
    mass_above = None
    if "top-p" in cuts:  # the mass above each token in top-p's input, ranked as top-p ranks
        before = stage_logits[names.index("top-p") - 1].softmax(-1)
        # rank only the tokens still in the running (after top-k, k of them; a full sort of
        # Gemma's 262k took most of a redraw), as top_p_filter does
        alive = (before > 0).nonzero().squeeze(-1)
        order = before[alive].sort(descending=True)
        cum = order.values.cumsum(-1) - order.values
        above = torch.ones_like(before)  # a removed token: all the mass is above it
        above[alive[order.indices]] = cum
        mass_above = above[ids].tolist()
    bias = dict(params.logit_bias)
    rows = []
    for n, (i, removed) in enumerate(zip(ids, removed_by(run, ids))):
        why = None
        if mask is not None and not bool(mask[i]):
            why = "the output format does not allow it here"
        elif bias.get(i, 0) <= -100:
            why = "the logit bias bans it (-100)"
        rows.append(
            Row(
                i,
                text_of(i),
                [float(d[i]) for d in dists],
                removed,
                mass_above[n] if mass_above is not None else None,
                why,
            )
        )
    shown = torch.tensor(ids)
    rank = None
    if drawn is not None:
        rank = int((raw > raw[drawn]).sum()) + 1
    return StageView(
        position,
        names,
        rows,
        drawn,
        None,
        False,
        rank,
        float(raw[drawn]) if drawn is not None else 0.0,
        float(final[drawn]) if drawn is not None else 0.0,
        entropy_bits(raw),
        entropy_bits(final),
        max(0.0, 1 - float(raw[shown].sum())),
        max(0.0, 1 - float(final[shown].sum())),
        params.top_p if "top-p" in cuts else None,
        params.greedy,
        temperature=params.temperature,
    )


class StepSession:
    """A text decided one token at a time on `engine` (a local Engine). `prompt_ids` is the
    whole prompt (chat template applied, or the text as it is). Methods are called from one
    thread at a time (the tab's handlers, the CLI); the passes run on the engine thread."""

    def __init__(
        self, engine, prompt_ids: list[int], params: SamplingParams, idle_s: float = IDLE_S
    ):
        if not engine.capabilities.local_tokens:
            raise StepError(remote_note(engine.name))
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise StepError("the prompt is empty: write the text to start from")
        engine.check(params)
        self.engine = engine
        self.params = (
            params
            if params.seed is not None
            else params.replace(seed=secrets.randbelow(RANDOM_SEEDS))
        )
        self.prompt_len = len(prompt_ids)
        self.ids = prompt_ids  # prompt + tokens taken so far
        self.positions: list[Position] = []
        self.matcher = engine.matcher(self.params)
        self.device = engine.runner.device
        self.generator = make_generator(self.params.seed, self.device)
        self.sampler = engine.sampler_state(self.prompt_len)
        self.cache = None
        self.reserved = 0  # KV positions counted against the budget
        self.idle_s = idle_s
        self.last_used = time.monotonic()
        self.released = ""  # why it was released ("" while it holds its cache)
        self.finish = ""  # "eos" | "stop" | "length" | "context" | ""
        self._lock = threading.RLock()
        self._reserve(len(prompt_ids) + self.params.max_new_tokens)

    # -- what it holds -------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return self.ids[self.prompt_len :]

    @property
    def vocab(self) -> int:
        return self.engine.runner.config.vocab_size

    def text_of(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def text(self) -> str:
        """The generated text (end tokens as they are written)."""
        return self.engine.tokenizer.decode(self.tokens, skip_special_tokens=False)

    def kv_positions(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def kv_bytes(self, positions: int | None = None) -> int:
        """Bytes of keys and values of `positions` (default: those in use), all layers."""
        if self.cache is None or not hasattr(self.cache, "k"):
            return 0
        per = (self.cache.k.nbytes + self.cache.v.nbytes) / max(self.cache.capacity, 1)
        return int(per * (self.kv_positions() if positions is None else positions))

    def _touch(self) -> None:
        if self.released:
            raise StepError(self.released)
        if time.monotonic() - self.last_used > self.idle_s:
            self.release(
                f"this step session was released after {self.idle_s / 60:g} "
                "minutes without use (its KV cache went back to the budget): Reset "
                "or Step starts again"
            )
            raise StepError(self.released)
        self.last_used = time.monotonic()

    def idle(self) -> bool:
        return not self.released and time.monotonic() - self.last_used > self.idle_s

    # -- the KV budget ---------------------------------------------------------------------
    def _reserve(self, positions: int) -> None:
        """Count `positions` against --kv-budget now (refused when they do not fit beside what
        runs); they stay counted until release."""
        sched = self.engine.scheduler

        def job():
            others = sum(s.held for s in sched.running) + sum(
                v for k, v in sched.kept.items() if k is not self
            )
            if others + positions > sched.kv_budget:
                raise StepError(
                    f"the KV budget (--kv-budget {sched.kv_budget}) has "
                    f"{max(sched.kv_budget - others, 0)} positions free and this step "
                    f"session needs {positions} (prompt + max new tokens): wait for running "
                    "replies to end, lower Max new tokens, or raise --kv-budget"
                )
            sched.kept[self] = positions

        self.engine.run_on_worker(job)
        self.reserved = positions

    @_locked
    def release(self, why: str = "released") -> None:
        """Give the KV cache back (Reset, the tab closed, the idle timeout)."""
        if self.released:
            return
        self.released = why
        sched = self.engine.scheduler
        cache, self.cache = self.cache, None
        self.engine._jobs.put(lambda: (sched.kept.pop(self, None), cache))

    # -- passes ------------------------------------------------------------------------------
    def _pass(self) -> Position:
        """Feed the positions the cache does not hold (the prompt, then the newest token) in
        one scheduler pass beside every other request; the logits of the last are kept."""
        engine, sched = self.engine, self.engine.scheduler
        if len(self.ids) >= engine.context_length:
            raise StepError(f"the context is full ({engine.context_length} tokens)")
        done = threading.Event()
        box: dict = {}
        started = time.perf_counter()

        def observe(logits, ids, token_id, allowed, state=None):
            box["logits"] = logits.detach().float().clone()
            box["forward_s"], box["shared"] = sched.last_pass_s, sched.last_width - 1

        def finish(error):
            box["error"] = error
            if not self.released:
                sched.kept[self] = max(seq.cache.capacity, self.reserved)
            engine._release()
            done.set()

        seq = Sequence(
            list(self.ids),
            ONE_PASS,
            1,
            lambda t: True,
            finish,
            frozenset(),
            observer=observe,
            reuse_prefix=False,
            stats=GenerationStats(prompt_tokens=len(self.ids)),
        )

        def add():
            reused = 0
            if self.cache is None:  # the first pass: a prefix another request left, if any
                cache, reused, logits = (
                    sched.prefix_cache.take(self.ids)
                    if sched.prefix_cache is not None
                    else (None, 0, None)
                )
                if cache is not None and logits is not None:
                    crop = reused - 1  # its logits are of the whole prompt: feed the last again
                    cache.crop(crop - cache.get_seq_length())
                    reused = crop
                self.cache = (
                    cache
                    if cache is not None
                    else engine.runner.new_cache(max(self.reserved, len(self.ids) + 1))
                )
            box["reused"] = reused
            box["cached"] = self.cache.get_seq_length()
            if hasattr(self.cache, "reserve"):  # grown by doubling, not a position a step
                self.cache.reserve(len(self.ids) + 1)
            seq.cache = self.cache
            sched.kept.pop(self, None)  # counted as the running sequence's while it runs
            try:
                sched.add(seq)
            except Exception as e:  # noqa: BLE001 -- e.g. larger than the budget
                finish(e)

        engine._admit()  # a place in the queue like any request (EngineBusy past it)
        engine._jobs.put(add)
        done.wait()
        if box.get("error") is not None:
            raise box["error"]
        if "logits" not in box:
            raise StepError("the pass ended without logits (the engine was stopped?)")
        cost = StepCost(
            box["forward_s"],
            time.perf_counter() - started,
            len(self.ids) - box["cached"],
            self.kv_positions(),
            self.kv_bytes(),
            box["reused"],
            box["shared"],
        )
        state = self.generator.get_state() if self.generator is not None else None
        return Position(box["logits"], state, cost, sampler_before=self.sampler.snapshot())

    # -- the current position -----------------------------------------------------------------
    def _allowed(self) -> torch.Tensor | None:
        return self.matcher.allowed(self.vocab) if self.matcher is not None else None

    def _previous(self) -> torch.Tensor:
        return torch.tensor([self.ids], dtype=torch.long, device=self.device)

    def _draw(self, pos: Position, allowed) -> int | None:
        """The draw at `pos` under the current settings, from the generator's state kept for
        it: exactly decode.choose's `sample` call. None when nothing is allowed."""
        if self.generator is not None and pos.gen_state is not None:
            self.generator.set_state(pos.gen_state)
        self.sampler.restore(pos.sampler_before)
        previous = self._previous()
        try:
            return int(
                sample(pos.logits, self.params, previous, self.generator, allowed, self.sampler)
            )
        except NoTokenAllowed:
            return None

    @_locked
    def view(self, top: int = TOP) -> StageView | None:
        """The current position's stages (None before the first Step): the last position,
        with the token taken there when the text is finished, else the draw it would take."""
        if not self.positions:
            return None
        pos = self.positions[-1]
        index = len(self.positions) - 1
        decided = pos.token is not None
        previous = self._previous()[:, : self.prompt_len + index]
        allowed = None
        if self.matcher is not None:
            if decided:  # the mask as it was before the token: one back, then forward again
                self.matcher.rollback(1)
                allowed = self._allowed()
                self.matcher.accept(pos.token)
            else:
                allowed = self._allowed()
        drawn = self._draw(pos, allowed)  # its random draws, for the chart
        drawn = pos.drawn if decided else drawn
        view = stage_view(
            pos.logits,
            self.params,
            previous,
            allowed,
            self.text_of,
            top,
            drawn,
            index,
            self.sampler,
        )
        view.taken, view.picked = pos.token, pos.picked
        if drawn is None:
            view.note = "the output format and the logit bias allow no token here"
        return view

    # -- actions ------------------------------------------------------------------------------
    @_locked
    def step(self, pick: int | None = None) -> StepCost:
        """Take one token at the current position -- the draw, or `pick` -- and run the pass
        that gives the next position's logits. The first call reads the prompt first."""
        self._touch()
        if self.finish:
            raise StepError(self.finished_note())
        if len(self.tokens) >= self.params.max_new_tokens:
            self.finish = "length"
            raise StepError(self.finished_note())
        if not self.positions:
            self.positions.append(self._pass())
        pos = self.positions[-1]
        allowed = self._allowed()
        drawn = self._draw(pos, allowed)
        after = self.generator.get_state() if self.generator is not None else None
        if pick is not None:
            self._check_pick(pick, allowed)
        token = pick if pick is not None else drawn
        if token is None:
            raise StepError(
                "the output format and the logit bias allow no token here: Back, or change them"
            )
        pos.token, pos.drawn, pos.picked = token, drawn, pick is not None and pick != drawn
        pos.entropy, pos.prob, probs = self._measure(pos, token, allowed)
        if token != drawn:  # a hand pick: the stages with state follow the token taken
            self.sampler.restore(pos.sampler_before)
            after_draw(self.params, self.sampler, probs, token, self._previous())
        mirostat_after = self.sampler.snapshot()
        self.ids = self.ids + [token]
        if self.matcher is not None:
            self.matcher.accept(token)
        if token in self.engine.eos_ids:
            self.finish = "eos"
        elif self.matcher is not None and self.matcher.done:
            self.finish = "stop"
        elif len(self.tokens) >= self.params.max_new_tokens:
            self.finish = "length"
        elif len(self.ids) >= self.engine.context_length:
            self.finish = "context"
        if self.finish:
            return pos.cost
        nxt = self._pass()
        nxt.gen_state = after  # the stream goes on from after this position's draw
        nxt.sampler_before = mirostat_after
        self.positions.append(nxt)
        return nxt.cost

    def _measure(self, pos: Position, token: int, allowed) -> tuple[float, float, torch.Tensor]:
        """The raw entropy and the taken token's final probability, for the plot over tokens,
        and the final distribution (what the draw used: its random draws reused)."""
        x = pos.logits.float()
        final = filter_stages(
            x[0],
            self.params,
            self._previous()[0],
            allowed[0] if allowed is not None else None,
            self.sampler,
        )
        probs = final[-1][1].softmax(-1) if final else x[0].softmax(-1)
        return entropy_bits(x[0].softmax(-1)), float(probs[token]), probs

    def _check_pick(self, token: int, allowed) -> None:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab:
            raise StepError(
                f"token id {token!r} is out of range: the vocabulary has ids 0..{self.vocab - 1}"
            )
        if allowed is not None and not bool(allowed[0, token]):
            raise StepError(
                f"{self.text_of(token)!r} cannot be taken: the output format does not allow it here"
            )
        if dict(self.params.logit_bias).get(token, 0) <= -100:
            raise StepError(
                f"{self.text_of(token)!r} cannot be taken: the logit bias bans it (-100)"
            )

    @_locked
    def pick_candidate(self, k: int, top: int = TOP) -> StepCost:
        """Take the k-th shown candidate (1 = the first row of the chart)."""
        view = self.view(top)
        if view is None:
            raise StepError("Step once first: there are no candidates before the prompt is read")
        if not 1 <= k <= len(view.rows):
            raise StepError(f"there is no candidate {k}: choose 1 to {len(view.rows)}")
        return self.step(view.rows[k - 1].token_id)

    def token_for_text(self, text: str) -> int:
        """The one token a typed text is; StepError listing the tokens it splits into when it
        is not exactly one."""
        if not text:
            raise StepError("type the text of a token to take it")
        ids = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            return ids[0]
        if not ids:
            raise StepError(f"{text!r} is no token at all")
        parts = ", ".join(f"{self.text_of(i)!r} ({i})" for i in ids)
        raise StepError(
            f"{text!r} is not one token: it splits into {len(ids)}: {parts}; "
            "take them one at a time"
        )

    def run(self, n: int | None = None, cancel: threading.Event | None = None):
        """Step n times (None: to the end); yields after each step. Stops at the end of the
        text or when `cancel` is set."""
        done = 0
        while (n is None or done < n) and not self.finish:
            if cancel is not None and cancel.is_set():
                return
            if len(self.tokens) >= self.params.max_new_tokens:
                self.finish = "length"
                return
            self.step()
            done += 1
            yield done

    def back(self, n: int = 1) -> None:
        """Go back n tokens."""
        self.back_to(len(self.tokens) - n)

    @_locked
    def back_to(self, keep: int) -> None:
        """Keep the first `keep` generated tokens: the position deciding token `keep` is the
        current one again, with its kept logits and generator state. The KV cache is cropped
        (not recomputed) and the grammar rolled back."""
        self._touch()
        taken = len(self.tokens)
        if not self.positions or taken == 0:
            raise StepError("nothing to go back to: no token was taken yet")
        if not 0 <= keep < taken:
            raise StepError(f"there is no token {keep + 1} to go back before: the text has {taken}")
        if self.matcher is not None:
            self.matcher.rollback(taken - keep)
        self.ids = self.ids[: self.prompt_len + keep]
        self.positions = self.positions[: keep + 1]
        pos = self.positions[-1]
        pos.token, pos.drawn, pos.picked = None, None, False
        self.finish = ""
        self.cache.crop(len(self.ids) - self.cache.get_seq_length())  # only this session uses it

    @_locked
    def update(self, params: SamplingParams) -> None:
        """New settings for the current position and the next steps: the stages re-run on
        the kept logits (no forward pass). A new output format re-checks the text so far."""
        self._touch()
        self.engine.check(params)
        if params.seed is None:
            params = params.replace(seed=self.params.seed)
        if params.constraint != self.params.constraint:
            matcher = self.engine.matcher(params)
            for n, token in enumerate(self.tokens if matcher is not None else ()):
                try:
                    matcher.accept(token)
                except GrammarError:
                    raise StepError(
                        f"the text so far does not fit that output format at "
                        f"token {n + 1} ({self.text_of(token)!r}): go back before "
                        "it first"
                    ) from None
            self.matcher = matcher
        if params.seed != self.params.seed:  # a new seed draws from here on
            self.generator = make_generator(params.seed, self.device)
            if self.positions:
                self.positions[-1].gen_state = self.generator.get_state()
        self.params = params
        if self.positions:
            need = self.prompt_len + params.max_new_tokens
            if need > self.reserved:
                self._reserve(need)
        if self.finish == "length" and len(self.tokens) < params.max_new_tokens:
            self.finish = ""

    # -- what to say -------------------------------------------------------------------------
    def finished_note(self) -> str:
        last = self.text_of(self.tokens[-1]) if self.tokens else ""
        return {
            "eos": f"the text is finished: the model wrote its end token {last!r}. Back "
            "or a click on an earlier token goes on from there; Reset starts again",
            "stop": "the text is finished: the output format is complete",
            "length": f"Max new tokens ({self.params.max_new_tokens}) reached: raise it to go on",
            "context": f"the context ({self.engine.context_length} tokens) is full",
        }.get(self.finish, "")

    def costs(self) -> list[StepCost]:
        return [p.cost for p in self.positions]


def remote_note(name: str) -> str:
    """What the Step view says for a model served by another server."""
    return (
        f"model '{name}' runs on a remote server: its logits never reach this app, so the "
        "stages, hand picks, Back and the costs cannot be shown here. The Chat and "
        "Notebook tabs' token inspector shows what the server's logprobs allow (the top "
        "alternatives of each token, no stages)"
    )
