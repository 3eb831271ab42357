"""Prompt-lookup speculation on the embedded model: on == off token for token (greedy, sampled
with seeds, alone and in a batch, with a grammar), each case with at least one draft accepted
and one rejected; the prefix cache after a speculative run equal to a plain run's; the drafting
rule and the acceptance count."""

from __future__ import annotations

import json
import threading

import pytest

from miniserve.core.config import Constraint, SamplingParams
from miniserve.engine.engine import Engine
from miniserve.engine.scheduler import SPEC_PAUSE, SPEC_WINDOW, Drafter

pytestmark = pytest.mark.same_on_every_cpu

CODE = """def total(items):
    result = 0
    for item in items:
        result = result + item.price * item.count
    return result


def average(items):
    if not items:
        return 0
    return total(items) / len(items)
"""
ASK = [
    {
        "role": "user",
        "content": "Rename `items` to `rows` in this code and give all of it back:\n\n" + CODE,
    }
]


@pytest.fixture(scope="module")
def spec(loaded):
    engine = Engine(loaded, speculate="ngram")
    yield engine
    engine.close()


def reply(engine, params, messages=ASK) -> tuple[list[int], object]:
    ids, last = [], None
    for chunk in engine.chat(messages, params):
        ids += chunk.token_ids
        last = chunk
    return ids, last.stats


GREEDY = SamplingParams(temperature=0, max_new_tokens=60)
SAMPLED = [
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=s, max_new_tokens=60) for s in (1, 2)
]


def both_ways(engine, spec, params):
    plain, plain_stats = reply(engine, params)
    fast, stats = reply(spec, params)
    assert fast == plain
    assert plain_stats.drafted == 0
    assert stats.accepted >= 1 and stats.drafted > stats.accepted  # some taken, some not
    return stats


def test_greedy_and_sampled_replies_are_the_same_with_speculation(engine, spec):
    assert spec.speculates and not engine.speculates
    for params in (GREEDY, *SAMPLED):
        both_ways(engine, spec, params)


def test_a_grammar_and_speculation(engine, spec):
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "maxLength": 200}},
        "required": ["code"],
    }
    params = GREEDY.replace(constraint=Constraint("json_schema", json.dumps(schema)))
    both_ways(engine, spec, params)


def test_in_a_batch_each_reply_is_its_own(engine, spec):
    asks = [GREEDY, *SAMPLED]
    alone = [reply(engine, p)[0] for p in asks]
    out: dict[int, list[int]] = {}
    stats: dict[int, object] = {}

    def run(i):
        out[i], stats[i] = reply(spec, asks[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(asks))] == alone
    assert spec.scheduler.widest >= 2
    assert sum(s.accepted for s in stats.values()) >= 1
    assert sum(s.drafted - s.accepted for s in stats.values()) >= 1


def test_the_prefix_cache_after_speculation_equals_a_plain_runs(engine, spec):
    """The entry holds the same ids and as many positions (rejected drafts cropped), and the
    next turn reuses it the same way and answers the same."""
    for e in (engine, spec):
        e.prefix_cache.clear()
    ids_plain, _ = reply(engine, GREEDY)
    ids_fast, stats = reply(spec, GREEDY)
    assert ids_fast == ids_plain and stats.accepted and stats.drafted > stats.accepted
    (a,), (b,) = engine.prefix_cache.entries.values(), spec.prefix_cache.entries.values()
    assert a.ids == b.ids and a.prompt_len == b.prompt_len
    assert a.cache.get_seq_length() == b.cache.get_seq_length() == len(a.ids)
    follow = [*ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    short = GREEDY.replace(max_new_tokens=8)
    ids1, s1 = reply(engine, short, follow)
    ids2, s2 = reply(spec, short, follow)
    assert s1.reused_tokens == s2.reused_tokens > 0 and ids1 == ids2


def test_the_drafting_rule():
    d = Drafter([5, 6, 7, 8, 1, 2, 5, 6, 7])
    assert d.draft(3) == [8, 1, 2]  # the last 3 tokens, seen before: what followed
    d.extend([9])
    assert d.draft(4) == []  # 7 8 ... 9: no earlier 7 9 or 6 7 9
    d.extend([5, 6])
    assert d.draft(2) == [7, 9]  # "5 6" matches (not "9 5 6"): its most recent occurrence
    assert d.draft(0) == []
    assert d.draft(8) == [7, 9, 5, 6]  # k starts at SPEC_START
    d.verified(4, 4)
    assert d.k == 8  # a draft taken whole: k doubles
    d.verified(8, 2)
    assert d.k == 3  # one more than was accepted
    # acceptance counting: a window of poor steps pauses drafting, longer each time
    for _ in range(SPEC_WINDOW):
        d.verified(3, 0)
    assert d.drafted == 4 + 8 + 3 * SPEC_WINDOW and d.accepted == 6
    assert all(d.draft(2) == [] for _ in range(SPEC_PAUSE))
    assert d.draft(2) == [7]  # k is 1 after the rejections
    for _ in range(SPEC_WINDOW):
        d.verified(1, 0)
    assert all(d.draft(2) == [] for _ in range(2 * SPEC_PAUSE))
    assert d.draft(2) == [7]


def test_acceptance_is_counted_as_the_passes_it_saved(spec):
    """Alone, a reply cut by its budget takes its prefill passes, then one pass a token less
    one for each accepted draft: the first token comes from the prefill, and each decode pass
    gives its accepted drafts and one token drawn after them. A verifier that took one token
    too many would give other tokens (the tests above) or another count here."""
    spec.prefix_cache.clear()
    sched = spec.scheduler
    passes, accepted = sched.passes, sched.spec_accepted
    prompt_ids = spec.chat_prompt(ASK, GREEDY)
    _, stats = reply(spec, GREEDY)
    assert stats.finish_reason == "length" and stats.reused_tokens == 0
    assert sched.spec_accepted - accepted == stats.accepted > 0
    prefill = -(-len(prompt_ids) // sched.step_tokens)
    assert sched.passes - passes == prefill + stats.new_tokens - 1 - stats.accepted
