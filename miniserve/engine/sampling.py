"""Choosing the next token: pure functions over a logits tensor.

Each stage takes logits of shape (..., vocab) and returns new logits in which removed tokens
are -inf. They are applied in one order (`stages`, which the sampler and the token inspector
both run):

    logit bias -> repetition penalty -> grammar mask -> temperature -> top-k -> top-p -> min-p
    -> softmax -> draw

Temperature 0 means greedy: the argmax after the grammar mask, no softmax. The grammar mask
(miniserve/engine/grammar.py) keeps only the tokens that can continue text the grammar accepts; when
it and the logit bias leave no token at all, `NoTokenAllowed` is raised.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from miniserve.core.config import SamplingParams
from miniserve.core.errors import UserError

NEG_INF = float("-inf")
BAN = -100.0  # a logit bias of -100 removes the token (as OpenAI documents it)
# Below this a temperature divides logits (at most ~1e4 in size) past float32's 3e38; any
# temperature above it scales them as it always has.
TINY_TEMPERATURE = 1e-30


class NoTokenAllowed(UserError, RuntimeError):
    """The grammar mask and the logit bias together left no token to choose."""


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """Add a bias to chosen tokens' logits; -100 bans a token (its logit becomes -inf)."""
    if not bias:
        return logits
    ids = torch.tensor([i for i, _ in bias], dtype=torch.long, device=logits.device)
    values = torch.tensor(
        [NEG_INF if b <= BAN else b for _, b in bias], dtype=logits.dtype, device=logits.device
    )
    return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], -1))


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Keep the tokens `allowed` (a bool tensor over the vocabulary) allows. None: all."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, NEG_INF)


def apply_repetition_penalty(
    logits: torch.Tensor, previous_ids: torch.Tensor | None, penalty: float
) -> torch.Tensor:
    """Make tokens already in `previous_ids` less likely (CTRL paper, as transformers does).

    A seen token's positive score is divided by `penalty`, a negative one multiplied,
    so a penalty > 1 always lowers it.
    """
    if penalty == 1.0 or previous_ids is None or previous_ids.numel() == 0:
        return logits
    ids = previous_ids.reshape(*logits.shape[:-1], -1)
    seen = torch.gather(logits, -1, ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, ids, seen)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sharpen (t < 1) or flatten (t > 1) the distribution. t must be > 0 here."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to scale logits, got {temperature}")
    if temperature < TINY_TEMPERATURE:  # logits / t would overflow to inf (softmax to NaN):
        # the limit as t -> 0 instead: the best logits (ties kept) at 0, every other removed
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        return shifted.masked_fill(shifted < 0, NEG_INF)
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest-scoring tokens (ties with the k-th are kept too). k = 0: off."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth_best = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_best, NEG_INF)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose total probability reaches p.

    A token is dropped when the tokens ranked above it already hold >= p of the mass.
    The most likely token is always kept. p = 1: off.
    """
    if p >= 1.0:
        return logits
    # Only tokens still in the running need ranking: after top-k that is k of the ~50,000
    # (-inf ones hold no probability, so they are dropped either way). Ranking k with topk
    # instead of sorting the whole vocabulary took a sampled step from ~4 ms to ~1 ms here.
    alive = int(torch.isfinite(logits).sum(dim=-1).max())
    sorted_logits, order = torch.topk(logits, max(alive, 1), dim=-1, sorted=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_above >= p
    drop_sorted[..., 0] = False
    drop = torch.ones_like(logits, dtype=torch.bool).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the top token's probability. 0: off."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, NEG_INF)


def stages(
    logits: torch.Tensor,
    params: SamplingParams,
    previous_ids: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(stage name, logits after it) for each stage that is on, in the one sampling order.
    Greedy (temperature 0) ends with the grammar mask: the argmax is taken there."""
    if params.logit_bias:
        logits = apply_logit_bias(logits, params.logit_bias)
        yield "logit bias", logits
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, previous_ids, params.repetition_penalty)
        yield "repetition penalty", logits
    if allowed is not None:
        logits = apply_mask(logits, allowed)
        yield "grammar", logits
    if params.greedy:
        return
    for name, stage, value in (
        ("temperature", apply_temperature, params.temperature),
        ("top-k", top_k_filter, params.top_k),
        ("top-p", top_p_filter, params.top_p),
        ("min-p", min_p_filter, params.min_p),
    ):
        logits = stage(logits, value)
        yield name, logits


def filter_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    previous_ids: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """All of the stages, in order: the logits the draw (or the argmax) sees."""
    out = logits  # no stage applies: the logits as they are
    for _, out in stages(logits, params, previous_ids, allowed):  # noqa: B007 -- the last
        pass
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private random stream for one request, so a seed reproduces it exactly."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    previous_ids: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Choose one token per row of `logits` (shape (B, vocab)); returns ids of shape (B,).
    `allowed`: the grammar's mask (bool, same shape), or None."""
    constrained = allowed is not None or bool(params.logit_bias)
    if params.greedy:  # no softmax needed: the argmax of the logits is the argmax of the probs
        logits = filter_logits(logits, params, previous_ids, allowed)
        if constrained and not torch.isfinite(logits).any(dim=-1).all():
            raise NoTokenAllowed("the grammar and the logit bias allow no token")
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float(), params, previous_ids, allowed)
    if constrained and not torch.isfinite(logits).any(dim=-1).all():
        raise NoTokenAllowed("the grammar and the logit bias allow no token")
    probs = logits.softmax(dim=-1)
    if probs.shape[0] == 1:  # draw among the tokens left: the same distribution, ~10x cheaper
        left = probs[0].nonzero().squeeze(-1)  # than a draw over all ~50,000 (1 ms here)
        pick = torch.multinomial(probs[0, left], num_samples=1, generator=generator)
        return left[pick]
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
