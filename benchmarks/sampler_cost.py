"""What sampling costs at 8 streams: each preset's aggregate tokens/s against greedy's, with the
one-row path that runs the stages after top-k on the k tokens kept (engine/sampling.py
`top_k_compact`) and with it switched off (every stage over the whole vocabulary), in one run,
alternating, end tokens banned so every stream writes all its tokens.

    .venv/bin/python benchmarks/sampler_cost.py [--repeat 3] [--streams 8] [--new-tokens 128]

Also the time of one `sample()` call per preset, alone (a 49,152-token row: SmolLM2's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from miniserve.bench.concurrency import run_concurrency  # noqa: E402
from miniserve.bench.options import ConcurrencyConfig  # noqa: E402
from miniserve.core.config import load_presets, with_builtins  # noqa: E402
from miniserve.core.platform import cpu_model  # noqa: E402
from miniserve.engine import sampling  # noqa: E402
from miniserve.engine.engine import Engine  # noqa: E402
from miniserve.runners.loader import load_model  # noqa: E402


def one_call_ms(params, width: int = 49152, n: int = 300) -> float:
    x = torch.randn(1, width, generator=sampling.make_generator(0)) * 3
    ids = torch.randint(0, width, (1, 300), generator=sampling.make_generator(1))
    gen = sampling.make_generator(2)
    for _ in range(20):
        sampling.sample(x, params, ids, gen)
    started = time.perf_counter()
    for _ in range(n):
        sampling.sample(x, params, ids, gen)
    return (time.perf_counter() - started) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--presets", default="balanced,creative")
    args = ap.parse_args()
    presets = with_builtins(load_presets())
    names = ["greedy", *[p for p in args.presets.split(",") if p]]
    compact = sampling.top_k_compact
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}")
    for name in names[1:]:
        on = one_call_ms(presets[name])
        sampling.top_k_compact = lambda *a: None
        off = one_call_ms(presets[name])
        sampling.top_k_compact = compact
        print(f"sample() one row, {name}: {on:.3f} ms with the top-k path, {off:.3f} ms without")
    engine = Engine(load_model(None, dtype="stored", progress=lambda m: None))
    config = ConcurrencyConfig(
        levels=[args.streams], new_tokens=args.new_tokens, presets=tuple(names), repeat=1
    )
    got: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeat):
        for path in ("top-k path", "whole vocabulary"):
            sampling.top_k_compact = compact if path == "top-k path" else (lambda *a: None)
            result = run_concurrency(engine, config)
            for row in result.rows:
                got.setdefault((path, row.preset), []).append(row.aggregate_tokens_per_s)
            sampling.top_k_compact = compact
            print(
                f"run {r + 1}, {path}: "
                + ", ".join(
                    f"{row.preset} {row.aggregate_tokens_per_s:.1f}" for row in result.rows
                ),
                flush=True,
            )
    print(f"\n{args.streams} streams, median of {args.repeat} (tok/s aggregate; share of greedy):")
    for path in ("top-k path", "whole vocabulary"):
        greedy = statistics.median(got[(path, "greedy")])
        cells = [f"greedy {greedy:.1f}"]
        for name in names[1:]:
            m = statistics.median(got[(path, name)])
            cells.append(f"{name} {m:.1f} ({m / greedy:.0%})")
        print(f"  {path:>16}: " + ", ".join(cells))
    engine.close()


if __name__ == "__main__":
    main()
