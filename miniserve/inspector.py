"""The token inspector: what the model saw at each step, and what each filter did.

An `Inspector` is passed to the decode loop as its observer. At every step it
records the chosen token, its probability, and the top alternatives with their
probability before the stages (plain softmax of the logits) and after them, and
which stage (logit bias / grammar / temperature / top-k / top-p / min-p) removed each — the
sampler's own stages, in its order (sampling.stages). When a grammar constrains the reply,
each step also records how much of the probability the grammar's mask took away. Nothing of
this runs when no inspector is attached.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from miniserve.config import SamplingParams
from miniserve.sampling import stages


@dataclass
class Candidate:
    token_id: int
    text: str
    prob: float          # softmax of the raw logits
    prob_filtered: float  # after all filters (what the draw used); 0 if removed
    removed_by: str | None


@dataclass
class Step:
    token_id: int
    text: str
    prob: float
    prob_filtered: float
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

    def as_json(self) -> list[dict]:
        return [{"token_id": s.token_id, "text": s.text, "prob": round(s.prob, 5),
                 "prob_filtered": round(s.prob_filtered, 5),
                 "top": [{"token_id": c.token_id, "text": c.text, "prob": round(c.prob, 5),
                          "prob_filtered": round(c.prob_filtered, 5), "removed_by": c.removed_by}
                         for c in s.candidates],
                 **({"grammar_removed_mass": round(s.masked_mass, 5),
                     "grammar_removed_tokens": s.masked_tokens}
                    if s.masked_mass is not None else {})} for s in self.steps]

    def as_text(self) -> str:
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
