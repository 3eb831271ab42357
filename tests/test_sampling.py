"""Sampling filters against their definitions and against transformers' own warpers."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from miniserve.core.config import SamplingParams
from miniserve.engine import sampling
from miniserve.engine.sampling import (
    apply_repetition_penalty,
    apply_temperature,
    make_generator,
    min_p_filter,
    sample,
    top_k_compact,
    top_k_filter,
    top_p_filter,
)

VOCAB = 1000


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(1234)
    return torch.randn(4, VOCAB, generator=g) * 3


def kept(x):
    return torch.isfinite(x)


@pytest.mark.parametrize("k", [1, 5, 50, 999])
def test_top_k_keeps_exactly_the_k_best(logits, k):
    out = top_k_filter(logits, k)
    assert (kept(out).sum(-1) == k).all()
    best = torch.topk(logits, k).indices
    for row in range(logits.shape[0]):
        assert set(kept(out[row]).nonzero().flatten().tolist()) == set(best[row].tolist())
    assert torch.equal(out[kept(out)], logits[kept(out)])  # survivors unchanged


def test_top_k_off_and_larger_than_vocab(logits):
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, VOCAB * 10), logits)


# 0.97, not 0.99: with these logits a token's mass lies 9e-8 from 0.99, below float32's
# rounding of the sums, where either answer is right
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.97])
def test_top_p_keeps_the_smallest_set_reaching_p(logits, p):
    # the definition sums the masses in another order than top_p_filter: equal sets where no
    # token sits within rounding of the cut-off
    assert boundary_margin(logits, "top_p", p) > 1e-5, "a token sits on the cut-off"
    out = top_p_filter(logits, p)
    probs = logits.softmax(-1)
    for row in range(logits.shape[0]):
        order = probs[row].argsort(descending=True)
        cumulative = probs[row][order].cumsum(0)
        n = int((cumulative < p).sum()) + 1  # smallest prefix whose mass reaches p
        expected = set(order[:n].tolist())
        assert set(kept(out[row]).nonzero().flatten().tolist()) == expected
        assert probs[row][list(expected)].sum() >= p


def test_top_p_one_is_off_and_top_token_always_kept(logits):
    assert torch.equal(top_p_filter(logits, 1.0), logits)
    out = top_p_filter(logits, 1e-9)
    assert (kept(out).sum(-1) == 1).all()
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_definition(logits, min_p):
    out = min_p_filter(logits, min_p)
    probs = logits.softmax(-1)
    expected = probs >= min_p * probs.max(-1, keepdim=True).values
    assert torch.equal(kept(out), expected)


def test_repetition_penalty_definition():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]
    assert torch.equal(apply_repetition_penalty(logits, torch.tensor([0]), 1.0), logits)


def boundary_margin(logits, case, p=0.9, min_p=0.1) -> float:
    """How far, in probability mass, the nearest token is from the top-p / min-p cut-off."""
    probs = logits.double().softmax(-1)
    if case == "top_p":
        ranked = probs.sort(dim=-1, descending=True).values
        return float((ranked.cumsum(-1) - ranked - p).abs().min())
    if case == "min_p":
        return float((probs - min_p * probs.amax(-1, keepdim=True)).abs().min())
    return float("inf")  # temperature, top-k, repetition: the same operations on each value


@pytest.mark.parametrize("case", ["temperature", "top_k", "top_p", "min_p", "repetition"])
def test_matches_transformers_warpers(logits, case):
    ids = torch.randint(0, VOCAB, (4, 30), generator=torch.Generator().manual_seed(7))
    ours, theirs = {
        "temperature": (apply_temperature(logits, 0.6), TemperatureLogitsWarper(0.6)(ids, logits)),
        "top_k": (top_k_filter(logits, 40), TopKLogitsWarper(40)(ids, logits)),
        "top_p": (top_p_filter(logits, 0.9), TopPLogitsWarper(0.9)(ids, logits)),
        "min_p": (min_p_filter(logits, 0.1), MinPLogitsWarper(0.1)(ids, logits)),
        "repetition": (
            apply_repetition_penalty(logits, ids, 1.3),
            RepetitionPenaltyLogitsProcessor(1.3)(ids, logits),
        ),
    }[case]
    # The same tokens kept: exact where no token lies within rounding of a cut-off (our top-p
    # and min-p compute their masses in another order than transformers, and softmax rounds
    # differently per CPU). These logits have none nearer than 1e-5; say so if that changes.
    assert boundary_margin(logits, case) > 1e-5, "a token sits on the cut-off: change the seed"
    assert torch.equal(kept(ours), kept(theirs))
    torch.testing.assert_close(ours[kept(ours)], theirs[kept(theirs)])


def test_greedy_is_argmax_and_ignores_the_generator(logits):
    params = SamplingParams(temperature=0, top_k=0, top_p=1.0)
    assert torch.equal(sample(logits, params), logits.argmax(-1))


def test_seeded_sampling_is_reproducible_and_seeds_differ(logits):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    flat = torch.zeros(1, VOCAB)  # uniform: any difference in the stream shows
    draws = lambda seed: [
        int(sample(flat, params, generator=g)) for g in [make_generator(seed)] for _ in range(20)
    ]
    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_sampled_tokens_come_only_from_the_filtered_set(logits):
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0)
    g = make_generator(0)
    allowed = torch.topk(logits, 3).indices
    for _ in range(50):
        tokens = sample(logits, params, generator=g)
        for row in range(logits.shape[0]):
            assert tokens[row] in allowed[row]


def test_one_row_draws_follow_the_filtered_distribution():
    """A single row (what the decode loop samples) is drawn among the tokens the filters left;
    the frequencies over many draws must match their softmax, token by token."""
    logits = torch.full((1, VOCAB), -2.0)
    chosen = torch.tensor([3, 250, 251, 700, 998])  # scattered: indices must map back right
    logits[0, chosen] = torch.tensor([2.0, 1.0, 0.5, 0.0, 1.5])
    params = SamplingParams(temperature=1.0, top_k=5, top_p=1.0)
    expected = torch.zeros(VOCAB)
    expected[chosen] = logits[0, chosen].softmax(-1)
    g = make_generator(7)
    counts = torch.zeros(VOCAB)
    n = 20000
    for _ in range(n):
        token = sample(logits, params, generator=g)
        assert token.shape == (1,)
        counts[int(token)] += 1
    assert torch.allclose(counts / n, expected, atol=0.015)


def test_one_draw_over_blocks_follows_the_probabilities_and_never_picks_a_zero():
    """draw_one: a block of 1,024 by the blocks' running total, then a token in it. Over a row
    of 2,500 (a short last block) with its mass spread over every block, some of it tiny, and
    zeros between: the frequencies match, token by token; a zero is never drawn; a seed draws
    the same; a row without a positive total (or with a NaN) is left to torch.multinomial."""
    probs = torch.zeros(1, 2500)
    chosen = torch.tensor([0, 1023, 1024, 1500, 2047, 2048, 2499])
    probs[0, chosen] = torch.tensor([0.2, 0.1, 0.15, 0.05, 0.25, 0.1, 0.15])
    probs[0, 10:20] = 1e-30  # subnormal-sized neighbours: drawn next to never, never a fault
    g = make_generator(11)
    n = 20000
    draws = [int(sampling.draw_one(probs, g)) for _ in range(n)]
    counts = torch.bincount(torch.tensor(draws), minlength=2500).float()
    assert set(draws) <= set(chosen.tolist()) | set(range(10, 20))
    assert torch.allclose(counts / n, probs[0] / probs.sum(), atol=0.012)
    again = make_generator(11)
    assert [int(sampling.draw_one(probs, again)) for _ in range(50)] == draws[:50]
    assert sampling.draw_one(torch.zeros(1, 5), g) is None
    assert sampling.draw_one(torch.tensor([[0.5, float("nan")]]), g) is None


def test_a_tiny_positive_temperature_is_the_argmax_not_nan():
    """A temperature far below any useful one (an API fuzzer sent 2.6e-201) would divide the
    logits past float32's range; it gives the argmax with all the mass, not a server error."""
    from miniserve.engine.sampling import apply_temperature

    logits = torch.tensor([[1.0, 3.0, 2.5, float("-inf")]])
    for t in (2.6e-201, 1e-40, 1e-31):
        probs = torch.softmax(apply_temperature(logits, t), dim=-1)
        assert not probs.isnan().any() and probs[0, 1] == 1.0
    assert torch.equal(apply_temperature(logits, 0.5), logits / 0.5)  # the usual arithmetic


def nucleus(row: torch.Tensor, p: float) -> list[int]:
    """top-p's definition in float64: the smallest set of the most likely tokens (ties: the
    lower id first) whose probability reaches p; ids ascending."""
    probs = row[0].double().softmax(-1)
    order = sorted(range(probs.shape[0]), key=lambda i: (-float(probs[i]), i))
    total, n = 0.0, 0
    while total < p:
        total += float(probs[order[n]])
        n += 1
    return sorted(order[:n])


def refuses_what_it_cannot_keep(compact, row, setting, off):
    """A compact stage's None, where the full-width filter must run: a NaN or +inf in the row,
    no finite logit, the stage off, more than one row."""
    for bad in (float("nan"), float("inf")):
        broken = row.clone()
        broken[0, 7] = bad
        assert compact(broken, setting) is None
    assert compact(torch.full((1, 10), float("-inf")), setting) is None
    assert compact(row, off) is None
    assert compact(row.repeat(2, 1), setting) is None


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.97])
@pytest.mark.parametrize("case", ["peaked", "wide", "flat", "masked", "ties", "one"])
def test_top_p_compact_keeps_the_smallest_set_reaching_p(case, p, path, monkeypatch):
    """One row's top-p without ranking the whole vocabulary, through decode.cpp's top_p where
    the library is loaded, else numpy: the tokens of the definition (in float64), their logits
    unchanged, ids ascending, whether the nucleus is a few tokens or most of the vocabulary;
    None (the full-width filter) for a row without a finite logit or with a NaN.
    (top_p_filter's float32 running total may stop a token short of p where many small
    probabilities add up.)"""
    from miniserve.runners import native

    if path == "numpy":
        monkeypatch.setattr(native, "_lib", None)
    elif native.load() is None:
        pytest.skip("no native library in this leg (the full leg runs this case)")
    gen = torch.Generator().manual_seed(round(p * 100))
    vocab, scale = {"peaked": (50_000, 6.0), "wide": (50_000, 1.0), "flat": (50_000, 0.1)}.get(
        case, (50_000, 4.0)
    )

    def draw():
        row = torch.randn(1, vocab, generator=gen) * scale
        if case == "masked":
            row[0, torch.randperm(vocab, generator=gen)[:49_000]] = float("-inf")
        elif case == "ties":  # equal logits on either side of the cut-off
            row = torch.round(row * 2) / 2
        elif case == "one":
            row[0, 123] = 40.0
        return row

    row = draw()
    while case != "ties" and boundary_margin(row, "top_p", p) < 1e-7:  # a token on the cut-off
        row = draw()
    got = sampling.top_p_compact(row, p)
    assert got is not None
    ids, values = got
    assert torch.equal(ids, ids.sort(-1).values) and torch.equal(values, row.gather(-1, ids))
    assert ids[0].tolist() == nucleus(row, p)  # ties: the lower id first, as the definition's
    if case != "ties":  # the full-width filter (the inspector's, the Step view's): the same set
        assert ids[0].tolist() == kept(top_p_filter(row, p)[0]).nonzero().flatten().tolist()
    if case in ("wide", "flat") and p >= 0.5:
        assert ids.shape[-1] > 5_000  # much of the vocabulary
    refuses_what_it_cannot_keep(sampling.top_p_compact, row, p, off=1.0)


def test_a_top_p_draw_over_the_compact_row_is_the_full_width_draw(monkeypatch):
    """sample() over one row with top-p and no top-k draws from the compact row: the same
    tokens, seed for seed, as with the full-width top-p filter."""
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=0.9, min_p=0.01)
    row = torch.randn(1, 50_000, generator=gen) * 2.5
    while boundary_margin(row / 0.8, "top_p", 0.9) < 1e-6:  # a token on the cut-off: another
        row = torch.randn(1, 50_000, generator=gen) * 2.5
    compact = [int(sample(row, params, generator=make_generator(s))) for s in range(20)]
    monkeypatch.setitem(sampling.COMPACT, "top_p", lambda row, p: None)
    wide = [int(sample(row, params, generator=make_generator(s))) for s in range(20)]
    assert compact == wide and len(set(wide)) > 3


@pytest.mark.parametrize("min_p", [0.001, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("case", ["peaked", "flat", "masked", "ties"])
def test_min_p_compact_keeps_what_the_full_width_filter_keeps(case, min_p):
    """One row's min-p as the tokens it keeps (ids ascending, their logits unchanged): the set
    min_p_filter keeps, away from the cut-off (a token on it may go either way in float32);
    None for a row without a finite logit, with a NaN or +inf, or min-p off."""
    gen = torch.Generator().manual_seed(round(min_p * 1000))
    scale = {"peaked": 6.0, "flat": 0.3}.get(case, 3.0)

    def draw():
        row = torch.randn(1, 50_000, generator=gen) * scale
        if case == "masked":
            row[0, torch.randperm(50_000, generator=gen)[:49_000]] = float("-inf")
        elif case == "ties":  # equal logits, the largest among them
            row = torch.round(row)
        return row

    row = draw()  # (min-p 1 keeps the largest and its ties: no token near that cut-off)
    while case != "ties" and min_p < 1 and boundary_margin(row, "min_p", min_p=min_p) < 1e-9:
        row = draw()
    got = sampling.min_p_compact(row, min_p)
    assert got is not None
    ids, values = got
    assert torch.equal(ids, ids.sort(-1).values) and torch.equal(values, row.gather(-1, ids))
    assert ids[0].tolist() == kept(min_p_filter(row, min_p)[0]).nonzero().flatten().tolist()
    if case == "flat" and min_p <= 0.05:
        assert ids.shape[-1] > 10_000  # much of the vocabulary
    refuses_what_it_cannot_keep(sampling.min_p_compact, row, min_p, off=0.0)


def test_a_min_p_draw_over_the_compact_row_is_the_full_width_draw(monkeypatch):
    """sample() over one row with min-p and no top-k or top-p draws from the compact row: the
    same tokens, seed for seed, as with the full-width min-p filter."""
    gen = torch.Generator().manual_seed(6)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.05)
    row = torch.randn(1, 50_000, generator=gen) * 2.5
    while boundary_margin(row / 0.8, "min_p", min_p=0.05) < 1e-9:
        row = torch.randn(1, 50_000, generator=gen) * 2.5
    compact = [int(sample(row, params, generator=make_generator(s))) for s in range(20)]
    monkeypatch.delitem(sampling.COMPACT, "min_p")
    wide = [int(sample(row, params, generator=make_generator(s))) for s in range(20)]
    assert compact == wide and len(set(wide)) > 3


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("case", ["plain", "masked", "ties", "nan"])
@pytest.mark.parametrize("k", [1, 40, 999])
def test_top_k_compact_on_the_cpu_keeps_what_torch_keeps(case, k, path, monkeypatch):
    # one float32 row on the CPU goes through decode.cpp's selection where the library is
    # loaded, else numpy: the same ids, values and dtypes as torch's topk, and the full-width
    # fallback (None) in the same cases
    from miniserve.runners import native

    if path == "numpy":
        monkeypatch.setattr(native, "_lib", None)
    elif native.load() is None:
        pytest.skip("no native library in this leg (the full leg runs this case)")
    gen = torch.Generator().manual_seed(k)
    row = torch.randn(1, 1000, generator=gen) * 3
    if case == "masked":  # fewer finite logits than k for the larger k
        row[0, torch.randperm(1000, generator=gen)[:990]] = float("-inf")
    elif case == "ties":
        row = torch.round(row)
    elif case == "nan":
        row[0, 7] = float("nan")
    got, want = top_k_compact(row, k), sampling._top_k_compact_torch(row, k)
    assert (got is None) == (want is None)
    if want is not None:
        assert torch.equal(got[0], want[0]) and got[0].dtype == want[0].dtype
        assert torch.equal(got[1], want[1])
    if case == "plain":
        assert got is not None  # the compact path itself ran
