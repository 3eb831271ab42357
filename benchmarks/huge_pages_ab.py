"""Packed matrices on 2 MB pages against 4 KB ones, in one process: two runners over the same
GGUF file, both with their matrices packed, one arena asked for transparent huge pages (the
default, lean.huge_page_memory) and one from an ordinary allocation, their decode passes
alternating so that a slow minute of the machine costs both alike.

    .venv/bin/python benchmarks/huge_pages_ab.py FILE.gguf [--rows 1,8] [--passes 200]

Prints the median and the minimum in ms for each (the first 20 passes left out), and how long
each runner took to build (packing, and the kernel finding 2 MB pages).
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--passes", type=int, default=200)
    ap.add_argument("--positions", type=int, default=128)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype="stored", progress=lambda m: None)
    made, built = {}, {}
    asked = native.huge_page_memory
    for name in ("2 MB", "4 KB"):
        native.huge_page_memory = asked if name == "2 MB" else (lambda nbytes: None)
        started = time.perf_counter()
        made[name] = StoredRunner(loaded.model, "auto", loaded.generation_config)
        built[name] = time.perf_counter() - started
    native.huge_page_memory = asked
    if not made["2 MB"].native.packed:
        sys.exit(f"nothing in {Path(args.model).name} packs on this build")
    print(f"{Path(args.model).name}, {native.kernels_label()} build ({cpu_model()})")
    print("runner built in " + ", ".join(f"{n}: {s:.2f} s" for n, s in built.items()))
    P = args.positions
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",") if r]:
            caches, times = {}, {name: [] for name in made}
            for name, r in made.items():
                caches[name] = [r.new_cache(P + 16) for _ in range(rows)]
                for i, c in enumerate(caches[name]):
                    r.step([(list(range(100 + i, 100 + i + P)), c)])
            for n in range(args.passes):
                for name in made if n % 2 else reversed(list(made)):
                    for c in caches[name]:
                        c.length = P  # the next token overwrites the same position
                    started = time.perf_counter()
                    made[name].step([([7 + n % 50], c) for c in caches[name]])
                    times[name].append(time.perf_counter() - started)
            for name, t in times.items():
                kept = t[WARM:]
                print(
                    f"{rows} rows a pass, {name} pages: median {statistics.median(kept) * 1e3:.2f}"
                    f"  min {min(kept) * 1e3:.2f} ms"
                )


if __name__ == "__main__":
    main()
