"""The hand-written loop on the real embedded model: equal to generate(), token for token."""

import threading

import pytest
import torch

from conftest import chat_ids
from miniserve.config import SamplingParams
from miniserve.decode import GenerationStats, generate

GREEDY = SamplingParams(temperature=0, top_k=0, top_p=1.0, max_new_tokens=40)
PROMPTS = {
    "short": "Explain why the sky is blue.",
    "long": "Summarise this text in one sentence. " + " ".join(
        f"Paragraph {i}: the river flows past the old mill, where the miller grinds wheat "
        f"and the children count boats." for i in range(16)),
    "multilingual": "Traduis en français et en japonais : « Good morning, how are you? » 日本語でも。",
}


def hf_generate(model, ids, n):
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=n, top_k=None, top_p=None, temperature=None)
    new = out[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    return new[:-1] if new and new[-1] == eos else new


@pytest.fixture(scope="module")
def lean_model(loaded):
    from miniserve.lean import LeanModel
    return LeanModel(loaded.model)


@pytest.mark.parametrize("runner", ["transformers", "lean", "native"])
@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_cache_equals_no_cache_equals_generate(loaded, engine, lean_model, name, runner):
    ids = chat_ids(loaded.tokenizer, PROMPTS[name])
    if name == "long":
        assert len(ids) > 300
    assert engine.runner == "native"  # the engine's default on this CPU
    model = {"transformers": loaded.model, "lean": lean_model, "native": engine.model}[runner]
    cached = list(generate(model, ids, GREEDY, eos_ids=engine.eos_ids))
    uncached = list(generate(model, ids, GREEDY, eos_ids=engine.eos_ids, use_cache=False))
    reference = hf_generate(loaded.model, ids, GREEDY.max_new_tokens)
    assert len(cached) >= 32, "want a long enough comparison"
    assert cached == uncached == reference


def test_greedy_equals_generate_in_bfloat16(bf16):
    from miniserve.lean import LeanModel
    assert bf16.model.dtype == torch.bfloat16
    lean = LeanModel(bf16.model)
    for text in (PROMPTS["short"], PROMPTS["multilingual"]):
        ids = chat_ids(bf16.tokenizer, text)
        reference = hf_generate(bf16.model, ids, GREEDY.max_new_tokens)
        assert list(generate(bf16.model, ids, GREEDY, eos_ids={2})) == reference
        assert list(generate(lean, ids, GREEDY, eos_ids={2})) == reference


def test_int8_weights_keep_the_top_token(bf16, loaded):
    """Quality of int8 weights, teacher-forced: at each position of a real text, the int8
    model's most likely next token is the float32 model's most of the time."""
    from miniserve.lean import LeanModel
    int8 = LeanModel(bf16.model, quant="int8")
    ids = chat_ids(loaded.tokenizer, PROMPTS["long"])[:200]
    agree = 0
    with torch.inference_mode():
        reference = loaded.model(torch.tensor([ids])).logits[0].argmax(-1)
        cache = int8.new_cache()
        for i, token in enumerate(ids):  # one token at a time: the int8 decode path
            agree += int(int8(torch.tensor([[token]]), cache).argmax(-1)) == int(reference[i])
    assert agree / len(ids) >= 0.9


def test_lean_reuses_a_cropped_cache_like_a_fresh_prefill(loaded, lean_model, engine):
    ids = chat_ids(loaded.tokenizer, PROMPTS["long"])
    cache = lean_model.new_cache()
    list(generate(lean_model, ids[:-40] + [5, 6, 7], GREEDY.replace(max_new_tokens=3),
                  eos_ids=set(), cache=cache))
    from miniserve.decode import crop_cache
    crop_cache(cache, len(ids) - 40)  # keep the shared prefix; a block of 40 new tokens follows
    reused = list(generate(lean_model, ids, GREEDY, eos_ids=engine.eos_ids, cache=cache))
    assert reused == list(generate(lean_model, ids, GREEDY, eos_ids=engine.eos_ids))


def test_seeded_sampling_reproducible_on_the_model(loaded, engine):
    ids = chat_ids(loaded.tokenizer, "Write a short poem about the sea.")
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24)
    run = lambda seed: list(generate(loaded.model, ids, params.replace(seed=seed),
                                     eos_ids=engine.eos_ids))
    first = run(11)
    assert first == run(11)
    assert first != run(12)


def test_stops_at_max_new_tokens_and_reports_stats(loaded, engine):
    ids = chat_ids(loaded.tokenizer, "Count from one to one hundred.")
    stats = GenerationStats()
    out = list(generate(loaded.model, ids, GREEDY.replace(max_new_tokens=5),
                        eos_ids=engine.eos_ids, stats=stats))
    assert len(out) == 5 and stats.new_tokens == 5
    assert stats.finish_reason == "length"
    assert stats.prompt_tokens == len(ids)
    assert 0 < stats.ttft_s <= stats.total_s


def test_stops_at_eos_without_yielding_it(loaded, engine):
    ids = chat_ids(loaded.tokenizer, "Say only the word yes.")
    stats = GenerationStats()
    out = list(generate(loaded.model, ids, GREEDY.replace(max_new_tokens=64),
                        eos_ids=engine.eos_ids, stats=stats))
    assert stats.finish_reason == "eos"
    assert not engine.eos_ids & set(out)


def test_cancel_stops_within_one_step(loaded, engine):
    ids = chat_ids(loaded.tokenizer, "Tell me a long story about dragons.")
    cancel = threading.Event()
    stats = GenerationStats()
    out = []
    for token in generate(loaded.model, ids, GREEDY.replace(max_new_tokens=200),
                          eos_ids=engine.eos_ids, cancel=cancel, stats=stats):
        out.append(token)
        if len(out) == 3:
            cancel.set()
    assert len(out) == 3 and stats.finish_reason == "cancelled"


def test_tiny_model_cache_equals_no_cache(tiny_model):
    ids = list(range(3, 40))
    a = list(generate(tiny_model, ids, GREEDY.replace(max_new_tokens=30), eos_ids=set()))
    b = list(generate(tiny_model, ids, GREEDY.replace(max_new_tokens=30), eos_ids=set(),
                      use_cache=False))
    assert a == b and len(a) == 30
