"""Synthetic GGUF models: the layer shapes of real models, random weights, the embedded
model's vocabulary (padded to the real model's size, or cut to its first N tokens and the
merges among them, for the tests' tiny files) -- for measuring speed and memory on bigger
models than the embedded 135M one where no model hub can be reached.

    python -m miniserve.bench.synthetic --shape llama-3.2-1b --quant q4_k_m [--vocab N] [--out DIR]

prints the file's path. The weights are seeded normals (std 0.02; norms 1), so activations stay
in range and the logits are spread out, not degenerate -- the tokens are gibberish, the cost of
computing them is a real model's. The file is written as F16 with the gguf package in
llama.cpp's naming (token_embd, blk.N.attn_q, ..., output_norm; `output` only when the
embeddings are not tied; q/k/v biases for qwen2), then quantized by llama.cpp's own quantizer
through llama-cpp-python (the K-quants need it: the gguf package only dequantizes them). Q8_0
and Q4_0 can also be made without llama-cpp-python by the gguf package's numpy quantizers: every
matrix in that one type, where llama.cpp's quantizer picks other types for some tensors (its
Q4_K_M: Q6_K for token_embd and half the attn_v / ffn_down).

Files go to `cache_root()/synthetic` as `<shape>-<vocab>-<quant>.gguf` (`...-numpy.gguf` from
the numpy quantizers) and are reused when present; the F16 file a quantization starts from is
kept beside them (`<shape>-<vocab>-f16.gguf`), so the other types of a shape start from it.

Not done, because random weights make them moot: Llama's q/k rows are not permuted for
llama.cpp's rope (convert_hf_to_gguf does this for real checkpoints), and Llama 3's rope scaling
(the `rope_freqs` tensor) is left out -- plain rope at the real theta.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import platform
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miniserve.core import architectures
from miniserve.runners.loader import cache_root, embedded_gguf

STD = 0.02  # the weights' standard deviation (the usual initializer range)
CONTEXT_LENGTH = 8192
FILLER_TOKEN = "<|synthetic_filler_{}|>"
# matrices llama.cpp's converter and quantizer keep in float32: the MoE router
F32_MATRICES = ("ffn_gate_inp.weight",)


@dataclass(frozen=True)
class Shape:
    arch: str  # llama.cpp's architecture name: a key of core/architectures.py's table
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    tied: bool = True
    qkv_bias: bool = False
    real_vocab: int = 0  # the real model's vocabulary size (for --vocab real)
    rotary: int = 0  # rope.dimension_count where fewer than head_dim turn (partial rotary)
    window: int = 0  # attention.sliding_window (0: none written)
    rope_linear: float = 0.0  # rope.scaling linear with this factor (0: no scaling)
    longrope: int = 0  # LongRoPE: rope.scaling.original_context_length (0: none)
    experts: int = 0  # MoE: expert_count, of which experts_used a token, each expert_ffn wide
    experts_used: int = 0
    expert_ffn: int = 0
    # whether the F16 file made as the source of a quantized one stays in the cache (the MoE's
    # is 15 GB: it goes once quantized; one made by asking for F16 itself stays)
    keep_source: bool = True

    def numbers(self, vocab: int) -> architectures.Shape:
        return architectures.Shape(
            D=self.hidden,
            I=self.ffn,
            H=self.heads,
            KV=self.kv_heads,
            hd=self.head_dim,
            V=vocab,
            rot=self.rotary,
            E=self.experts,
            F=self.expert_ffn,
        )


# The real configs (config.json of meta-llama/Llama-3.2-1B / -3B and Qwen/Qwen2.5-1.5B).
SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 500000.0, 1e-5, real_vocab=128256),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128, 500000.0, 1e-5, real_vocab=128256),
    "qwen2.5-1.5b": Shape(
        "qwen2", 1536, 8960, 28, 12, 2, 128, 1000000.0, 1e-6, qkv_bias=True, real_vocab=151936
    ),
    # Qwen/Qwen3-1.7B, microsoft/Phi-4-mini-instruct (partial rotary 0.75, LongRoPE from 4096),
    # google/gemma-3-1b-it (local layers of 512 positions, every 6th global)
    "qwen3-0.6b": Shape("qwen3", 1024, 3072, 28, 16, 8, 128, 1000000.0, 1e-6, real_vocab=151936),
    "qwen3-1.7b": Shape("qwen3", 2048, 6144, 28, 16, 8, 128, 1000000.0, 1e-6, real_vocab=151936),
    "phi-4-mini": Shape(
        "phi3",
        3072,
        8192,
        32,
        24,
        8,
        128,
        10000.0,
        1e-5,
        real_vocab=200064,
        rotary=96,
        longrope=4096,
    ),
    # Qwen/Qwen3-30B-A3B with 12 of its 48 layers (128 experts, 8 a token, 768 wide each)
    "qwen3-30b-a3b-12l": Shape(
        "qwen3moe",
        2048,
        6144,
        12,
        32,
        4,
        128,
        1000000.0,
        1e-6,
        tied=False,
        real_vocab=151936,
        experts=128,
        experts_used=8,
        expert_ffn=768,
        keep_source=False,
    ),
    "gemma-3-1b": Shape(
        "gemma3", 1152, 6912, 26, 4, 1, 256, 1000000.0, 1e-6, real_vocab=262144, window=512
    ),
    # HuggingFaceTB/SmolLM2-1.7B-Instruct: a kv head for every query head (no grouping)
    "smollm2-1.7b": Shape("llama", 2048, 8192, 24, 32, 32, 64, 130000.0, 1e-5, real_vocab=49152),
}

# quant name -> llama.cpp's file type (enum llama_ftype), as llama_model_quantize takes it
FTYPES = {
    "f16": 1,
    "q4_0": 2,
    "q8_0": 7,
    "q4_k_m": 15,
    "q5_k_m": 17,
    "q4_k_s": 14,
    "q5_k_s": 16,
    "q3_k_m": 12,
    "q2_k": 10,
    "q6_k": 18,
    "q5_0": 8,
    "q5_1": 9,
    "q4_1": 3,
    "iq4_xs": 30,
    "iq4_nl": 25,
    "iq3_s": 26,
    "iq3_m": 27,
    # (BLOCK_QUANTS: written here, not by llama.cpp's quantizer)
    "iq3_xxs": 23,
    "iq2_xxs": 19,
    "iq2_xs": 20,
    "iq2_s": 28,
    "iq1_s": 24,
    "iq1_m": 31,
}
NUMPY_QUANTS = ("q8_0", "q4_0")  # what the fallback (gguf's numpy quantizers) makes
# The lattice types llama.cpp's quantizer makes only with an importance matrix (which
# llama_model_quantize takes only from C++): their files are written here, every matrix of the
# type as blocks of random bytes (any bytes are a valid block: random weights, as the others),
# their fp16 scales set so that the weights' standard deviation is STD.
BLOCK_QUANTS = ("iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_s", "iq1_m")


def tensor_shapes(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape: rows = outputs, columns = inputs) of every tensor, as the
    architecture's declaration names them (core/architectures.py): each layer's, biases only
    where the shape has them; the output layer only where it is not tied; LongRoPE's factors."""
    spec, numbers = architectures.ARCHITECTURES[shape.arch], shape.numbers(vocab)
    model = {t.role: (t.suffix, numbers.dims(t)) for t in architectures.MODEL_TENSORS}
    out = [model["embed"]]
    if shape.longrope:
        half = numbers.numbers()["R"]
        out += [("rope_factors_long.weight", (half,)), ("rope_factors_short.weight", (half,))]
    for i in range(shape.layers):
        out += [
            (f"blk.{i}.{t.suffix}", numbers.dims(t))
            for t in spec.layer
            if t.kind != "bias" or shape.qkv_bias
        ]
    out.append(model["final_norm"])
    if not shape.tied:
        out.append(model["lm_head"])
    return out


def parameter_count(shape: Shape, vocab: int) -> int:
    return sum(int(np.prod(s)) for _, s in tensor_shapes(shape, vocab))


def random_tensor(name: str, dims: tuple[int, ...], seed: int) -> np.ndarray:
    """The tensor's values (float32), the same for a name and seed whatever the order: norms
    are 1 (with 1% noise), biases and matrices normal with std STD."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.startswith("rope_factors"):  # frequency divisors from 1 to 4
        return (1.0 + 3.0 * rng.random(dims)).astype(np.float32)
    if name.endswith("_norm.weight"):
        return (1.0 + 0.01 * rng.standard_normal(dims, dtype=np.float32)).astype(np.float32)
    values = rng.standard_normal(dims, dtype=np.float32)
    values *= STD
    return values


def _set_block_scales(blocks: np.ndarray, qtype, d: np.ndarray) -> None:
    """Every block's fp16 scale (blocks: (n, bytes a block) uint8) set to d (float16, (n,)):
    at its start, or IQ1_M's, the top nibbles of its 4 scale words (bytes 48-55)."""
    import gguf

    bits = d.astype(np.float16).view(np.uint16)
    if qtype == gguf.GGMLQuantizationType.IQ1_M:
        words = blocks[:, 48:56].copy().view("<u2")
        for t in range(4):
            words[:, t] = (words[:, t] & 0x0FFF) | (((bits >> (4 * t)) & 15) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    else:
        blocks[:, :2] = bits.view(np.uint8).reshape(-1, 2)


def random_blocks(name: str, dims: tuple[int, ...], quant: str, seed: int) -> np.ndarray:
    """A matrix of a BLOCK_QUANTS type as random block bytes, (rows, bytes a row) uint8, the
    same for a name and seed: the scale of every block the one that gives its weights a
    standard deviation of STD (measured over sample blocks by gguf's decoder)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[quant.upper()]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(dims[:-1])), dims[-1]
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    sample = data[:256].copy()
    _set_block_scales(sample, qtype, np.ones(len(sample), np.float16))
    unit = float(np.std(gguf.quants.dequantize(sample.reshape(1, -1), qtype)))
    _set_block_scales(data, qtype, np.full(len(data), STD / unit, np.float16))
    return data.reshape(rows, cols // block * size)


@functools.lru_cache(maxsize=1)
def _embedded_vocab():
    """The `tokenizer.*` fields of the embedded GGUF (its reader parses the whole vocabulary:
    seconds, so once)."""
    import gguf

    reader = gguf.GGUFReader(str(embedded_gguf()))
    return [f for name, f in reader.fields.items() if name.startswith("tokenizer.")]


def _copy_tokenizer(writer, fields, vocab: int, chat_template: str | None = None) -> int:
    """Copy the embedded model's tokenizer keys (and chat template, or `chat_template`). A
    larger `vocab` pads its token list with filler tokens (normal tokens no merge ever
    produces); a smaller one keeps its first `vocab` tokens and the merges among them (every
    merge's parts and result kept: its tokens are in merge order, so that is a whole, smaller
    BPE tokenizer, which a reader parses in a fraction of the time -- the tests' tiny files).
    Returns the vocab size."""
    import gguf

    tokens = next((f.contents() for f in fields if f.name == "tokenizer.ggml.tokens"), None)
    if tokens is None:
        raise ValueError("the embedded GGUF has no tokenizer.ggml.tokens")
    base = len(tokens)
    specials = [
        f.contents()
        for f in fields
        if f.name.startswith("tokenizer.ggml.") and f.name.endswith("_id")
    ]
    if vocab < base and (vocab < 512 or max(specials, default=0) >= vocab):
        raise ValueError(
            f"--vocab {vocab}: a cut of the embedded vocabulary keeps at least 512 tokens and "
            f"its special tokens (ids up to {max(specials, default=0)})"
        )
    kept = set(tokens[:vocab])
    for field in fields:
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value[:vocab] + [FILLER_TOKEN.format(i) for i in range(base, vocab)]
        elif field.name in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            fill = int(gguf.TokenType.NORMAL) if field.name.endswith("type") else 0.0
            value = list(value)[:vocab] + [fill] * (vocab - len(value))
        elif field.name == "tokenizer.ggml.merges" and vocab < base:
            value = [m for m in value if {*m.split(" "), m.replace(" ", "")} <= kept]
        elif field.name == "tokenizer.chat_template" and chat_template is not None:
            value = chat_template
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    return vocab


def _qwen3_size() -> int:
    from miniserve.bench.tokenizer_files import qwen3_vocab_size

    return qwen3_vocab_size()


def _qwen3_tokenizer(writer, vocab: int, chat_template: str | None = None) -> None:
    from miniserve.bench.tokenizer_files import add_qwen3_tokenizer

    add_qwen3_tokenizer(writer, vocab, chat_template)


def embedded_vocab_size() -> int:
    for field in _embedded_vocab():
        if field.name == "tokenizer.ggml.tokens":
            return len(field.data)
    raise ValueError("the embedded GGUF has no tokenizer.ggml.tokens")


# name -> (its vocabulary size, a function writing its keys into a GGUFWriter for a vocab)
TOKENIZERS = {
    "embedded": (
        lambda: embedded_vocab_size(),
        lambda w, n, template=None: _copy_tokenizer(w, _embedded_vocab(), n, template),
    ),
    "qwen3": (lambda: _qwen3_size(), lambda w, n, template=None: _qwen3_tokenizer(w, n, template)),
}


def write_gguf(
    path: Path,
    shape_name: str,
    vocab: int | None = None,
    quant: str = "f16",
    seed: int = 0,
    progress=None,
    tokenizer: str = "embedded",
) -> Path:
    """Write the synthetic model of SHAPES[shape_name] (write_shape). Returns `path`."""
    return write_shape(
        path, SHAPES[shape_name], shape_name, vocab, quant, seed, progress, tokenizer
    )


def write_shape(
    path: Path,
    shape: Shape,
    label: str,
    vocab: int | None = None,
    quant: str = "f16",
    seed: int = 0,
    progress=None,
    tokenizer: str = "embedded",
    context_length: int = CONTEXT_LENGTH,
    chat_template: str | None = None,
) -> Path:
    """Write a model of `shape` as `quant` (f16, q8_0 / q4_0 by the numpy quantizers, or a
    BLOCK_QUANTS type as random blocks),
    tensor by tensor (never the whole model in memory), whole or not at all (a .partial beside
    it, renamed), with a tokenizer from TOKENIZERS: the embedded model's (padded with filler
    tokens to `vocab`, or cut to its first `vocab` tokens and their merges) or Qwen3's
    (tokenizer.json and chat template; `make tokenizer-qwen3`).
    Returns `path`."""
    import gguf
    from gguf.quants import quant_shape_to_byte_shape, quantize

    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose from {', '.join(TOKENIZERS)}")
    say = progress or (lambda m: None)
    spec = architectures.ARCHITECTURES[shape.arch]
    qtype = {
        "f16": None,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
    }.get(quant)
    if quant in BLOCK_QUANTS:
        qtype = gguf.GGMLQuantizationType[quant.upper()]
    elif qtype is None and quant != "f16":
        raise ValueError(
            f"{quant} is made by llama.cpp's quantizer (make()); written here: f16, "
            f"{', '.join(NUMPY_QUANTS)}, {', '.join(BLOCK_QUANTS)}"
        )
    vocab = vocab or TOKENIZERS[tokenizer][0]()
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(partial), shape.arch)
    writer.add_name(f"synthetic {label} (random weights)")
    writer.add_type("model")
    base_vocab = TOKENIZERS[tokenizer][0]()
    writer.add_description(
        f"random weights (seed {seed}, std {STD}) in the shape of {label}; "
        f"{'the embedded model' if tokenizer == 'embedded' else tokenizer}'s tokenizer"
        + (f", padded from {base_vocab} to {vocab} tokens" if vocab > base_vocab else "")
    )
    writer.add_context_length(context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(FTYPES[quant])
    writer.add_vocab_size(vocab)
    if shape.arch == "llama" or shape.rotary:
        writer.add_rope_dimension_count(shape.rotary or shape.head_dim)
    if shape.window:
        writer.add_sliding_window(shape.window)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.rope_linear:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(shape.rope_linear)
    if shape.longrope:
        writer.add_rope_scaling_orig_ctx_len(shape.longrope)
        scale = context_length / shape.longrope  # Phi-3's converter's attention factor
        writer.add_rope_scaling_attn_factors((1 + np.log(scale) / np.log(shape.longrope)) ** 0.5)
    # where the head is not hidden / heads, and always where the q/k norms are per head, as
    # llama.cpp's converter writes qwen3
    if shape.head_dim != shape.hidden // shape.heads or spec.qk_norm:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    TOKENIZERS[tokenizer][1](writer, vocab, chat_template)  # the tokenizer's own template if None

    tensors = tensor_shapes(shape, vocab)
    for name, dims in tensors:
        if len(dims) == 1 or name.endswith(F32_MATRICES):  # as the converters keep them
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        elif qtype is None:
            writer.add_tensor_info(name, dims, np.dtype(np.float16), 2 * int(np.prod(dims)))
        else:
            byte_shape = quant_shape_to_byte_shape(dims, qtype)
            writer.add_tensor_info(
                name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = len(tensors)
    for i, (name, dims) in enumerate(tensors):
        if quant in BLOCK_QUANTS and not (len(dims) == 1 or name.endswith(F32_MATRICES)):
            data = random_blocks(name, dims, quant, seed)
        else:
            values = random_tensor(name, dims, seed)
            if len(dims) == 1 or name.endswith(F32_MATRICES):
                data = values
            elif qtype is None:
                data = values.astype(np.float16)
            else:
                data = quantize(values, qtype)
        writer.write_tensor_data(data)
        if name.endswith("weight") and (i % 20 == 0 or i == total - 1):
            say(f"  wrote {i + 1}/{total} tensors")
    writer.close()
    partial.rename(path)
    return path


def llama_quantize(source: Path, out: Path, quant: str, threads: int = 0) -> Path:
    """llama.cpp's quantizer (llama-cpp-python's llama_model_quantize) from `source` (F16)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant]
    params.nthread = threads
    partial = out.with_name(out.name + ".partial")
    code = llama_cpp.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if code != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({source.name} -> {quant}) returned {code}")
    partial.rename(out)
    return out


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def default_dir() -> Path:
    return cache_root() / "synthetic"


def file_name(
    shape_name: str, vocab: int, quant: str, numpy_quant: bool = False, tokenizer: str = "embedded"
) -> str:
    """<shape>-<vocab>-<quant>.gguf; `-numpy` before .gguf for the numpy quantizer's files
    (every matrix in the one type: not what llama.cpp's quantizer makes of the same type), and
    the tokenizer's name where it is not the embedded model's."""
    own = "" if tokenizer == "embedded" else f"-{tokenizer}"
    return f"{shape_name}-{vocab}{own}-{quant}{'-numpy' if numpy_quant else ''}.gguf"


def target(
    shape_name: str,
    quant: str,
    vocab: int,
    out_dir: Path,
    numpy_only: bool = False,
    tokenizer: str = "embedded",
) -> Path:
    """Where make() puts (or finds) the file."""
    if quant in BLOCK_QUANTS:  # written here, always
        return Path(out_dir) / file_name(shape_name, vocab, quant, False, tokenizer)
    use_numpy = quant != "f16" and (numpy_only or not llama_cpp_available())
    if use_numpy and quant not in NUMPY_QUANTS:
        raise ValueError(
            f"{quant} needs llama-cpp-python (llama.cpp's quantizer); without "
            f"it only {', '.join(NUMPY_QUANTS)} can be made"
        )
    return Path(out_dir) / file_name(shape_name, vocab, quant, use_numpy, tokenizer)


def make(
    shape_name: str,
    quant: str = "q4_k_m",
    vocab: int | None = None,
    out_dir: Path | None = None,
    seed: int = 0,
    numpy_only: bool = False,
    progress=None,
    tokenizer: str = "embedded",
) -> Path:
    """The synthetic model's file, made once (reused when present)."""
    say = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; choose from {', '.join(SHAPES)}")
    if quant not in FTYPES:
        raise ValueError(f"unknown quant {quant!r}; choose from {', '.join(FTYPES)}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose from {', '.join(TOKENIZERS)}")
    vocab = vocab or TOKENIZERS[tokenizer][0]()
    out_dir = Path(out_dir) if out_dir else default_dir()
    out = target(shape_name, quant, vocab, out_dir, numpy_only, tokenizer)
    use_numpy = out.name.endswith("-numpy.gguf")
    if out.is_file():
        return out
    if quant == "f16" or use_numpy or quant in BLOCK_QUANTS:
        say(
            f"writing {out.name} ({parameter_count(SHAPES[shape_name], vocab) / 1e9:.2f} B "
            "parameters"
            + (", gguf's numpy quantizer" if use_numpy else "")
            + (", blocks of random bytes" if quant in BLOCK_QUANTS else "")
            + ") ..."
        )
        return write_gguf(out, shape_name, vocab, quant, seed, say, tokenizer)
    made_here = not target(shape_name, "f16", vocab, out_dir, tokenizer=tokenizer).is_file()
    f16 = make(shape_name, "f16", vocab, out_dir, seed, progress=say, tokenizer=tokenizer)
    say(f"quantizing {f16.name} -> {out.name} with llama.cpp ...")
    llama_quantize(f16, out, quant)
    if made_here and not SHAPES[shape_name].keep_source:  # (an F16 asked for itself stays)
        say(f"removing {f16.name} ({f16.stat().st_size / 2**30:.1f} GiB), the quantizer's source")
        f16.unlink()
    return out


def tensor_types(path: Path) -> dict[str, list[str]]:
    """{ggml type: [tensor names]} of a GGUF."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    types: dict[str, list[str]] = {}
    for t in reader.tensors:
        types.setdefault(t.tensor_type.name, []).append(t.name)
    return types


def summarize_types(path: Path) -> str:
    """One line: each type with how many tensors and which kinds (blk.N. stripped)."""
    parts = []
    for kind, names in sorted(tensor_types(path).items()):
        roles = sorted({n.split(".", 2)[-1] if n.startswith("blk.") else n for n in names})
        parts.append(f"{kind} x{len(names)} ({', '.join(roles)})")
    return "; ".join(parts)


def block_amx() -> None:
    """Make llama.cpp run without its AMX weight buffers in this process (and its children):
    a seccomp filter fails arch_prctl(ARCH_REQ_XCOMP_PERM) with EPERM, so ggml's AMX init
    reports "AMX is not ready to be used!" and the weights go to its other extra buffer
    (CPU_REPACK) or stay mapped -- llama.cpp's defaults on a CPU without AMX. Why: the AMX
    kernels of llama-cpp-python 0.3.36 as built here die on this CPU (SIGILL on `tilezero` in
    ggml_backend_amx_mul_mat at the first prompt; peer.py saw a segfault there), a ggml bug
    (its tile config, llama.cpp PR #26954), not a missing permission: AMX itself works here.
    Irreversible for the process; x86-64 Linux only (elsewhere a no-op)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    no_new_privs, set_seccomp, mode_filter = 38, 22, 2
    audit_arch_x86_64, nr_arch_prctl, req_xcomp_perm = 0xC000003E, 158, 0x1023
    allow, errno_eperm = 0x7FFF0000, 0x00050000 | 1
    ld_abs, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET
    program = [
        (ld_abs, 0, 0, 4),
        (jeq, 1, 0, audit_arch_x86_64),
        (ret, 0, 0, allow),
        (ld_abs, 0, 0, 0),
        (jeq, 0, 3, nr_arch_prctl),
        (ld_abs, 0, 0, 16),
        (jeq, 0, 1, req_xcomp_perm),
        (ret, 0, 0, errno_eperm),
        (ret, 0, 0, allow),
    ]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(program), ctypes.cast(code, ctypes.c_void_p))
    if (
        libc.prctl(no_new_privs, 1, 0, 0, 0) != 0
        or libc.prctl(set_seccomp, mode_filter, ctypes.byref(prog), 0, 0) != 0
    ):
        raise OSError(ctypes.get_errno(), "could not install the seccomp filter")


def check(path: Path, new_tokens: int = 8, threads: int = 2, amx: bool = False) -> list[int]:
    """Load the file in llama-cpp-python (its default buffers; AMX off unless `amx`, see
    block_amx -- which then stays off in this process) and decode a few greedy tokens."""
    import llama_cpp

    if not amx:
        block_amx()
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    ids = llm.tokenize(b"The history of science is the study of", add_bos=False)
    tokens = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        tokens.append(token)
        if len(tokens) >= new_tokens:
            break
    del llm
    return tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miniserve.bench.synthetic", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--quant", default="q4_k_m", choices=sorted(FTYPES))
    parser.add_argument(
        "--vocab",
        default=None,
        help="pad the embedded vocabulary with filler tokens up to N tokens "
        "('real': the real model's size, e.g. 128256 for Llama 3), or keep its first N "
        "(at least 512) and the merges among them",
    )
    parser.add_argument("--out", default=None, help="folder (default: the cache's synthetic/)")
    parser.add_argument(
        "--tokenizer",
        default="embedded",
        choices=sorted(TOKENIZERS),
        help="the embedded model's vocabulary (default), or Qwen3's (make tokenizer-qwen3)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--numpy",
        action="store_true",
        help="q8_0 / q4_0 by gguf's numpy quantizers, without llama-cpp-python",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="then load it in llama-cpp-python and decode a few tokens",
    )
    parser.add_argument("--types", action="store_true", help="also list the tensor types")
    args = parser.parse_args(argv)
    vocab = None
    if args.vocab:
        vocab = SHAPES[args.shape].real_vocab if args.vocab == "real" else int(args.vocab)
    try:
        vocab = vocab or TOKENIZERS[args.tokenizer][0]()
        existed = target(
            args.shape,
            args.quant,
            vocab,
            Path(args.out or default_dir()),
            args.numpy,
            args.tokenizer,
        ).is_file()
        start = time.perf_counter()
        path = make(
            args.shape,
            args.quant,
            vocab,
            args.out,
            args.seed,
            args.numpy,
            tokenizer=args.tokenizer,
        )
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    took = time.perf_counter() - start
    print(
        f"{path.stat().st_size / 2**20:.0f} MiB, "
        + ("already there" if existed else f"made in {took:.1f} s"),
        file=sys.stderr,
    )
    if args.types:
        print(summarize_types(path), file=sys.stderr)
    if args.check:
        print(f"llama.cpp decodes: {check(path)}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
