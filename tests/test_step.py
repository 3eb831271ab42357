"""The Step view's engine side (miniserve/engine/step.py) on the real embedded model: the chart's
numbers are sampling.stages' on the same logits, Back restores a step exactly, a seed gives
the normal reply's text, a hand pick continues as a prompt ending in it would, new settings
run no forward pass, and bad input is one specific line."""

import re
import threading

import pytest
import torch

from miniserve.core.config import Constraint, SamplingParams
from miniserve.engine.sampling import stages
from miniserve.engine.step import StepError, StepSession, entropy_bits

PROMPT = [{"role": "user", "content": "Write one sentence about a cat."}]


def session(engine, params, messages=PROMPT, **kwargs):
    return StepSession(engine, engine.chat_prompt(messages, params), params, **kwargs)


def counting(engine, monkeypatch):
    """Count the runner's forward passes (step: every batched pass; forward: single ones)."""
    calls = {"n": 0}
    for name in ("step", "forward"):
        real = getattr(engine.runner, name, None)
        if real is None:
            continue

        def wrapped(*args, real=real, **kwargs):
            calls["n"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(engine.runner, name, wrapped)
    return calls


def test_chart_numbers_are_sampling_stages_on_the_same_logits(engine):
    params = SamplingParams(
        temperature=0.8,
        top_k=30,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.3,
        seed=5,
        max_new_tokens=16,
        logit_bias=((13, 2.0), (198, -100)),
    )
    s = session(engine, params)
    for _ in s.run(4):
        pass
    view = s.view()
    logits = s.positions[-1].logits[0]
    run = list(stages(logits, params, torch.tensor(s.ids), None))
    assert view.stages == ["raw", *[name for name, _ in run], "final"]
    assert view.stages[1:-1] == [
        "logit bias",
        "repetition penalty",
        "temperature",
        "top-k",
        "top-p",
        "min-p",
    ]
    dists = [logits.softmax(-1)] + [x.softmax(-1) for _, x in run]
    dists.append(dists[-1])
    assert len(view.rows) >= 20
    for row in view.rows:
        assert row.probs == pytest.approx([float(d[row.token_id]) for d in dists], abs=1e-7)
        removed = next((name for name, x in run if x[row.token_id] == float("-inf")), None)
        assert row.removed_by == removed
        assert row.text == engine.tokenizer.decode([row.token_id])
    # the rows are the raw top 20 first, in order
    top = torch.topk(dists[0], 20).indices.tolist()
    assert [r.token_id for r in view.rows[:20]] == top
    # top-p: the mass above each token in its input, and the cut at p
    before = dict(run)["top-k"].softmax(-1)
    for row in view.rows:
        above = float(before[before > before[row.token_id]].sum())
        assert row.mass_above == pytest.approx(above, abs=1e-5)
        if row.removed_by == "top-p":
            assert row.mass_above >= 0.9
    shown = torch.tensor([r.token_id for r in view.rows])
    assert view.outside_raw == pytest.approx(1 - float(dists[0][shown].sum()), abs=1e-6)
    p = dists[0][dists[0] > 0]
    assert view.entropy_raw == pytest.approx(float(-(p * p.log2()).sum()), rel=1e-5)
    # the drawn token: its rank among the raw probabilities, its final probability
    assert view.rank == int((dists[0] > dists[0][view.drawn]).sum()) + 1
    assert view.drawn_final == pytest.approx(float(dists[-1][view.drawn]))
    s.release()


def test_greedy_chart_ends_with_the_argmax(engine):
    s = session(engine, SamplingParams(temperature=0, max_new_tokens=8))
    s.step()
    view = s.view()
    assert view.stages == ["raw", "greedy", "final"] and view.greedy
    top = view.rows[0]
    assert view.drawn == top.token_id == int(s.positions[-1].logits.argmax())
    assert top.probs[-1] == 1.0 and all(r.removed_by == "greedy" for r in view.rows[1:])
    assert view.entropy_final == 0.0
    s.release()


@pytest.mark.parametrize("preset", ["balanced", "creative"])
def test_run_to_the_end_with_a_seed_is_the_normal_reply(engine, presets, preset):
    params = presets[preset].replace(seed=11, max_new_tokens=24)
    s = session(engine, params)
    for _ in s.run():
        pass
    text, last = engine.chat_text(PROMPT, params)
    assert s.text().removesuffix("<|im_end|>") == text
    assert {"eos": "eos", "length": "length"}[s.finish] == last.stats.finish_reason
    s.release()


def test_completion_mode_run_is_the_normal_completion(engine, presets):
    params = presets["balanced"].replace(seed=3, max_new_tokens=16)
    start = "The capital of France is"
    s = StepSession(engine, engine.prompt_ids(start, params), params)
    for _ in s.run():
        pass
    reply = "".join(c.text for c in engine.complete_text(start, params))
    assert s.text().removesuffix("<|im_end|>").removesuffix("<|endoftext|>") == reply
    s.release()


def test_back_restores_the_same_logits_candidates_and_draw(engine, presets):
    params = presets["creative"].replace(seed=2, max_new_tokens=32)
    s = session(engine, params)
    for _ in s.run(3):
        pass
    logits, view, kv = s.positions[-1].logits.clone(), s.view(), s.kv_positions()
    for _ in s.run(2):
        pass
    next_token = s.tokens[3]
    assert s.kv_positions() == kv + 2
    s.back(2)
    assert len(s.tokens) == 3 and s.kv_positions() == kv  # cropped, not recomputed
    assert torch.equal(s.positions[-1].logits, logits)
    assert s.view() == view
    s.step()
    assert s.tokens[3] == next_token  # the generator's state was kept for the position
    # a click on an earlier token: back to just before it
    s.back_to(1)
    assert len(s.tokens) == 1 and s.kv_positions() == len(s.ids)
    s.release()


def test_back_rolls_the_grammar_back(engine):
    params = SamplingParams(
        temperature=0,
        max_new_tokens=20,
        constraint=Constraint("choice", '["yes please", "no thanks"]'),
    )
    s = session(engine, params)
    for _ in s.run():
        pass
    assert s.finish in ("stop", "eos")
    first = s.text()
    assert first.startswith(("yes please", "no thanks"))
    s.back_to(0)
    for _ in s.run():
        pass
    assert s.text() == first
    s.release()


def test_hand_pick_continues_as_a_prompt_ending_in_that_token(engine):
    params = SamplingParams(temperature=0, max_new_tokens=12)
    s = session(engine, params)
    s.step()
    s.step()
    third = s.view().rows[2].token_id
    s.pick_candidate(3)
    assert s.tokens[-1] == third and s.positions[-2].picked
    for _ in s.run(6):
        pass
    after = s.tokens[3:]
    prefix = s.ids[: s.prompt_len + 3]
    alone = [
        t for c in engine.complete(prefix, params.replace(max_new_tokens=6)) for t in c.token_ids
    ]
    assert after == alone[: len(after)] and len(after) == 6
    s.release()


def test_new_settings_rerun_the_stages_without_a_forward_pass(engine, monkeypatch):
    s = session(engine, SamplingParams(temperature=0.7, top_k=40, seed=1, max_new_tokens=16))
    calls = counting(engine, monkeypatch)
    s.step()
    assert calls["n"] >= 2  # the prompt, then the new token
    before, passes = s.view(), calls["n"]
    for params in (
        SamplingParams(temperature=1.5, top_k=40, seed=1, max_new_tokens=16),
        SamplingParams(temperature=0.3, top_k=5, top_p=0.5, seed=1, max_new_tokens=16),
        SamplingParams(
            temperature=0.3,
            seed=1,
            max_new_tokens=16,
            logit_bias=((before.rows[0].token_id, -100),),
        ),
        SamplingParams(
            temperature=0.3,
            seed=1,
            max_new_tokens=16,
            constraint=Constraint("regex", re.escape(s.text()) + "[0-9]+"),
        ),
    ):
        s.update(params)
        after = s.view()
        assert after.rows != before.rows
    assert calls["n"] == passes
    s.release()


def test_a_step_shares_the_pass_with_a_running_reply(engine):
    params = SamplingParams(temperature=0, max_new_tokens=200)
    s = session(engine, SamplingParams(temperature=0, max_new_tokens=8))
    s.step()
    stream = engine.chat([{"role": "user", "content": "Tell a long story about a ship."}], params)
    next(iter(stream))  # the reply is running
    cost = s.step()
    stream.close()
    assert cost.shared >= 1 and cost.new_rows == 1 and cost.forward_s > 0
    assert cost.kv_positions == len(s.ids) and cost.kv_bytes > 0
    s.release()


def test_kv_budget_counts_the_session_and_release_gives_it_back(engine):
    sched = engine.scheduler
    s = session(engine, SamplingParams(temperature=0, max_new_tokens=30))
    s.step()
    held = engine.run_on_worker(lambda: sched.kept.get(s, 0))
    assert held >= s.prompt_len + 30
    assert engine.run_on_worker(sched.kv_used) >= held
    s.release()
    assert engine.run_on_worker(lambda: s not in sched.kept)
    with pytest.raises(StepError, match="released"):
        s.step()


def test_a_session_too_large_for_the_kv_budget_is_refused(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler, "kv_budget", 40)
    with pytest.raises(StepError, match=r"--kv-budget 40\) has \d+ positions free"):
        session(engine, SamplingParams(temperature=0, max_new_tokens=64))


def test_idle_session_is_released_and_says_so(engine):
    s = session(engine, SamplingParams(temperature=0, max_new_tokens=8), idle_s=0.0)
    with pytest.raises(StepError, match="released after 0 minutes without use"):
        s.step()
    assert engine.run_on_worker(lambda: s not in engine.scheduler.kept)


def test_bad_input_is_one_specific_line(engine):
    tok = engine.tokenizer
    s = session(
        engine,
        SamplingParams(
            temperature=0.7,
            seed=1,
            max_new_tokens=8,
            logit_bias=((tok.convert_tokens_to_ids("The"), -100),),
        ),
    )
    with pytest.raises(StepError, match="no token was taken yet"):
        s.back()
    with pytest.raises(StepError, match="Step once first"):
        s.pick_candidate(1)
    s.step()
    with pytest.raises(
        StepError,
        match=r"'hello world' is not one token: it splits into 2: "
        r"'hello' \(\d+\), ' world' \(\d+\)",
    ):
        s.token_for_text("hello world")
    with pytest.raises(StepError, match="type the text of a token"):
        s.token_for_text("")
    assert s.token_for_text(" cat") == tok(" cat", add_special_tokens=False)["input_ids"][0]
    with pytest.raises(StepError, match="'The' cannot be taken: the logit bias bans it"):
        s.step(tok.convert_tokens_to_ids("The"))
    with pytest.raises(StepError, match="there is no candidate 99: choose 1 to"):
        s.pick_candidate(99)
    with pytest.raises(StepError, match="out of range"):
        s.step(10**9)
    with pytest.raises(StepError, match="there is no token 6 to go back before"):
        s.back_to(5)
    s.step(tok.convert_tokens_to_ids("<|im_end|>"))  # an end token, by hand
    with pytest.raises(
        StepError, match="the text is finished: the model wrote its end token '<|im_end|>'"
    ):
        s.step()
    s.release()
    grammar = session(
        engine,
        SamplingParams(
            temperature=0, max_new_tokens=8, constraint=Constraint("choice", '["yes", "no"]')
        ),
    )
    grammar.step()
    with pytest.raises(
        StepError, match="' cat' cannot be taken: the output format does not allow it here"
    ):
        grammar.step(s.token_for_text(" cat"))
    grammar.release()
    free = session(engine, SamplingParams(temperature=0, max_new_tokens=8))
    for _ in free.run(3):
        pass
    with pytest.raises(StepError, match="does not fit that output format at token 1"):
        free.update(
            SamplingParams(
                temperature=0, max_new_tokens=8, constraint=Constraint("regex", "[0-9]+")
            )
        )
    free.release()
    with pytest.raises(StepError, match="the prompt is empty"):
        StepSession(engine, [], SamplingParams())


def test_a_remote_model_says_what_it_cannot_show():
    from miniserve.engine.surface import REMOTE

    class Remote:  # only what the check reads: the session never talks to the server
        capabilities, name = REMOTE, "far"

    with pytest.raises(
        StepError, match="model 'far' runs on a remote server: its logits never reach this app"
    ):
        StepSession(Remote(), [1, 2], SamplingParams())


# -- the Step tab's handlers, called as Gradio calls them (no browser) ------------------------


def gr_update():
    import gradio as gr

    return gr.update()


def tab_settings(
    presets,
    preset="balanced",
    temperature=None,
    seed=4,
    bias="",
    fmt="Free text",
    fmt_text="",
    top=20,
    prompt="Write one sentence about a cat.",
    mode=None,
):
    from miniserve.ui.step_tab import CHAT
    from miniserve.ui.widgets import preset_values, setting_names

    values = preset_values(presets, preset)
    if temperature is not None:
        values[setting_names().index("temperature")] = temperature
    return [mode or CHAT, prompt, *values, seed, bias, fmt, fmt_text, top, None]


def test_tab_steps_restages_picks_and_goes_back(engine, presets, monkeypatch):
    from miniserve.ui.step_tab import StepHandlers

    tab = StepHandlers(engine, presets)
    settings = tab_settings(presets)
    for _ in range(3):
        text, chart, costs, status = tab.step(*settings)
    assert status.startswith("3 tokens taken · seed 4"), status
    assert text.count('class="ms-chip"') == 3 and 'data-pick="' in chart
    assert "shared the pass with" in costs and "<polyline" in costs
    held = tab._get(None)
    view = held.session.view()
    bars = re.findall(
        r'<g data-token="(\d+)">(?:(?!</g>).)*?data-stage="final" '
        r'data-p="([0-9.]+)"',
        chart,
    )
    assert [(int(t), float(p)) for t, p in bars] == [
        (r.token_id, pytest.approx(r.probs[-1], abs=1e-6))
        for r in view.rows
        if r.removed_by is None
    ]
    calls = counting(engine, monkeypatch)
    _, hotter, _, _ = tab.restage(*tab_settings(presets, temperature=1.6))
    assert hotter != chart and calls["n"] == 0
    third = held.session.view().rows[2].token_id
    _, _, _, status = tab.act(f"pick:{third}@1", *settings)
    assert held.session.tokens[-1] == third and held.session.positions[-2].picked
    text, _, _, status = tab.act("back:1@2", *settings)
    assert len(held.session.tokens) == 1 and "back to just before token 2" in status
    assert text.count('class="ms-chip"') == 1
    *_, status = list(tab.run(5, *settings))[-1]  # a generator: its last output
    assert "6 tokens taken" in status or "finished" in status
    *_, status = list(tab.run(2.5, *settings))[-1]
    assert "Run N takes a whole number of tokens from 1 to 4096, got 2.5" in status
    *_, status = tab.take_text("hello world", *settings)
    assert "is not one token: it splits into 2" in status
    *_, status = tab.step(*tab_settings(presets, bias="13:lots"))
    assert "Logit bias: write token ID:BIAS pairs separated by commas" in status
    *_, status = tab.reset()
    assert "released" in status
    assert engine.run_on_worker(lambda: held.session not in engine.scheduler.kept)
    # left unused past the timeout: released, and the next poll says so (once)
    tab.step(*settings)
    idle = tab._get(None).session
    idle.last_used -= tab.idle_s + 1
    assert tab.poll() == gr_update()
    tab.reap()
    assert "released after 10 minutes without use" in tab.poll() and tab.poll() == gr_update()
    assert engine.run_on_worker(lambda: idle not in engine.scheduler.kept)
    *_, status = tab.step(*settings)  # Step starts again
    assert status.startswith("1 token taken")
    # the browser tab closed (demo.unload): its session goes too
    tab.step(*settings)
    closing = tab._get(None).session
    tab.closed()
    assert tab._get(None) is None and closing.released == "released (the tab closed)"
    assert engine.run_on_worker(lambda: closing not in engine.scheduler.kept)


# -- python -m miniserve step -----------------------------------------------------------------


def test_cli_loop_steps_picks_goes_back_and_sets(engine, presets):
    import io

    from miniserve.cli.step import StepLoop

    params = presets["balanced"].replace(seed=1, max_new_tokens=20)
    s = session(engine, params)
    out = io.StringIO()
    lines = "\n\n3\n/set temperature 1.5\nb\nt hello world\nzz\n/set top_k x\nq\n"
    assert StepLoop(s, presets, 6, "", out).run(io.StringIO(lines)) == 0
    text = out.getvalue()
    tables = text.split("    #  token")
    assert len(tables) == 6  # two steps, a pick, a new temperature, a step back
    head = text[text.index("    #  token") :].splitlines()[0].split()
    assert head == [
        "#",
        "token",
        "raw",
        "rep.pen",
        "temp",
        "top-k",
        "top-p",
        "min-p",
        "final",
        "above",
    ]
    assert re.search(r"\n[^\n\[]*\[[^\]\n]+\]\n\[forward", text)  # the pick, bracketed
    assert "error: 'hello world' is not one token: it splits into 2" in text
    assert "unknown input 'zz'" in text
    assert "error: 'top_k' must be a number, got 'x'" in text
    assert len(s.tokens) == 2 and s.params.temperature == 1.5
    s.release()


def test_cli_bad_flags_are_one_line():
    from test_cli import run

    for flags, line in [
        (["--top", "0"], "error: --top must be from 1 to 200, got 0"),
        (["--temperature", "9"], "error: 'temperature' must be in [0, 2], got 9.0"),
    ]:
        done = run("step", *flags, timeout=120)
        assert done.returncode == 2 and done.stderr.strip() == line, done.stderr


def test_tab_bad_input_is_one_line_on_the_status(engine, presets):
    from miniserve.ui.step_tab import RAW, StepHandlers

    tab = StepHandlers(engine, presets)
    *_, status = tab.back(*tab_settings(presets))
    assert status == "**Error:** press Step first: there is no text to act on yet"
    *_, status = tab.step(*tab_settings(presets, prompt="   "))
    assert "write a prompt first" in status
    *_, status = tab.step(*tab_settings(presets, seed=1.5))
    assert "&#x27;seed&#x27; must be a whole number" in status
    *_, status = tab.step(*tab_settings(presets, fmt="JSON schema", fmt_text="{"))
    assert "the JSON schema is not JSON" in status
    *_, status = tab.step(*tab_settings(presets, bias="99999999:1"))
    assert "token id 99999999 is out of range" in status
    assert tab.act("nonsense", *tab_settings(presets))[3] == gr_update()
    # completion mode shows the prompt's text before the chips
    text, *_ = tab.step(*tab_settings(presets, mode=RAW, prompt="The capital of France is"))
    assert (
        '<span class="ms-step-prompt">The capital of France is</span><span class="ms-chip"' in text
    )
    tab.reset()


def test_tab_run_to_the_end_stops_on_stop(engine, presets):
    import time

    from miniserve.ui.step_tab import StepHandlers

    tab = StepHandlers(engine, presets)
    settings = tab_settings(presets, preset="creative")
    from miniserve.ui.widgets import setting_names

    settings[2 + setting_names().index("max_new_tokens")] = 4096  # it would run for minutes
    outputs = []
    runner = threading.Thread(target=lambda: outputs.extend(tab.run_to_end(*settings)))
    runner.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        tab._get(None) is None or len(tab._get(None).session.tokens) < 3
    ):
        time.sleep(0.01)
    tab.stop()
    runner.join(60)
    assert not runner.is_alive()
    *_, status = outputs[-1]
    taken = len(tab._get(None).session.tokens)
    assert status.startswith(f"{taken} tokens taken") and "stopped by you" in status
    assert 3 <= taken < 4096
    tab.reset()


def test_entropy_is_in_bits_and_never_shown_below_zero():
    """Four equal tokens: 2 bits; one token left (greedy, or top-p keeping one): 0, not the
    -0.00 a plain -sum(p log p) prints."""
    assert entropy_bits(torch.full((4,), 0.25)) == pytest.approx(2.0)
    one = entropy_bits(torch.tensor([0.0, 1.0, 0.0]))
    assert one == 0.0 and f"{one:.2f}" == "0.00"
