"""The token inspector: what the model saw at each step, and what each filter did.

An `Inspector` is passed to the decode loop as its observer. At every step it
records the chosen token, its probability, and the top alternatives with their
probability before the filters (plain softmax of the logits) and after them, and
which filter (temperature / top-k / top-p / min-p) removed each. Nothing of this
runs when no inspector is attached.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from miniserve.config import SamplingParams
from miniserve.sampling import (apply_repetition_penalty, apply_temperature, min_p_filter,
                                top_k_filter, top_p_filter)


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


def filter_stages(logits: torch.Tensor, params: SamplingParams, previous_ids) -> list[tuple]:
    """(stage name, logits after it) for each filter that is on, in the sampling order."""
    stages = [("repetition penalty", apply_repetition_penalty(logits, previous_ids,
                                                              params.repetition_penalty))]
    if params.greedy:
        x = stages[-1][1]
        return stages + [("greedy", x.masked_fill(x < x.max(), float("-inf")))]
    stages.append(("temperature", apply_temperature(stages[-1][1], params.temperature)))
    stages.append(("top-k", top_k_filter(stages[-1][1], params.top_k)))
    stages.append(("top-p", top_p_filter(stages[-1][1], params.top_p)))
    stages.append(("min-p", min_p_filter(stages[-1][1], params.min_p)))
    return stages


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

    def observe(self, logits: torch.Tensor, previous_ids: torch.Tensor, token_id: int) -> None:
        logits = logits[0].float()
        raw = logits.softmax(-1)
        stages = filter_stages(logits, self.params, previous_ids[0])
        final = stages[-1][1].softmax(-1)
        if self.keep:
            self.distributions.append((raw, final))
        top = torch.topk(raw, self.top)
        candidates = []
        for p, i in zip(top.values.tolist(), top.indices.tolist()):
            removed = next((name for name, x in stages if x[i] == float("-inf")), None)
            candidates.append(Candidate(i, self._text(i), p, float(final[i]), removed))
        self.steps.append(Step(token_id, self._text(token_id), float(raw[token_id]),
                               float(final[token_id]), candidates))

    def as_json(self) -> list[dict]:
        return [{"token_id": s.token_id, "text": s.text, "prob": round(s.prob, 5),
                 "prob_filtered": round(s.prob_filtered, 5),
                 "top": [{"token_id": c.token_id, "text": c.text, "prob": round(c.prob, 5),
                          "prob_filtered": round(c.prob_filtered, 5), "removed_by": c.removed_by}
                         for c in s.candidates]} for s in self.steps]

    def as_text(self) -> str:
        lines = []
        for n, s in enumerate(self.steps):
            alts = ", ".join(f"{c.text!r} {c.prob:.2f}->{c.prob_filtered:.2f}"
                             + (f" (cut by {c.removed_by})" if c.removed_by else "")
                             for c in s.candidates)
            lines.append(f"{n:4d} {s.text!r:>16} p={s.prob:.3f}  | {alts}")
        return "\n".join(lines)

    def as_html(self) -> str:
        """The reply as tokens shaded by probability; hover shows the alternatives."""
        spans = []
        for n, s in enumerate(self.steps):
            tip = "\n".join(f"{c.text!r}: {c.prob:.1%} -> {c.prob_filtered:.1%}"
                            + (f" (removed by {c.removed_by})" if c.removed_by else "")
                            for c in s.candidates)
            alpha = 0.15 + 0.6 * (1 - s.prob)  # unlikely choices stand out
            spans.append(f'<span class="ms-tok" data-step="{n}" data-prob="{s.prob:.4f}" '
                         f'title="{html.escape(tip)}" style="background: rgba(255,140,0,{alpha:.2f});'
                         f'border-radius:3px;padding:1px 0;white-space:pre-wrap">'
                         f'{html.escape(s.text)}</span>')
        return '<div class="ms-inspector" style="line-height:1.9">' + "".join(spans) + "</div>"
