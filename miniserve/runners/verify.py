"""Are these greedy tokens right? A check that holds on any CPU.

Two computations give bit-identical logits only when they do the same arithmetic in the same
order. Ours often do not: a prompt goes through a many-row matrix product (MKL / oneDNN),
a decoded token through a one-row step (torch.mv or our C++ loops), bfloat16 through other
kernels than float32, and each CPU's kernels sum in their own order. Their logits then agree
to rounding, and their greedy tokens are equal except where two candidates nearly tie.

So the check is made along the candidate's own path (teacher forcing): one forward pass of
a reference over prompt + the candidate's tokens gives, at every step, the logits the
candidate should have seen. A step is *decided* when the reference's top-2 margin exceeds
2 x the error bound of the candidate's arithmetic (each of the two logits may be off by the
bound); there the candidate must have chosen the reference's top token. At an undecided step
it must have chosen a token within 2 x bound of the top, one of the near-tied ones, and the
steps after it are checked on the path it took. Every token is checked, not just a prefix.

Error bounds: the largest |logit - float64 logit| over ~280 tokens of held-out text,
teacher-forced, with every runner; measured on an AMD EPYC (Zen 4, AVX-512) as it is and with
its kernels capped to AVX2 / generic code; the bounds leave 10x (float32) and 2.5x (bfloat16)
room over the largest seen (BENCHMARKS.md, "Exactness").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from miniserve.runners.stored import StoredRunner

# float32 arithmetic (native C++ step, PyTorch lean pass, transformers): logits are O(10-30);
# measured largest error 9.8e-5 (7.0e-5 .. 9.8e-5 over runners and legs).
BOUND_FLOAT32 = 1e-3
# bfloat16 arithmetic (bf16 activations through bf16 matrix products): measured 1.25 .. 1.63.
BOUND_BFLOAT16 = 4.0


# bfloat16 products (the native runner's --math bfloat16: activations rounded to bfloat16 where
# they enter a matrix product, and with vdpbf16ps a bfloat16 KV cache, query and attention
# weights; float32 sums, residual stream, norms and softmax): measured 0.55 (products only) and
# 0.68 (with the bfloat16 KV cache) on an AMD EPYC (Zen 4).
BOUND_BF16_PRODUCTS = 1.5


# Weights as stored (quantized blocks, miniserve/runners/stored.py): each activation row is rounded
# to int8 per block (a step of amax / 127) before the integer dot products. A product's error
# is then at most half a step per element times the weights' magnitudes (tests/test_stored.py
# computes that bound per product) plus float32 rounding in combining the blocks, allowed as
# this fraction of sum |w x|.
BOUND_STORED_RELATIVE = 1e-5
# ... and what that rounding makes of a whole model's logits: the embedded SmolLM2 Q4_1 as
# stored, teacher-forced over HELD_OUT (248 tokens) against float64 over the same weights
# dequantized, measured largest |error| 1.22 (float32 attention) / 1.05 (bfloat16) on an Intel
# Xeon (Sapphire Rapids, AVX-512 VNNI); top-1 agreement 94% / 97%. llama.cpp rounds its
# activations the same way (Q8_0 / Q8_1 / Q8_K blocks): the quality check against it is
# BENCHMARKS.md's perplexity row, not this bound.
BOUND_STORED = 3.0
# Float16 weights as stored (their rows widened, the activations not rounded: float32 products),
# teacher-forced against float64 over the same weights: the largest |error| relative to the
# largest |logit|, tiny synthetic models of every family in the architecture table
# (tests/test_families.py); float32 rounding leaves ~1e-6 there, 10x room.
BOUND_STORED_F16_RELATIVE = 1e-5


def bound_for(arithmetic: torch.dtype) -> float:
    """The error bound of logits computed in this dtype (float16 is not measured: bf16's)."""
    return BOUND_FLOAT32 if arithmetic in (torch.float32, torch.float64) else BOUND_BFLOAT16


def runner_bound(runner) -> float:
    """The error bound of a runner's logits: its arithmetic's, bfloat16 products apart."""
    if isinstance(runner, StoredRunner):  # weights as stored (quantized blocks)
        return BOUND_STORED
    if runner.name == "native" and runner.math == "bfloat16":
        return BOUND_BF16_PRODUCTS
    return bound_for(runner.act_dtype)


@dataclass
class GreedyCheck:
    steps: int = 0  # tokens checked (the end token included when one was chosen)
    decided: int = 0  # steps whose reference margin exceeds 2 x bound
    first_undecided: int = 0  # index of the first undecided step (= steps when none)
    wrong: list = field(default_factory=list)  # (step, chosen, reference top, logit gap)

    @property
    def ok(self) -> bool:
        return not self.wrong


def check_greedy(
    reference_rows: torch.Tensor, chosen: list[int], bound: float, end_ids=()
) -> GreedyCheck:
    """reference_rows[i]: the reference's logits for the step that chose chosen[i]. With
    `end_ids`, one more row is the step that stopped on an end token (not recorded which):
    the nearest of them to the reference's best is checked there."""
    steps = list(chosen)
    if end_ids:
        last = reference_rows[len(steps)].double()
        steps.append(max(end_ids, key=lambda t: float(last[t])))
    result = GreedyCheck(steps=len(steps), first_undecided=len(steps))
    for step, token in enumerate(steps):
        row = reference_rows[step].double()
        top2 = row.topk(2)
        if float(top2.values[0] - top2.values[1]) > 2 * bound:
            result.decided += 1
        else:
            result.first_undecided = min(result.first_undecided, step)
        # at a decided step only the top token is that close; at a near-tie, any tied one
        gap = float(top2.values[0] - row[token])
        if gap > 2 * bound:
            result.wrong.append((step, token, int(top2.indices[0]), round(gap, 6)))
    return result


def last_logits(model, ids: list[int], n: int) -> torch.Tensor:
    """(n, vocab) float64 logits of a transformers model at the last n positions of `ids`,
    in one pass (only those n rows are computed: a long prompt's would take gigabytes)."""
    with torch.inference_mode():
        out = model(torch.tensor([ids], device=model.device), logits_to_keep=n)
        return out.logits[0, -n:].double().cpu()


def all_logits(model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) logits of a transformers model at every position, in one pass."""
    return last_logits(model, ids, len(ids))


def check_tokens(
    reference_model, prompt_ids: list[int], tokens: list[int], bound: float, end_ids=()
) -> GreedyCheck:
    """Check greedy `tokens`, chosen after `prompt_ids`, against a transformers reference.
    `end_ids`: the candidate then stopped by choosing one of them (checked too)."""
    if not tokens and not end_ids:
        return GreedyCheck()
    # row i chose tokens[i]; the last row, after every token, is where an end token was chosen
    rows = last_logits(reference_model, list(prompt_ids) + list(tokens), len(tokens) + 1)
    return check_greedy(rows, tokens, bound, end_ids)
