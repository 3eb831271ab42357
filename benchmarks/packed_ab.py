"""Packed against stored rows in one process: two runners over the same GGUF file, one with its
matrices packed at load where the build packs their type (the default: Q4_K on AVX-512 without
AMX and on AVX2; the 32-weight types on AVX-512 and AVX2) and one with MINISERVE_PACK=0, their
passes alternating so that a slow minute of the machine costs both alike. Decode passes of R rows (R
sequences, one new token each, at a fixed number of positions), then prompts of N tokens from an
empty cache.

    .venv/bin/python benchmarks/packed_ab.py FILE.gguf [--rows 1,4,8] [--positions 128]
        [--passes 300] [--prompts 64,512] [--prompt-runs 6]

Prints min, quartiles and median in ms for each (the first 20 passes, and each layout's first
prompt, left out). MINISERVE_NATIVE_ARCH=x86-64-v3 measures the AVX2 build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from miniserve.core.platform import cpu_model  # noqa: E402
from miniserve.runners import native  # noqa: E402
from miniserve.runners.loader import load_model  # noqa: E402
from miniserve.runners.stored import StoredRunner  # noqa: E402

WARM = 20


def runners(path: str):
    loaded = load_model(path, dtype="stored", progress=lambda m: None)
    made = {}
    for name, setting in (("stored", "0"), ("packed", "1")):
        os.environ["MINISERVE_PACK"] = setting
        made[name] = StoredRunner(loaded.model, "auto", loaded.generation_config)
    os.environ.pop("MINISERVE_PACK")
    if not made["packed"].native.packed:
        sys.exit(f"nothing in {Path(path).name} packs on this build ({native.kernels_label()})")
    return made


def summary(times: list[float]) -> str:
    t = sorted(times)
    q = statistics.quantiles(t, n=4, method="inclusive") if len(t) > 1 else [t[0]] * 3
    return (
        f"min {t[0] * 1e3:8.2f}  p25 {q[0] * 1e3:8.2f}  median {statistics.median(t) * 1e3:8.2f}  "
        f"p75 {q[2] * 1e3:8.2f} ms"
    )


def decode_passes(made: dict, rows: int, positions: int, passes: int) -> dict[str, list[float]]:
    """Each runner's decode passes of `rows` sequences (one new token each, at `positions`
    positions), the runners' passes alternating; seconds a pass, by runner name."""
    caches, times = {}, {name: [] for name in made}
    for name, r in made.items():
        caches[name] = [r.new_cache(positions + 16) for _ in range(rows)]
        for i, c in enumerate(caches[name]):
            r.step([(list(range(100 + i, 100 + i + positions)), c)])
    for n in range(passes):
        for name in made if n % 2 else reversed(list(made)):
            for c in caches[name]:
                c.length = positions  # the next token overwrites the same position
            started = time.perf_counter()
            made[name].step([([7 + n % 50], c) for c in caches[name]])
            times[name].append(time.perf_counter() - started)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--passes", type=int, default=300)
    ap.add_argument("--prompts", default="64,512")
    ap.add_argument("--prompt-runs", type=int, default=6)
    args = ap.parse_args()
    made = runners(args.model)
    build = f"{native.kernels_label()} build ({cpu_model()})"
    print(f"{Path(args.model).name}, {build}, the two layouts alternating")
    P = args.positions
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",") if r]:
            times = decode_passes(made, rows, P, args.passes)
            for name in made:
                print(f"{rows} rows a pass, {name:6s}: {summary(times[name][WARM:])}")
        for length in [int(n) for n in args.prompts.split(",") if n]:
            times = {name: [] for name in made}
            for n in range(args.prompt_runs):
                for name in made if n % 2 else reversed(list(made)):
                    cache = made[name].new_cache(length + 16)
                    ids = list(range(100 + n, 100 + n + length))
                    started = time.perf_counter()
                    made[name].step([(ids, cache)])
                    times[name].append(time.perf_counter() - started)
            for name in made:
                print(f"a {length}-token prompt, {name:6s}: {summary(times[name][1:])}")


if __name__ == "__main__":
    main()
