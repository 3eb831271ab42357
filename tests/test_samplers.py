"""The samplers as declarations: DRY, XTC, top-nσ, typical-p and Mirostat v2 against cases
worked by hand from llama.cpp's implementations (src/llama-sampling.cpp), a user-set order,
and a stage declared here that every surface then has with no other edit."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from miniserve.core.config import ConfigError, SamplingParams
from miniserve.core.samplers import check_order, default_order, describe, running
from miniserve.engine.sampling import (
    APPLY,
    Call,
    SamplerState,
    draw_one,
    dry_penalties,
    filter_logits,
    make_generator,
    mirostat_cut,
    sample,
    stages,
    top_k_compact,
    top_n_sigma_filter,
    typical_filter,
    xtc_cut,
)

NEG = float("-inf")


def kept(logits: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(logits.tolist()) if x != NEG}


def probs_logits(*p) -> torch.Tensor:
    return torch.tensor([math.log(x) for x in p])


# -- each stage on a case worked by hand ------------------------------------------------------


def test_top_n_sigma_keeps_logits_within_n_deviations_of_the_best():
    # finite logits 3, 2, 1, 0: mean 1.5, population deviation sqrt(1.25) = 1.118
    x = torch.tensor([3.0, 2.0, 1.0, 0.0, NEG])
    assert kept(top_n_sigma_filter(x, 1.0)) == {0, 1}  # >= 3 - 1.118
    assert kept(top_n_sigma_filter(x, 2.0)) == {0, 1, 2}  # >= 0.764
    assert kept(top_n_sigma_filter(x, 3.0)) == {0, 1, 2, 3}
    assert torch.equal(top_n_sigma_filter(x, 0.0), x)  # <= 0: off
    assert torch.equal(top_n_sigma_filter(x, -1.0), x)


def test_typical_p_ranks_by_distance_from_the_entropy():
    # p = .5 .3 .15 .05: H = 1.1421 nats; |-ln p - H| = .449 .062 .755 1.854, so the order is
    # .3, .5, .15, .05 with masses .3 .8 .95 1: kept up to the first mass above p
    x = probs_logits(0.5, 0.3, 0.15, 0.05)
    assert kept(typical_filter(x, 0.2)) == {1}  # the most likely token is not the most typical
    assert kept(typical_filter(x, 0.5)) == {0, 1}
    assert kept(typical_filter(x, 0.85)) == {0, 1, 2}
    assert kept(typical_filter(x, 0.99)) == {0, 1, 2, 3}
    assert torch.equal(typical_filter(x, 1.0), x)
    # a removed token stays removed and holds no mass
    assert kept(typical_filter(torch.cat([x, torch.tensor([NEG])]), 0.5)) == {0, 1}


def test_xtc_removes_the_top_choices_but_the_least_likely_of_them():
    x = probs_logits(0.4, 0.3, 0.2, 0.1)
    assert kept(xtc_cut(x, 0.25)) == {1, 2, 3}  # .4 and .3 reach it: .3 stays
    assert kept(xtc_cut(x, 0.1)) == {3}  # all reach it: the least likely stays
    assert kept(xtc_cut(x, 0.35)) == {0, 1, 2, 3}  # one reaches it: nothing to exclude


def test_xtc_acts_with_its_probability_drawn_from_the_replys_generator():
    x = probs_logits(0.4, 0.3, 0.2, 0.1).unsqueeze(0)
    acted = 0
    for seed in range(40):
        params = SamplingParams(
            temperature=1.0, top_k=0, top_p=1.0, xtc_probability=0.5, xtc_threshold=0.25
        )
        chance = float(torch.rand((), generator=make_generator(seed)))
        out = filter_logits(x, params, generator=make_generator(seed))
        assert kept(out[0]) == ({1, 2, 3} if chance <= 0.5 else {0, 1, 2, 3}), seed
        acted += chance <= 0.5
    assert 5 < acted < 35
    # off: no draw at all, so a seeded reply is the same as before XTC existed
    gen = make_generator(3)
    state = gen.get_state()
    filter_logits(x, SamplingParams(temperature=1.0), generator=gen)
    assert torch.equal(gen.get_state(), state)


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    ids = [1, 2, 3, 4, 1, 2, 3]  # "1 2 3" again: 4 would repeat 4 tokens
    assert dry_penalties(ids, frozenset(), 1.0, 2.0, 2, -1) == {4: 2.0}  # 2^(3 - 2)
    assert dry_penalties(ids, frozenset(), 0.8, 1.75, 3, -1) == {4: 0.8}  # 1.75^0
    assert dry_penalties(ids, frozenset(), 1.0, 2.0, 4, -1) == {}  # shorter than allowed
    assert dry_penalties(ids, frozenset(), 1.0, 2.0, 2, 4) == {}  # range: 4 1 2 3 only
    assert dry_penalties(ids, frozenset({2}), 1.0, 2.0, 2, -1) == {}  # a breaker ends it
    assert dry_penalties(ids, frozenset({4}), 1.0, 2.0, 2, -1) == {4: 2.0}  # before the tail
    assert dry_penalties(ids, frozenset(), 0.0, 2.0, 2, -1) == {}  # multiplier 0: off
    # a run of one token: the suffix "5 5 5" is also found one place earlier
    assert dry_penalties([5, 5, 5, 5], frozenset(), 1.0, 2.0, 2, -1) == {5: 2.0}
    # several candidates, each its longest repeat
    got = dry_penalties([7, 8, 9, 1, 8, 9, 2, 8, 9], frozenset(), 1.0, 2.0, 2, -1)
    assert got == {1: 1.0, 2: 1.0}
    # the exponent is capped where base^x would overflow a float, as llama.cpp caps it
    long = list(range(300)) * 2
    (value,) = dry_penalties(long, frozenset(), 1.0, 4.0, 1, -1).values()
    assert math.isfinite(value) and value == 4.0 ** (88.7228391 / math.log(4.0))


def test_dry_on_the_logits_subtracts_its_penalty():
    logits = torch.zeros(1, 10)
    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3]])
    params = SamplingParams(temperature=0.0, dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    run = dict(stages(logits, params, ids))
    assert list(run) == ["DRY"]
    want = torch.zeros(1, 10)
    want[0, 4] = -2.0
    assert torch.equal(run["DRY"], want)


def test_mirostat_v2_follows_its_target_surprise_step_by_step():
    # p = 1/2 1/4 1/8 1/8: surprises 1 2 3 3 bits. tau 1.5: mu starts at 3, all kept
    x = probs_logits(0.5, 0.25, 0.125, 0.125).unsqueeze(0)
    assert kept(mirostat_cut(x, 3.0)[0]) == {0, 1, 2, 3}
    assert kept(mirostat_cut(x, 2.5)[0]) == {0, 1}
    assert kept(mirostat_cut(x, 0.1)[0]) == {0}  # the most likely at least
    params = SamplingParams(
        temperature=1.0, top_k=0, top_p=1.0, mirostat=2, mirostat_tau=1.5, mirostat_eta=0.1
    )
    state, gen = SamplerState(), make_generator(11)
    mu = 3.0
    for _ in range(30):
        token = int(sample(x, params, generator=gen, state=state))
        cut = mirostat_cut(x, mu)[0].softmax(-1)  # renormalised over the tokens kept
        assert cut[token] > 0
        mu -= 0.1 * (-math.log2(float(cut[token])) - 1.5)
        assert state.mu == pytest.approx(mu, abs=1e-6)
    # Mirostat replaces the truncation stages
    on = SamplingParams(temperature=0.8, top_k=1, min_p=0.5, mirostat=2)
    keys = [s.key for s in running(on)]
    assert keys[-1] == "mirostat" and "temperature" in keys
    assert not {"top_k", "min_p", "top_p"} & set(keys)


def test_presence_and_frequency_penalties_count_the_replys_own_tokens():
    """OpenAI's formula over the tokens the reply chose: the prompt's tokens count for
    nothing (its first step sees the prompt alone), a reply token loses the presence penalty
    once and the frequency penalty per time it is there; greedy runs the stage too."""
    x = torch.randn(1, 20, generator=make_generator(1))
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    state = SamplerState()
    stage = APPLY["presence"]
    prompt = torch.tensor([[3, 3, 3, 5]])
    assert torch.equal(stage(x, Call(params, prompt, None, state, False)), x)
    reply = torch.tensor([[3, 3, 3, 5, 7, 7, 3]])  # the reply so far: 7, 7, 3
    want = x.clone()
    want[0, 7] -= 0.5 + 2 * 0.25
    want[0, 3] -= 0.5 + 1 * 0.25
    assert torch.allclose(stage(x, Call(params, reply, None, state, False)), want)
    assert "presence" in [s.key for s in running(params)]
    assert "presence" in [s.key for s in running(params.replace(temperature=0))]
    assert "presence" not in [s.key for s in running(SamplingParams())]
    # a state told its prompt's length counts the reply's tokens even when the stage first
    # runs late (the Step view: the penalty switched on after three tokens)
    late = SamplerState(prompt_len=4)
    assert torch.allclose(stage(x, Call(params, reply, None, late, False)), want)
    # llama.cpp's `penalties` in an order is all three penalties: it brings this stage in
    assert check_order(["top_k", "penalties"]) == ("top_k", "penalties", "presence")
    assert check_order(["presence", "penalties"]) == ("presence", "penalties")
    # negative values favour repeats, as OpenAI allows (-2..2)
    more = stage(x, Call(params.replace(presence_penalty=-1.0), reply, None, state, False))
    assert more[0, 7] > x[0, 7] - 2 * 0.25


# -- the order ---------------------------------------------------------------------------------


def test_the_default_order_is_the_classic_one_and_a_stage_left_out_is_off():
    assert default_order() == (
        "penalties",
        "presence",
        "dry",
        "temperature",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "top_p",
        "min_p",
        "xtc",
    )
    x = torch.randn(1, 50, generator=make_generator(0))
    p = SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.0)
    labels = [name for name, _ in stages(x, p)]
    assert labels == ["temperature", "top-k", "top-p", "min-p"]
    # min-p before temperature sees the untempered distribution: another set of tokens
    swapped = p.replace(samplers=["min_p", "temperature"])
    assert [name for name, _ in stages(x, swapped)] == ["min-p", "temperature"]
    want = (x.softmax(-1) >= 0.1 * x.softmax(-1).max()).sum()
    assert len(kept(filter_logits(x, swapped)[0])) == int(want)
    assert len(kept(filter_logits(x, swapped)[0])) != len(kept(filter_logits(x, p)[0]))
    assert SamplingParams(samplers="top_k;temperature").samplers == ("top_k", "temperature")
    assert SamplingParams(samplers=list(default_order())).samplers is None  # the default
    with pytest.raises(ConfigError, match="unknown stage 'nope'"):
        SamplingParams(samplers=["nope"])
    with pytest.raises(ConfigError, match="listed twice"):
        SamplingParams(samplers=["top_k", "top-k"])
    assert "samplers=min_p;temperature" in describe(swapped)


# -- a stage declared here is on every surface -------------------------------------------------

DECLARED = textwrap.dedent(
    """
    import json, sys
    from miniserve.core.fields import Field
    from miniserve.core.samplers import Param, Stage, declare

    declare(Stage(
        "parity", "parity", "removes every odd token id",
        (Param("parity_strength", Field(float, 0.0, 1.0, 0.0, "Parity strength",
               "1 = odd ids removed; 0 = off"), 0.0, step=0.5),),
        place=45, truncation=True,
    ))

    import torch
    from miniserve.engine.sampling import applies

    @applies("parity")
    def _parity(logits, call):
        if call.params.parity_strength < 1.0:
            return logits
        odd = torch.arange(logits.shape[-1]) % 2 == 1
        return logits.masked_fill(odd, float("-inf"))

    from miniserve.core.config import FIELDS, SamplingParams, load_presets
    from miniserve.engine.sampling import stages
    from miniserve.engine.inspector import Inspector
    from miniserve.core.samplers import describe, default_order
    seen = {}
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, parity_strength=1.0)
    seen["params"] = p.parity_strength == 1.0 and "parity_strength" in FIELDS
    seen["order"] = "parity" in default_order()
    logits = torch.randn(1, 20)
    run = list(stages(logits, p))
    seen["stages"] = [n for n, _ in run]
    seen["removed"] = all(x == float("-inf") for x in run[-1][1][0, 1::2].tolist())
    seen["describe"] = "parity_strength=1" in describe(p)

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return str(ids[0])
    insp = Inspector(Tok(), p, top=20)
    insp.observe(logits, torch.tensor([[1, 2]]), 0)
    seen["inspector"] = sorted(
        {c.removed_by for c in insp.steps[0].candidates if c.token_id % 2})

    import tempfile, pathlib
    f = pathlib.Path(tempfile.mkdtemp()) / "p.yaml"
    f.write_text("presets:\\n  even:\\n    temperature: 1.0\\n    parity_strength: 1.0\\n")
    seen["preset"] = load_presets(f)["even"].parity_strength

    from miniserve.serve.protocol import ChatCompletionRequest
    from miniserve.serve import parse
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "parity_strength": 1.0,
         "samplers": ["temperature", "parity"]})
    seen["api"] = [body.parity_strength, body.samplers]
    seen["api_schema"] = "parity_strength" in ChatCompletionRequest.model_json_schema()[
        "properties"]
    seen["api_default"] = parse.api_defaults()["parity_strength"]
    try:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "parity_strength": 3})
        seen["api_range"] = "accepted"
    except Exception as e:
        seen["api_range"] = "parity_strength" in str(e)

    from miniserve.models.remote import stage_fields
    seen["remote"] = stage_fields(p, "llama.cpp", "m").get("parity_strength")
    try:
        stage_fields(p, "vllm", "m")
        seen["remote_refused"] = False
    except Exception as e:
        seen["remote_refused"] = "parity" in str(e) and getattr(e, "field", "") == "parity_strength"

    from miniserve.cli.main import build_parser
    from miniserve.cli.repl import set_setting
    args = build_parser().parse_args(["generate", "--parity-strength", "1", "--prompt", "hi"])
    seen["cli"] = args.parity_strength
    seen["set"] = set_setting(SamplingParams(), "parity_strength 1").parity_strength

    import gradio as gr
    from miniserve.ui.widgets import build_sampling, params_from, preset_values, setting_names
    from miniserve.ui.chat_tab import ChatHandlers
    import inspect
    presets = {"even": load_presets(f)["even"]}
    with gr.Blocks():
        controls = build_sampling(presets, "even", lambda n: preset_values(presets, n), "")
    labels = [getattr(c, "label", None) for c in controls.sliders]
    seen["ui"] = "Parity strength" in labels
    values = preset_values(presets, "even")
    seen["ui_params"] = params_from(values, 1).parity_strength
    seen["ui_handler"] = "setting_parity_strength" in inspect.signature(
        ChatHandlers.send).parameters
    print(json.dumps(seen))
    """
)


def test_a_stage_declared_in_a_test_is_on_every_surface(tmp_path):
    """The stage is declared before anything reads the declarations (as a plugin would be):
    the settings, presets, the order, the stages, the inspector's marks, the one-line
    description (REPL, Compare), the API's field, limits and schema, the remote engines'
    fields and refusal, the CLI's flag and /set, the UI's control and its handlers."""
    import json

    script = tmp_path / "declared.py"
    script.write_text(DECLARED)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {
        "params": True,
        "order": True,
        "stages": ["temperature", "top-k", "top-p", "parity", "min-p"],
        "removed": True,
        "describe": True,
        "inspector": ["parity"],
        "preset": 1.0,
        "api": [1.0, ["temperature", "parity"]],
        "api_schema": True,
        "api_default": 0.0,
        "api_range": True,
        "remote": 1.0,
        "remote_refused": True,
        "cli": 1.0,
        "set": 1.0,
        "ui": True,
        "ui_params": 1.0,
        "ui_handler": True,
    }


def test_one_row_draws_on_the_tokens_top_k_kept_as_over_the_whole_vocabulary():
    """sample()'s one-row path runs the stages after top-k on the k tokens it kept: the token
    drawn is the one the whole-vocabulary stages and draw give, seed for seed (the running
    totals, summed over other blocks, could part only where u x the total falls within
    rounding of a token's edge)."""

    def whole(x, params, ids, gen):  # the draw over every probability, zeros included
        probs = filter_logits(x.float(), params, ids).softmax(-1)
        return int(draw_one(probs, gen))

    torch.manual_seed(0)
    settings = [
        dict(temperature=0.7, top_k=50, top_p=0.95, repetition_penalty=1.1),
        dict(temperature=1.0, top_k=80, top_p=0.98, min_p=0.02, repetition_penalty=1.15),
        dict(temperature=0.9, top_k=40, typical_p=0.9, xtc_probability=0.0),
        dict(temperature=0.8, top_k=20, top_n_sigma=1.5, samplers=["top_k", "temperature"]),
        dict(temperature=0.8, top_k=30, dry_multiplier=0.8, samplers=["top_k", "dry", "min_p"]),
    ]
    compact = 0
    for n in range(200):
        x = torch.randn(1, 4096) * 4
        x[0, n % 7] = x[0, n % 11]  # ties now and then (the full path keeps ties with the k-th)
        ids = torch.randint(0, 4096, (1, 60))
        params = SamplingParams(**settings[n % len(settings)])
        got = int(sample(x, params, ids, make_generator(n)))
        assert got == whole(x, params, ids, make_generator(n)), (n, params)
        compact += top_k_compact(x, params.top_k) is not None
    assert compact > 150  # the path under test ran


# -- on the real model ------------------------------------------------------------------------

STATEFUL = [
    dict(temperature=0.9, top_k=0, top_p=1.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2),
    dict(temperature=0.8, top_k=40, top_p=1.0, xtc_probability=0.6, xtc_threshold=0.05),
    dict(temperature=0.7, dry_multiplier=0.8, dry_allowed_length=2, repetition_penalty=1.0),
    dict(temperature=0.9, top_k=0, top_p=1.0, top_n_sigma=1.0, typical_p=0.9),
]


def test_the_new_stages_in_a_batch_give_what_each_gives_alone(engine):
    """Four replies at once, each with its own stage (Mirostat's mu and XTC's draws per
    reply), get the tokens each gets through the one-sequence loop."""
    from test_scheduler import together

    from miniserve.engine.decode import generate

    prompts = [
        engine.chat_prompt([{"role": "user", "content": q}], SamplingParams())
        for q in ("Name a fruit.", "Count to five.", "Say hello twice.", "What is 2+2?")
    ]
    params = [SamplingParams(**s, seed=7 + i, max_new_tokens=24) for i, s in enumerate(STATEFUL)]
    out = [tokens for tokens, _ in together(engine, prompts, params)]
    for ids, p, got in zip(prompts, params, out):
        want = engine.run_on_worker(
            lambda ids=ids, p=p: list(
                generate(
                    engine.runner, ids, p, eos_ids=engine.eos_ids, sampler=engine.sampler_state()
                )
            )
        )
        assert got == want, p


def test_back_in_the_step_view_restores_mirostats_state(engine):
    """Mirostat's mu is kept per position: Back then Step takes the same tokens with the same
    mu, and a hand pick moves mu by the picked token's surprise."""
    from miniserve.engine.step import StepSession

    params = SamplingParams(**STATEFUL[0], seed=3, max_new_tokens=12)
    s = StepSession(
        engine,
        engine.chat_prompt([{"role": "user", "content": "Tell me a story."}], params),
        params,
    )
    try:
        mus = []
        for _ in range(6):
            s.step()
            mus.append(s.sampler.mu)
        first = list(s.tokens)
        assert len(set(mus)) > 1  # mu moved with the surprises
        s.back(3)
        for _ in range(3):
            s.step()
        assert s.tokens == first and s.sampler.mu == mus[-1]
        s.back(1)
        view = s.view()
        other = next(r.token_id for r in view.rows if r.token_id != view.drawn and r.probs[-1] > 0)
        s.step(other)
        assert s.tokens[-1] == other and s.sampler.mu != mus[-1]
    finally:
        s.release()
