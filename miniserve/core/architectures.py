"""The architectures the engine runs natively: one declaration each, read by everything that
needs to know one (as llama.cpp's llama-arch.cpp names each architecture's tensors).

    Architecture(name="qwen3", ...)   # llama.cpp's name (a GGUF's general.architecture)
        tensors: the GGUF tensors a layer holds (llama.cpp's names, after "blk.N."), each
                 with its role in the forward pass, its shape in symbols, required or not
        norms, biases, RoPE (layout, scalings, rotated dimensions, per-frequency factors),
        sliding-window pattern and local RoPE base, embedding scale, activation, tied output,
        attention scale, MoE parameters

Readers: runners/stored.py (which tensors to map, what to check, how to build the native
config), runners/lean.py (the same forward pass over a transformers model's weights),
runners/native.py (the native struct's fields), runners/loader.py (what the error names as
running natively), bench/synthetic.py (the tensors a synthetic file holds). Adding an
architecture is one entry in ARCHITECTURES (plus a native field only where its forward pass
needs an operation decode.cpp does not have).

No torch here: the page is built before torch is imported (core/deferred.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Tensor:
    """A GGUF tensor of a layer (or of the model, in MODEL_TENSORS). `dims` are symbols, rows
    first (numpy's order; GGUF lists them the other way round): D hidden, I feed-forward, q
    heads x head_dim, kv kv_heads x head_dim, hd head_dim, qkv = q + 2 kv, gu = 2 I (gate | up
    in one matrix), E experts, F an expert's feed-forward, V vocabulary, R rotated dims / 2."""

    role: str  # the runner's name: wq, wk, ..., attn_norm, bq, ...
    name: str  # llama.cpp's, without "blk.N." and ".weight" / ".bias"
    dims: tuple[str, ...]
    required: bool = True
    kind: str = "weight"  # or "bias"

    @property
    def suffix(self) -> str:
        return f"{self.name}.{self.kind}"


def _t(role: str, name: str, *dims: str, required: bool = True, kind: str = "weight") -> Tensor:
    return Tensor(role, name, tuple(dims), required, kind)


# the pieces layers are made of
ATTENTION = (
    _t("attn_norm", "attn_norm", "D"),
    _t("wq", "attn_q", "q", "D"),
    _t("wk", "attn_k", "kv", "D"),
    _t("wv", "attn_v", "kv", "D"),
    _t("wo", "attn_output", "D", "q"),
)
FUSED_ATTENTION = (
    _t("attn_norm", "attn_norm", "D"),
    _t("wqkv", "attn_qkv", "qkv", "D"),
    _t("wo", "attn_output", "D", "q"),
)
BIASES = tuple(
    _t(f"b{x}", f"attn_{x}", n, required=False, kind="bias")
    for x, n in (("q", "q"), ("k", "kv"), ("v", "kv"))
)
QK_NORMS = (_t("q_norm", "attn_q_norm", "hd"), _t("k_norm", "attn_k_norm", "hd"))
MLP = (
    _t("mlp_norm", "ffn_norm", "D"),
    _t("w1", "ffn_gate", "I", "D"),
    _t("w3", "ffn_up", "I", "D"),
    _t("w2", "ffn_down", "D", "I"),
)
FUSED_MLP = (  # llama.cpp's phi3: ffn_up holds the gate's rows, then the up rows
    _t("mlp_norm", "ffn_norm", "D"),
    _t("w13", "ffn_up", "gu", "D"),
    _t("w2", "ffn_down", "D", "I"),
)
MOE = (
    _t("mlp_norm", "ffn_norm", "D"),
    _t("router", "ffn_gate_inp", "E", "D"),
    _t("w1_exps", "ffn_gate_exps", "E", "F", "D"),
    _t("w3_exps", "ffn_up_exps", "E", "F", "D"),
    _t("w2_exps", "ffn_down_exps", "E", "D", "F"),
)
BRANCH_NORMS = (  # Gemma: each branch's output normed before the residual sum
    _t("attn_out_norm", "post_attention_norm", "D"),
    _t("mlp_out_norm", "post_ffw_norm", "D"),
)

# the model's own tensors (no "blk.N."); output is absent where it is the embedding (tied)
MODEL_TENSORS = (
    _t("embed", "token_embd", "V", "D"),
    _t("final_norm", "output_norm", "D"),
    _t("lm_head", "output", "V", "D", required=False),
)


@dataclass(frozen=True)
class Window:
    """Sliding-window attention: local layers see the last `sliding_window` positions (the
    header's, else `default`); every `global_every`-th layer (1-based) is global, 0: none is.
    Local layers' RoPE has a base of its own (`local_theta`) and no scaling."""

    global_every: int = 0
    default: int = 0
    local_theta: float | None = None


@dataclass(frozen=True)
class Architecture:
    name: str  # llama.cpp's (a GGUF's general.architecture)
    model_type: str  # transformers' config.model_type
    label: str  # the families people know it by
    layer: tuple[Tensor, ...]
    # RoPE: "pairs" (adjacent pairs: llama.cpp's converter permutes llama's q/k rows) or
    # "halves" (NeoX: i with i + rotated / 2)
    rope: str = "halves"
    rope_scalings: tuple[str, ...] = ("none",)  # rope.scaling.type values that run
    # per-frequency divisors: "freqs" (a rope_freqs tensor, Llama 3) or "longrope" (Phi-3's
    # rope_factors_long / _short, the long ones past rope.scaling.original_context_length,
    # and rope.scaling.attn_factor folded into cos and sin)
    rope_factors: str | None = None
    partial_rotary: bool = False  # rope.dimension_count < head_dim rotates only those
    norm_plus_one: bool = False  # transformers' weights hold w for a norm of 1 + w (Gemma;
    # a GGUF holds 1 + w already)
    activation: str = "silu"  # or "gelu_tanh"
    embed_scale: bool = False  # embeddings x sqrt(hidden)
    window: Window | None = None
    # the scores' factor where it is not head_dim^-0.5: a function of the header's numbers
    # (D, H, hd, layers) -> the factor
    attn_scale: Callable[[dict], float] | None = None
    eps: float = 1e-5  # the norms' epsilon where the header has none
    theta: float = 10000.0  # the RoPE base where the header has none
    # experts (ffn_*_exps, the header's expert_count E, expert_used_count K,
    # expert_feed_forward_length F): a softmax router, the top K, their weights renormalised
    moe: bool = False
    lean: bool = True  # the PyTorch lean runner runs it (from a transformers model)
    notes: str = ""

    def has(self, role: str) -> bool:
        return any(t.role == role for t in self.layer)

    @property
    def qk_norm(self) -> bool:
        return self.has("q_norm")

    @property
    def branch_norms(self) -> bool:
        return self.has("attn_out_norm")


def _gemma3_scale(n: dict) -> float:
    """llama.cpp's gemma3: (hidden / heads)^-0.5 for the 27B (62 layers, its
    query_pre_attn_scalar), head_dim^-0.5 for the others."""
    return (n["D"] / n["H"] if n["layers"] == 62 else n["hd"]) ** -0.5


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            "llama",
            "llama",
            "Llama 2/3, SmolLM, Mistral 7B",
            ATTENTION + BIASES + MLP,
            rope="pairs",
            rope_scalings=("none", "linear", "llama3"),
            rope_factors="freqs",
        ),
        Architecture(
            "qwen2",
            "qwen2",
            "Qwen2, Qwen2.5",
            ATTENTION + BIASES + MLP,
            eps=1e-6,
            theta=1e6,
        ),
        Architecture(
            "qwen3",
            "qwen3",
            "Qwen3 (dense)",
            ATTENTION + QK_NORMS + MLP,
            eps=1e-6,
            theta=1e6,
        ),
        Architecture(
            "qwen3moe",
            "qwen3_moe",
            "Qwen3 MoE (30B-A3B)",
            ATTENTION + QK_NORMS + MOE,
            eps=1e-6,
            theta=1e6,
            moe=True,
            lean=False,
        ),
        Architecture(
            "phi3",
            "phi3",
            "Phi-3, Phi-4-mini",
            FUSED_ATTENTION + FUSED_MLP,
            partial_rotary=True,
            rope_factors="longrope",
            window=Window(global_every=0),
        ),
        Architecture(
            "gemma3",
            "gemma3_text",
            "Gemma 3",
            ATTENTION + QK_NORMS + BRANCH_NORMS + MLP,
            rope_scalings=("none", "linear"),
            norm_plus_one=True,
            activation="gelu_tanh",
            embed_scale=True,
            window=Window(global_every=6, default=512, local_theta=10000.0),
            attn_scale=_gemma3_scale,
            eps=1e-6,
            theta=1e6,
        ),
    )
}


def native_names() -> str:
    """The architectures that run natively, for messages: "llama (Llama 2/3, ...), ..."."""
    return ", ".join(f"{a.name} ({a.label})" for a in ARCHITECTURES.values())


def by_model_type(model_type: str) -> Architecture | None:
    """The declaration of a transformers model_type, None where none runs it."""
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)


@dataclass(frozen=True)
class Shape:
    """A model's numbers, as the symbols of Tensor.dims name them."""

    D: int
    I: int  # noqa: E741 -- the symbol's name
    H: int
    KV: int
    hd: int
    V: int
    E: int = 0
    F: int = 0
    rot: int = 0  # rotated dimensions (0: all of head_dim)

    def numbers(self) -> dict[str, int]:
        q, kv = self.H * self.hd, self.KV * self.hd
        return {
            "D": self.D,
            "I": self.I,
            "q": q,
            "kv": kv,
            "hd": self.hd,
            "qkv": q + 2 * kv,
            "gu": 2 * self.I,
            "E": self.E,
            "F": self.F,
            "V": self.V,
            "R": (self.rot or self.hd) // 2,
        }

    def dims(self, t: Tensor) -> tuple[int, ...]:
        n = self.numbers()
        return tuple(n[s] for s in t.dims)
