"""Streaming text: deltas join to the full decode, no U+FFFD halves, stop strings."""

import copy

import pytest

from miniserve.engine.stream import REPLACEMENT, Detokenizer, StopStrings

TEXTS = [
    "Hello 👋🏽 world! 🎉🎉 Let's go 🚀",
    "日本の首都は東京です。中文也可以：你好，世界！한국어도요.",
    "Crème brûlée, naïve façade, Ærøskøbing, Ωmega — “quotes” …",
    "Mixed: 🤖 robots 机器人 ロボット résumé 👨‍👩‍👧‍👦 family",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_decoded_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids) or text.isascii(), (
        "the sample must split a character across tokens to be a real test"
    )
    detok = Detokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_deltas_on_generated_ids(engine):
    from miniserve.core.config import SamplingParams

    chunks = list(
        engine.chat(
            [{"role": "user", "content": "Write three emoji and the word 日本."}],
            SamplingParams(temperature=0, max_new_tokens=30),
        )
    )
    ids = [i for c in chunks for i in c.token_ids]
    assert "".join(c.text for c in chunks) == engine.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_fast_decode_gives_the_pieces_transformers_decode_gives(tokenizer, skip_special):
    """The Detokenizer calls the fast tokenizer's own decode where transformers' decode adds
    nothing to it: the same pieces as through transformers, special tokens kept or skipped;
    a tokenizer class with a decode of its own goes through that decode."""
    ids = [tokenizer.bos_token_id or 0]
    for text in TEXTS:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += [tokenizer.eos_token_id]
    fast, slow = Detokenizer(tokenizer, skip_special), Detokenizer(tokenizer, skip_special)
    assert fast._backend is not None
    slow._backend = None
    pieces = [(fast.push(i), slow.push(i)) for i in ids] + [(fast.flush(), slow.flush())]
    assert all(a == b for a, b in pieces)
    assert "".join(a for a, _ in pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special)

    class OwnDecode(type(tokenizer)):
        def decode(self, token_ids, **kwargs):
            return "own"

    class OwnPart(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return "own"

    for kind in (OwnDecode, OwnPart):
        own = copy.copy(tokenizer)  # the same tokenizer, its class one with a decode of its own
        own.__class__ = kind
        detok = Detokenizer(own, skip_special)
        detok.push(ids[1])
        assert detok._backend is None and detok.text == "own"


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer("ok 🎉", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tokenizer)
    streamed = "".join(detok.push(i) for i in ids[:-1])
    assert REPLACEMENT not in streamed
    assert streamed + detok.push(ids[-1]) + detok.flush() == "ok 🎉"


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(["</end>"])
    out = [s.feed(p) for p in ["Hello <", "/e", "nd> bye"]]
    assert "".join(out) == "Hello " and s.stopped
    t = StopStrings(["</end>"])
    assert t.feed("a <") == "a " and t.feed("b") == "<b" and t.flush() == ""


def test_stop_strings_earliest_of_several():
    s = StopStrings(["STOP", "\n\n"])
    assert s.feed("one two\n\nthree STOP") == "one two" and s.stopped
