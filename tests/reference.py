"""The float64 reference the tests hold every inexact equality to (see miniserve/runners/verify.py
for the check and the measured error bounds).

Exact by construction -- and so compared with ==: the same code on the same inputs with the
same shapes, run twice (a seed, another thread, a repeated prompt served from the prefix
cache). Everything else -- cache vs no cache, C++ vs MKL sums, fused vs separate matrices,
bfloat16 vs float32 -- is compared with this reference and a stated tolerance.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from miniserve.runners.hf import as_runner
from miniserve.runners.verify import GreedyCheck, all_logits, check_tokens

# Teacher-forced top-1 agreement with the float64 reference over HELD_OUT (278 tokens),
# measured 100% for every float32 path and 96.0-97.1% for bfloat16 arithmetic on the AMD EPYC
# (AVX-512 and capped to AVX2); float32 may only lose a near-tie.
AGREE_FLOAT32 = 0.99
AGREE_BFLOAT16 = 0.93
# The tiny random models of the unit tests have logits ~0.1 and errors ~1e-7.
TINY_BOUND = 1e-5

# Held-out text for teacher-forced agreement: no test prompt or benchmark filler contains it.
HELD_OUT = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, carrying a can of "
    "oil and a small brass key. From the gallery he could see the fishing boats returning "
    "across the bay, their lanterns swinging as the swell rose beneath them. In winter the "
    "storms came from the north-west and the waves broke over the harbour wall, throwing "
    "spray as high as the lamp room. He kept a log of every ship that passed: its name, the "
    "hour, the direction of the wind and the state of the sea. Over forty years the log grew "
    "to eleven volumes, which the village museum now keeps in a glass case beside his coat. "
    "Visitors often ask why he never married. The answer, according to his niece, was simple: "
    "the light could not be left alone, and no one he met wanted to live on a rock three miles "
    "from the nearest shop. Still, he was not lonely. The postman rowed out twice a week, the "
    "children from the school came every summer, and in the evenings he played chess by radio "
    "with a retired captain in Aberdeen. When the light was automated in 1987 he moved to a "
    "cottage on the mainland, where he planted roses and wrote a short book about birds."
)


def float64_twin(hf_model):
    """The same (possibly bfloat16-rounded) weights in float64."""
    return copy.deepcopy(hf_model).to(torch.float64).eval()


class Remembered:
    """A float64 reference that remembers its passes. The float64 pass is a pure function of
    (ids, rows kept): the same code over the same inputs and shapes gives the same bits, so
    runners that reach the same tokens (most greedy replies of a prompt, every teacher-forced
    pass over HELD_OUT) are checked against one computation instead of one each. Up to
    `budget` bytes of logits are kept, the oldest dropped first."""

    def __init__(self, model, budget: int = 512 << 20):
        self.model, self.budget, self.kept = model, budget, {}

    def __getattr__(self, name):  # device, config, ...: the model's
        return getattr(self.model, name)

    def __call__(self, input_ids, logits_to_keep: int = 0):  # as verify.last_logits calls it
        key = (tuple(input_ids.shape), tuple(input_ids.flatten().tolist()), logits_to_keep)
        logits = self.kept.get(key)
        if logits is None:
            logits = self.kept[key] = self.model(input_ids, logits_to_keep=logits_to_keep).logits
            while sum(x.nbytes for x in self.kept.values()) > self.budget:
                self.kept.pop(next(iter(self.kept)))
        return SimpleNamespace(logits=logits.clone())  # the kept copy stays as computed


def remembered_twin(hf_model) -> Remembered:
    """float64_twin, remembering its passes (the session's shared references)."""
    return Remembered(float64_twin(hf_model))


def assert_greedy(
    reference, prompt_ids, tokens, bound, end_id=None, min_decided: int = 32
) -> GreedyCheck:
    """Greedy `tokens` must follow the float64 reference (miniserve.runners.verify.check_tokens),
    and
    the first `min_decided` steps (or all of a shorter reply) must be decided ones, so that
    the comparison has teeth: a prompt with an early near-tie is a poor test prompt."""
    result = check_tokens(reference, prompt_ids, tokens, bound, () if end_id is None else (end_id,))
    assert result.ok, f"tokens off the float64 reference (step, chosen, top, gap): {result.wrong}"
    assert result.first_undecided >= min(min_decided, result.steps), (
        f"a near-tie at step {result.first_undecided} of {result.steps}: too short a "
        "comparison, choose another prompt"
    )
    return result


def teacher_forced(step_logits, reference, ids: list[int]) -> tuple[float, float]:
    """(top-1 agreement, largest |logit error|) of a candidate's logits at every position of
    `ids` against the reference's. `step_logits(ids)` returns (len(ids), vocab) logits."""
    got = step_logits(ids).double()
    want = all_logits(reference, ids)
    agree = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    return agree, float((got - want).abs().max())


def one_token_at_a_time(model):
    """step_logits of a runner's decode path: one token per call through its cache."""

    def run(ids):
        cache = model.new_cache()
        with torch.inference_mode():
            return torch.cat([model(torch.tensor([[t]]), cache).float() for t in ids])

    return run


def whole_prompt(model):
    """step_logits of a runner's prompt path: every position in one pass."""

    def run(ids):
        with torch.inference_mode():
            return as_runner(model).forward(torch.tensor([ids]), None, all_logits=True)

    return run
