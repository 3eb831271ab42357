"""The token inspector: what the model saw at each step, and what each filter did.

An `Inspector` is passed to the decode loop as its observer. At every step it
records the chosen token, its probability, and the top alternatives with their
probability before the stages (plain softmax of the logits) and after them, and
which stage (logit bias / grammar / temperature / top-k / top-p / min-p) removed each — the
sampler's own stages, in its order (sampling.stages). When a grammar constrains the reply,
each step also records how much of the probability the grammar's mask took away. Nothing of
this runs when no inspector is attached.

A remote model (miniserve/models/remote.py) has no logits here: its engine feeds the server's
logprobs instead (`add_remote_step`), steps without token ids or filter stages, and the views
say so ("server logprobs"), with one line when the server gave none.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import torch

from miniserve.core.config import SamplingParams
from miniserve.engine.sampling import stages


@dataclass
class Candidate:
    token_id: int | None  # None: a remote model's (the server gives text)
    text: str
    prob: float          # softmax of the raw logits (remote: the server's probability)
    prob_filtered: float | None  # after all filters (what the draw used); 0 if removed
    removed_by: str | None       # (both None for a remote model: the server does not say)


@dataclass
class Step:
    token_id: int | None
    text: str
    prob: float | None  # None: the server gave no logprob for this token
    prob_filtered: float | None
    candidates: list[Candidate]
    masked_mass: float | None = None  # probability the grammar removed (None: no grammar)
    masked_tokens: int = 0            # how many tokens it removed


def filter_stages(logits: torch.Tensor, params: SamplingParams, previous_ids,
                  allowed: torch.Tensor | None = None) -> list[tuple]:
    """(stage name, logits after it) for each stage that is on, in the sampling order; greedy
    ends with the argmax (every other token "removed by greedy")."""
    out = list(stages(logits, params, previous_ids, allowed))
    if params.greedy:
        x = out[-1][1] if out else logits
        out.append(("greedy", x.masked_fill(x < x.max(), float("-inf"))))
    return out


class Inspector:
    def __init__(self, tokenizer, params: SamplingParams, top: int = 5,
                 keep_distributions: bool = False):
        self.tokenizer = tokenizer
        self.params = params
        self.top = top
        self.steps: list[Step] = []
        self.keep = keep_distributions  # the full before/after vectors (for tests, plots)
        self.distributions: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.remote = False  # the steps came from a server's logprobs (add_remote_step)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def observe(self, logits: torch.Tensor, previous_ids: torch.Tensor, token_id: int,
                allowed: torch.Tensor | None = None) -> None:
        logits = logits[0].float()
        raw = logits.softmax(-1)
        mask = allowed[0] if allowed is not None else None
        stages = filter_stages(logits, self.params, previous_ids[0], mask)
        final = stages[-1][1].softmax(-1)
        masked_mass, masked_tokens = None, 0
        if mask is not None:  # what the grammar took: the mass of the tokens it removed
            before = dict(stages).get("repetition penalty",
                                      dict(stages).get("logit bias", logits))
            masked_mass = float(before.softmax(-1)[~mask].sum())
            masked_tokens = int((~mask).sum())
        if self.keep:
            self.distributions.append((raw, final))
        top = torch.topk(raw, self.top)
        candidates = []
        for p, i in zip(top.values.tolist(), top.indices.tolist()):
            removed = next((name for name, x in stages if x[i] == float("-inf")), None)
            candidates.append(Candidate(i, self._text(i), p, float(final[i]), removed))
        self.steps.append(Step(token_id, self._text(token_id), float(raw[token_id]),
                               float(final[token_id]), candidates, masked_mass, masked_tokens))

    def add_remote_step(self, text: str, logprob: float | None,
                        top: list[tuple[str, float]] = ()) -> None:
        """A remote model's step: the token's text, the server's logprob of it (None when the
        server gave none) and its top alternatives as (text, logprob). No token ids, no filter
        stages: the server reports probabilities, not what its sampler removed."""
        self.remote = True
        prob = math.exp(logprob) if logprob is not None else None
        self.steps.append(Step(None, text, prob, None,
                               [Candidate(None, t, math.exp(lp), None, None)
                                for t, lp in list(top)[:self.top]]))

    def remote_note(self) -> str:
        """The line above a remote model's steps ("" for a local one)."""
        if not self.remote:
            return ""
        missing = sum(s.prob is None for s in self.steps)
        if self.steps and missing == len(self.steps):
            return "server logprobs: the server gave none (its tokens are shown without " \
                   "probabilities)"
        return "server logprobs (no filter stages: the server does not report them)" + (
            f"; the server gave none for {missing} of {len(self.steps)} tokens" if missing
            else "")

    def as_json(self) -> list[dict]:
        if self.remote:
            return [{"token_id": None, "text": s.text, "source": "server logprobs",
                     "prob": round(s.prob, 5) if s.prob is not None else None,
                     "top": [{"token_id": None, "text": c.text, "prob": round(c.prob, 5)}
                             for c in s.candidates]} for s in self.steps]
        return [{"token_id": s.token_id, "text": s.text, "prob": round(s.prob, 5),
                 "prob_filtered": round(s.prob_filtered, 5),
                 "top": [{"token_id": c.token_id, "text": c.text, "prob": round(c.prob, 5),
                          "prob_filtered": round(c.prob_filtered, 5), "removed_by": c.removed_by}
                         for c in s.candidates],
                 **({"grammar_removed_mass": round(s.masked_mass, 5),
                     "grammar_removed_tokens": s.masked_tokens}
                    if s.masked_mass is not None else {})} for s in self.steps]

    def as_text(self) -> str:
        if self.remote:
            return "\n".join([self.remote_note()] + [
                f"{n:4d} {s.text!r:>16} p={_p(s.prob, '.3f')}  | "
                + ", ".join(f"{c.text!r} {c.prob:.2f}" for c in s.candidates)
                for n, s in enumerate(self.steps)])
        lines = []
        for n, s in enumerate(self.steps):
            alts = ", ".join(f"{c.text!r} {c.prob:.2f}->{c.prob_filtered:.2f}"
                             + (f" (cut by {c.removed_by})" if c.removed_by else "")
                             for c in s.candidates)
            bent = (f"  [grammar removed {s.masked_mass:.0%}]" if s.masked_mass else "")
            lines.append(f"{n:4d} {s.text!r:>16} p={s.prob:.3f}  | {alts}{bent}")
        return "\n".join(lines)

    def as_html(self) -> str:
        """The reply as tokens shaded by probability; hover shows the alternatives."""
        if self.remote:
            return self._remote_html()
        spans = []
        for n, s in enumerate(self.steps):
            tip = "\n".join(f"{c.text!r}: {c.prob:.1%} -> {c.prob_filtered:.1%}"
                            + (f" (removed by {c.removed_by})" if c.removed_by else "")
                            for c in s.candidates)
            alpha = 0.15 + 0.6 * (1 - s.prob)  # unlikely choices stand out
            bent = ""
            if s.masked_mass:  # the grammar removed tokens the model wanted: underline it
                tip = (f"the grammar removed {s.masked_mass:.1%} of the probability "
                       f"({s.masked_tokens} tokens)\n") + tip
                width = 1 + round(3 * s.masked_mass)
                bent = f"border-bottom:{width}px solid rgba(0,90,200,0.9);"
            spans.append(f'<span class="ms-tok" data-step="{n}" data-prob="{s.prob:.4f}" '
                         + (f'data-grammar-removed="{s.masked_mass:.4f}" '
                            if s.masked_mass is not None else "")
                         + f'title="{html.escape(tip)}" style="background: rgba(255,140,0,{alpha:.2f});'
                         f'border-radius:3px;padding:1px 0;white-space:pre-wrap;{bent}">'
                         f'{html.escape(s.text)}</span>')
        return '<div class="ms-inspector" style="line-height:1.9">' + "".join(spans) + "</div>"

    def _remote_html(self) -> str:
        """A remote model's steps: shaded by the server's probability (grey where it gave
        none), hover shows its alternatives; the note above says where they came from."""
        spans = []
        for n, s in enumerate(self.steps):
            tip = "\n".join(f"{c.text!r}: {c.prob:.1%}" for c in s.candidates) or \
                "the server gave no probability for this token"
            color = ("rgba(160,160,160,0.25)" if s.prob is None else
                     f"rgba(255,140,0,{0.15 + 0.6 * (1 - s.prob):.2f})")
            spans.append(f'<span class="ms-tok" data-step="{n}" '
                         + (f'data-prob="{s.prob:.4f}" ' if s.prob is not None else "")
                         + f'title="{html.escape(tip)}" style="background: {color};'
                         f'border-radius:3px;padding:1px 0;white-space:pre-wrap;">'
                         f'{html.escape(s.text)}</span>')
        return (f'<div class="ms-inspector" style="line-height:1.9">'
                f'<div class="ms-source">{html.escape(self.remote_note())}</div>'
                + "".join(spans) + "</div>")


def _p(prob: float | None, fmt: str) -> str:
    return "?" if prob is None else format(prob, fmt)
