"""A GGUF model run with its weights as stored: the file memory-mapped, each matrix used where it
lies in its own block format (Q4_K, Q6_K, Q8_0, Q4_1, ...) by the native forward pass.

    GGUF file --mmap--> tensors in their block formats --(StoredMatrix: address, type, shape)-->
        decode.cpp: each activation row quantized per block to int8 once per product, then
        integer dot products per block; norms, RoPE, attention and the residual stream float32

Nothing is dequantized at start and nothing is written to disk for the weights: the pages are
the file's, shared with every other process that maps it, read in as the first passes touch
them. One exception, in memory: where the build has a packed form of a type (Q4_K and Q6_K, 16
rows' blocks side by side in the AVX-512 build, 8 in the AVX2 one; Q5_K, IQ4_XS, Q3_K and Q2_K
in the AVX-512 build; the 32-weight types, IQ4_NL among them; native.pack), a layer's matrices
of it are laid out anew at load (~0.3 s for Qwen3-1.7B's 0.7 GB) and their file pages handed
back, so that they are resident once; the products are the same bits. What is read at start:
the header and tensor table (miniserve/runners/gguf_file.py, checked before any native code
sees a byte), the tokenizer (built by transformers from the file once, then kept in the cache
folder keyed by the header's hash), and small float32 tensors (norms, biases) copied out. A
tensor of a type the kernels do not run in place (the ternary TQ1_0 / TQ2_0) is dequantized to
float32 at load by the gguf package, and the load says so.

Architectures: those of miniserve/core/architectures.py, each one declaration (its tensors,
norms, RoPE, windows, activation, ...) that this file reads. llama files hold q and k rows
permuted for RoPE on adjacent pairs (llama.cpp's converter does that); decode.cpp rotates pairs
for them (rope_pairs). Llama 3's RoPE scaling comes as a `rope_freqs` tensor of frequency
divisors, linear scaling as a factor, Phi-3's LongRoPE as two tensors of divisors and a factor
of cos and sin.
"""

from __future__ import annotations

import hashlib
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from miniserve.core.architectures import (
    ARCHITECTURES,
    MODEL_TENSORS,
    Architecture,
    Shape,
    native_names,
)
from miniserve.runners import native
from miniserve.runners.gguf_file import GGUFFile, GGUFFileError

# positions the RoPE tables cover at most (cos and sin: positions x rotary dims / 2 float32 each)
MAX_POSITIONS = 32768
F32, F16, BF16 = 0, 1, 30
FLOAT_TYPES = {F32: "float32", F16: "float16", BF16: "bfloat16"}  # torch's dtype names
# the matrix types the kernels run in place: every ggml block type a GGUF of these families
# holds but the ternary TQ1_0 / TQ2_0 (a file of those loads dequantized by default: as stored
# they would become float32 copies at every start)
IN_PLACE = {F32, F16, BF16, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 29}

Progress = Callable[[str], None]


def runs_as_stored(path: Path) -> bool:
    """Whether a GGUF's architecture runs with its weights as stored (its header alone is
    read). A damaged file says yes: loading it as stored names what is wrong."""
    try:
        with GGUFFile(path) as f:
            arch = ARCHITECTURES.get(f.architecture)
            scaling = str(f.get(f"{f.architecture}.rope.scaling.type", "none") or "none")
            matrices = {t.type for t in f.tensors.values() if len(t.shape) >= 2}
            return arch is not None and scaling in arch.rope_scalings and matrices <= IN_PLACE
    except (GGUFFileError, OSError):
        return True


class StoredModelError(ValueError):
    """The file cannot run with its weights as stored; the message says why in one sentence."""


@dataclass
class StoredConfig:
    """What the engine and the runner read of a model's configuration, in transformers' names."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int  # what the file says it was trained for (before MAX_POSITIONS)
    rotary_dim: int = 0  # the dimensions of a head RoPE turns (partial rotary: < head_dim)
    num_experts: int = 0  # experts (0: a dense feed-forward), of which a token uses
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # an expert's feed-forward width
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict)


def _say(progress: Progress | None, message: str) -> None:
    (progress or (lambda m: print(m, file=sys.stderr, flush=True)))(message)


class GGUFWeights:
    """A GGUF file's model: its configuration and its tensors, where they lie (a runner is made
    from it by StoredRunner). Raises StoredModelError for a file it cannot run."""

    def __init__(
        self, path: Path, progress: Progress | None = None, first=None, reserve: bool = False
    ):
        """first(self), when given, runs once the header, configuration and tensor table are
        read and before the weights' pages are: the loader reads the tokenizer there, so that
        the parse's freed memory is handed back before the file's pages come in (the peak).

        reserve: the native runner's arena for the packed matrices is made before first(),
        sized from the tensor table (_run_in_place), and its pages faulted in on another core
        meanwhile (native.reserve_arena; taken by take_arena), and the scales' check hands the
        pages of the matrices to be packed back as it reads them, so that the arena and those
        matrices as stored are not resident together (packing reads them back)."""
        self.path = Path(path)
        try:
            self.file = GGUFFile(self.path)
        except GGUFFileError as e:
            raise StoredModelError(str(e)) from None
        f = self.file
        if f.architecture not in ARCHITECTURES:
            raise StoredModelError(
                f"{self.path.name}: architecture '{f.architecture}' does not run with its "
                f"weights as stored (these do: {native_names()})"
            )
        self.arch = f.architecture
        self.spec: Architecture = ARCHITECTURES[self.arch]
        if native.load() is None:  # before anything is read: nothing runs the blocks here
            raise StoredModelError(
                "weights as stored need the native runner: "
                + (native.unavailable_reason() or "it is not available")
            )
        self.config = self._config()
        self._kept: list = []  # float32 copies the runner points to
        self.converted: list[str] = []  # tensors dequantized at load (types not run in place)
        names = self._names()
        packed: set[str] = set()
        self._arena = None
        if reserve:
            plan = self._run_in_place()
            packed = {name for name, m in plan.items() if native.packed_bytes(m)}
            self._arena = native.reserve_arena([plan], None)
        if first is not None:
            first(self)
        try:
            f.check_scales([n for n in names.values() if n in f.tensors], release=packed)
        except GGUFFileError as e:
            raise StoredModelError(str(e)) from None
        cfg = self.config
        model = self._tensors("")
        self.embed, self.final_norm = model["embed"], model["final_norm"]
        self.lm_head = model.get("lm_head", self.embed)  # absent: tied to the embedding
        self.layers = [self._layer(i) for i in range(cfg.num_hidden_layers)]
        if self.converted:
            _say(
                progress,
                f"{self.path.name}: {len(self.converted)} tensors of types the kernels "
                f"do not run in place were dequantized to float32 at load "
                f"({', '.join(sorted(set(self.converted)))})",
            )

    def _run_in_place(self) -> dict[str, native.StoredMatrix]:
        """The matrices the runner reads as stored and so may pack (the layers' and the output
        layer's, which is the embedding where none is stored), from the tensor table alone, as
        matrix() will make them (address 0): file name -> StoredMatrix. What matrix() refuses
        or converts is left out; its error comes when the layers are made."""
        shape, out = self.shape(), {}
        head = next(t for t in MODEL_TENSORS if t.role == "lm_head")
        if head.suffix not in self.file.tensors:
            head = next(t for t in MODEL_TENSORS if t.role == "embed")
        wanted = [(head.suffix, shape.dims(head))] + [
            (f"blk.{i}.{t.suffix}", shape.dims(t))
            for i in range(self.config.num_hidden_layers)
            for t in self.spec.layer
        ]
        for name, dims in wanted:
            info = self.file.tensors.get(name)
            if info is None or len(dims) < 2 or tuple(info.shape) != tuple(dims):
                continue
            stored = _in_place(info, dims)
            if stored is not None:
                out[name] = stored
        return out

    def take_arena(self):
        """The arena reserved at load (reserve=True), once: the next caller gets None."""
        arena, self._arena = self._arena, None
        return arena

    # -- configuration ---------------------------------------------------------------------
    def _meta(self, key: str, default=None, required: bool = True):
        value = self.file.get(f"{self.arch}.{key}", None)
        if value is None:
            if required and default is None:
                raise StoredModelError(
                    f"{self.path.name}: the header has no "
                    f"'{self.arch}.{key}'; the file is incomplete"
                )
            return default
        return value.item() if isinstance(value, np.generic) else value

    def _count(self, key: str, default=None, low: int = 1, high: int = 1 << 20) -> int:
        """A whole number of the header, one for every layer (a per-layer list must hold one
        value), within [low, high]; else StoredModelError naming the key."""
        value = self._meta(key, default)
        if isinstance(value, (list, tuple, np.ndarray)):
            values = {int(v) for v in value}
            if len(values) != 1:
                raise StoredModelError(
                    f"{self.path.name}: '{self.arch}.{key}' differs from "
                    "layer to layer, which does not run as stored"
                )
            value = values.pop()
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not low <= number <= high or number != value:
            raise StoredModelError(
                f"{self.path.name}: '{self.arch}.{key}' is {value!r}; a whole "
                f"number from {low} to {high} was expected"
            )
        return number

    def _config(self) -> StoredConfig:
        spec = self.spec
        D = self._count("embedding_length")
        heads = self._count("attention.head_count", high=4096)
        kv = self._count("attention.head_count_kv", heads, high=heads)
        if heads % kv:
            raise StoredModelError(
                f"{self.path.name}: {heads} attention heads do not share {kv} kv heads evenly"
            )
        head_dim = self._count("attention.key_length", max(D // heads, 2), low=2, high=1024)
        if head_dim % 2:
            raise StoredModelError(
                f"{self.path.name}: head size {head_dim} is odd (RoPE turns pairs)"
            )
        rotary = self._count("rope.dimension_count", head_dim, low=2, high=head_dim)
        if rotary % 2 or (rotary != head_dim and not spec.partial_rotary):
            raise StoredModelError(
                f"{self.path.name}: '{self.arch}.rope.dimension_count' is {rotary}; "
                + (
                    f"an even number up to the head size {head_dim} was expected"
                    if spec.partial_rotary
                    else f"{self.arch} turns the whole head ({head_dim})"
                )
            )
        layers = self._count("block_count", high=4096)
        first = next(t for t in spec.layer if len(t.dims) >= 2)
        if f"blk.{layers - 1}.{first.suffix}" not in self.file.tensors:
            raise StoredModelError(
                f"{self.path.name}: the header says {layers} layers, but "
                f"tensor 'blk.{layers - 1}.{first.suffix}' is missing"
            )
        vocab = self.file.tensors.get("token_embd.weight")
        if vocab is None or len(vocab.shape) != 2:
            raise StoredModelError(f"{self.path.name}: no 2-D tensor 'token_embd.weight'")
        context = self._count("context_length", 2048, high=1 << 24)
        moe = {}
        if spec.moe:  # experts: the feed-forward width is an expert's
            experts = self._count("expert_count", high=4096)
            moe = dict(
                num_experts=experts,
                num_experts_per_tok=self._count("expert_used_count", high=experts),
                moe_intermediate_size=self._count("expert_feed_forward_length"),
            )
        window = None
        if spec.window is not None:
            window = int(self._meta("attention.sliding_window", spec.window.default, False) or 0)
        return StoredConfig(
            model_type=spec.model_type,
            hidden_size=D,
            intermediate_size=moe.get("moe_intermediate_size")
            or self._count("feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            vocab_size=int(vocab.shape[0]),
            max_position_embeddings=min(context, MAX_POSITIONS),
            rms_norm_eps=float(self._meta("attention.layer_norm_rms_epsilon", spec.eps)),
            rope_theta=float(self._meta("rope.freq_base", spec.theta)),
            context_length=context,
            rotary_dim=rotary,
            sliding_window=window or None,
            **moe,
        )

    def shape(self) -> Shape:
        """The numbers the table's tensor symbols name (core/architectures.py)."""
        c = self.config
        return Shape(
            D=c.hidden_size,
            I=c.intermediate_size,
            H=c.num_attention_heads,
            KV=c.num_key_value_heads,
            hd=c.head_dim,
            V=c.vocab_size,
            rot=c.rotary_dim,
            E=c.num_experts,
            F=c.moe_intermediate_size,
        )

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it sees every position), by the table's pattern:
        every `global_every`-th layer global, the others local where the file has a window."""
        window, size = self.spec.window, self.config.sliding_window
        every = window.global_every if window is not None else 0
        return [
            None if window is None or not size or (every and (i + 1) % every == 0) else size
            for i in range(self.config.num_hidden_layers)
        ]

    def scores_scale(self) -> float | None:
        """The attention scores' factor where the table gives one (else None: head_dim^-0.5)."""
        c, spec = self.config, self.spec
        if spec.attn_scale is None:
            return None
        return spec.attn_scale(
            {
                "D": c.hidden_size,
                "H": c.num_attention_heads,
                "hd": c.head_dim,
                "layers": c.num_hidden_layers,
            }
        )

    # -- tensors ---------------------------------------------------------------------------
    def _names(self) -> dict:
        """Every tensor the architecture names, present or not: role -> file name."""
        names = {t.role: t.suffix for t in MODEL_TENSORS}
        for i in range(self.config.num_hidden_layers):
            names.update({f"{i}.{t.role}": f"blk.{i}.{t.suffix}" for t in self.spec.layer})
        return names

    def _tensors(self, prefix: str) -> dict:
        """The tensors of a layer (prefix "blk.N.") or of the model (""), by role, as the
        table declares them: matrices where they lie, vectors as float32 copies; an optional
        one that is absent is left out; a required one that is absent, or any of another
        shape than the header's numbers make it, is StoredModelError naming it."""
        shape, out = self.shape(), {}
        for t in self.spec.layer if prefix else MODEL_TENSORS:
            name, dims = prefix + t.suffix, shape.dims(t)
            if not t.required and name not in self.file.tensors:
                continue
            if len(dims) == 1:
                out[t.role] = self.vector(name, dims[0])
            else:
                out[t.role] = self.matrix(name, dims)
        return out

    def _tensor(self, name: str):
        info = self.file.tensors.get(name)
        if info is None:
            raise StoredModelError(f"{self.path.name}: tensor '{name}' is missing")
        return info

    def matrix(self, name: str, shape: tuple[int, ...]):
        """A matrix where it lies (a StoredMatrix), or a float32 copy for a type the kernels do
        not run in place."""
        info = self._tensor(name)
        if tuple(info.shape) != tuple(shape):
            raise StoredModelError(
                f"{self.path.name}: tensor '{name}' is {info.shape}, the "
                f"header's sizes make it {shape}"
            )
        rows, cols = math.prod(shape[:-1]), shape[-1]  # experts: E x F rows one after another
        shape = (rows, cols)
        if info.type in FLOAT_TYPES and info.type != F16:
            dtype = getattr(torch, FLOAT_TYPES[info.type])
            t = _tensor_view(self.file.data(name), dtype).view(shape)
            self._kept.append(t)  # bfloat16 / float32 where they lie
            return t
        stored = _in_place(info, shape, self.file.address(name))
        if stored is not None:
            return stored
        self.converted.append(info.type_name)
        return self._dequantized(name, info, shape)

    def _dequantized(self, name, info, shape) -> torch.Tensor:
        import gguf

        data = gguf.quants.dequantize(self.file.data(name), gguf.GGMLQuantizationType(info.type))
        t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).view(shape)
        self._kept.append(t)
        return t

    def vector(self, name: str, n: int, optional: bool = False) -> torch.Tensor | None:
        """A small tensor (a norm, a bias) as a float32 copy."""
        info = self.file.tensors.get(name)
        if info is None:
            if optional:
                return None
            raise StoredModelError(f"{self.path.name}: tensor '{name}' is missing")
        if info.type in FLOAT_TYPES:  # a copy, even of float32: the pass never reads the map
            # for it (each read there maps the file's pages around it: with the large page-cache
            # folios of recent kernels, up to 2 MB of the next matrix a vector, ~120 MiB a pass
            # for Qwen3-1.7B's 113 norms, resident beside the packed copies)
            view = _tensor_view(self.file.data(name), getattr(torch, FLOAT_TYPES[info.type]))
            t = view.to(torch.float32, copy=True)
        else:
            t = self._dequantized(name, info, (-1,))
        if t.numel() != n:
            raise StoredModelError(
                f"{self.path.name}: tensor '{name}' has {t.numel()} numbers, "
                f"the header's sizes make it {n}"
            )
        return t.contiguous()

    def _layer(self, i: int) -> dict:
        """A layer's tensors by role; q/k/v biases as one vector (zeros for an absent one)."""
        w = self._tensors(f"blk.{i}.")
        biases = [w.pop(b, None) for b in ("bq", "bk", "bv")]
        if any(t is not None for t in biases):
            n = self.shape().numbers()
            w["bqkv"] = torch.cat(
                [
                    t if t is not None else torch.zeros(n[size])
                    for t, size in zip(biases, ("q", "kv", "kv"))
                ]
            )
        return w

    # -- what the rest of the app asks -------------------------------------------------------
    def num_parameters(self) -> int:
        return sum(int(np.prod(t.shape)) for t in self.file.tensors.values())

    def weight_bytes(self) -> int:
        """Bytes of weights read per decoded token (the embedding is looked up, not read,
        unless it is also the output layer; of the experts' matrices, the K a token uses)."""
        return sum(self._per_token(name, t.nbytes) for name, t in self._read_per_token())

    def weight_elements(self) -> int:
        """Weights multiplied per decoded token: the tensors weight_bytes() counts."""
        return sum(self._per_token(name, math.prod(t.shape)) for name, t in self._read_per_token())

    def _read_per_token(self):
        skip = {"token_embd.weight"} if "output.weight" in self.file.tensors else set()
        return [(name, t) for name, t in self.file.tensors.items() if name not in skip]

    def _per_token(self, name: str, amount: int) -> int:
        """Of an experts' tensor (E experts), the share of the K a token uses; else all."""
        cfg = self.config
        if "_exps." in name and cfg.num_experts:
            return amount * cfg.num_experts_per_tok // cfg.num_experts
        return amount

    def file_type(self) -> str:
        """What the file's weights are, as llama.cpp names the mix (q4_k_m, q8_0, ...), else
        the most common matrix type."""
        import gguf

        kind = self.file.get("general.file_type")
        try:
            return gguf.LlamaFileType(int(kind)).name.removeprefix("MOSTLY_").lower()
        except (TypeError, ValueError):
            pass
        types = [t.type_name for t in self.file.tensors.values() if len(t.shape) == 2]
        return max(set(types), key=types.count).lower() if types else "unknown"

    def header_key(self) -> str:
        """A hash of the header (metadata and tensor table): what names this file's tokenizer
        in the cache, without reading the weights."""
        with open(self.path, "rb") as f:
            return hashlib.sha256(f.read(self.file.header_bytes)).hexdigest()[:16]


def _in_place(info, dims, address: int = 0) -> native.StoredMatrix | None:
    """A matrix of `dims` (experts: E x F rows one after another) as the kernels read it where
    it lies -- F16, or blocks whose rows fill the tensor's bytes -- at `address`; else None
    (bfloat16 and float32 are viewed as they are, other types dequantized: GGUFWeights.matrix)."""
    rows, cols = math.prod(dims[:-1]), dims[-1]
    if info.type in FLOAT_TYPES and info.type != F16:
        return None
    if native.row_bytes(info.type, cols) * rows != info.nbytes:
        return None
    return native.StoredMatrix(address, info.type, rows, cols, info.nbytes)


def _tensor_view(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the file's read-only mapped bytes (nothing writes through it: the runner
    only reads weights), without PyTorch's warning about buffers it cannot write."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype)


def rope_tables(
    rotary: int,
    theta: float,
    positions: int,
    scale: float = 1.0,
    divisors: torch.Tensor | None = None,
    factor: float = 1.0,
):
    """cos and sin (positions, rotary / 2) float32, one number an angle, for RoPE with base
    `theta` over `rotary` dimensions: frequencies theta^(-2i/rotary) divided by `scale` (linear
    scaling) or by per-frequency divisors (Llama 3's rope_freqs, Phi-3's LongRoPE factors); both
    times `factor` (LongRoPE's attention factor, as llama.cpp folds it into cos and sin). The
    native pass pairs each angle with its two dimensions (halves or pairs), so a table holds it
    once: for Gemma 3's 32,768 positions, two bases and 256-wide heads, 67 MB instead of 134."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.int64).float() / rotary))
    inv_freq = inv_freq / scale
    if divisors is not None:
        inv_freq = inv_freq / divisors
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.contiguous(), sin.contiguous()


class StoredRunner(native.CompiledPass):
    """The native runner over a GGUF file's weights as stored (runners/base.py's interface)."""

    def __init__(self, weights: GGUFWeights, math: str = "auto", generation_config=None):
        self.device = torch.device("cpu")
        self.dtype = self.act_dtype = torch.float32  # activations (weights keep their types)
        if native.load() is None:
            raise ValueError(
                "weights as stored need the native runner: "
                + (native.unavailable_reason() or "it is not available")
            )
        self.weights = weights
        self.config = weights.config
        self.generation_config = generation_config
        cfg = weights.config
        spec = self.arch = weights.spec
        # the arithmetic of attention and of float matrices: bfloat16 where the CPU has
        # bfloat16 dot products (a bfloat16 KV cache, half the bytes), else float32
        self.math = native.resolve_math(math, torch.bfloat16)
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.rot = cfg.rotary_dim
        self.eps = cfg.rms_norm_eps
        self.embed, self.lm_head = weights.embed, weights.lm_head
        self.final_norm = weights.final_norm
        self.layers = weights.layers
        positions = cfg.max_position_embeddings
        meta = weights._meta
        scaling = str(meta("rope.scaling.type", "", required=False) or "none")
        if scaling not in spec.rope_scalings:
            raise ValueError(
                f"{weights.path.name}: RoPE scaling '{scaling}' does not run with "
                f"the weights as stored ({', '.join(spec.rope_scalings)} do for {spec.name})"
            )
        # linear: the positions divided by the factor; per-frequency divisors (below)
        scale = (
            float(meta("rope.scaling.factor", 1.0, required=False) or 1.0)
            if scaling == "linear"
            else 1.0
        )
        divisors, factor = self._rope_factors(positions)
        self.rope_pairs = spec.rope == "pairs"
        self.cos, self.sin = rope_tables(
            self.rot, cfg.rope_theta, positions, scale, divisors, factor
        )
        self.windows = weights.layer_windows()
        self.local_cos, self.local_sin = self.cos, self.sin
        local_theta = spec.window.local_theta if spec.window is not None else None
        if any(self.windows) and local_theta is not None:  # local layers: their own base
            self.local_cos, self.local_sin = rope_tables(self.rot, local_theta, positions)
        self.embed_scale = torch.tensor(float(cfg.hidden_size) ** 0.5) if spec.embed_scale else None
        self.attn_scale = weights.scores_scale()
        self.native = native.NativeForward(
            self,
            self.math,
            release=lambda m: weights.file.release(m.address, m.nbytes),
            arena=weights.take_arena(),
        )

    def _rope_factors(self, positions: int) -> tuple[torch.Tensor | None, float]:
        """Per-frequency divisors of the RoPE frequencies and the factor of cos and sin:
        Llama 3's rope_freqs tensor; Phi-3's LongRoPE: the long factors where the context this
        runner serves (`positions`) passes rope.scaling.original_context_length, as llama.cpp
        chooses them, else the short ones, and rope.scaling.attn_factor."""
        w, kind, n = self.weights, self.arch.rope_factors, self.rot // 2
        tensors = w.file.tensors
        if kind == "freqs" and "rope_freqs.weight" in tensors:
            return w.vector("rope_freqs.weight", n), 1.0
        if kind == "longrope" and "rope_factors_long.weight" in tensors:
            original = int(w._meta("rope.scaling.original_context_length", 0, required=False))
            long = original and positions > original
            name = "rope_factors_long.weight" if long else "rope_factors_short.weight"
            factor = float(w._meta("rope.scaling.attn_factor", 1.0, required=False) or 1.0)
            return w.vector(name, n), factor
        return None, 1.0

    def layer_tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.windows[layer] is not None:
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    def weight_bytes(self) -> int:
        return self.weights.weight_bytes()

    def weight_elements(self) -> int:
        return self.weights.weight_elements()


# -- float models quantized at load (--quant q8_0 | q4_0) -------------------------------------

QUANTS = {"q8_0": 8, "q4_0": 2}  # --quant -> ggml's type id (gguf's numpy quantizers make both)


def quantize_at_load(hf_model, quant: str, math: str = "auto"):
    """A float model (a transformers folder or Hub id) with its matrices quantized to Q8_0 or
    Q4_0 blocks at load, by the gguf package's quantizer (llama.cpp's reference arithmetic),
    run by the same native kernels as a GGUF's stored blocks: the lean runner's fused
    matrices (q|k|v, gate|up) and the output layer, each row quantized on its own; the
    embedding stays in the weights' dtype (it is looked up, not multiplied). Seconds per
    billion weights; the float copy stays for the benchmark's reference."""
    import gguf

    if quant not in QUANTS:
        raise ValueError(f"unknown --quant '{quant}': use {', '.join(QUANTS)}")
    if native.load() is None:
        raise ValueError(
            f"--quant {quant} runs on the native runner: "
            + (native.unavailable_reason() or "it is not available")
        )
    qtype = gguf.GGMLQuantizationType(QUANTS[quant])
    # its matrices fused and its tables float32, as the native runner takes them; the float
    # matrices' pass is replaced below by one over their blocks
    model = native.NativeRunner(hf_model, math=math)
    kept = []

    def blocks(w: torch.Tensor) -> native.StoredMatrix:
        rows, cols = w.shape
        if cols % 32:
            raise ValueError(
                f"--quant {quant} needs rows of whole 32-weight blocks; this "
                f"model has a matrix {rows} x {cols}"
            )
        data = gguf.quants.quantize(w.detach().float().cpu().numpy(), qtype)
        kept.append(data)
        return native.StoredMatrix(data.ctypes.data, int(qtype), rows, cols, data.nbytes)

    for layer in model.layers:
        for name in ("wqkv", "wo", "w13", "w2"):
            layer[name] = blocks(layer[name])
    model.lm_head = blocks(model.lm_head)
    model.quant, model.quantized_blocks = quant, kept
    model.math = native.resolve_math(math, torch.bfloat16)
    model.native = native.NativeForward(model, model.math)
    return model
