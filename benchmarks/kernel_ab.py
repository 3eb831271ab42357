"""Two versions of the native kernels in one process: this tree's and those at a git ref, each
matrix laid out by each version's own ms_pack and multiplied by its own ms_matmul, the two calls
taking turns pair by pair, so that the machine's moment costs both alike (these shared VMs move
by up to 2x within minutes: two versions timed one after the other can differ by more than the
change). Prints, per type and activation rows, each version's best and median GFLOPS and the
median of the pairs' ratios (new / base time inverted: above 1, this tree is faster), and
whether the two gave the same bits (they must, for a change that keeps the arithmetic).

    .venv/bin/python benchmarks/kernel_ab.py --base HEAD~1 [--types Q4_1,Q5_K] [--rows 1536]
        [--cols 576] [--batches 1,4,8] [--threads 1] [--pairs 40]

The matrices are random weights quantized by gguf's own quantizer, or random blocks with sane
scales where it has none (tests/product_digests.py); the default size (SmolLM2's 1,536 x 576
up and gate) stays in L2, so the figures are the kernels' arithmetic. MINISERVE_NATIVE_ARCH
picks the build for both (x86-64-v3: the AVX2 one).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
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

KERNELS = "miniserve/runners/kernels"


def base_library(ref: str, out: Path) -> ctypes.CDLL:
    """The kernels at `ref` (git show of each kernel file), built as this tree's are built."""
    src = out / "kernels"
    src.mkdir()
    for path in native.KERNEL_FILES:
        rel = path.relative_to(ROOT).as_posix()
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:{rel}"], capture_output=True, check=True
        ).stdout
        (src / path.name).write_bytes(text)
    target = native.build_target()
    compiler = native._compiler()
    lib_path = out / "base.so"
    for arch in native.TARGETS[target]:
        cmd = [compiler, *native.FLAGS, *arch, str(src / native.SOURCE.name), "-o", str(lib_path)]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            lib = ctypes.CDLL(str(lib_path))
            native._declare(lib)
            return lib
    sys.exit(f"could not build the kernels at {ref}")


def matrix(name: str, rows: int, cols: int) -> tuple[StoredMatrix, np.ndarray]:
    qtype = getattr(gguf.GGMLQuantizationType, name)
    rng = np.random.default_rng(1)
    floats = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    try:
        data = np.ascontiguousarray(gguf.quants.quantize(floats, qtype))
    except NotImplementedError:  # no quantizer in gguf: random blocks
        data = np.ascontiguousarray(k_quant_blocks(rng, qtype, rows, cols))
    return StoredMatrix(data.ctypes.data, int(qtype), rows, cols, data.nbytes), data


def laid_out(lib, w: StoredMatrix, keep: list) -> StoredMatrix:
    """w as `lib` runs it: packed by its ms_pack where it packs the type, else as stored."""
    out = torch.empty(2 * w.nbytes + 4096, dtype=torch.uint8)  # (room for any packed form)
    at = out.data_ptr() + (-out.data_ptr()) % 64
    kind = lib.ms_pack(ctypes.byref(native.ms_mat(w)), w.cols, at, torch.get_num_threads())
    if kind < 0:
        return w
    keep.append(out)
    return StoredMatrix(at, kind, w.rows, w.cols, w.nbytes)


def product(lib, w: StoredMatrix, x: torch.Tensor, y: torch.Tensor) -> None:
    lib.ms_matmul(
        ctypes.byref(native.ms_mat(w)),
        x.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        w.cols,
        native.MATH_CODES["float32"],
        torch.get_num_threads(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="a git ref: the kernels to compare against")
    ap.add_argument("--types", default="Q4_1,Q8_0")
    ap.add_argument("--rows", type=int, default=1536)
    ap.add_argument("--cols", type=int, default=576)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=40)
    args = ap.parse_args()
    new = native.load()
    if new is None:
        sys.exit(f"no native library: {native.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = base_library(args.base, Path(tmp))
        print(
            f"{cpu_model()}, {native.isa()} kernels, {args.threads} thread(s), "
            f"{args.rows} x {args.cols}; this tree against {args.base}"
        )
        for name in args.types.split(","):
            w, _data = matrix(name, args.rows, args.cols)
            keep: list = []
            forms = {"base": (base, laid_out(base, w, keep)), "new": (new, laid_out(new, w, keep))}
            for batch in (int(b) for b in args.batches.split(",")):
                x = torch.randn(batch, args.cols)
                ys = {k: torch.empty(batch, args.rows) for k in forms}
                reps = max(1, int(2e8 / (2 * args.rows * args.cols * batch)))
                times: dict[str, list[float]] = {k: [] for k in forms}
                for pair in range(args.pairs):
                    for k in ("base", "new") if pair % 2 == 0 else ("new", "base"):
                        lib, m = forms[k]
                        product(lib, m, x, ys[k])
                        started = time.perf_counter()
                        for _ in range(reps):
                            product(lib, m, x, ys[k])
                        times[k].append((time.perf_counter() - started) / reps)
                flops = 2 * args.rows * args.cols * batch / 1e9
                ratio = statistics.median(b / n for b, n in zip(times["base"], times["new"]))
                same = torch.equal(ys["base"], ys["new"])
                print(
                    f"{name} x {batch}: base {flops / min(times['base']):.1f} "
                    f"(median {flops / statistics.median(times['base']):.1f}) GFLOPS, "
                    f"new {flops / min(times['new']):.1f} "
                    f"(median {flops / statistics.median(times['new']):.1f}); "
                    f"paired {ratio:.2f}x; {'same bits' if same else 'DIFFERENT BITS'}"
                )


if __name__ == "__main__":
    main()
