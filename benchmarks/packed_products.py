"""One matrix of a block type, packed and as stored, in one process: native.matmul against 1, 4
and 8 activation rows, the two layouts alternating, on the threads given (default 1). The
matrix is random weights quantized by gguf's own quantizer (the 32-weight types), or random
block bytes with sane scales (the K-quants and the others gguf cannot quantize:
tests/product_digests.py); its default size (1,536 x 576: SmolLM2's up and gate) stays in L2,
so the figures are the kernels' arithmetic, not the memory's. GFLOPS = 2 x rows x columns x
activation rows / time (median, and best, of 10 runs of 200 products).

    .venv/bin/python benchmarks/packed_products.py [--types Q4_1,Q5_0] [--rows 1536]
        [--cols 576] [--threads 1]
    .venv/bin/python benchmarks/packed_products.py --types Q4_K,Q6_K --rows 256 --cols 2048

MINISERVE_NATIVE_ARCH=x86-64-v3 measures the AVX2 build.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from product_digests import k_quant_blocks  # noqa: E402

from miniserve.core.platform import cpu_model  # noqa: E402
from miniserve.runners import native  # noqa: E402
from miniserve.runners.native import StoredMatrix  # noqa: E402

RUNS, PRODUCTS = 10, 200


def timed(m: StoredMatrix, x: torch.Tensor) -> float:
    native.matmul(m, x)
    started = time.perf_counter()
    for _ in range(PRODUCTS):
        native.matmul(m, x)
    return (time.perf_counter() - started) / PRODUCTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0")
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=576)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if native.load() is None:
        sys.exit(f"no native library: {native.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    print(
        f"{cpu_model()}, {native.isa()} kernels, {args.threads} thread(s), "
        f"{args.rows} x {args.cols}"
    )
    for name in args.types.split(","):
        qtype = getattr(gguf.GGMLQuantizationType, name)
        rng = np.random.default_rng(1)
        floats = rng.standard_normal((args.rows, args.cols)).astype(np.float32) * 0.05
        try:
            data = np.ascontiguousarray(gguf.quants.quantize(floats, qtype))
        except NotImplementedError:  # gguf has no quantizer for it: random blocks
            data = np.ascontiguousarray(k_quant_blocks(rng, qtype, args.rows, args.cols))
        stored = StoredMatrix(data.ctypes.data, int(qtype), args.rows, args.cols, data.nbytes)
        made = native.pack(stored)
        if made is None:
            print(f"{name}: this build keeps it as stored (nothing to compare)")
            continue
        packed, _keep = made
        for batch in (1, 4, 8):
            x = torch.randn(batch, args.cols)
            times = {"packed": [], "stored": []}
            for run in range(RUNS):
                order = (("packed", packed), ("stored", stored))
                for label, m in order if run % 2 == 0 else order[::-1]:
                    times[label].append(timed(m, x))
            flops = 2 * args.rows * args.cols * batch
            med = {k: statistics.median(v) for k, v in times.items()}
            best = {k: min(v) for k, v in times.items()}
            print(
                f"{name} x {batch}: packed {flops / med['packed'] / 1e9:.1f} GFLOPS "
                f"(best {flops / best['packed'] / 1e9:.1f}), "
                f"stored {flops / med['stored'] / 1e9:.1f} "
                f"(best {flops / best['stored'] / 1e9:.1f}) "
                f"({med['stored'] / med['packed']:.2f}x)"
            )


if __name__ == "__main__":
    main()
