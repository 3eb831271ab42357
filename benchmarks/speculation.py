"""Prompt-lookup speculation against decoding one token a step, on the same engine's model, in
one run: input-grounded tasks (rename in a code file, correct the typos of a passage), free
prose, and 8 streams at once. Greedy; the replies must be identical both ways (checked).

    .venv/bin/python benchmarks/speculation.py [--model default] [--tokens 256] [--repeat 3]

Tasks' texts: benchmarks/speculation_tasks/ (SOURCES.md says where each comes from). Prints
decode tokens/s off and on, the ratio (median of the repeats, alternating), and what the drafts
did: "accepted X of Y a step".
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TASKS = ROOT / "benchmarks" / "speculation_tasks"


def tasks() -> dict[str, str]:
    code = (TASKS / "detokenizer.txt").read_text("utf-8")
    typos = (TASKS / "typos.txt").read_text("utf-8")
    return {
        "rename": "Rename `ids` to `token_ids` in this code and give all of it back, "
        "nothing else:\n\n" + code,
        "typos": "Correct the spelling mistakes in this passage and give all of it back:\n\n"
        + typos,
        "prose": "Write a short story about a lighthouse keeper.",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from miniserve.core.config import SamplingParams
    from miniserve.engine.engine import Engine
    from miniserve.runners.loader import load_model

    from benchmarks.common import on_threads

    loaded = load_model(args.model, dtype="stored")
    engines = {name: Engine(loaded, speculate=name, max_batch=8) for name in ("off", "ngram")}
    params = SamplingParams(temperature=0, max_new_tokens=args.tokens)

    def run(engine, prompt):
        ids, stats = [], None
        for chunk in engine.chat([{"role": "user", "content": prompt}], params, reuse_prefix=False):
            ids += chunk.token_ids
            stats = chunk.stats
        return ids, stats

    def many(engine, prompts):
        import time

        start = time.perf_counter()
        out = on_threads(len(prompts), lambda i: run(engine, prompts[i]))
        seconds = time.perf_counter() - start
        return [o[0] for o in out], sum(o[1].new_tokens for o in out) / seconds, out

    for e in engines.values():
        e.warm_up()
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    print(f"CPU: {cpu}; model {loaded.name}; greedy, {args.tokens} new tokens at most")
    for name, prompt in tasks().items():
        speeds = {"off": [], "ngram": []}
        replies = {}
        last = None
        for _ in range(args.repeat):
            for mode, engine in engines.items():
                ids, stats = run(engine, prompt)
                speeds[mode].append(stats.decode_tokens_per_s)
                replies.setdefault(mode, ids)
                assert ids == replies[mode]
                if mode == "ngram":
                    last = stats
        assert replies["off"] == replies["ngram"], f"{name}: speculation changed the reply"
        off, on = statistics.median(speeds["off"]), statistics.median(speeds["ngram"])
        drafts = (
            f"accepted {last.accepted / last.draft_steps:.1f} of "
            f"{last.drafted / last.draft_steps:.1f} a step, {last.draft_steps} drafting steps"
            if last.draft_steps
            else "no drafts"
        )
        print(
            f"  {name:7s} {last.new_tokens:4d} tokens: off {off:6.1f} tok/s, on {on:6.1f} "
            f"tok/s, {on / off:.2f}x ({drafts})"
        )
    prompts = list(tasks().values()) * 3
    prompts = prompts[:8]
    off_ids, off_rate, _ = many(engines["off"], prompts)
    on_ids, on_rate, _ = many(engines["ngram"], prompts)
    assert off_ids == on_ids, "8 streams: speculation changed a reply"
    print(
        f"  8 streams (the three tasks mixed): off {off_rate:.1f} tok/s in all, on "
        f"{on_rate:.1f}, {on_rate / off_rate:.2f}x"
    )
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
