"""Choosing the next token: pure functions over a logits tensor, one per declared stage.

The stages are declared in miniserve/core/samplers.py (their settings, order, labels); each
function here attaches to its declaration with `@applies(key)`. A stage takes logits of shape
(..., vocab) and returns new logits in which removed tokens are -inf. They run in one order
(`stages`, which the sampler, the token inspector and the Step view all run):

    logit bias -> grammar mask -> [the order: repetition penalty -> DRY -> temperature ->
    top-nσ -> top-k -> typical-p -> top-p -> min-p -> XTC] -> (Mirostat) -> softmax -> draw

Temperature 0 means greedy: the argmax after the stages that move logits (bias, mask,
penalties), no softmax. The grammar mask (miniserve/engine/grammar.py) keeps only the tokens
that can continue text the grammar accepts; when it and the logit bias leave no token at all,
`NoTokenAllowed` is raised. XTC's draw comes from the reply's own generator; Mirostat's state
(mu) lives in the reply's `SamplerState`.

The scheduler samples the rows of a pass that share their settings together (`sample_rows`): the
stages with a block function (`BLOCK`) run once over the rows, each row's numbers exactly
those it gets alone, and each row draws from its own generator. A stage declared without one
(its own draws, a state, Python a row) has its rows sampled one at a time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from miniserve.core.config import SamplingParams
from miniserve.core.errors import UserError
from miniserve.core.samplers import running
from miniserve.runners import native

NEG_INF = float("-inf")
BAN = -100.0  # a logit bias of -100 removes the token (as OpenAI documents it)
# Below this a temperature divides logits (at most ~1e4 in size) past float32's 3e38; any
# temperature above it scales them as it always has.
TINY_TEMPERATURE = 1e-30


class NoTokenAllowed(UserError, RuntimeError):
    """The grammar mask and the logit bias together left no token to choose."""


NO_TOKEN = "the grammar and the logit bias allow no token"


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """Add a bias to chosen tokens' logits; -100 bans a token (its logit becomes -inf)."""
    return add_logit_bias_(logits.clone(), bias) if bias else logits


def add_logit_bias_(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """apply_logit_bias in place (sample_rows' own block)."""
    if not bias:
        return logits
    ids, values = _bias_tensors(bias, logits.dtype, logits.device)
    return logits.index_add_(-1, ids, values.expand(*logits.shape[:-1], -1))


_BIAS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _bias_tensors(bias, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A logit bias's ids and values as tensors, made once per bias (a reply's every step, or
    the bench's streams, add the same one)."""
    key = (bias, dtype, str(device))
    if key not in _BIAS:
        if len(_BIAS) >= 256:
            _BIAS.clear()
        ids = torch.tensor([i for i, _ in bias], dtype=torch.long, device=device)
        values = torch.tensor(
            [NEG_INF if b <= BAN else b for _, b in bias], dtype=dtype, device=device
        )
        _BIAS[key] = ids, values
    return _BIAS[key]


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
    return logits.scatter(-1, ids, _penalized(torch.gather(logits, -1, ids), penalty))


def _penalized(seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Seen tokens' logits after the repetition penalty: positive ones divided, negative ones
    multiplied."""
    return torch.where(seen < 0, seen * penalty, seen / penalty)


def repetition_penalty_rows_(
    logits: torch.Tensor, previous: list[torch.Tensor | None], penalty: float
) -> torch.Tensor:
    """apply_repetition_penalty in place on each row of `logits` (B, vocab, contiguous) with
    its own ids so far (any lengths): the rows as one long row, each row's ids shifted to its
    place; every logit gets the operation it gets in its row alone."""
    width = logits.shape[-1]
    shifted = [ids.reshape(-1) + r * width for r, ids in enumerate(previous) if ids is not None]
    if penalty == 1.0 or not shifted:
        return logits
    flat, ids = logits.view(-1), torch.cat(shifted)
    flat.scatter_(0, ids, _penalized(flat.gather(0, ids), penalty))
    return logits


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
    # float64 running totals: float32 ones stop a token or two short of p where thousands of
    # small probabilities add up (the set top_p_compact finds is the float64 one too)
    probs = sorted_logits.double().softmax(dim=-1)
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


# -- the stages' functions, attached to their declarations (miniserve/core/samplers.py) --------


@dataclass
class SamplerState:
    """One reply's sampling state: Mirostat's mu, the random draws the last step's stages made
    (so that the inspector shows what the draw saw), and the text of tokens (DRY's sequence
    breakers; None: no breakers). `snapshot`/`restore` make the Step view's Back exact."""

    text_of: Callable[[int], str] | None = None
    vocab: int = 0
    mu: float | None = None
    draws: dict = field(default_factory=dict)
    # where the reply's own tokens start in the ids a stage sees (the presence stage counts
    # those); None: the ids the stage first sees are the prompt
    prompt_len: int | None = None

    def snapshot(self) -> float | None:
        """What carries from one step to the next (the draws are the last step's own)."""
        return self.mu

    def restore(self, snap: float | None) -> None:
        self.mu = snap


@dataclass
class Call:
    """What a stage sees besides the logits."""

    params: SamplingParams
    previous_ids: torch.Tensor | None
    generator: torch.Generator | None
    state: SamplerState
    replay: bool  # show what the last draw saw: reuse its random draws, draw nothing

    def draw(self, key: str, make: Callable[[], float]) -> float:
        if self.replay and key in self.state.draws:
            return self.state.draws[key]
        value = make()
        self.state.draws[key] = value
        return value


APPLY: dict[str, Callable[[torch.Tensor, Call], torch.Tensor]] = {}
AFTER_DRAW: dict[str, Callable[[Call, torch.Tensor, int], None]] = {}
ID_FREE: set[str] = set()  # stages that never read which token a column is
# Stages that run once over a block of rows sharing their settings (`sample_rows`), each row
# getting exactly the numbers it gets alone: fn(block, call, each row's ids so far); the block
# is sample_rows' own, so fn may change it in place.
BLOCK: dict[str, Callable[[torch.Tensor, Call, list], torch.Tensor]] = {}


def applies(key: str, after_draw=None, id_free: bool = False, block=None):
    """Attach a function over the logits to the declared stage `key` (and, for a stage with
    state, what it does once the token is drawn: `after_draw(call, final probs, token)`).
    `id_free`: it treats the columns alike whatever tokens they are (temperature, the
    truncations), so it may run on the few tokens a truncation left (see `sample`).
    `block`: True where the function itself takes a block of rows (B, width) and gives each
    row what it gives the row alone (elementwise work, or reductions along a row), or the
    block's own function `fn(block, call, previous ids a row)`; None: rows with this stage on
    are sampled one at a time (a draw, a state, per-row work in Python)."""

    def attach(fn):
        APPLY[key] = fn
        if after_draw is not None:
            AFTER_DRAW[key] = after_draw
        if id_free:
            ID_FREE.add(key)
        if block is True:
            BLOCK[key] = lambda x, call, previous: fn(x, call)
        elif block is not None:
            BLOCK[key] = block
        return fn

    return attach


@applies("logit_bias", block=lambda x, call, previous: add_logit_bias_(x, call.params.logit_bias))
def _bias(logits, call):
    return apply_logit_bias(logits, call.params.logit_bias)


@applies(
    "penalties",
    block=lambda x, call, previous: repetition_penalty_rows_(
        x, previous, call.params.repetition_penalty
    ),
)
def _penalties(logits, call):
    return apply_repetition_penalty(logits, call.previous_ids, call.params.repetition_penalty)


@applies("presence")
def _presence(logits, call):
    """OpenAI's formula over the tokens this reply has chosen (its first step saw the prompt
    alone: `state.prompt_len`): logit - frequency x count - presence x (count > 0)."""
    p, ids = call.params, call.previous_ids
    if ids is None:
        return logits
    rows = ids.reshape(*logits.shape[:-1], -1)
    if call.state.prompt_len is None:
        call.state.prompt_len = rows.shape[-1]
    reply = rows[..., call.state.prompt_len :]
    if reply.numel() == 0:
        return logits
    counts = torch.zeros_like(logits).scatter_add_(
        -1, reply, torch.ones(reply.shape, dtype=logits.dtype, device=logits.device)
    )
    return (
        logits - counts * p.frequency_penalty - (counts > 0).to(logits.dtype) * p.presence_penalty
    )


@applies("xtc", id_free=True)
def _xtc(logits, call):
    p = call.params
    rows = logits.reshape(-1, logits.shape[-1])
    out = []
    for r, row in enumerate(rows):
        if int(torch.isfinite(row).sum()) < 2:  # as llama.cpp: no draw below two tokens
            out.append(row)
            continue
        chance = call.draw(f"xtc{r}", lambda: float(torch.rand((), generator=call.generator)))
        out.append(row if chance > p.xtc_probability else xtc_cut(row, p.xtc_threshold))
    return torch.stack(out).reshape(logits.shape)


@applies("dry")
def _dry(logits, call):
    p = call.params
    if call.previous_ids is None:
        return logits
    rows = logits.reshape(-1, logits.shape[-1])
    ids = call.previous_ids.reshape(rows.shape[0], -1).tolist()
    breakers = breaker_ids(call.state, p.dry_sequence_breakers)
    out = rows.clone()
    for r, row_ids in enumerate(ids):
        penalties = dry_penalties(
            row_ids,
            breakers,
            p.dry_multiplier,
            p.dry_base,
            p.dry_allowed_length,
            p.dry_penalty_last_n,
        )
        if penalties:
            tokens = torch.tensor(list(penalties), dtype=torch.long, device=rows.device)
            values = torch.tensor(list(penalties.values()), dtype=rows.dtype, device=rows.device)
            out[r] = out[r].index_add(0, tokens, -values)
    return out.reshape(logits.shape)


def _mirostat_after(call, probs, token):
    state, p = call.state, call.params
    mu = state.draws.get("mirostat", 2 * p.mirostat_tau)
    surprise = -math.log2(max(float(probs.reshape(-1, probs.shape[-1])[0, token]), 1e-45))
    state.mu = mu - p.mirostat_eta * (surprise - p.mirostat_tau)


@applies("mirostat", after_draw=_mirostat_after, id_free=True)
def _mirostat(logits, call):
    state, p = call.state, call.params
    mu = call.draw("mirostat", lambda: state.mu if state.mu is not None else 2 * p.mirostat_tau)
    return mirostat_cut(logits, mu)


def top_n_sigma_filter(logits: torch.Tensor, n: float) -> torch.Tensor:
    """Keep the tokens whose logit is at least max - n x the standard deviation of the logits
    (the finite ones, population deviation), as llama.cpp's top-nσ. n <= 0: off."""
    if n <= 0:
        return logits
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True)
    if int(count.max()) <= 1:
        return logits
    x = logits.masked_fill(~finite, 0.0)
    mean = x.sum(dim=-1, keepdim=True) / count
    var = ((x - mean) ** 2).masked_fill(~finite, 0.0).sum(dim=-1, keepdim=True) / count
    top = logits.amax(dim=-1, keepdim=True)
    # a row with one finite logit or none keeps what it has (each row decides for itself)
    return logits.masked_fill((logits < top - n * var.sqrt()) & (count > 1), NEG_INF)


def typical_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al.), as llama.cpp's: rank tokens by how far their
    surprise is from the distribution's entropy, keep them in that order until their mass
    exceeds p. p = 1: off."""
    if p >= 1.0:
        return logits
    probs = logits.softmax(dim=-1)
    logp = torch.log(probs)
    entropy = -(probs * logp).nan_to_num(0.0).sum(dim=-1, keepdim=True)
    shifted = (-logp - entropy).abs()  # inf for removed tokens: ranked last
    order = shifted.argsort(dim=-1, stable=True)
    cum = probs.gather(-1, order).cumsum(dim=-1)
    # the first place where the mass exceeds p is the last kept (none: all kept)
    over = cum > p
    first = torch.where(over.any(-1), over.int().argmax(-1), over.shape[-1] - 1)
    keep_sorted = torch.arange(order.shape[-1], device=logits.device) <= first.unsqueeze(-1)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, NEG_INF)


def xtc_cut(row: torch.Tensor, threshold: float) -> torch.Tensor:
    """XTC's removal on one row: of the tokens at least `threshold` likely, all but the least
    likely go (nothing when fewer than two reach it)."""
    probs = row.softmax(-1)
    above = int((probs >= threshold).sum())
    if above < 2:
        return row
    top = torch.topk(probs, above).indices[: above - 1]
    return row.index_fill(0, top, NEG_INF)


def mirostat_cut(logits: torch.Tensor, mu: float) -> torch.Tensor:
    """Mirostat v2's truncation: drop tokens whose surprise (-log2 p) exceeds mu, keeping the
    most likely one at least."""
    probs = logits.softmax(dim=-1)
    drop = -torch.log2(probs) > mu
    best = probs.argmax(dim=-1, keepdim=True)
    drop = drop.scatter(-1, best, False)
    return logits.masked_fill(drop, NEG_INF)


def _temperature_block(x, call, previous):
    """The temperature over a block in place: before top-k it meets every logit of every row,
    and torch's division of a block that size runs on two threads that wait for a core
    (see _working_copy); numpy's divides by the same float32 on this thread alone."""
    t = call.params.temperature
    if t == 1.0 or t < TINY_TEMPERATURE or not _numpy_can_read(x):
        return apply_temperature(x, t)
    a = x.detach().numpy()
    np.divide(a, np.float32(t), out=a)
    return x


# The stages whose function takes the logits and one of their settings (columns alike), and
# their block functions (True: the function itself).
for _key, _fn, _setting, _block in (
    ("temperature", apply_temperature, "temperature", _temperature_block),
    ("top_k", top_k_filter, "top_k", True),
    ("top_p", top_p_filter, "top_p", True),
    ("min_p", min_p_filter, "min_p", True),
    ("top_n_sigma", top_n_sigma_filter, "top_n_sigma", True),
    ("typ_p", typical_filter, "typical_p", True),
):
    applies(_key, id_free=True, block=_block)(
        lambda logits, call, fn=_fn, setting=_setting: fn(logits, getattr(call.params, setting))
    )


FLOAT_MAX_LOG = 88.7228391  # log(FLT_MAX): llama.cpp caps DRY's exponent there


def dry_penalties(
    ids: list[int],
    breakers: frozenset[int],
    multiplier: float,
    base: float,
    allowed: int,
    last_n: int,
) -> dict[int, float]:
    """DRY, as llama.cpp computes it: {token: penalty subtracted from its logit}.

    Over the last `last_n` ids (-1: all): the tail may extend back only to the latest
    sequence breaker. For every earlier place where the text so far ends the same way as the
    tail for L >= `allowed` tokens, the token that followed there would repeat L + 1 tokens:
    it loses multiplier x base^(L - allowed) (the longest L for each token)."""
    if multiplier == 0.0 or base < 1.0 or last_n == 0:
        return {}
    window = ids if last_n < 0 else ids[-last_n:]
    n = len(window)
    if n <= allowed:
        return {}
    limit = n
    for i in range(n):
        if window[n - 1 - i] in breakers:
            limit = i
            break
    if limit < allowed:
        return {}
    r = window[::-1]
    z = [0] * n  # z[i]: how far r[i:] agrees with r (the Z-function)
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and r[z[i]] == r[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    longest: dict[int, int] = {}
    for i in range(1, n):
        length = min(z[i], limit)
        if length >= allowed:
            token = window[n - i]
            if length > longest.get(token, -1):
                longest[token] = length
    cap = FLOAT_MAX_LOG / math.log(base) if base > 1.00001 else float("inf")
    return {t: multiplier * base ** min(length - allowed, cap) for t, length in longest.items()}


_BREAKERS: dict[tuple, frozenset[int]] = {}


def breaker_ids(state: SamplerState, breakers: tuple[str, ...]) -> frozenset[int]:
    """The tokens whose text holds one of DRY's sequence breakers (each token's own text; a
    breaker spread over several tokens is not matched). No tokenizer: none."""
    if not breakers or state.text_of is None or not state.vocab:
        return frozenset()
    key = (state.text_of, state.vocab, breakers)
    if key not in _BREAKERS:
        _BREAKERS[key] = frozenset(
            i for i in range(state.vocab) if any(b in (state.text_of(i) or "") for b in breakers)
        )
    return _BREAKERS[key]


def stages(
    logits: torch.Tensor,
    params: SamplingParams,
    previous_ids: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    state: SamplerState | None = None,
    generator: torch.Generator | None = None,
    replay: bool = False,
    run: list | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(stage label, logits after it) for each stage that runs, in the order
    (samplers.running): the logit bias and the grammar's mask first, then the request's order
    (default: today's); greedy keeps the stages that move logits, and its argmax is taken
    after them. `replay`: reuse the random draws the last real pass made (the inspector).
    `run`: running(params), where the caller has it."""
    call = Call(params, previous_ids, generator, state or SamplerState(), replay)
    if not replay:
        call.state.draws.clear()
    for stage in run if run is not None else running(params):
        if stage.key == "grammar":
            if allowed is None:
                continue
            logits = apply_mask(logits, allowed)
        else:
            logits = APPLY[stage.key](logits, call)
        yield stage.label, logits


def filter_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    previous_ids: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    state: SamplerState | None = None,
    generator: torch.Generator | None = None,
    run: list | None = None,
) -> torch.Tensor:
    """All of the stages, in order: the logits the draw (or the argmax) sees."""
    out = logits  # no stage applies: the logits as they are
    for _, out in stages(  # noqa: B007
        logits, params, previous_ids, allowed, state, generator, run=run
    ):
        pass
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private random stream for one request, so a seed reproduces it exactly."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def top_k_compact(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top-k as the few tokens it keeps: (their ids ascending, their logits), shape (1, k); None
    where the full-width filter must run (off, or ties with the k-th that it would keep too)."""
    if k <= 0 or k >= row.shape[-1]:
        return None
    if _numpy_can_read(row) and row.shape[0] == 1:
        return _top_k_compact_cpu(row, k)
    return _top_k_compact_torch(row, k)


def _numpy_can_read(t: torch.Tensor) -> bool:
    """A float32 tensor on the CPU: the sampler's numpy paths take it as it is."""
    return t.device.type == "cpu" and t.dtype == torch.float32


def _top_k_compact_torch(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top_k_compact in torch (other devices, dtypes, several rows)."""
    top = torch.topk(row, k, dim=-1)
    kth = top.values[..., -1:]
    if not bool(torch.isfinite(kth).all()) or int((row >= kth).sum()) != k:
        return None
    order = top.indices.argsort(dim=-1)
    return top.indices.gather(-1, order), top.values.gather(-1, order)


def _top_k_compact_cpu(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top_k_compact for one float32 row on the CPU: decode.cpp's one-pass selection where the
    library is loaded (~15 us over 49,152 logits), else numpy's partition and count (~1/3 of
    torch's topk and comparison, yet ~0.3 ms): the same ids and values, and None in the same
    cases (a k-th value that is not finite, or ties with it; a NaN among the k makes their
    least NaN)."""
    kept = native.top_k(row[0], k)
    if kept is not NotImplemented:
        return None if kept is None else (kept[0].unsqueeze(0), kept[1].unsqueeze(0))
    a = row.detach().numpy()[0]
    ids = np.argpartition(a, -k)[-k:]
    values = a[ids]
    kth = values.min()
    if not math.isfinite(kth) or int(np.count_nonzero(a >= kth)) != k:
        return None
    order = ids.argsort()
    return (
        torch.from_numpy(ids[order].astype(np.int64)).unsqueeze(0),
        torch.from_numpy(values[order].copy()).unsqueeze(0),
    )


TOP_P_SHIFT = 16  # top_p_compact's buckets: a probability's float32 bits shifted this far


def top_p_compact(row: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """top-p over one float32 row on the CPU as the tokens it keeps (their ids ascending, their
    logits), shape (1, n), without ranking the whole vocabulary (a full ranking of 151,936
    logits took ~13 ms a token here, a third of a Qwen3-1.7B step; OpenAI's API has no top-k,
    so its clients' top_p alone meets it). None where the full-width filter must run: off,
    another device or dtype, no finite logit, a NaN.

    The probabilities go into buckets by their float32 bits' top 16 (the bits of a positive
    float rise with it: 128 buckets an octave), each bucket's mass summed. Going down from the
    most likely bucket, the one where the mass above reaches p is the only one whose tokens
    need ranking (ties: the lower id first); every token above it is kept, every one below it
    dropped, as top_p_filter decides: a token stays while the tokens ranked above it hold less
    than p (the most likely always). decode.cpp's top_p does this where the library is loaded
    (~0.1 ms over a model's 49,152 logits, ~0.3 ms over flat ones); else numpy below (~0.3 ms,
    ~0.5 ms over 151,936, peaked or flat). The two agree but where a token lies on the cut-off
    to float32's last bits (their exps may differ there)."""
    if not 0.0 < p < 1.0 or row.shape[0] != 1 or not _numpy_can_read(row):
        return None  # (p <= 0: top_p_filter keeps the most likely alone)
    kept = native.top_p(row[0], p)  # decode.cpp's: the same rule, ~0.1 ms over 49,152
    if kept is None:
        return None
    a = row.detach().numpy()[0]
    if kept is not NotImplemented:  # the logits gathered by numpy, on this thread
        return kept.unsqueeze(0), torch.from_numpy(a[kept.numpy()]).unsqueeze(0)
    top = a.max()
    if not math.isfinite(top):  # no finite logit (or +inf), or a NaN among them
        return None
    e = np.exp(a - top)  # in [0, 1]: the most likely is 1
    bucket = (e.view(np.int32) >> TOP_P_SHIFT).astype(np.intp)
    mass = np.bincount(bucket, weights=e)  # float64
    need = p * mass.sum()
    above = np.cumsum(mass[::-1])[::-1] - mass  # the mass of the buckets above each
    k = int(np.flatnonzero((mass > 0) & (above < need))[0])  # the lowest bucket that may keep
    inside = np.flatnonzero(bucket == k)
    order = inside[np.argsort(-e[inside], kind="stable")]
    ranked = e[order].astype(np.float64)
    keep = bucket > k
    keep[order[above[k] + np.cumsum(ranked) - ranked < need]] = True
    ids = torch.from_numpy(np.flatnonzero(keep)).unsqueeze(0)
    return ids, row.gather(-1, ids)


def _filtered_row(row, params, run, previous_ids, allowed, state, generator, at=0, kept=None):
    """The stages over one row, as `stages` runs them, but from the first top-k (or a top-p or
    min-p before any: COMPACT) on over the tokens it kept only (ids ascending, so the draw sees the
    same vector as over the whole vocabulary); a stage that reads token ids widens the row
    back first. Returns (ids or None for the whole row, logits). `at`, `kept`: go on from
    stage `at` with (ids, logits) as the stages before it left them (sample_rows)."""
    call = Call(params, previous_ids, generator, state, False)
    if at == 0:
        state.draws.clear()
    ids, x = kept if kept is not None else (None, row)
    for stage in run[at:]:
        if ids is not None and stage.key not in ID_FREE:
            x = torch.full_like(row, NEG_INF).scatter(-1, ids, x)
            ids = None
        if stage.key == "grammar":
            if allowed is not None:
                x = apply_mask(x, allowed)
            continue
        if ids is None and stage.key in COMPACT:
            kept = COMPACT[stage.key](x, getattr(params, stage.key))
            if kept is not None:
                ids, x = kept
                continue
        x = APPLY[stage.key](x, call)
    return ids, x


def min_p_compact(row: torch.Tensor, min_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """min-p over one float32 row on the CPU as the tokens it keeps (their ids ascending, their
    logits), shape (1, n): a token stays while exp(logit - the largest) >= min_p, the ratio of
    its probability to the top one's, which is what min_p_filter compares without the
    softmax's division (float32 both: the two agree but where a token lies on the cut-off to
    the last bits). ~0.07 ms over 49,152 logits where the full-width filter and the stages
    after it took ~0.4 ms, ~1.6 ms over 151,936. None where the full-width filter must run:
    off, another device or dtype, no finite logit, a NaN or +inf."""
    if not 0.0 < min_p <= 1.0 or row.shape[0] != 1 or not _numpy_can_read(row):
        return None
    a = row.detach().numpy()[0]
    top = a.max()
    if not math.isfinite(top):  # no finite logit (or +inf), or a NaN among them
        return None
    ids = np.flatnonzero(np.exp(a - top) >= np.float32(min_p))
    return torch.from_numpy(ids).unsqueeze(0), torch.from_numpy(a[ids]).unsqueeze(0)


# stages that can keep their tokens as a compact row (None: run the full-width filter)
COMPACT = {"top_k": top_k_compact, "top_p": top_p_compact, "min_p": min_p_compact}


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit's index, as torch.argmax: through numpy for float32 rows on
    the CPU (its vector loop takes ~5 us over 49,152 logits where torch's takes ~55 here)."""
    if _numpy_can_read(logits):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1).astype("int64", copy=False))
    return logits.argmax(dim=-1)


DRAW_BLOCK = 1024  # draw_one's blocks


def draw_one(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor | None:
    """A token from one row of probabilities (float32, on the CPU; zeros allowed), shape (1,),
    for one uniform u from the generator: the block of DRAW_BLOCK tokens where the running
    total of the blocks' sums passes u x the total, then the token in it where the running
    total of its probabilities passes what is left (float64 running totals: float32 ones lose
    the smallest probabilities, and widening a whole row of them is slow where many are
    subnormal). torch.multinomial draws an exponential for every entry instead: ~4 ms over
    151,936 probabilities, a tenth of a Qwen3-1.7B step with temperature alone, as OpenAI
    clients send it. None where it does not apply (another device or dtype, no positive
    total: multinomial says what is wrong)."""
    if not _numpy_can_read(probs):
        return None
    p = probs[0]
    if p.shape[0] <= DRAW_BLOCK:  # one block (the tokens top-k kept): its running totals in
        # numpy, where torch's calls over a few dozen numbers cost more than their work
        a = p.detach().numpy()
        running = np.cumsum(a, dtype=np.float64)
        total = float(running[-1])
        if not (math.isfinite(total) and total > 0):
            return None
        x = float(torch.rand((), dtype=torch.float64, generator=generator)) * total
        i = int(np.searchsorted(running, x, side="right"))
        if i >= a.shape[0]:  # x rounded onto the total: the last token with a probability
            i = int(np.flatnonzero(a)[-1])
        return torch.tensor([i])
    whole = p.shape[0] // DRAW_BLOCK * DRAW_BLOCK
    blocks = p[:whole].view(-1, DRAW_BLOCK).sum(1)
    if whole < p.shape[0]:
        blocks = torch.cat([blocks, p[whole:].sum().view(1)])
    running = blocks.double().cumsum(0)
    total = float(running[-1])
    if not (math.isfinite(total) and total > 0):
        return None
    x = float(torch.rand((), dtype=torch.float64, generator=generator)) * total
    b = min(int(torch.searchsorted(running, x, right=True)), running.shape[0] - 1)
    while float(blocks[b]) <= 0:  # x rounded onto an empty block's edge: the one before
        b -= 1
    start = b * DRAW_BLOCK
    inside = p[start : start + DRAW_BLOCK]
    x -= float(running[b - 1]) if b else 0.0
    i = int(torch.searchsorted(inside.double().cumsum(0), x, right=True))
    if i >= inside.shape[0]:  # the block's float64 total came out below its float32 sum
        i = int(inside.nonzero()[-1])
    return torch.tensor([start + i])


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    previous_ids: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    allowed: torch.Tensor | None = None,
    state: SamplerState | None = None,
) -> torch.Tensor:
    """Choose one token per row of `logits` (shape (B, vocab)); returns ids of shape (B,).
    `allowed`: the grammar's mask (bool, same shape), or None. `state`: the reply's sampling
    state (Mirostat's mu, the last draws), kept by the caller across steps.

    One row (every decode step) runs the stages on the tokens top-k (or top-p) keeps, once it
    has run: the same values in the same order as over the whole vocabulary (the draw takes
    the same token, a softmax's last bit aside), a few hundred microseconds less a token (with
    top-p alone over 151,936 logits, ~12 ms)."""
    state = state if state is not None else SamplerState()
    run = running(params)
    constrained = allowed is not None or any(s.removes_all and s.is_on(params) for s in run)
    if params.greedy:  # no softmax needed: the argmax of the logits is the argmax of the probs
        logits = filter_logits(logits, params, previous_ids, allowed, state, generator, run)
        token = argmax(logits)
        if constrained:  # a row's best is finite unless it has no finite logit (or a NaN)
            best = logits.gather(-1, token.unsqueeze(-1)).reshape(-1).tolist()
            if not all(map(math.isfinite, best)) and not torch.isfinite(logits).any(-1).all():
                raise NoTokenAllowed(NO_TOKEN)
        return token
    ids, width = None, logits.shape[-1]
    if logits.shape[0] == 1:
        ids, logits = _filtered_row(
            logits.float(), params, run, previous_ids, allowed, state, generator
        )
        token, probs = _draw_filtered(ids, logits, generator, constrained)
    else:
        logits = filter_logits(logits.float(), params, previous_ids, allowed, state, generator, run)
        if constrained and not torch.isfinite(logits).any(dim=-1).all():
            raise NoTokenAllowed(NO_TOKEN)
        probs = logits.softmax(dim=-1)
        token = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    if any(s.key in AFTER_DRAW for s in run):
        if ids is not None:  # widened: the token's probability where the stage looks
            probs = torch.zeros(1, width, device=probs.device).scatter(-1, ids, probs)
        after_draw(params, state, probs, int(token.reshape(-1)[0]), previous_ids)
    return token


def _draw_filtered(ids, logits, generator, constrained) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's end in `sample`, after its stages (ids: the tokens a compact row holds, or
    None): no token left (where a stage may remove all) raises NoTokenAllowed; else the
    softmax and the draw. Returns (the token, shape (1,); the probabilities drawn from)."""
    if constrained and not torch.isfinite(logits).any(dim=-1).all():
        raise NoTokenAllowed(NO_TOKEN)
    probs = logits.softmax(dim=-1)
    token = _draw_row(probs, generator)
    return (ids[0, token] if ids is not None else token), probs


def _draw_row(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A token from one row of probabilities (1, width), shape (1,): draw_one where it applies."""
    drawn = draw_one(probs, generator)
    if drawn is not None:
        return drawn
    # draw among the tokens left: the same distribution, ~10x cheaper than a draw over all
    # ~50,000 (1 ms)
    left = probs[0].nonzero().squeeze(-1)
    pick = torch.multinomial(probs[0, left], num_samples=1, generator=generator)
    return left[pick]


def batch_key(params: SamplingParams) -> tuple | None:
    """What rows must share to be sampled together (`sample_rows`): their stages' settings
    (each row draws from its own generator, seeded or not). None where such rows are sampled
    one at a time: an output format, or a stage on that has no block function (draws of its
    own, a state, Python a row: XTC, Mirostat, DRY, presence). The caller also keeps rows
    with a grammar's mask apart (a tool call's grammar comes without a format)."""
    if params.constraint is not None:
        return None
    for stage in running(params):
        if stage.key != "grammar" and stage.key not in BLOCK and stage.is_on(params):
            return None
    # the seed, stop strings and token budget change no stage's numbers
    return params.replace(seed=None, stop=(), max_new_tokens=1)._key()


def sample_rows(
    logits: torch.Tensor,
    params: SamplingParams,
    previous: list[torch.Tensor | None],
    generators: list[torch.Generator | None],
    states: list[SamplerState],
) -> list[torch.Tensor | NoTokenAllowed]:
    """`sample` for each row of `logits` (B, vocab), rows whose settings are `params`
    (batch_key not None) with no grammar's mask, each with its ids so far, generator and state:
    a token of shape (1,) a row, or the NoTokenAllowed that `sample` would raise for it.

    Each row's token is the one `sample` gives it alone: the stages run once over the block
    (BLOCK: each row's numbers as alone), top-k keeps each row's tokens as `sample` keeps them
    (native, a row at a time) and the block goes on over those; each row then draws from its
    own generator, in row order. A row the block cannot carry on as it would go alone (ties at
    the k-th token; a top-p or min-p before any top-k keeps as many tokens as each row needs)
    goes on by itself from that stage, as `sample` would, with what the block gave it. Over
    rows of a few dozen tokens, or a few numbers changed in a row, a stage's cost is its calls,
    not its work: 8 `balanced` rows after a pass took ~2.4 ms this way, ~5 ms one at a time."""
    rows = logits.shape[0]
    out: list = [None] * rows
    for state in states:
        state.draws.clear()
    run, call = running(params), Call(params, None, None, SamplerState(), False)
    keep = list(range(rows))  # the rows still in the block
    # x: the pass's logits until a stage changes them; then sample_rows' own block
    x, ids, own = logits if params.greedy else logits.float(), None, False

    constrained = any(s.removes_all and s.is_on(params) for s in run)

    def alone(r, row, at, kept):  # row r (its full width: row) goes on by itself from stage
        try:  # `at` with (ids, logits) as the block left them, as `sample` would
            ids_r, x_r = _filtered_row(
                row, params, run, previous[r], None, states[r], generators[r], at, kept
            )
            out[r] = _draw_filtered(ids_r, x_r, generators[r], constrained)[0]
        except NoTokenAllowed as e:
            out[r] = e

    for at, stage in enumerate(run):  # as _filtered_row runs them (filter_logits, for greedy)
        if ids is not None and stage.key not in ID_FREE:  # widen back
            x = torch.full(
                (len(keep), logits.shape[-1]), NEG_INF, dtype=x.dtype, device=x.device
            ).scatter(-1, ids, x)
            ids, own = None, True
        if stage.key == "grammar":
            continue
        if not params.greedy and ids is None and stage.key in COMPACT:
            kept = [
                COMPACT[stage.key](x[i : i + 1], getattr(params, stage.key))
                for i in range(len(keep))
            ]
            if any(k is not None for k in kept) or (stage.key != "top_k" and stage.is_on(params)):
                # top-k keeps k tokens a row: those rows go on as a block. A row tied at the
                # k-th (the whole-width filter), and top-p's and min-p's rows (as many tokens
                # as each row needs), go on by themselves
                good = [i for i, k in enumerate(kept) if k is not None and stage.key == "top_k"]
                for i in sorted(set(range(len(keep))) - set(good)):
                    if kept[i] is not None:
                        alone(keep[i], x[i : i + 1], at + 1, kept[i])
                    else:
                        alone(keep[i], x[i : i + 1], at, (None, x[i : i + 1]))
                if not good:
                    return out
                keep = [keep[i] for i in good]
                ids = torch.cat([kept[i][0] for i in good])
                x, own = torch.cat([kept[i][1] for i in good]), True
                continue
        if not stage.is_on(params):  # a stage that is off leaves the logits as they are
            continue
        if not own:
            x, own = _working_copy(x), True
        x = BLOCK[stage.key](x, call, [previous[r] for r in keep])
    if params.greedy:  # a row's best is finite unless it has no finite logit (or a NaN)
        token = argmax(x)
        finite = [True] * len(keep)
        if constrained:
            best = x.gather(-1, token.unsqueeze(-1)).reshape(-1).tolist()
            finite = [
                math.isfinite(b) or bool(torch.isfinite(x[i]).any()) for i, b in enumerate(best)
            ]
        for i, r in enumerate(keep):
            out[r] = token[i : i + 1] if finite[i] else NoTokenAllowed(NO_TOKEN)
        return out
    finite = torch.isfinite(x).any(dim=-1).tolist() if constrained else [True] * len(keep)
    probs = x.softmax(dim=-1)
    for i, r in enumerate(keep):
        if not finite[i]:
            out[r] = NoTokenAllowed(NO_TOKEN)
            continue
        token = _draw_row(probs[i : i + 1], generators[r])
        out[r] = ids[i, token] if ids is not None else token
    return out


_SCRATCH = threading.local()


def _working_copy(logits: torch.Tensor) -> torch.Tensor:
    """A copy of a block of logits that sample_rows may change in place, in memory kept for the
    next step (the thread's own): a fresh megabyte or more a step costs its page faults, which
    here took longer than the stages' work."""
    buf = getattr(_SCRATCH, "buf", None)
    rows, width = logits.shape
    if (
        buf is None
        or buf.shape[0] < rows
        or buf.shape[1] != width
        or buf.dtype != logits.dtype
        or buf.device != logits.device
    ):
        rows_kept = max(rows, buf.shape[0] if buf is not None else 0)
        buf = torch.empty(rows_kept, width, dtype=logits.dtype, device=logits.device)
        _SCRATCH.buf = buf
    if _numpy_can_read(logits):  # numpy's copy runs on this thread: torch's, on two, waited
        np.copyto(buf[:rows].numpy(), logits.detach().numpy())  # for a core the pass's pool
        return buf[:rows]  # still spun on (~0.25 ms for 8 rows of 49,152 after a pass)
    return buf[:rows].copy_(logits)


def after_draw(
    params: SamplingParams,
    state: SamplerState,
    probs: torch.Tensor,
    token: int,
    previous_ids: torch.Tensor | None = None,
) -> None:
    """What the stages with state do once the token is known (Mirostat updates mu from the
    token's surprise under `probs`, the distribution the draw used)."""
    call = Call(params, previous_ids, None, state, True)
    for stage in running(params):
        if stage.key in AFTER_DRAW:
            AFTER_DRAW[stage.key](call, probs, token)
