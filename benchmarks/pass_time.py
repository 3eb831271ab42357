"""The native pass alone: the time of one decode pass of R rows (R sequences, one new token each)
at a fixed number of positions, over the embedded model (or --model FILE) as stored, with no
scheduler, sampling or Python around it -- what the kernels and attention cost, apart from the
step's other work.
Each pass writes its token at the same position again, so every pass reads the same caches.

    .venv/bin/python benchmarks/pass_time.py [--rows 8] [--positions 128] [--passes 300]
        [--model FILE] [--per-layer]

Prints the minimum, the 25th percentile and the median in ms (the first 20 passes left out).
--per-layer: also the output layer's product of the rows alone, from memory (the bench
ceiling's way: bench.machine.time_from_memory),
and the rest of the median pass over the layers -- what a layer takes, where the output layer
is a larger share of a file cut to a few layers (the Qwen3-30B-A3B shape's 12 of 48).
Compare two versions by running each in turn, a few rounds: the machines here are shared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from miniserve.bench.machine import as_run, time_from_memory  # noqa: E402
from miniserve.core.platform import cpu_model  # noqa: E402
from miniserve.runners import native  # noqa: E402
from miniserve.runners.loader import load_model  # noqa: E402
from miniserve.runners.stored import StoredRunner  # noqa: E402

WARM = 20  # passes left out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--passes", type=int, default=300)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--per-layer", action="store_true", help="the output layer apart, a layer")
    args = ap.parse_args()
    if args.rows < 1 or args.positions < 1 or args.passes <= WARM:
        ap.error(f"--rows and --positions must be >= 1 and --passes > {WARM}")
    loaded = load_model(args.model, dtype="stored", progress=lambda m: None)
    model = StoredRunner(loaded.model, "auto", loaded.generation_config)
    caches = [model.new_cache(args.positions + 16) for _ in range(args.rows)]
    for i, cache in enumerate(caches):  # a different prompt a row
        model.step([(list(range(100 + i, 100 + i + args.positions)), cache)])
    times = []
    with torch.inference_mode():
        for n in range(args.passes):
            for cache in caches:
                cache.length = args.positions  # the next token overwrites the same position
            started = time.perf_counter()
            model.step([([7 + n % 50], cache) for cache in caches])
            times.append(time.perf_counter() - started)
    times = times[WARM:]
    print(
        f"{args.rows} rows at {args.positions} positions ({cpu_model()}): "
        f"min {min(times) * 1e3:.3f}  p25 {statistics.quantiles(times, n=4)[0] * 1e3:.3f}  "
        f"median {statistics.median(times) * 1e3:.3f} ms a pass"
    )
    if args.per_layer:
        head = as_run(model, model.lm_head)
        x = torch.randn(args.rows, head.shape[1])
        with torch.inference_mode():
            best = time_from_memory(lambda: native.matmul(head, x, model.math))
        layers = len(model.layers)
        print(
            f"output layer ({head.shape[0]} x {head.shape[1]}) {best * 1e3:.3f} ms; the "
            f"{layers} layers {(statistics.median(times) - best) / layers * 1e3:.3f} ms each"
        )


if __name__ == "__main__":
    main()
