"""The README's DRY case: a greedy reply that loops under the repetition penalty, a stronger
penalty that breaks the text instead, and DRY stopping the loop; then the Step view's table at
the first token where DRY chose otherwise (the same table `python -m miniserve step` prints).

    .venv/bin/python benchmarks/dry_case.py        # the embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miniserve.cli.step import stage_table  # noqa: E402
from miniserve.core.config import SamplingParams  # noqa: E402
from miniserve.engine.engine import Engine  # noqa: E402
from miniserve.engine.step import StepSession  # noqa: E402
from miniserve.runners.loader import load_model  # noqa: E402

QUESTION = "List the days of the week, then do it again."
NEW_TOKENS = 120
CASES = {
    "repetition penalty 1.1": dict(repetition_penalty=1.1),
    "repetition penalty 1.3": dict(repetition_penalty=1.3),
    "repetition penalty 1.1 + DRY 0.5": dict(repetition_penalty=1.1, dry_multiplier=0.5),
}


def longest_loop(ids: list[int]) -> int:
    """Tokens at the end that repeat the tokens one period before them (any period < 40)."""
    best = 0
    for period in range(1, 40):
        k = 0
        while k + period < len(ids) and ids[-1 - k] == ids[-1 - k - period]:
            k += 1
        best = max(best, k)
    return best


def main() -> None:
    engine = Engine(load_model(None, dtype="stored", progress=lambda m: None))
    messages = [{"role": "user", "content": QUESTION}]
    replies = {}
    for name, settings in CASES.items():
        params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, **settings)
        ids = [t for c in engine.chat(messages, params) for t in c.token_ids]
        replies[name] = (params, ids)
        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
        print(f"## {name}: {len(ids)} tokens, the last {longest_loop(ids)} repeat a loop\n")
        print(text + "\n")
    (_, plain), (dry, with_dry) = (
        replies["repetition penalty 1.1"],
        replies["repetition penalty 1.1 + DRY 0.5"],
    )
    at = next(i for i, (a, b) in enumerate(zip(plain, with_dry)) if a != b)
    session = StepSession(engine, engine.chat_prompt(messages, dry), dry)
    try:
        for _ in range(at):
            session.step()
        view = session.view(6)
        so_far = engine.tokenizer.decode(with_dry[:at], skip_special_tokens=True)
        print(f"## The Step view at token {at + 1}, after ...{so_far[-40:]!r}\n")
        print(stage_table(view, 6))
    finally:
        session.release()
        engine.close()


if __name__ == "__main__":
    main()
