"""The scheduler (miniserve/engine/scheduler.py) against the one-sequence loop: each sequence of a
batch gets exactly the tokens `decode.generate` gives it alone on the same runner -- greedy
and seeded sampling, whatever shares its passes, however its prompt was chunked, with a
reused prefix -- and the KV budget's policy: wait, never cut off, refuse only what can never
fit."""

import threading

import pytest
import torch

from miniserve.core.config import SamplingParams
from miniserve.engine import sampling
from miniserve.engine.decode import generate
from miniserve.engine.engine import Engine, EngineBusy, RequestTooLarge
from miniserve.engine.sampling import NoTokenAllowed, SamplerState, make_generator

from conftest import chat_ids, needs_native, same_on_every_cpu
from reference import HELD_OUT

QUESTIONS = [
    "Name a bird.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Name a color.",
    "What is the capital of Italy?",
    "Write a haiku about rain.",
    "Name a planet.",
    "Give me a word that rhymes with cat.",
]


def settings(n, new_tokens=24):
    """Greedy and seeded sampling, alternating."""
    return [
        SamplingParams(temperature=0, max_new_tokens=new_tokens)
        if i % 2 == 0
        else SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_new_tokens=new_tokens)
        for i in range(n)
    ]


def alone(engine, ids, params):
    """The reference: the one-sequence loop, on the engine's runner and thread."""
    return engine.run_on_worker(
        lambda: list(
            generate(
                engine.runner, ids, params, eos_ids=engine.eos_ids, max_length=engine.context_length
            )
        )
    )


def together(engine, prompts, params, **kwargs):
    """Every request at once from its own thread; each one's token ids and last chunk."""
    out = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def one(i):
        start.wait()
        chunks = list(engine.complete(prompts[i], params[i], reuse_prefix=False, **kwargs))
        out[i] = ([t for c in chunks for t in c.token_ids], chunks[-1])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def bf16_engine(bf16):
    return Engine(bf16)  # bfloat16 weights: bfloat16 products where the CPU has them


@pytest.mark.parametrize("which", ["engine", "bf16_engine", "stored_engine"])
def test_eight_streams_get_the_tokens_each_gets_alone(request, which):
    engine = request.getfixturevalue(which)
    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS]
    params = settings(8, new_tokens=16)
    before, blocks = engine.scheduler.widest, engine.scheduler.sampled_together
    got = together(engine, prompts, params)
    for ids, p, (tokens, last) in zip(prompts, params, got):
        assert tokens == alone(engine, ids, p)
        assert last.stats.finish_reason in ("eos", "length")
    if engine.runner_name == "native":  # one pass over several sequences did happen, and
        assert max(engine.scheduler.widest, before) >= 2  # rows were sampled as a block
        assert engine.scheduler.sampled_together > blocks


@pytest.mark.parametrize("which", ["bf16", "stored"])
@needs_native
def test_a_prompt_read_in_chunks_beside_other_streams_gets_the_same_tokens(request, which):
    """Step of 24 rows: a 290-token prompt is read in chunks of what the decode rows of the
    other streams leave, over more than ten passes (bfloat16 weights, and the GGUF's Q4_1
    blocks as stored)."""
    engine = Engine(request.getfixturevalue(which), step_tokens=24)
    prompts = [chat_ids(engine.tokenizer, HELD_OUT + " Summarize this.")] + [
        chat_ids(engine.tokenizer, q) for q in QUESTIONS[:3]
    ]
    params = settings(4, new_tokens=16)
    got = together(engine, prompts, params)
    for ids, p, (tokens, _) in zip(prompts, params, got):
        assert tokens == alone(engine, ids, p)
    assert engine.scheduler.tallest <= 24 and engine.scheduler.passes > len(prompts[0]) // 24


@pytest.mark.parametrize("which", ["engine", "stored_engine"])
@needs_native
def test_a_reused_prefix_gives_the_tokens_of_a_fresh_prompt(request, which):
    """The next turn of a chat reuses the KV of the last one and reads only the rest: exact,
    since a position's keys and values do not depend on how the prompt was cut."""
    engine = request.getfixturevalue(which)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    messages = [{"role": "user", "content": "Name three rivers."}]
    first, _ = engine.chat_text(messages, params)
    messages += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Which is the longest?"},
    ]
    ids = engine.chat_prompt(messages, params)
    chunks = list(engine.complete(ids, params))
    assert 0 < chunks[-1].stats.reused_tokens < len(ids)
    assert [t for c in chunks for t in c.token_ids] == alone(engine, ids, params)


def test_the_kv_budget_makes_requests_wait_and_cuts_none_off(loaded):
    """A budget that holds one request at a time: three requests at once run one after the
    other, each to its full length, the budget never exceeded; a fourth while the queue of
    three is full is refused as busy; one that could never fit, refused at once."""
    params = SamplingParams(temperature=0, max_new_tokens=20)
    engine = Engine(loaded, kv_budget=100, max_queue=3, prefix_cache_entries=0)
    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS[:3]]
    assert all(len(p) + 20 <= 100 < 2 * (len(p) + 20) for p in prompts)
    streams = [engine.complete(p, params, reuse_prefix=False) for p in prompts]
    with pytest.raises(EngineBusy):
        engine.complete(prompts[0], params)
    for ids, stream in zip(prompts, streams):
        chunks = list(stream)
        assert [t for c in chunks for t in c.token_ids] == alone(engine, ids, params)
    assert engine.scheduler.widest == 1 and engine.scheduler.peak_kv <= 100
    long_prompt = chat_ids(engine.tokenizer, HELD_OUT)
    with pytest.raises(RequestTooLarge, match="KV budget is 100"):
        engine.complete(long_prompt, params)
    assert engine.queue_depth == 0


def test_a_cancelled_stream_leaves_within_a_step_and_the_others_go_on(engine):
    params = SamplingParams(temperature=0, max_new_tokens=40)
    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS[:2]]
    cancel = threading.Event()
    leaving = engine.complete(prompts[0], params, cancel=cancel, reuse_prefix=False)
    staying = engine.complete(prompts[1], params, reuse_prefix=False)
    next(leaving)
    cancel.set()
    rest = list(leaving)
    assert rest[-1].done and rest[-1].stats.finish_reason == "cancelled"
    assert rest[-1].stats.new_tokens < 40
    tokens = [t for c in staying for t in c.token_ids]
    assert tokens == alone(engine, prompts[1], params)
    assert engine.queue_depth == 0


def test_a_failing_observer_ends_its_own_request_and_the_engine_goes_on(engine):
    """An error while choosing a token (here the observer's) ends that sequence with the
    error; the sequence beside it and later requests run as usual."""
    params = SamplingParams(temperature=0, max_new_tokens=12)
    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS[:2]]

    def broken(logits, ids, token_id, allowed, state):
        raise RuntimeError("observer broke")

    failing = engine.complete(prompts[0], params, observer=broken, reuse_prefix=False)
    fine = engine.complete(prompts[1], params, reuse_prefix=False)
    with pytest.raises(RuntimeError, match="observer broke"):
        list(failing)
    assert [t for c in fine for t in c.token_ids] == alone(engine, prompts[1], params)
    again = list(engine.complete(prompts[0], params, reuse_prefix=False))
    assert again[-1].done and engine.queue_depth == 0


@same_on_every_cpu
def test_a_waiting_request_keeps_the_prefix_cache_it_cannot_use(loaded):
    """While running sequences hold the budget, a waiting request does not empty the prefix
    cache (giving it up would not make room); kept caches count with their capacity."""
    params = SamplingParams(temperature=0, max_new_tokens=30)
    engine = Engine(loaded)
    first = chat_ids(engine.tokenizer, QUESTIONS[0])
    list(engine.complete(first, params))  # leaves one kept cache
    kept = engine.prefix_cache.held_positions()
    assert len(engine.prefix_cache.entries) == 1 and kept >= len(first) + 30
    second = chat_ids(engine.tokenizer, "Repeat the word 'apple' forever.")  # no early end
    third = chat_ids(engine.tokenizer, QUESTIONS[2])
    running = len(second) + 200
    engine.scheduler.kv_budget = running + kept  # the kept cache and one long request fit
    assert running + len(third) + kept + 40 > engine.scheduler.kv_budget
    long_run = engine.complete(second, params.replace(max_new_tokens=200), reuse_prefix=False)
    next(long_run)  # running: it holds the rest of the budget
    waiting = engine.complete(third, params.replace(max_new_tokens=kept + 40), reuse_prefix=False)
    assert engine.run_on_worker(lambda: len(engine.scheduler.waiting)) == 1
    assert len(engine.prefix_cache.entries) == 1  # not given up in vain
    list(long_run)
    assert list(waiting)[-1].done
    assert engine.scheduler.peak_kv <= engine.scheduler.kv_budget


@same_on_every_cpu
def test_bad_token_ids_and_a_dropped_stream(engine):
    params = SamplingParams(temperature=0, max_new_tokens=40)
    with pytest.raises(ValueError, match="token id 999999 is out of range"):
        engine.complete([1, 2, 999999], params)
    stream = engine.complete(chat_ids(engine.tokenizer, QUESTIONS[3]), params, reuse_prefix=False)
    cancel = stream.cancel
    del stream  # never read: dropping it cancels the request
    assert cancel.is_set()
    engine.run_on_worker(lambda: None)  # a step later
    deadline = __import__("time").time() + 30
    while engine.queue_depth and __import__("time").time() < deadline:
        engine.run_on_worker(lambda: None)
    assert engine.queue_depth == 0


# -- a pass's rows sampled together (sampling.sample_rows) -------------------------------------

TOGETHER = [
    dict(temperature=0.7, top_k=50, top_p=0.95, repetition_penalty=1.1),  # balanced
    dict(temperature=1.0, top_k=80, top_p=0.98, min_p=0.02, repetition_penalty=1.15),
    dict(temperature=0.8, top_k=40, top_n_sigma=1.5, typical_p=0.9, logit_bias={3: 2.5, 9: -100}),
    dict(
        temperature=0.9,
        top_k=30,
        samplers=["top_k", "penalties", "temperature"],
        repetition_penalty=1.3,
    ),  # the penalty after top-k: the block widens back
    dict(temperature=0, repetition_penalty=1.2, logit_bias={0: -100, 1: -100, 2: 4.0}),
    dict(temperature=0.9, top_k=0, top_p=0.9, min_p=0.05),  # top-p first: ragged rows
]


def _rows(seed, rows, width=4096):
    """Logits as a pass gives them, the ids so far (of different lengths), and now and then a
    row tied at the 40th token, or one whose only finite logits are ones a bias bans."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=gen) * 3
    if seed % 3 == 0:
        logits[rows // 2, :45] = 9.0  # ties at the k-th: that row goes the whole-width way
    if seed % 4 == 1:
        logits[-1] = float("-inf")
        logits[-1, 9] = 1.0  # only token 9, which the third setting bans
    previous = [torch.randint(0, width, (1, 5 + 17 * r), generator=gen) for r in range(rows)]
    return logits, previous


@pytest.mark.parametrize("setting", range(len(TOGETHER)))
def test_rows_sampled_together_get_the_token_each_gets_alone(monkeypatch, setting):
    """sample_rows over a block of rows (the scheduler's, for streams sharing their settings)
    against `sample` on each row alone with the same generator: the same token, or the same
    NoTokenAllowed, and the generator left in the same state. Rows the block cannot carry
    (ties at the k-th, top-p's ragged rows) go on by themselves from where the block left
    them, never from the start again."""
    params = SamplingParams(**TOGETHER[setting], seed=1)
    key = sampling.batch_key(params)
    assert key is not None
    assert sampling.batch_key(params.replace(seed=9, stop=["\n"], max_new_tokens=7)) == key
    assert sampling.batch_key(params.replace(repetition_penalty=1.01)) != key
    sample = sampling.sample
    for seed in range(12):
        rows = 1 + seed % 9
        logits, previous = _rows(seed, rows)
        alone_gens = [make_generator(100 + r) for r in range(rows)]
        block_gens = [make_generator(100 + r) for r in range(rows)]
        want = []
        for r in range(rows):
            try:
                want.append(sample(logits[r : r + 1], params, previous[r], alone_gens[r]))
            except NoTokenAllowed as e:
                want.append(e)
        monkeypatch.setattr(sampling, "sample", None)  # the block never starts a row over
        before = logits.clone()
        got = sampling.sample_rows(
            logits, params, previous, block_gens, [SamplerState() for _ in range(rows)]
        )
        monkeypatch.setattr(sampling, "sample", sample)
        assert torch.equal(logits, before)  # the pass's logits (the inspector's) untouched
        for r in range(rows):
            if isinstance(want[r], NoTokenAllowed):
                assert isinstance(got[r], NoTokenAllowed), (seed, r)
            else:
                assert torch.equal(got[r].reshape(-1), want[r].reshape(-1)), (seed, r)
            assert torch.equal(block_gens[r].get_state(), alone_gens[r].get_state())


def test_each_block_stage_gives_a_row_the_numbers_it_gets_alone():
    """Every stage sample_rows runs over a block (sampling.BLOCK) against its function on each
    row alone, bit for bit, on full rows and on the few tokens top-k keeps, with removed
    (-inf) tokens among them: the claim sample_rows rests on, on this CPU's kernels."""
    settings = dict(
        logit_bias={5: -100, 7: 1.5},
        penalties=dict(repetition_penalty=1.3),
        temperature=dict(temperature=0.7),
        top_k=dict(top_k=9),
        top_p=dict(top_p=0.8),
        min_p=dict(min_p=0.05),
        top_n_sigma=dict(top_n_sigma=1.0),
        typ_p=dict(typical_p=0.7),
    )
    assert set(sampling.BLOCK) == set(settings)
    gen = torch.Generator().manual_seed(5)
    for key, values in settings.items():
        own = {"logit_bias": values} if key == "logit_bias" else values
        params = SamplingParams(**{"temperature": 0.9, **own})
        for rows, width in ((1, 50), (3, 50), (8, 50), (9, 4096), (8, 49152)):
            x = torch.randn(rows, width, generator=gen) * 4
            x[torch.rand(rows, width, generator=gen) < 0.1] = float("-inf")
            previous = [
                torch.randint(0, width, (1, 3 + 11 * r), generator=gen) for r in range(rows)
            ]
            call = sampling.Call(params, None, None, SamplerState(), False)
            got = sampling.BLOCK[key](x.clone(), call, previous)
            for r in range(rows):
                one = sampling.Call(params, previous[r], None, SamplerState(), False)
                want = sampling.APPLY[key](x[r : r + 1], one)
                assert torch.equal(got[r : r + 1], want), (key, rows, width, r)


def test_rows_with_draws_or_state_of_their_own_sample_one_at_a_time():
    """A stage without a block function (its own draw, a state, Python a row) or an output
    format keeps its rows out of a block: batch_key is None for them."""
    from miniserve.core.config import Constraint  # noqa: PLC0415

    for own in (
        dict(xtc_probability=0.5, xtc_threshold=0.1),
        dict(mirostat=2),
        dict(dry_multiplier=0.8),
        dict(presence_penalty=0.5),
    ):
        assert sampling.batch_key(SamplingParams(temperature=0.8, **own)) is None, own
    fmt = SamplingParams(temperature=0.8, constraint=Constraint("json_object"))
    assert sampling.batch_key(fmt) is None
    assert sampling.batch_key(SamplingParams(temperature=0.8)) is not None
