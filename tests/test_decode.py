"""The hand-written loop on the real embedded model: bit for bit generate() where it makes
the same calls, and within float32's / bfloat16's error bound of a float64 reference where
it computes otherwise (tests/reference.py says which is which)."""

import threading

import pytest
import torch

from miniserve.core.config import SamplingParams
from miniserve.engine.decode import GenerationStats, generate
from miniserve.runners.lean import LeanRunner
from miniserve.runners.native import NativeRunner
from miniserve.runners.verify import (
    BOUND_BF16_PRODUCTS,
    BOUND_BFLOAT16,
    BOUND_FLOAT32,
    check_tokens,
)

from conftest import (
    chat_ids,
    expected_runner,
    native_expected,
    needs_native,
    pinned_runner,
    same_on_every_cpu,
)
from reference import (
    AGREE_BFLOAT16,
    AGREE_FLOAT32,
    HELD_OUT,
    TINY_BOUND,
    assert_greedy,
    one_token_at_a_time,
    teacher_forced,
    whole_prompt,
)

GREEDY = SamplingParams(temperature=0, top_k=0, top_p=1.0, max_new_tokens=40)
PROMPTS = {
    "short": "Explain why the sky is blue.",
    "long": "Summarise this text in one sentence. "
    + " ".join(
        f"Paragraph {i}: the river flows past the old mill, where the miller grinds wheat "
        f"and the children count boats."
        for i in range(16)
    ),
    "multilingual": "Traduis en français et en japonais : « Good morning, how are you? » 日本語でも。",  # noqa: E501
}


def hf_generate(model, ids, n, logits=None):
    """generate()'s greedy tokens (the end token dropped); its raw logits into `logits`."""
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=n,
            top_k=None,
            top_p=None,
            temperature=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    if logits is not None:
        logits.extend(row[0] for row in out.logits)
    new = out.sequences[0, len(ids) :].tolist()
    eos = model.generation_config.eos_token_id
    return new[:-1] if new and new[-1] == eos else new


def run(model, ids, params=GREEDY, **kwargs):
    """(tokens, end id or None, logits of every step) of our loop."""
    steps = []
    tokens = list(
        generate(
            model,
            ids,
            params,
            eos_ids=kwargs.pop("eos_ids", {2}),
            observer=lambda logits, _, t, _allowed, _state: steps.append((logits[0], t)),
            **kwargs,
        )
    )
    end = steps[-1][1] if len(steps) > len(tokens) else None
    return tokens, end, [logits for logits, _ in steps]


@pytest.fixture(scope="module")
def lean_model(loaded):

    return LeanRunner(loaded.model)


@pinned_runner
@same_on_every_cpu  # equal by construction, whatever the kernels' arithmetic
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hand_loop_equals_generate_bit_for_bit(loaded, bf16, dtype):
    """Exact by construction: our loop driving the transformers model makes the calls
    generate() makes -- the whole prompt, then one token at a time through the same cache,
    logits of the last position only -- so the same kernels sum the same numbers in the same
    order: equal logits at every step, bit for bit, on any CPU, and so equal tokens. (It
    rests on generate()'s all-ones attention mask leading transformers to the same unmasked
    causal attention our loop gets; a transformers version that masked instead would fail
    here, on any CPU, and say so.)"""
    model = (loaded if dtype == "float32" else bf16).model
    for name in ("short", "multilingual"):
        ids = chat_ids(loaded.tokenizer, PROMPTS[name])
        theirs = []
        reference = hf_generate(model, ids, GREEDY.max_new_tokens, theirs)
        tokens, _, ours = run(model, ids)
        assert tokens == reference and len(tokens) >= 32
        assert len(ours) == len(theirs)
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(ours, theirs))


@pytest.mark.parametrize(
    "runner",
    [
        pytest.param("transformers", marks=pinned_runner),
        pytest.param("lean", marks=pinned_runner),
        pytest.param("native", marks=needs_native),
    ],
)
@pytest.mark.parametrize("name", PROMPTS)
def test_cache_and_no_cache_follow_the_float64_reference(
    loaded, engine, lean_model, ref32, name, runner
):
    """Not exact by construction: with the cache a step is one row through torch.mv or the
    C++ step, without it many rows through an MKL matrix product; the lean runner fuses
    matrices, the native one sums in C++. Each greedy reply must follow the float64 reference
    within float32's error bound (tests/reference.py), over >= 32 decided steps. Without the
    cache (40 passes over the whole text) on the short prompt only: the many-row arithmetic
    of the long one is what the teacher-forced prompt-pass test below checks."""
    ids = chat_ids(loaded.tokenizer, PROMPTS[name])
    if name == "long":
        assert len(ids) > 300
    assert engine.runner_name == expected_runner()  # the engine's default on this CPU
    model = {"transformers": loaded.model, "lean": lean_model, "native": engine.runner}[runner]
    for use_cache in (True, False) if name == "short" else (True,):
        tokens, end, _ = run(model, ids, eos_ids=engine.eos_ids, use_cache=use_cache)
        assert len(tokens) >= 32, "want a long enough comparison"
        assert_greedy(ref32, ids, tokens, BOUND_FLOAT32, end)


@pinned_runner
def test_bfloat16_arithmetic_follows_the_reference_within_its_bound(bf16, ref16):
    """bfloat16 activations (the lean runner over bf16 weights; generate() in bf16): another
    rounding on every product, ~1.6 logits of error (BOUND_BFLOAT16), larger than the top-2
    margin of most steps of a chat reply -- so no run of decided steps can be asked for here,
    only that every token is within the bound of the reference's best. What bounds bf16's
    quality is the teacher-forced agreement below."""

    lean = LeanRunner(bf16.model)
    assert lean.act_dtype == torch.bfloat16
    for text in (PROMPTS["short"], PROMPTS["multilingual"]):
        ids = chat_ids(bf16.tokenizer, text)
        tokens, end, _ = run(lean, ids)
        assert len(tokens) >= 16
        assert_greedy(ref16, ids, tokens, BOUND_BFLOAT16, end, min_decided=0)


def paths(loaded, bf16, engine, lean_model):
    """(step_logits, reference, bound, agreement threshold) of each way we compute logits."""

    return {
        "engine steps, float32": (
            one_token_at_a_time(engine.runner),
            "ref32",
            BOUND_FLOAT32,
            AGREE_FLOAT32,
        ),
        "lean prompt pass, float32": (
            whole_prompt(lean_model),
            "ref32",
            BOUND_FLOAT32,
            AGREE_FLOAT32,
        ),
        "native steps, bf16 weights": (
            lambda ids: one_token_at_a_time(NativeRunner(bf16.model, math="float32"))(ids),
            "ref16",
            BOUND_FLOAT32,
            AGREE_FLOAT32,
        ),
        "native steps, bf16 products": (
            lambda ids: one_token_at_a_time(NativeRunner(bf16.model, math="bfloat16"))(ids),
            "ref16",
            BOUND_BF16_PRODUCTS,
            AGREE_BFLOAT16,
        ),
        "lean prompt pass, bf16": (
            whole_prompt(LeanRunner(bf16.model)),
            "ref16",
            BOUND_BFLOAT16,
            AGREE_BFLOAT16,
        ),
    }


PATHS = [
    "engine steps, float32",
    pytest.param("lean prompt pass, float32", marks=pinned_runner),
    pytest.param("native steps, bf16 weights", marks=needs_native),
    pytest.param("native steps, bf16 products", marks=needs_native),
    pytest.param("lean prompt pass, bf16", marks=pinned_runner),
]


@pytest.mark.parametrize("path", PATHS)
def test_teacher_forced_logits_on_held_out_text(loaded, bf16, engine, lean_model, request, path):
    """Every position of ~280 tokens of held-out text: the largest logit error is within the
    bound of the path's arithmetic, and the top-1 token agrees with the float64 reference's
    (measured 100% in float32, 96-97% in bf16; thresholds in tests/reference.py)."""
    if path.startswith("engine"):
        assert engine.runner_name == expected_runner()  # the engine's default on this CPU
    step_logits, ref, bound, threshold = paths(loaded, bf16, engine, lean_model)[path]
    ids = chat_ids(loaded.tokenizer, HELD_OUT)
    agree, error = teacher_forced(step_logits, request.getfixturevalue(ref), ids)
    assert error <= bound and agree >= threshold, (agree, error)


def broken(loaded, how: str):
    """The engine's runner (native, or lean where it is off), deliberately wrong in one way."""
    from miniserve.runners.native import NativeForward, NativeRunner

    model = (NativeRunner if native_expected() else LeanRunner)(loaded.model)
    if how == "rope base 10000":  # the model's is 100000
        inv = 1.0 / (10000.0 ** (torch.arange(0, model.head_dim, 2).float() / model.head_dim))
        freqs = torch.outer(torch.arange(model.cos.shape[0], dtype=torch.float32), inv)
        model.cos, model.sin = freqs.cos().to(model.cos.dtype), freqs.sin().to(model.sin.dtype)
    elif how == "one MLP residual branch dropped":
        model.layers[5]["w2"] = torch.zeros_like(model.layers[5]["w2"])
    elif how == "bfloat16 weights in a float32 model":
        for w in model.layers:
            for name in ("wqkv", "wo", "w13", "w2"):
                w[name] = w[name].to(torch.bfloat16).float()
    if isinstance(model, NativeRunner):
        model.native = NativeForward(model, model.math)  # it reads the (new) weights' addresses
    return model


@same_on_every_cpu
@pytest.mark.parametrize(
    "how",
    ["rope base 10000", "one MLP residual branch dropped", "bfloat16 weights in a float32 model"],
)
def test_a_broken_runner_fails_these_checks(loaded, ref32, how):
    """The checks above can fail. A wrong RoPE base or a dropped residual branch: caught by
    the greedy check (on the short and multilingual prompts; the long one's summary is so
    sure of itself that even these keep its tokens) and by the teacher-forced agreement
    over HELD_OUT's first 100 positions (75-80% measured). Weights rounded to bfloat16 in a
    model that claims float32 (0.3 logits of error, the tokens unchanged): caught by the
    bound."""
    model = broken(loaded, how)
    assert model.config.rope_parameters["rope_theta"] == 100000.0
    gross = how != "bfloat16 weights in a float32 model"
    if gross:  # some token off the reference on at least one of the two prompts
        caught = []
        for name in ("short", "multilingual"):
            ids = chat_ids(loaded.tokenizer, PROMPTS[name])
            tokens, end, _ = run(model, ids)
            caught.append(
                not check_tokens(
                    ref32, ids, tokens, BOUND_FLOAT32, () if end is None else (end,)
                ).ok
            )
        assert any(caught)
    held_out = chat_ids(loaded.tokenizer, HELD_OUT)[:100]
    agree, error = teacher_forced(one_token_at_a_time(model), ref32, held_out)
    assert error > BOUND_FLOAT32 and (agree < AGREE_FLOAT32 or not gross), (agree, error)


@pinned_runner
def test_int8_weights_keep_the_top_token(bf16, loaded):
    """Quality of int8 weights, teacher-forced: at each position of a real text, the int8
    model's most likely next token is the float32 model's most of the time."""

    int8 = LeanRunner(bf16.model, quant="int8")
    ids = chat_ids(loaded.tokenizer, PROMPTS["long"])[:200]
    agree = 0
    with torch.inference_mode():
        reference = loaded.model(torch.tensor([ids])).logits[0].argmax(-1)
        cache = int8.new_cache()
        for i, token in enumerate(ids):  # one token at a time: the int8 decode path
            agree += int(int8(torch.tensor([[token]]), cache).argmax(-1)) == int(reference[i])
    assert agree / len(ids) >= 0.9


@pinned_runner
def test_lean_reuses_a_cropped_cache_like_a_fresh_prefill(loaded, lean_model, engine, ref32):
    """A block of 40 prompt tokens after a reused prefix: other shapes than one fresh prefill
    (so not bit for bit); the reply follows the float64 reference like a fresh one."""
    ids = chat_ids(loaded.tokenizer, PROMPTS["long"])
    cache = lean_model.new_cache()
    list(
        generate(
            lean_model,
            ids[:-40] + [5, 6, 7],
            GREEDY.replace(max_new_tokens=3),
            eos_ids=set(),
            cache=cache,
        )
    )
    from miniserve.engine.decode import crop_cache

    crop_cache(cache, len(ids) - 40)  # keep the shared prefix; a block of 40 new tokens follows
    tokens, end, _ = run(lean_model, ids, eos_ids=engine.eos_ids, cache=cache)
    assert len(tokens) >= 32
    assert_greedy(ref32, ids, tokens, BOUND_FLOAT32, end)


@pinned_runner
@same_on_every_cpu  # the same seed twice: equal by construction
def test_seeded_sampling_reproducible_on_the_model(loaded, engine):
    ids = chat_ids(loaded.tokenizer, "Write a short poem about the sea.")
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24)
    run = lambda seed: list(
        generate(loaded.model, ids, params.replace(seed=seed), eos_ids=engine.eos_ids)
    )
    first = run(11)
    assert first == run(11)
    assert first != run(12)


def greedy_chat(loaded, engine, text, max_new_tokens, **kwargs):
    """generate()'s greedy reply to `text` as a user message, not yet run, and the stats it
    fills: (prompt ids, the token generator, stats)."""
    ids = chat_ids(loaded.tokenizer, text)
    stats = GenerationStats()
    params = GREEDY.replace(max_new_tokens=max_new_tokens)
    tokens = generate(loaded.model, ids, params, eos_ids=engine.eos_ids, stats=stats, **kwargs)
    return ids, tokens, stats


@pinned_runner
def test_stops_at_max_new_tokens_and_reports_stats(loaded, engine):
    ids, tokens, stats = greedy_chat(loaded, engine, "Count from one to one hundred.", 5)
    out = list(tokens)
    assert len(out) == 5 and stats.new_tokens == 5
    assert stats.finish_reason == "length"
    assert stats.prompt_tokens == len(ids)
    assert 0 < stats.ttft_s <= stats.total_s


@pinned_runner
def test_stops_at_eos_without_yielding_it(loaded, engine):
    _, tokens, stats = greedy_chat(loaded, engine, "Say only the word yes.", 64)
    out = list(tokens)
    assert stats.finish_reason == "eos"
    assert not engine.eos_ids & set(out)


@pinned_runner
def test_cancel_stops_within_one_step(loaded, engine):
    cancel = threading.Event()
    text = "Tell me a long story about dragons."
    _, tokens, stats = greedy_chat(loaded, engine, text, 200, cancel=cancel)
    out = []
    for token in tokens:
        out.append(token)
        if len(out) == 3:
            cancel.set()
    assert len(out) == 3 and stats.finish_reason == "cancelled"


@pinned_runner
def test_tiny_model_cache_and_no_cache_follow_the_reference(tiny_model):
    """A tiny random Llama (logits ~0.1, so a tighter bound than the real model's: measured
    largest error 2e-7): cached and uncached greedy replies both follow its float64 twin."""
    from reference import float64_twin

    reference = float64_twin(tiny_model)
    ids = list(range(3, 40))
    for use_cache in (True, False):
        tokens = list(
            generate(
                tiny_model,
                ids,
                GREEDY.replace(max_new_tokens=30),
                eos_ids=set(),
                use_cache=use_cache,
            )
        )
        assert len(tokens) == 30
        assert_greedy(reference, ids, tokens, TINY_BOUND)
