"""A float64 forward pass over a GGUF file's weights, dequantized by the gguf package's own
decoder (not the kernels'): the reference that the stored runner's logits are held to
(miniserve/runners/verify.py's BOUND_STORED), written from llama.cpp's definitions in plain
numpy, one layer's weights at a time, so that no model copy is ever made.

    x = embed[ids] (x sqrt(D) where the architecture scales it)
    per layer: h = rmsnorm(x); q, k, v = h Wq, h Wk, h Wv (+ biases; or one fused matrix)
               q, k per head: rmsnorm (q/k norms), then RoPE on the first `rot` dimensions
                   (adjacent pairs or NeoX halves; frequencies over `rot`, divided by linear
                   scaling or per-frequency factors; cos and sin times the attention factor)
               attention, causal, a local layer's window: q - k < window
               x += [rmsnorm](attention Wo);  x += [rmsnorm](act(h W1) * (h W3) W2)
    logits = rmsnorm(x) Wout

The configuration (sizes, windows, RoPE) is the header's, read through GGUFWeights; the RoPE
tables are computed here again in float64, not taken from the runner.
"""

from __future__ import annotations

import numpy as np

from miniserve.runners.stored import GGUFWeights


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


class Float64Reference:
    def __init__(self, weights: GGUFWeights, positions: int | None = None):
        self.w = weights
        self.spec = weights.spec
        self.cfg = weights.config
        self.positions = positions or self.cfg.max_position_embeddings
        self.margins: list[float] = []  # MoE: each row's routing margin (_experts)

    def tensor(self, name: str) -> np.ndarray:
        import gguf

        info = self.w.file.tensors[name]
        values = gguf.quants.dequantize(
            self.w.file.data(name), gguf.GGMLQuantizationType(info.type)
        )
        return np.asarray(values, dtype=np.float64).reshape(info.shape)

    def _optional(self, name: str) -> np.ndarray | None:
        return self.tensor(name) if name in self.w.file.tensors else None

    def _angles(self, theta: float, scale: float, divisors, count: int) -> np.ndarray:
        rot = self.cfg.rotary_dim
        inv = 1.0 / theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot) / scale
        if divisors is not None:
            inv = inv / divisors
        return np.outer(np.arange(count, dtype=np.float64), inv)  # (T, rot / 2)

    def _rope(self, v: np.ndarray, angles: np.ndarray, factor: float) -> np.ndarray:
        """v (T, heads, hd): the first rot dimensions turned, as pairs or halves."""
        rot, out = self.cfg.rotary_dim, v.copy()
        cos = (np.cos(angles) * factor)[:, None, :]
        sin = (np.sin(angles) * factor)[:, None, :]
        if self.spec.rope == "pairs":
            a, b = v[..., 0:rot:2], v[..., 1:rot:2]
            out[..., 0:rot:2], out[..., 1:rot:2] = a * cos - b * sin, b * cos + a * sin
        else:
            a, b = v[..., : rot // 2], v[..., rot // 2 : rot]
            out[..., : rot // 2], out[..., rot // 2 : rot] = a * cos - b * sin, b * cos + a * sin
        return out

    def _rope_setup(self, count: int):
        """(global angles, local angles, factor), from the header and llama.cpp's rules."""
        meta, cfg, spec = self.w._meta, self.cfg, self.spec
        scaling = str(meta("rope.scaling.type", "", required=False) or "none")
        scale = float(meta("rope.scaling.factor", 1.0, required=False) or 1.0)
        scale = scale if scaling == "linear" else 1.0
        divisors, factor = None, 1.0
        tensors = self.w.file.tensors
        if spec.rope_factors == "freqs" and "rope_freqs.weight" in tensors:
            divisors = self.tensor("rope_freqs.weight")
        if spec.rope_factors == "longrope" and "rope_factors_long.weight" in tensors:
            original = int(meta("rope.scaling.original_context_length", 0, required=False))
            which = "long" if original and self.positions > original else "short"
            divisors = self.tensor(f"rope_factors_{which}.weight")
            factor = float(meta("rope.scaling.attn_factor", 1.0, required=False) or 1.0)
        angles = self._angles(cfg.rope_theta, scale, divisors, count)
        local = angles
        if spec.window is not None and spec.window.local_theta is not None:
            local = self._angles(spec.window.local_theta, 1.0, None, count)
        return angles, local, factor

    def logits(self, ids: list[int]) -> np.ndarray:
        """(len(ids), vocab) float64 logits of every position of one sequence from position 0."""
        cfg, spec, eps = self.cfg, self.spec, self.cfg.rms_norm_eps
        T, H, KV, hd = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        embed = self.tensor("token_embd.weight")
        x = embed[np.asarray(ids)]
        if spec.embed_scale:
            x = x * np.sqrt(np.float64(cfg.hidden_size))
        angles, local, factor = self._rope_setup(T)
        scale = self.w.scores_scale() or hd**-0.5
        windows = self.w.layer_windows()
        pos = np.arange(T)
        for i in range(cfg.num_hidden_layers):
            get = lambda part, i=i: self._optional(f"blk.{i}.{part}")  # noqa: E731
            h = _rms(x, get("attn_norm.weight"), eps)
            fused = get("attn_qkv.weight")
            if fused is not None:
                qkv = h @ fused.T
                q, k, v = np.split(qkv, [H * hd, (H + KV) * hd], axis=-1)
            else:
                q, k, v = (h @ get(f"attn_{n}.weight").T for n in "qkv")
            biases = [get(f"attn_{n}.bias") for n in "qkv"]
            q, k, v = (t if b is None else t + b for t, b in zip((q, k, v), biases))
            q, k, v = q.reshape(T, H, hd), k.reshape(T, KV, hd), v.reshape(T, KV, hd)
            if spec.qk_norm:
                q = _rms(q, get("attn_q_norm.weight"), eps)
                k = _rms(k, get("attn_k_norm.weight"), eps)
            window = windows[i]
            a = local if window is not None else angles
            q, k = self._rope(q, a, factor), self._rope(k, a, factor)
            group = H // KV
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) * scale
            seen = pos[None, :] <= pos[:, None]
            if window is not None:
                seen &= pos[:, None] - pos[None, :] < window
            scores = np.where(seen[None], scores, -np.inf)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            att = np.einsum("hqk,khd->qhd", scores, v).reshape(T, H * hd)
            out = att @ get("attn_output.weight").T
            if spec.branch_norms:
                out = _rms(out, get("post_attention_norm.weight"), eps)
            x = x + out
            h = _rms(x, get("ffn_norm.weight"), eps)
            out = self._mlp(h, get)
            if spec.branch_norms:
                out = _rms(out, get("post_ffw_norm.weight"), eps)
            x = x + out
        head = self._optional("output.weight")
        return _rms(x, self.tensor("output_norm.weight"), eps) @ (embed if head is None else head).T

    def _mlp(self, h: np.ndarray, get) -> np.ndarray:
        if self.spec.moe:
            return self._experts(h, get)
        gate_up = get("ffn_gate.weight")
        if gate_up is not None:
            gate, up = h @ gate_up.T, h @ get("ffn_up.weight").T
        else:  # phi3: gate | up in ffn_up
            gate, up = np.split(h @ get("ffn_up.weight").T, 2, axis=-1)
        return (_act(gate, self.spec.activation) * up) @ get("ffn_down.weight").T

    def _experts(self, h: np.ndarray, get) -> np.ndarray:
        """Qwen3 MoE as llama.cpp computes it: softmax over the router's logits, the top K
        (the lower id among equals), their weights renormalised, each expert's SwiGLU.
        `self.margins` collects, per row, the gap between the K-th and the next probability:
        where it is tiny, another computation may choose the other expert."""
        K = self.cfg.num_experts_per_tok
        logits = h @ get("ffn_gate_inp.weight").T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        order = np.argsort(-p, axis=-1, kind="stable")  # stable: the lower id first
        ranked = np.take_along_axis(p, order, -1)
        self.margins.extend((ranked[:, K - 1] - ranked[:, K]).tolist())
        gate, up, down = (get(f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        out = np.zeros_like(h)
        for row in range(h.shape[0]):
            chosen = np.sort(order[row, :K])
            weights = p[row, chosen] / p[row, chosen].sum()
            for e, w in zip(chosen, weights):
                x = h[row]
                out[row] += w * ((_act(gate[e] @ x, "silu") * (up[e] @ x)) @ down[e].T)
        return out


def _act(g: np.ndarray, kind: str) -> np.ndarray:
    if kind == "gelu_tanh":
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    return g / (1 + np.exp(-g))
