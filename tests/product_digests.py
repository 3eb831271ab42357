"""Digests of the native kernels' products over fixed inputs: every weight type a GGUF file's
matrices are read in as stored (the block types and F16), against 1, 3, 5, 7, 8, 16 and 64
activation rows -- one row (decode), few rows (4, 2 and 1 at a time), a group of 8, 16 (where
AMX tiles and the unpacked K-quant path start: AMX_ROWS / MANY_ROWS in decode.cpp), and a
prompt's chunk. tests/data/product_digests.json holds them, and every
leg of `make test` compares its build's products with them (test_stored.py), so that "the same
bits on every build" is checked on whichever CPU runs the suite, not only between AMX and the
AVX-512 loops in one process.

The inputs come from numpy's generators alone (torch's normal sampler has vector paths that
depend on the CPU), the 32-weight types quantized by gguf's own quantizer (exact float
operations), the K-quants as random block bytes with finite fp16 scales. numpy does not
promise its random streams across versions, nor gguf its rounding: a digest of the inputs is
committed too ("Q4_0 inputs"), so a changed input says so instead of blaming a kernel.

Where the arithmetic is documented to differ, a type has one digest per arithmetic: F16
weights' products use fused multiply-adds in the vector builds and separate ones in the plain
loops (kernels/quants.h), keyed "fma" and "plain". Float32 and bfloat16 weights (a transformers
model's, or a GGUF file's dequantized) are left out: their products keep one accumulator of the
vector's width (decode.cpp), so AVX-512 and AVX2 round differently by design; the float64
bounds hold them in every leg instead.

    python tests/product_digests.py      # prints this build's digests as JSON (to review)
    python tests/product_digests.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from miniserve.runners import native
from miniserve.runners.native import StoredMatrix

Q = gguf.GGMLQuantizationType
PATH = Path(__file__).parent / "data" / "product_digests.json"
ROWS = (1, 3, 5, 7, 8, 16, 64)
WEIGHT_ROWS = 37  # not a multiple of the threads' shares
BLOCK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL]
BLOCK_TYPES += [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
# the lattice types (kquants.h's MskqIq decoders)
IQ_LATTICE = [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M]
BLOCK_TYPES += IQ_LATTICE
# the types of 256-weight super-blocks (the K-quants' activations, kernels/kquants.h)
K_QUANTS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, *IQ_LATTICE}
# the types whose weights are random block bytes (gguf has no quantizer for them, or the bytes
# reach cases its quantizer would not), and where such a block keeps its fp16 scales: (offset,
# count) -- random bytes there are replaced by finite scales of a sane size; the other bytes
# (quants, 6-bit scales) stay random
SCALES = {Q.Q2_K: (80, 2), Q.Q3_K: (108, 1), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1)}
SCALES |= {Q.IQ4_XS: (0, 1), Q.IQ4_NL: (0, 1)}
SCALES |= {t: (0, 1) for t in IQ_LATTICE if t != Q.IQ1_M}
# IQ1_M's fp16 d is the top nibbles of its 4 scale words (bytes 48-55, word 0's the lowest)
SCALES |= {Q.IQ1_M: (48, 0)}
# the weight type whose products fuse multiply and add in the vector builds only
BY_ARITHMETIC = ("F16",)


# the 32-weight types again over rows whose last group of 8 blocks holds 1 or 2 (the vector
# loops' quarter-width tail; 43 blocks end in 3: the half-width one) or 5 (the whole-group loop
# with zero lanes): "Q4_0/41" and so on
SHORT_TAILS = (41, 42, 45)


def qtype(name: str):
    return Q[name.split("/")[0]]


def columns(name: str) -> int:
    """17 super-blocks for the K-quants (the AVX-512 loops' pieces of 8 blocks, and one more);
    43 blocks of 32 for the others (5 groups of 8 and a short one), or the blocks after the
    slash; an odd width for F16 (the n % 32 tail)."""
    if name == "F16":
        return 32 * 12 + 7
    if "/" in name:
        return 32 * int(name.split("/")[1])
    return 256 * 17 if Q[name] in K_QUANTS else 32 * 43


def block_weights(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype not in SCALES:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.05)
        w[:, :32] += np.float32(0.3)  # a block with an offset: the types with a min
        return np.ascontiguousarray(gguf.quants.quantize(w, qtype))
    return np.ascontiguousarray(k_quant_blocks(rng, qtype, rows, cols))


def k_quant_blocks(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """Weights of a type in SCALES (the K-quants, IQ4_NL, IQ4_XS) as random block bytes (every
    byte pattern is a valid block) with finite fp16 scales of a sane size: (rows, bytes per
    row) uint8."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offset, count = SCALES[qtype]
    if qtype == Q.IQ1_M:
        d = (rng.random((rows, cols // block)) * 0.01 + 0.001).astype(np.float16).view(np.uint16)
        words = data[:, :, offset : offset + 8].copy().view("<u2")  # (rows, blocks, 4)
        for t in range(4):
            words[..., t] = (words[..., t] & 0x0FFF) | (((d >> (4 * t)) & 15) << 12)
        data[:, :, offset : offset + 8] = words.view(np.uint8)
        return data.reshape(rows, -1)
    scales = (rng.random((rows, cols // block, count)) * 0.01 + 0.001).astype(np.float16)
    data[:, :, offset : offset + 2 * count] = scales.view(np.uint8).reshape(
        rows, cols // block, 2 * count
    )
    return data.reshape(rows, -1)


def weights(name: str, seed: int):
    """A StoredMatrix over the type's bytes, and the bytes (kept alive beside it)."""
    cols = columns(name)
    if name == "F16":
        w = np.random.default_rng(seed).standard_normal((WEIGHT_ROWS, cols), dtype=np.float32)
        data = np.ascontiguousarray((w * np.float32(0.1)).astype(np.float16).view(np.uint8))
    else:
        data = block_weights(qtype(name), WEIGHT_ROWS, cols, seed)
    return StoredMatrix(data.ctypes.data, int(qtype(name)), WEIGHT_ROWS, cols, data.nbytes), data


def activations(batch: int, cols: int) -> torch.Tensor:
    x = np.random.default_rng(1000 + batch).standard_normal((batch, cols), dtype=np.float32)
    return torch.from_numpy(x)


def arithmetic() -> str:
    """The F16 arithmetic of this build: "plain" (the plain loops) or "fma"."""
    return "plain" if (native.isa() or "").startswith("generic") else "fma"


def names() -> list[str]:
    short = [f"{t.name}/{n}" for t in BLOCK_TYPES if t not in K_QUANTS for n in SHORT_TAILS]
    return [t.name for t in BLOCK_TYPES] + short + ["F16"]


def seed(name: str) -> int:
    return len(name) * 100 + sum(map(ord, name))


def product_digest(name: str, batch: int) -> str:
    w, _keep = weights(name, seed(name))
    x = activations(batch, columns(name))
    y = native.matmul(w, x)
    return hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16]


def inputs_digest(name: str) -> str:
    """The weight bytes and every activation row count's rows of the type: what numpy and gguf
    make, no kernel involved."""
    h = hashlib.sha256()
    _w, data = weights(name, seed(name))
    h.update(data.tobytes())
    for batch in ROWS:
        h.update(activations(batch, columns(name)).numpy().tobytes())
    return h.hexdigest()[:16]


def digests_of(name: str) -> dict[str, str]:
    """This build's digests of one type: {"Q4_0 x 5": ..., "F16 x 1 fma": ...}."""
    tail = f" {arithmetic()}" if name in BY_ARITHMETIC else ""
    return {f"{name} x {batch}{tail}": product_digest(name, batch) for batch in ROWS}


def digests() -> dict[str, str]:
    """Every type's product digests and its inputs' digest."""
    out = {}
    for name in names():
        out.update(digests_of(name))
        out[f"{name} inputs"] = inputs_digest(name)
    return out


def committed() -> dict[str, str]:
    return json.loads(PATH.read_text())


if __name__ == "__main__":
    mine = digests()
    if "--write" in sys.argv:
        kept = committed() if PATH.exists() else {}
        kept.update(mine)
        PATH.write_text(json.dumps(dict(sorted(kept.items())), indent=1) + "\n")
        print(f"wrote {len(mine)} digests ({native.isa()}) to {PATH}")
    else:
        print(json.dumps(mine, indent=1))
