"""The token inspector's numbers, checked against a softmax computed here (float64)."""

import html
import math

import torch

from miniserve.core.config import SamplingParams
from miniserve.engine.decode import generate
from miniserve.engine.inspector import Inspector

from conftest import chat_ids


def inspect_run(loaded, engine, params, text="Name three animals."):
    inspector = Inspector(loaded.tokenizer, params, keep_distributions=True)
    seen_logits = []

    def observe(logits, ids, token, allowed=None, state=None):
        seen_logits.append(logits[0].float().clone())
        inspector.observe(logits, ids, token, allowed, state)

    tokens = list(
        generate(
            loaded.model,
            chat_ids(loaded.tokenizer, text),
            params,
            eos_ids=engine.eos_ids,
            observer=observe,
        )
    )
    return inspector, seen_logits, tokens


def test_greedy_probabilities(loaded, engine):
    params = SamplingParams(temperature=0, max_new_tokens=10)
    inspector, logits, tokens = inspect_run(loaded, engine, params)
    assert [s.token_id for s in inspector.steps][: len(tokens)] == tokens
    for step, (raw, _final), x in zip(inspector.steps, inspector.distributions, logits):
        assert abs(float(raw.sum()) - 1) < 1e-4  # a distribution over the full vocabulary
        x = x.double()
        expected = torch.exp(x - x.max()) / torch.exp(x - x.max()).sum()
        assert math.isclose(step.prob, float(expected[step.token_id]), rel_tol=1e-4)
        assert step.candidates[0].token_id == step.token_id  # greedy takes the top-1
        probs = [c.prob for c in step.candidates]
        assert probs == sorted(probs, reverse=True) and len(probs) == 5
        for c in step.candidates:
            assert math.isclose(c.prob, float(expected[c.token_id]), rel_tol=1e-4, abs_tol=1e-7)
        assert step.prob_filtered == 1.0 and all(
            c.removed_by == "greedy" for c in step.candidates[1:]
        )


def test_filters_are_reported(loaded, engine):
    params = SamplingParams(temperature=0.8, top_k=3, top_p=1.0, max_new_tokens=8, seed=3)
    inspector, _, _ = inspect_run(loaded, engine, params)
    for step, (_raw, final) in zip(inspector.steps, inspector.distributions):
        assert int((final > 0).sum()) <= 3
        assert abs(float(final.sum()) - 1) < 1e-4
        assert step.prob_filtered > 0  # the chosen token survived the filters
        for rank, c in enumerate(step.candidates):
            if rank >= 3:
                assert c.removed_by == "top-k" and c.prob_filtered == 0
    html = inspector.as_html()
    assert html.count('class="ms-tok"') == len(inspector.steps)


def test_chart_data_is_what_the_sampling_stages_give_on_the_same_logits(loaded, engine):
    """The bars each token's hover chart draws (inspector.chart, and the popup's data-before
    / data-after) equal, on the logits of that step, the softmax of the logits and the softmax
    after every stage of sampling.stages (computed here in float64); each removed candidate is
    marked with the first stage that removed it."""
    import re

    from miniserve.engine.inspector import chart
    from miniserve.engine.sampling import stages

    params = SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        max_new_tokens=12,
        seed=5,
    )
    inspector = Inspector(loaded.tokenizer, params)
    seen = []

    def observe(logits, ids, token, allowed=None, state=None):
        seen.append((logits[0].float().clone(), ids[0].clone(), token))
        inspector.observe(logits, ids, token, allowed, state)

    list(
        generate(
            loaded.model,
            chat_ids(loaded.tokenizer, "Name three animals."),
            params,
            eos_ids=engine.eos_ids,
            observer=observe,
        )
    )
    html = inspector.as_html()
    popups = re.findall(r'<span class="ms-pop".*?</span></span>(?=</span>)', html)
    assert len(popups) == len(inspector.steps) == len(seen)
    removed_seen = set()
    for step, (logits, previous, token), popup in zip(inspector.steps, seen, popups):
        ran = list(stages(logits, params, previous))
        assert (
            step.stages
            == tuple(name for name, _ in ran)
            == ("repetition penalty", "temperature", "top-k", "top-p", "min-p")
        )
        before = logits.double().softmax(-1)
        after = ran[-1][1].double().softmax(-1)
        bars = chart(step)
        assert [b.token_id for b in bars][:5] == torch.topk(before, 5).indices.tolist()
        assert sum(b.chosen for b in bars) == 1
        assert next(b for b in bars if b.chosen).token_id == token
        rows = re.findall(
            r'data-token-id="(\d+)" data-before="([\d.]+)" data-after="([\d.]+)"', popup
        )
        assert [int(r[0]) for r in rows] == [b.token_id for b in bars]
        for bar, (_, shown_before, shown_after) in zip(bars, rows):
            i = bar.token_id
            assert math.isclose(bar.before, float(before[i]), rel_tol=1e-4, abs_tol=1e-7)
            assert math.isclose(bar.after, float(after[i]), rel_tol=1e-4, abs_tol=1e-7)
            assert math.isclose(float(shown_before), bar.before, abs_tol=1e-6)
            assert math.isclose(float(shown_after), bar.after, abs_tol=1e-6)
            first_cut = next((name for name, x in ran if x[i] == float("-inf")), None)
            assert bar.removed_by == first_cut and (bar.after == 0) == (first_cut is not None)
            removed_seen.add(first_cut)
            # the bars' widths are the two probabilities
            assert f"--b:{100 * bar.before:.1f}%;--a:{100 * bar.after:.1f}%" in popup
    assert removed_seen - {None}, "some candidate was removed by a stage"


def test_greedy_chart_shows_the_argmax_taking_all_the_mass(loaded, engine):
    from miniserve.engine.inspector import chart

    params = SamplingParams(temperature=0, max_new_tokens=4)
    inspector, logits, tokens = inspect_run(loaded, engine, params)
    for step, x in zip(inspector.steps, logits):
        bars = chart(step)
        assert bars[0].chosen and bars[0].token_id == int(x.argmax())
        assert bars[0].after == 1.0 and all(
            b.after == 0 and b.removed_by == "greedy" for b in bars[1:]
        )


def test_a_reply_that_ends_on_the_end_token_shows_it_as_its_last_step(loaded, engine):
    """The inspector keeps the step that chose the end token (its probability is why the text
    stopped) after the new tokens, which do not count it; the page shows it last."""
    from miniserve.engine.decode import GenerationStats

    params = SamplingParams(temperature=0, max_new_tokens=64)
    inspector = Inspector(loaded.tokenizer, params)
    stats = GenerationStats()
    tokens = list(
        generate(
            loaded.model,
            chat_ids(loaded.tokenizer, "Say hello."),
            params,
            eos_ids=engine.eos_ids,
            observer=inspector.observe,
            stats=stats,
        )
    )
    assert stats.finish_reason == "eos", "the greedy reply should end within 64 tokens"
    assert stats.new_tokens == len(tokens)  # the end token is not yielded
    assert len(inspector.steps) == len(tokens) + 1
    assert [s.token_id for s in inspector.steps[:-1]] == tokens
    last = inspector.steps[-1]
    assert last.token_id in engine.eos_ids
    assert last.text == loaded.tokenizer.decode([last.token_id], skip_special_tokens=False)
    spans = inspector.as_html().split('class="ms-tok"')[1:]
    assert len(spans) == len(tokens) + 1 and ">" + html.escape(last.text) in spans[-1]
