"""The token inspector: what the model saw at each step, and what each filter did.

An `Inspector` is passed to the decode loop as its observer. At every step it
records the chosen token, its probability, and the top alternatives with their
probability before the stages (plain softmax of the logits) and after them, and
which stage (logit bias / grammar / temperature / top-k / top-p / min-p) removed each — the
sampler's own stages, in its order (sampling.stages). In the web app each token opens a small
chart of these on hover (`chart`, `popup_html`): a bar before and a bar after the stages. When a
grammar constrains the reply,
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
from miniserve.core.samplers import STAGES
from miniserve.engine.sampling import SamplerState, stages


@dataclass
class Candidate:
    token_id: int | None  # None: a remote model's (the server gives text)
    text: str
    prob: float  # softmax of the raw logits (remote: the server's probability)
    prob_filtered: float | None  # after all filters (what the draw used); 0 if removed
    removed_by: str | None  # (both None for a remote model: the server does not say)


@dataclass
class Step:
    token_id: int | None
    text: str
    prob: float | None  # None: the server gave no logprob for this token
    prob_filtered: float | None
    candidates: list[Candidate]
    masked_mass: float | None = None  # probability the grammar removed (None: no grammar)
    masked_tokens: int = 0  # how many tokens it removed
    stages: tuple[str, ...] = ()  # the sampling stages that were on, in their order


@dataclass
class Bar:
    """One row of a token's chart (what the hover popup draws): a candidate's probability
    before the sampling stages (softmax of the logits) and after them (the distribution the
    draw used; None for a remote model's, whose server does not say)."""

    token_id: int | None
    text: str
    before: float | None
    after: float | None
    removed_by: str | None
    chosen: bool


def chart(step: Step) -> list[Bar]:
    """The bars of a step's chart: its top candidates by raw probability, then the chosen
    token when it is not among them (a sampled draw can be less likely than the top 5)."""
    bars = [
        Bar(
            c.token_id,
            c.text,
            c.prob,
            c.prob_filtered,
            c.removed_by,
            c.token_id == step.token_id if step.token_id is not None else c.text == step.text,
        )
        for c in step.candidates
    ]
    if not any(b.chosen for b in bars):
        bars.append(Bar(step.token_id, step.text, step.prob, step.prob_filtered, None, True))
    return bars


def filter_stages(
    logits: torch.Tensor,
    params: SamplingParams,
    previous_ids,
    allowed: torch.Tensor | None = None,
    state: SamplerState | None = None,
) -> list[tuple]:
    """(stage label, logits after it) for each stage that runs, in the sampling order; greedy
    ends with the argmax (every other token "removed by greedy"). `state`: the reply's
    sampling state, whose last draws the stages reuse (the chart shows what the draw saw)."""
    out = list(stages(logits, params, previous_ids, allowed, state, replay=True))
    if params.greedy:
        x = out[-1][1] if out else logits
        out.append(("greedy", x.masked_fill(x < x.max(), float("-inf"))))
    return out


GRAMMAR = STAGES["grammar"].label


def removed_by(run: list[tuple], ids: list[int]) -> list[str | None]:
    """For each token of `ids`, the first stage of `run` ((label, logits after it), as
    filter_stages gives them) that removed it, or None: the one place this is worked out (the
    inspector's marks, the Step view's crosses)."""
    out: list[str | None] = [None] * len(ids)
    if not ids:
        return out
    at = torch.tensor(ids)
    for name, x in run:
        gone = (x.reshape(-1)[at] == float("-inf")).tolist()
        out = [o if o is not None or not g else name for o, g in zip(out, gone)]
    return out


def logits_before(run: list[tuple], label: str, raw: torch.Tensor) -> torch.Tensor:
    """The logits a stage received: the previous stage's output (the raw logits when first)."""
    before = raw
    for name, x in run:
        if name == label:
            return before
        before = x
    return before


class Inspector:
    def __init__(
        self, tokenizer, params: SamplingParams, top: int = 5, keep_distributions: bool = False
    ):
        self.tokenizer = tokenizer
        self.params = params
        self.top = top
        self.steps: list[Step] = []
        self.keep = keep_distributions  # the full before/after vectors (for tests, plots)
        self.distributions: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.remote = False  # the steps came from a server's logprobs (add_remote_step)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def observe(
        self,
        logits: torch.Tensor,
        previous_ids: torch.Tensor,
        token_id: int,
        allowed: torch.Tensor | None = None,
        state: SamplerState | None = None,
    ) -> None:
        logits = logits[0].float()
        raw = logits.softmax(-1)
        mask = allowed[0] if allowed is not None else None
        stages = filter_stages(logits, self.params, previous_ids[0], mask, state)
        final = stages[-1][1].softmax(-1)
        masked_mass, masked_tokens = None, 0
        if mask is not None:  # what the grammar took: the mass of the tokens it removed
            before = logits_before(stages, GRAMMAR, logits)
            masked_mass = float(before.softmax(-1)[~mask].sum())
            masked_tokens = int((~mask).sum())
        if self.keep:
            self.distributions.append((raw, final))
        top = torch.topk(raw, self.top)
        ids = top.indices.tolist()
        candidates = [
            Candidate(i, self._text(i), p, float(final[i]), removed)
            for p, i, removed in zip(top.values.tolist(), ids, removed_by(stages, ids))
        ]
        self.steps.append(
            Step(
                token_id,
                self._text(token_id),
                float(raw[token_id]),
                float(final[token_id]),
                candidates,
                masked_mass,
                masked_tokens,
                tuple(name for name, _ in stages),
            )
        )

    def add_remote_step(
        self,
        text: str,
        logprob: float | None,
        top: list[tuple[str, float]] = (),
        answer: bool = True,
    ) -> None:
        """A remote model's step: the token's text, the server's logprob of it (None when the
        server gave none) and its top alternatives as (text, logprob). No token ids, no filter
        stages: the server reports probabilities, not what its sampler removed. (`answer`:
        whether the token is the answer's; the inspector shows every step alike.)"""
        self.remote = True
        prob = math.exp(logprob) if logprob is not None else None
        self.steps.append(
            Step(
                None,
                text,
                prob,
                None,
                [Candidate(None, t, math.exp(lp), None, None) for t, lp in list(top)[: self.top]],
            )
        )

    def remote_note(self) -> str:
        """The line above a remote model's steps ("" for a local one)."""
        if not self.remote:
            return ""
        missing = sum(s.prob is None for s in self.steps)
        if self.steps and missing == len(self.steps):
            return (
                "server logprobs: the server gave none (its tokens are shown without probabilities)"
            )
        return "server logprobs (no filter stages: the server does not report them)" + (
            f"; the server gave none for {missing} of {len(self.steps)} tokens" if missing else ""
        )

    def as_json(self) -> list[dict]:
        if self.remote:
            return [
                {
                    "token_id": None,
                    "text": s.text,
                    "source": "server logprobs",
                    "prob": round(s.prob, 5) if s.prob is not None else None,
                    "top": [
                        {"token_id": None, "text": c.text, "prob": round(c.prob, 5)}
                        for c in s.candidates
                    ],
                }
                for s in self.steps
            ]
        return [
            {
                "token_id": s.token_id,
                "text": s.text,
                "prob": round(s.prob, 5),
                "prob_filtered": round(s.prob_filtered, 5),
                "top": [
                    {
                        "token_id": c.token_id,
                        "text": c.text,
                        "prob": round(c.prob, 5),
                        "prob_filtered": round(c.prob_filtered, 5),
                        "removed_by": c.removed_by,
                    }
                    for c in s.candidates
                ],
                **(
                    {
                        "grammar_removed_mass": round(s.masked_mass, 5),
                        "grammar_removed_tokens": s.masked_tokens,
                    }
                    if s.masked_mass is not None
                    else {}
                ),
            }
            for s in self.steps
        ]

    def as_text(self) -> str:
        if self.remote:
            return "\n".join(
                [self.remote_note()]
                + [
                    f"{n:4d} {s.text!r:>16} p={_p(s.prob, '.3f')}  | "
                    + ", ".join(f"{c.text!r} {c.prob:.2f}" for c in s.candidates)
                    for n, s in enumerate(self.steps)
                ]
            )
        lines = []
        for n, s in enumerate(self.steps):
            alts = ", ".join(
                f"{c.text!r} {c.prob:.2f}->{c.prob_filtered:.2f}"
                + (f" (cut by {c.removed_by})" if c.removed_by else "")
                for c in s.candidates
            )
            bent = f"  [grammar removed {s.masked_mass:.0%}]" if s.masked_mass else ""
            lines.append(f"{n:4d} {s.text!r:>16} p={s.prob:.3f}  | {alts}{bent}")
        return "\n".join(lines)

    def as_html(self) -> str:
        """The reply as tokens shaded by probability (grey where a server gave none); hovering
        or focusing a token opens its chart (`popup_html`): the top alternatives' probability
        before -> after the sampling stages as bars, and which stage removed each. A step the
        grammar bent is underlined, its popup says how much it removed; a remote model's
        steps have the note above them and bars of the server's probabilities only."""
        spans = []
        for n, s in enumerate(self.steps):
            if s.prob is None:
                color = "rgba(160,160,160,0.25)"
            else:  # unlikely choices stand out
                color = f"rgba(255,140,0,{0.15 + 0.6 * (1 - s.prob):.2f})"
            bent = ""
            if s.masked_mass:  # the grammar removed tokens the model wanted: underline it
                width = 1 + round(3 * s.masked_mass)
                bent = f"border-bottom:{width}px solid rgba(0,90,200,0.9);"
            spans.append(
                f'<span class="ms-tok" tabindex="0" data-step="{n}" '
                + (f'data-prob="{s.prob:.4f}" ' if s.prob is not None else "")
                + (
                    f'data-grammar-removed="{s.masked_mass:.4f}" '
                    if s.masked_mass is not None
                    else ""
                )
                + f'style="background:{color};{bent}">{html.escape(s.text)}'
                + popup_html(s, self.remote)
                + "</span>"
            )
        note = (
            f'<div class="ms-source">{html.escape(self.remote_note())}</div>' if self.remote else ""
        )
        return (
            f'<div class="ms-inspector" style="line-height:1.9">{POPUP_CSS}{note}'
            + "".join(spans)
            + "</div>"
        )


# The hover chart's look: a popup under the token (shown while it is hovered or focused),
# each row a candidate's text, two bars in one track (orange: before the stages; blue: after
# them, what the draw used; widths from the --b and --a of the row) and the numbers.
BEFORE_COLOR, AFTER_COLOR = "#f28c00", "#2f6fd6"
POPUP_CSS = f"""<style>
.ms-inspector .ms-tok{{position:relative;border-radius:3px;padding:1px 0;white-space:pre-wrap}}
.ms-inspector .ms-pop{{display:none;position:absolute;left:0;top:1.7em;z-index:1000;
 min-width:400px;padding:6px 8px;border:1px solid #b9b9b9;border-radius:6px;
 background:var(--background-fill-primary,#fff);color:var(--body-text-color,#222);
 box-shadow:0 3px 12px rgba(0,0,0,.18);font-size:12px;line-height:1.4;white-space:normal;
 font-weight:normal;text-decoration:none}}
.ms-inspector .ms-tok:hover>.ms-pop,.ms-inspector .ms-tok:focus>.ms-pop{{display:block}}
.ms-pop .ms-head,.ms-pop .ms-note,.ms-pop .ms-key{{display:block;margin-bottom:3px}}
.ms-pop .ms-key,.ms-pop .ms-note{{opacity:.8}}
.ms-pop .ms-row{{display:grid;grid-template-columns:90px 120px auto;gap:6px;
 align-items:center}}
.ms-pop .ms-alt{{font-family:var(--font-mono,monospace);white-space:pre;overflow:hidden;
 text-overflow:ellipsis}}
.ms-pop .ms-chosen .ms-alt{{font-weight:bold}}
.ms-pop .ms-bars{{display:block;height:12px;background:
 linear-gradient({BEFORE_COLOR},{BEFORE_COLOR}) 0 0/var(--b) 5px no-repeat,
 linear-gradient({AFTER_COLOR},{AFTER_COLOR}) 0 100%/var(--a) 5px no-repeat,#ececec}}
.ms-pop .ms-num{{white-space:nowrap}}
.ms-pop .ms-removed .ms-num{{color:#a33}}
.ms-pop i.ms-sw{{display:inline-block;width:10px;height:5px;margin:0 3px 1px 6px}}
</style>"""


def _pct(p: float | None) -> str:
    return "?" if p is None else f"{p:.1%}"


def popup_html(step: Step, remote: bool = False) -> str:
    """A token's hover chart (its bars: `chart`), the HTML inside its span."""
    if remote:
        head = (
            f"chose {step.text!r}: {_pct(step.prob)} by the server's logprobs"
            if step.prob is not None
            else f"{step.text!r}: the server gave no probability for this token"
        )
        key = (
            f'<i class="ms-sw" style="background:{BEFORE_COLOR}"></i>the server\'s '
            "probability (no filter stages: the server does not report them)"
        )
    else:
        head = f"chose {step.text!r}: {_pct(step.prob)} → {_pct(step.prob_filtered)}" + (
            f" · stages: {' → '.join(step.stages)}" if step.stages else " · no stage on"
        )
        key = (
            f'<i class="ms-sw" style="background:{BEFORE_COLOR}"></i>before the stages '
            f'(softmax of the logits)<i class="ms-sw" style="background:{AFTER_COLOR}">'
            "</i>after them (what the draw used)"
        )
    rows = []
    for bar in chart(step):
        numbers = _pct(bar.before) if remote else f"{_pct(bar.before)} → {_pct(bar.after)}"
        if bar.removed_by:
            numbers += f" removed by {bar.removed_by}"
        elif bar.chosen:
            numbers += " chosen"
        cls = (
            "ms-row"
            + (" ms-chosen" if bar.chosen else "")
            + (" ms-removed" if bar.removed_by else "")
        )
        rows.append(
            f'<span class="{cls}" '
            + (f'data-token-id="{bar.token_id}" ' if bar.token_id is not None else "")
            + (f'data-before="{bar.before:.6f}" ' if bar.before is not None else "")
            + (f'data-after="{bar.after:.6f}" ' if bar.after is not None else "")
            + f'style="--b:{100 * (bar.before or 0):.1f}%;'
            f'--a:{100 * (bar.after or 0):.1f}%">'
            f'<span class="ms-alt">{html.escape(repr(bar.text))}</span>'
            f'<span class="ms-bars"></span><span class="ms-num">{numbers}</span>'
            "</span>"
        )
    bent = (
        f'<span class="ms-note">the grammar removed {step.masked_mass:.1%} of the '
        f"probability ({step.masked_tokens} tokens)</span>"
        if step.masked_mass
        else ""
    )
    return (
        f'<span class="ms-pop" role="tooltip"><span class="ms-head">'
        f"{html.escape(head)}</span>{bent}{''.join(rows)}"
        f'<span class="ms-key">{key}</span></span>'
    )


def _p(prob: float | None, fmt: str) -> str:
    return "?" if prob is None else format(prob, fmt)
