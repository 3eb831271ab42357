"""The token inspector's numbers, checked against a softmax computed here (float64)."""

import math

import torch

from conftest import chat_ids
from miniserve.core.config import SamplingParams
from miniserve.engine.decode import generate
from miniserve.engine.inspector import Inspector


def inspect_run(loaded, engine, params, text="Name three animals."):
    inspector = Inspector(loaded.tokenizer, params, keep_distributions=True)
    seen_logits = []

    def observe(logits, ids, token, allowed=None):
        seen_logits.append(logits[0].float().clone())
        inspector.observe(logits, ids, token, allowed)

    tokens = list(generate(loaded.model, chat_ids(loaded.tokenizer, text), params,
                           eos_ids=engine.eos_ids, observer=observe))
    return inspector, seen_logits, tokens


def test_greedy_probabilities(loaded, engine):
    params = SamplingParams(temperature=0, max_new_tokens=10)
    inspector, logits, tokens = inspect_run(loaded, engine, params)
    assert [s.token_id for s in inspector.steps][:len(tokens)] == tokens
    for step, (raw, final), x in zip(inspector.steps, inspector.distributions, logits):
        assert abs(float(raw.sum()) - 1) < 1e-4  # a distribution over the full vocabulary
        x = x.double()
        expected = torch.exp(x - x.max()) / torch.exp(x - x.max()).sum()
        assert math.isclose(step.prob, float(expected[step.token_id]), rel_tol=1e-4)
        assert step.candidates[0].token_id == step.token_id  # greedy takes the top-1
        probs = [c.prob for c in step.candidates]
        assert probs == sorted(probs, reverse=True) and len(probs) == 5
        for c in step.candidates:
            assert math.isclose(c.prob, float(expected[c.token_id]), rel_tol=1e-4, abs_tol=1e-7)
        assert step.prob_filtered == 1.0 and all(c.removed_by == "greedy"
                                                 for c in step.candidates[1:])


def test_filters_are_reported(loaded, engine):
    params = SamplingParams(temperature=0.8, top_k=3, top_p=1.0, max_new_tokens=8, seed=3)
    inspector, _, _ = inspect_run(loaded, engine, params)
    for step, (raw, final) in zip(inspector.steps, inspector.distributions):
        assert int((final > 0).sum()) <= 3
        assert abs(float(final.sum()) - 1) < 1e-4
        assert step.prob_filtered > 0  # the chosen token survived the filters
        for rank, c in enumerate(step.candidates):
            if rank >= 3:
                assert c.removed_by == "top-k" and c.prob_filtered == 0
    html = inspector.as_html()
    assert html.count('class="ms-tok"') == len(inspector.steps)
