"""The token check: do the greedy tokens of a run follow a reference holding the engine's
weights, within the error bound of the arithmetic that chose them (TokenCheck)."""

from __future__ import annotations

import copy
import time

import torch

from miniserve.bench.machine import available_memory
from miniserve.bench.options import Progress
from miniserve.engine.engine import Engine
from miniserve.runners.float64 import Float64Reference
from miniserve.runners.verify import BOUND_STORED, GreedyCheck, check_greedy, last_logits


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


class TokenCheck:
    """Do our greedy tokens follow a reference holding the engine's weights, within the error
    bound of the arithmetic that chose them?

    The rule (miniserve/runners/verify.py's check_greedy), teacher-forced: one reference pass
    over prompt + a reply's own tokens gives the logits each step should have seen. A step is
    decided where the reference's top two logits differ by more than 2 x the row's error bound
    (bounds 3.0 for weights as stored, 1e-3 for float32 arithmetic); there the reply must have
    chosen the reference's top token. Elsewhere (a near-tie) it may have chosen any token
    within 2 x the bound of the top, and the later steps are checked on the path it took. A
    reply that stopped early is checked for choosing an end token at its last step.

    The reference: for a GGUF run as stored, a float64 pass over the file's blocks dequantized
    a tensor at a time (Float64Reference), every reply of the run in one pass, so each layer is
    dequantized once; nothing is written, and what it holds at once is estimated first: where
    that is more than the memory available, the check is skipped and says so. For a
    transformers model, the model itself in float32 (a float32 copy in memory for bfloat16
    weights), one pass per reply.

    add() each reply, run() once, then verdict() per row; each distinct reply is computed
    once (the repeats of a mode, and the modes that agree, give the same tokens)."""

    def __init__(self, engine: Engine, new_tokens: int):
        self.engine, self.new_tokens = engine, new_tokens
        self.stored = engine.loaded.stored
        self.replies: dict[tuple, None] = {}  # (prompt ids, tokens), in order
        self.rows: dict[tuple, torch.Tensor] = {}  # their reference logits
        self.skipped = ""  # why the check did not run
        self.results: dict[tuple, GreedyCheck] = {}
        self.seconds = 0.0
        self.peak_bytes = 0

    def _ends(self, tokens) -> tuple:
        """A shorter reply stopped on an end token (which is not recorded)."""
        return () if len(tokens) >= self.new_tokens else tuple(self.engine.eos_ids)

    def add(self, prompt_ids, tokens) -> None:
        self.replies.setdefault((tuple(prompt_ids), tuple(tokens)), None)

    def run(self, progress: Progress | None = None) -> None:
        progress = progress or (lambda f, m: None)
        todo = [key for key in self.replies if key not in self.rows]
        todo = [key for key in todo if key[1] or self._ends(key[1])]  # nothing to check else
        if not todo:
            return
        start = time.perf_counter()
        if self.stored:
            reference = Float64Reference(self.engine.loaded.model)
            lengths = [len(p) + len(t) for p, t in todo]
            last = [len(t) + 1 for _, t in todo]  # row i chose t[i]; the last, an end token
            self.peak_bytes = reference.peak_bytes(lengths, last)
            free = available_memory()
            if free is not None and self.peak_bytes > free:
                self.skipped = (
                    "greedy tokens not checked: the float64 reference over the file's blocks "
                    f"would hold about {_gb(self.peak_bytes)} at once and "
                    f"{_gb(free)} is available"
                )
                progress(1.0, self.skipped)
                return
            progress(
                1.0,
                f"checking the tokens: a float64 pass over the file's blocks "
                f"({sum(lengths)} positions)",
            )
            rows = reference.logits_many([list(p) + list(t) for p, t in todo], last)
            for key, r in zip(todo, rows):
                self.rows[key] = torch.from_numpy(r)
        else:
            progress(1.0, "checking the tokens against the float32 reference")
            model = self.engine.loaded.reference()
            if model.dtype != torch.float32:
                model = copy.deepcopy(model).float()
            for p, t in todo:
                self.rows[(p, t)] = last_logits(model, list(p) + list(t), len(t) + 1)
        self.seconds += time.perf_counter() - start

    def result(self, prompt_ids, tokens, bound: float) -> GreedyCheck | None:
        """The check of one reply at this bound; None where it was not computed."""
        key = (tuple(prompt_ids), tuple(tokens))
        ends = self._ends(tokens)
        if not tokens and not ends:
            return GreedyCheck()
        if key not in self.rows:
            return None
        if (key, bound) not in self.results:
            self.results[(key, bound)] = check_greedy(self.rows[key], list(tokens), bound, ends)
        return self.results[(key, bound)]

    def verdict(self, replies, bound: float) -> bool | None:
        """Do all these replies follow the reference? None: not checked (skipped)."""
        checks = [self.result(p, t, bound) for p, t in replies]
        if any(c is None for c in checks):
            return None
        return all(c.ok for c in checks)

    @property
    def name(self) -> str:
        """What the tokens are checked against; or, not checked, the line that says why."""
        if self.skipped:
            return self.skipped
        return "float64 reference over the file's blocks" if self.stored else "float32 reference"

    def rule(self) -> str:
        """The rule, and what this run's check found and cost."""
        if self.skipped:
            return ""
        counts: dict[float, list[int]] = {}  # bound -> [decided, steps] over the checks
        for (_, bound), c in self.results.items():
            n = counts.setdefault(bound, [0, 0])
            n[0], n[1] = n[0] + c.decided, n[1] + c.steps
        found = ", ".join(
            f"{d} of {n} at bound {b:g}" + (" (as stored)" if b == BOUND_STORED else "")
            for b, (d, n) in sorted(counts.items(), reverse=True)
        )
        top = [  # the distinct replies' tokens that are the reference's top token
            (int((rows[: len(t)].argmax(-1) == torch.tensor(t)).sum()), len(t))
            for (_, t), rows in self.rows.items()
        ]
        if top:
            found += (
                f"; the reference's top token at {sum(a for a, _ in top)} of "
                f"{sum(n for _, n in top)} steps"
            )
        cost = f"{self.seconds:.1f} s" + (
            f", about {_gb(self.peak_bytes)} held, nothing written" if self.stored else ""
        )
        return (
            "teacher-forced; a step is decided where the reference's top two logits differ by "
            "more than 2 x the row's error bound, and elsewhere any token that close to the "
            f"top counts; steps decided: {found or 'none checked'}; {cost}"
        )
