"""Packed matrices on 2 MB pages against 4 KB ones, in one process: two runners over the same
GGUF file, both with their matrices packed, one arena asked for transparent huge pages (the
default, lean.huge_page_memory) and one from an ordinary allocation, their decode passes
alternating so that a slow minute of the machine costs both alike.

    .venv/bin/python benchmarks/huge_pages_ab.py FILE.gguf [--rows 1,8] [--passes 200]

Prints min, quartiles and median in ms for each (the passes of packed_ab.py), and how long each
runner took to build (packing, and the kernel finding 2 MB pages).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from packed_ab import WARM, decode_passes, summary  # noqa: E402

from miniserve.core.platform import cpu_model  # noqa: E402
from miniserve.runners import native  # noqa: E402
from miniserve.runners.loader import load_model  # noqa: E402
from miniserve.runners.stored import StoredRunner  # noqa: E402


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
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",") if r]:
            times = decode_passes(made, rows, args.positions, args.passes)
            for name, t in times.items():
                print(f"{rows} rows a pass, {name} pages: {summary(t[WARM:])}")


if __name__ == "__main__":
    main()
