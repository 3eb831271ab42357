"""Structured output on the real model: the grammar mask as a stage of the sampler
(miniserve/engine/grammar.py, llguidance). Constrained against unconstrained (greedy keeps the
model's top token wherever the grammar allows it), outputs against their schema or pattern,
a batch of constrained and free replies against each alone, the finish reasons, and the
errors for what cannot be enforced. The full sweep over 20+ schemas is
`python -m benchmarks.grammar_sweep` (BENCHMARKS.md)."""

import json
import re
import threading

import jsonschema
import pytest

from miniserve.core.config import Constraint, SamplingParams
from miniserve.engine.decode import generate
from miniserve.engine.grammar import GrammarError
from miniserve.engine.inspector import Inspector
from miniserve.engine.sampling import filter_logits

from conftest import chat_ids

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {
            "type": "array",
            "items": {"enum": ["cat", "dog", "fish"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
ORDER = {
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "qty": {"type": "integer", "minimum": 1},
            },
            "required": ["sku", "qty"],
        }
    },
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
        "note": {"type": "string", "maxLength": 30},
    },
    "required": ["id", "items"],
}


def ask(engine, text):
    return chat_ids(engine.tokenizer, text)


def run(engine, text, constraint, observer=None, **settings):
    """One reply alone, through the one-sequence loop: (text, token ids, stats)."""
    from miniserve.engine.decode import GenerationStats

    params = SamplingParams(
        **{"temperature": 0, "max_new_tokens": 120, **settings}, constraint=constraint
    )
    stats = GenerationStats()
    ids = engine.run_on_worker(
        lambda: list(
            generate(
                engine.runner,
                ask(engine, text),
                params,
                eos_ids=engine.eos_ids,
                stats=stats,
                observer=observer,
                matcher=engine.matcher(params),
            )
        )
    )
    shown = [t for t in ids if t not in engine.eos_ids]
    return engine.tokenizer.decode(shown, skip_special_tokens=True), ids, stats


def json_schema(schema):
    return Constraint("json_schema", json.dumps(schema))


@pytest.mark.parametrize(
    "schema, question",
    [
        (PERSON, "Describe a person and their pets as JSON."),
        (ORDER, "Write an order as JSON."),
    ],
)
def test_greedy_json_follows_its_schema(engine, schema, question):
    text, _, stats = run(engine, question, json_schema(schema), max_new_tokens=160)
    assert stats.finish_reason in ("stop", "eos"), (stats.finish_reason, text)
    jsonschema.validate(json.loads(text), schema)


def test_sampled_json_follows_its_schema(engine):
    """Every seed's reply finishes (PERSON is bounded and compact: about 30 tokens of the
    160) and is valid; and the seeds did sample (not all the same reply)."""
    texts = []
    for seed in (1, 2, 3):
        text, _, stats = run(
            engine,
            "Describe a person as JSON.",
            json_schema(PERSON),
            temperature=0.8,
            top_p=0.95,
            seed=seed,
            max_new_tokens=160,
        )
        assert stats.finish_reason in ("stop", "eos"), (seed, stats.finish_reason, text)
        jsonschema.validate(json.loads(text), PERSON)
        texts.append(text)
    assert len(set(texts)) > 1, texts


def test_greedy_keeps_the_top_token_wherever_the_grammar_allows_it(engine):
    """At every step where the unconstrained choice (the argmax of the same logits) is
    allowed, the constrained choice is that token; and the mask did bite somewhere."""
    steps = []
    run(
        engine,
        "Tell me about a cat named Tom.",
        json_schema(PERSON),
        observer=lambda logits, ids, token, allowed, _state: steps.append(
            (
                int(filter_logits(logits, SamplingParams(temperature=0), ids).argmax()),
                allowed[0].clone(),
                token,
            )
        ),
    )
    assert steps and all(allowed is not None for _, allowed, _ in steps)
    kept = [(free, token) for free, allowed, token in steps if allowed[free]]
    assert all(free == token for free, token in kept)
    assert len(kept) < len(steps), "the grammar changed the choice at some step"
    assert kept, "and left the model's own choice at others"


@pytest.mark.parametrize(
    "constraint, check",
    [
        (
            Constraint("regex", r"\d{4}-\d{2}-\d{2}"),
            lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t),
        ),
        (
            Constraint("choice", json.dumps(["red", "green", "blue"])),
            lambda t: t in ("red", "green", "blue"),
        ),
        (
            Constraint("grammar", 'root ::= "Answer: " ("yes" | "no")'),
            lambda t: t in ("Answer: yes", "Answer: no"),
        ),
        (
            Constraint("grammar", 'start: "Answer: " NUMBER\nNUMBER: /[0-9]{1,3}/'),  # Lark
            lambda t: re.fullmatch(r"Answer: [0-9]{1,3}", t),
        ),
        (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_regex_choice_grammar_and_any_json(engine, constraint, check):
    text, _, stats = run(
        engine, "What is today's date? Pick a colour. Is it raining?", constraint, max_new_tokens=60
    )
    assert check(text), text
    assert stats.finish_reason in ("stop", "eos")


def test_no_token_allowed_ends_the_reply_with_its_own_finish_reason(engine):
    """A regex that must start with a digit, and a logit bias that bans every token starting
    with one: nothing can come next."""
    tokenizer = engine.tokenizer
    digits = [i for i in range(len(tokenizer)) if tokenizer.decode([i])[:1].isdigit()]
    assert 0 < len(digits) <= 300
    text, ids, stats = run(
        engine,
        "Give me a number.",
        Constraint("regex", r"[0-9]+"),
        logit_bias={i: -100 for i in digits},
    )
    assert stats.finish_reason == "no_token_allowed" and ids == [] and text == ""


def test_a_reply_cut_by_max_tokens_ends_with_length(engine):
    text, _, stats = run(
        engine, "Describe a person as JSON.", json_schema(PERSON), max_new_tokens=5
    )
    assert stats.finish_reason == "length" and stats.new_tokens == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_logit_bias_bans_and_boosts(engine):
    free, ids, _ = run(engine, "Name a colour.", None, max_new_tokens=6)
    first = ids[0]
    _, banned, _ = run(engine, "Name a colour.", None, max_new_tokens=6, logit_bias={first: -100})
    assert banned[0] != first
    _, boosted, _ = run(
        engine, "Name a colour.", None, max_new_tokens=1, logit_bias={first: -100, 12345: 100}
    )
    assert boosted == [12345]


def test_constrained_and_free_replies_in_one_batch_get_what_each_gets_alone(engine):
    """Per-row masks: each sequence of a pass is masked by its own grammar (or none)."""
    cases = [
        ("Describe a person as JSON.", json_schema(PERSON), {}),
        ("Write an order as JSON.", json_schema(ORDER), {}),
        ("What is the date?", Constraint("regex", r"\d{4}-\d{2}-\d{2}"), {}),
        ("Name a bird.", None, {}),
        ("Describe a person as JSON.", json_schema(PERSON), {"temperature": 0.9, "seed": 7}),
        ("Pick a colour.", Constraint("choice", json.dumps(["red", "blue"])), {}),
    ]
    params = [
        SamplingParams(**{"temperature": 0, "max_new_tokens": 60, **s}, constraint=c)
        for _, c, s in cases
    ]
    expected = [
        engine.run_on_worker(
            lambda p=p, q=q: list(
                generate(
                    engine.runner,
                    ask(engine, q),
                    p,
                    eos_ids=engine.eos_ids,
                    matcher=engine.matcher(p),
                )
            )
        )
        for (q, _, _), p in zip(cases, params)
    ]
    out = [None] * len(cases)
    start = threading.Barrier(len(cases))

    def one(i):
        start.wait()
        chunks = list(engine.complete(ask(engine, cases[i][0]), params[i], reuse_prefix=False))
        out[i] = [t for c in chunks for t in c.token_ids]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(out, expected):
        assert got == [t for t in want if t not in engine.eos_ids]


def test_a_reused_prefix_gives_the_same_constrained_reply(engine):
    params = SamplingParams(temperature=0, max_new_tokens=60, constraint=json_schema(PERSON))
    first = engine.chat_text([{"role": "user", "content": "A person as JSON, please."}], params)
    again = engine.chat_text([{"role": "user", "content": "A person as JSON, please."}], params)
    assert again[1].stats.reused_tokens > 0 and again[0] == first[0]


def test_the_inspector_shows_what_the_grammar_removed(engine):
    params = SamplingParams(temperature=0, max_new_tokens=40, constraint=json_schema(PERSON))
    inspector = Inspector(engine.tokenizer, params)
    run(
        engine,
        "Tell me about a cat named Tom.",
        json_schema(PERSON),
        observer=inspector.observe,
        max_new_tokens=40,
    )
    removed = [s.masked_mass for s in inspector.steps]
    assert all(m is not None for m in removed) and max(removed) > 0.5
    assert any(c.removed_by == "grammar" for s in inspector.steps for c in s.candidates)
    assert "data-grammar-removed" in inspector.as_html()
    assert "grammar removed" in inspector.as_text()


@pytest.mark.parametrize(
    "constraint, words",
    [
        (json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (json_schema({"type": "object", "not": {"required": ["a"]}}), "not"),
        (Constraint("json_schema", "{not json"), "not JSON"),
        (Constraint("regex", "a("), "unclosed group"),
        (Constraint("regex", "(?=a)b"), "look-around"),
        (Constraint("grammar", "root ::= ( "), "root"),
        (Constraint("choice", "[]"), "non-empty strings"),
    ],
)
def test_what_cannot_be_enforced_is_an_error_naming_why(engine, constraint, words):
    with pytest.raises(GrammarError, match=re.escape(words)):
        engine.grammars.check(constraint)
    with pytest.raises(GrammarError):
        engine.chat_text(
            [{"role": "user", "content": "Hi"}],
            SamplingParams(max_new_tokens=4, constraint=constraint),
        )


def test_objects_get_only_their_declared_keys_unless_the_schema_says_otherwise():
    from miniserve.engine.grammar import closed_objects

    closed = closed_objects(ORDER)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["item"]["additionalProperties"] is False
    assert "additionalProperties" not in ORDER  # the caller's schema is not changed
    open_map = {"type": "object", "additionalProperties": {"type": "number"}}
    assert closed_objects(open_map) == open_map
    combined = {
        "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
        "properties": {"c": {}},
    }
    assert closed_objects(combined) == combined  # allOf's parts add up: left open
    # what the closed schema generates, the original accepts
    sample = {"id": 1, "items": [{"sku": "ABC", "qty": 2}]}
    jsonschema.validate(sample, closed)
    jsonschema.validate(sample, ORDER)
