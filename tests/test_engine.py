"""The Engine: streaming chat, stop strings, prefix reuse, queue limit."""

import re
import threading
import time

import pytest

from miniserve.core.config import SamplingParams
from miniserve.engine.chat import ChatError, render, trim_history
from miniserve.engine.engine import Engine, EngineBusy

from conftest import same_on_every_cpu

GREEDY = SamplingParams(temperature=0, top_k=0, top_p=1.0, max_new_tokens=24)


def test_chat_streams_pieces_that_join_to_the_reply(engine):
    messages = [{"role": "user", "content": "Name three colours."}]
    chunks = list(engine.chat(messages, GREEDY))
    assert chunks[-1].done and sum(not c.done for c in chunks) >= 2
    ids = [i for c in chunks for i in c.token_ids]
    assert "".join(c.text for c in chunks) == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert chunks[-1].stats.new_tokens == len(ids)


def test_stop_string_cuts_the_reply(engine):
    # Exact by construction: the second request repeats the prompt, so it reuses the first's
    # cached prompt and the logits it produced (PrefixCache), then decodes the same way.
    messages = [{"role": "user", "content": "Count: 1, 2, 3, 4, 5, 6, 7, 8"}]
    full, _ = engine.chat_text(messages, GREEDY.replace(max_new_tokens=40))
    word = full.split()[2]
    text, last = engine.chat_text(messages, GREEDY.replace(max_new_tokens=40, stop=(word,)))
    assert last.stats.finish_reason == "stop"
    assert text == full[: full.index(word)]


def test_follow_up_turn_reuses_the_prefix_cache(loaded):
    engine = Engine(loaded)
    history = [{"role": "user", "content": "Tell me about the moon. " * 20}]
    reply, first = engine.chat_text(history, GREEDY)
    assert first.stats.reused_tokens == 0
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And Mars?"}]
    _, second = engine.chat_text(history, GREEDY)
    assert second.stats.reused_tokens >= first.stats.prompt_tokens - 1
    cold = Engine(loaded, prefix_cache_entries=0)
    _, third = cold.chat_text(history, GREEDY)
    assert third.stats.reused_tokens == 0


@same_on_every_cpu
def test_progress_says_how_far_a_long_prompt_is_read(loaded):
    """Asked for, chunks without text say how many prompt positions are in the cache: at
    admission, then after each pass of 24 rows that read a part of the prompt; all before the
    reply, which is the one given without them. A follow-up turn's count starts where the
    prefix cache's KV ends."""
    engine = Engine(loaded, step_tokens=24)
    try:
        history = [{"role": "user", "content": "Tell me about the moon. " * 12}]
        ids = engine.chat_prompt(history, GREEDY)
        plain = list(engine.complete(ids, GREEDY, reuse_prefix=False))
        chunks = list(engine.complete(ids, GREEDY, progress=True))
        read = [c.prompt_read for c in chunks if c.prompt_read is not None]
        assert len(ids) > 4 * 24 and read == list(range(0, len(ids), 24))
        assert all(c.prompt_read is None for c in plain)
        reply = chunks[len(read) :]
        assert all(c.prompt_read is None and c.stats.prompt_tokens == len(ids) for c in reply)
        assert [(c.text, c.token_ids) for c in reply] == [(c.text, c.token_ids) for c in plain]

        history += [
            {"role": "assistant", "content": "".join(c.text for c in reply)},
            {"role": "user", "content": "And Mars? " * 10},
        ]
        follow = engine.chat_prompt(history, GREEDY)
        chunks = list(engine.complete(follow, GREEDY, progress=True))
        read = [c.prompt_read for c in chunks if c.prompt_read is not None]
        reused = chunks[-1].stats.reused_tokens
        assert reused >= len(ids) - 1 and read == list(range(reused, len(follow), 24))
    finally:
        engine.close()


@same_on_every_cpu
def test_prefix_cache_is_bounded(loaded):
    engine = Engine(loaded, prefix_cache_entries=2)
    for i in range(4):
        engine.chat_text(
            [
                {"role": "system", "content": f"{i} is your lucky number."},
                {"role": "user", "content": "Why?"},
            ],
            GREEDY.replace(max_new_tokens=2),
        )
    assert len(engine.prefix_cache.entries) == 2


@same_on_every_cpu
def test_queue_limit_answers_busy(loaded):
    engine = Engine(loaded, max_queue=1)
    running = engine.chat([{"role": "user", "content": "Hi"}], GREEDY)
    next(running)  # holds the only slot
    with pytest.raises(EngineBusy):
        next(engine.chat([{"role": "user", "content": "Hello"}], GREEDY))
    running.close()  # cancels; the engine thread frees the slot within a step
    deadline = time.time() + 10
    while engine.queue_depth and time.time() < deadline:
        time.sleep(0.01)
    assert engine.queue_depth == 0
    assert engine.chat_text([{"role": "user", "content": "Hello"}], GREEDY)[1].done


def test_concurrent_chats_do_not_mix(engine):
    """Exact by construction: each reply is computed from scratch (no prefix reuse), alone or
    while the others wait, by the same code on the same numbers."""
    questions = ["What is 2+2?", "Name a fruit.", "What colour is the sky?"]
    ask = lambda q: engine.chat_text([{"role": "user", "content": q}], GREEDY, reuse_prefix=False)[
        0
    ]
    alone = {q: ask(q) for q in questions}
    together = {}
    threads = [
        threading.Thread(target=lambda q=q: together.__setitem__(q, ask(q))) for q in questions
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


def test_trim_keeps_system_and_newest_and_fits(tokenizer):
    system = {"role": "system", "content": "You are terse."}
    turns = []
    for i in range(30):
        turns += [
            {"role": "user", "content": f"Question {i} " + "words " * 20},
            {"role": "assistant", "content": f"Answer {i} " + "more " * 20},
        ]
    messages = [system] + turns + [{"role": "user", "content": "Last question?"}]
    result = trim_history(tokenizer, messages, context_length=600, max_new_tokens=100)
    assert result.dropped > 0
    assert result.messages[0] == system and result.messages[-1] == messages[-1]
    assert result.messages[1]["role"] == "user"
    assert len(result.prompt_ids) + 100 <= 600
    assert result.prompt_ids == render(tokenizer, result.messages)
    # keeping two more messages (one more turn) would not have fitted
    rest = messages[1:]
    assert len(render(tokenizer, [system] + rest[result.dropped - 2 :])) + 100 > 600


def test_too_long_message_is_a_clear_error(tokenizer):
    messages = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(ChatError, match="too long"):
        trim_history(tokenizer, messages, context_length=1000, max_new_tokens=100)


@same_on_every_cpu
@pytest.mark.parametrize(
    "messages, field",
    [
        ([], "messages"),
        ([{"role": "user", "content": "   "}], "messages[0].content"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "system", "content": "hi"}], "messages"),
    ],
)
def test_bad_messages_name_the_field(engine, messages, field):
    with pytest.raises(ChatError) as info:
        engine.chat(messages, GREEDY)
    assert info.value.field == field


@same_on_every_cpu
def test_control_characters_and_surrogates_are_cleaned(engine):
    """The prompt the engine builds drops the control characters and turns the lone surrogate
    into '?' (core/text.py): the same ids as the cleaned message's, and a reply to it."""
    params = GREEDY.replace(max_new_tokens=4)
    dirty = [{"role": "user", "content": "Hi\x00\x07 there \ud800!"}]
    ids = engine.chat_prompt(dirty, params)
    shown = engine.tokenizer.decode(ids)
    assert "Hi there ?!" in shown, shown
    assert not any(c in shown for c in "\x00\x07") and not re.search("[\ud800-\udfff]", shown)
    assert ids == engine.chat_prompt([{"role": "user", "content": "Hi there ?!"}], params)
    _, last = engine.chat_text(dirty, params)
    assert last.done and last.stats.new_tokens > 0
    assert last.stats.prompt_tokens == len(ids)


def test_a_repeated_prompt_reuses_its_logits_and_answers_the_same(loaded):
    """Regenerate / a retried request: the whole prompt and the logits it produced come from
    the prefix cache -- no prefill, and bit for bit the first reply (a sampled one too)."""
    engine = Engine(loaded)
    messages = [{"role": "user", "content": "Write a line about autumn."}]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16, seed=3)
    first, a = engine.chat_text(messages, params)
    again, b = engine.chat_text(messages, params)
    assert a.stats.reused_tokens == 0 and b.stats.reused_tokens == b.stats.prompt_tokens
    assert again == first
    partial, c = engine.chat_text(
        messages
        + [{"role": "assistant", "content": first}, {"role": "user", "content": "Another."}],
        params,
    )
    assert 0 < c.stats.reused_tokens < c.stats.prompt_tokens  # a shared prefix: fed the rest


def test_compare_interleaves_columns_and_matches_single_runs(engine):
    """Exact by construction: every column and every single run computes from scratch."""
    ids = engine.chat_prompt([{"role": "user", "content": "Name a bird."}], GREEDY)
    settings = [
        GREEDY.replace(max_new_tokens=10),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_new_tokens=10, seed=4),
    ]
    texts, order = ["", ""], []
    for col, chunk, busy in engine.compare(ids, settings):
        texts[col] += chunk.text
        order.append(col)
        assert busy > 0
    assert order.index(1) < len(order) - order[::-1].index(0) - 1  # both advanced in turn
    for col, params in enumerate(settings):
        alone = "".join(c.text for c in engine.complete(ids, params, reuse_prefix=False))
        assert texts[col] == alone


class FakeCache:
    """Enough of a KV cache for the prefix cache's bookkeeping: a length that crops."""

    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n

    def crop(self, k):
        self.n = self.n + k if k < 0 else min(k, self.n)


def test_prefix_cache_reuses_logits_only_for_the_same_prompt():
    from miniserve.engine.engine import PrefixCache

    prompt = list(range(100, 130))
    logits = object()
    cache = PrefixCache()
    cache.put(prompt + [7, 8], FakeCache(32), len(prompt), logits)  # prompt + 2 generated
    got, n, reused_logits = cache.take(prompt)
    assert (got.n, n, reused_logits) == (30, 30, logits)  # whole prompt, and what it produced
    cache.put(prompt + [7, 8], FakeCache(32), len(prompt), logits)
    got, n, reused_logits = cache.take(prompt[:-3])  # a shorter prompt: its last token is fed
    assert (got.n, n, reused_logits) == (26, 26, None)
    cache.put(prompt + [7, 8], FakeCache(32), len(prompt), logits)
    got, n, reused_logits = cache.take(prompt + [7, 8, 9])  # a longer one: the rest is fed
    assert (got.n, n, reused_logits) == (32, 32, None)


def test_prefix_cache_drops_logits_of_a_prompt_it_does_not_hold_and_short_matches():
    from miniserve.engine.engine import PrefixCache

    prompt = list(range(100, 130))
    cache = PrefixCache()
    cache.put(prompt[:10], FakeCache(10), len(prompt), object())  # cancelled during prefill
    assert cache.entries[0].prompt_logits is None
    cache = PrefixCache(min_match=16)
    cache.put(prompt[:16] + [1, 2], FakeCache(18), 16, object())
    assert cache.take(prompt[:16] + [3])[0] is not None  # 16 shared, 16 reusable
    cache.put(prompt[:16] + [1, 2], FakeCache(18), 18, object())
    assert cache.take(prompt[:16]) == (None, 0, None)  # 16 shared, but only 15 reusable
