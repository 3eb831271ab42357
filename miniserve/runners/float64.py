"""A float64 forward pass over a GGUF file's weights, dequantized by the gguf package's own
decoder (not the kernels'): the reference that the stored runner's logits are held to
(miniserve/runners/verify.py's BOUND_STORED) and that the benchmark checks its greedy tokens
against, written from llama.cpp's definitions in plain numpy, one tensor at a time, so that no
model copy is ever made (not on disk, not in memory).

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

What it holds at once (`peak_bytes` estimates it): one tensor dequantized (an expert's slice of
an experts tensor; the embeddings only at the rows asked for, the output matrix a slice of rows
at a time), the activations of every row of every sequence, and the attention scores of a block
of query rows. Several sequences go through one pass (`logits_many`): each layer's weights are
dequantized once for all of them.
"""

from __future__ import annotations

import numpy as np

from miniserve.runners.stored import GGUFWeights


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


# what one block of attention scores (query rows x keys of one head, float64) may hold, and one
# slice of the output matrix's rows: the pass's memory stays bounded for long prompts and large
# vocabularies
SCORES_BYTES = 32 << 20
ATTENTION_ROWS = 128  # ... and at most this many query rows: the keys past a block's are skipped
HEAD_SLICE_BYTES = 64 << 20


class Float64Reference:
    def __init__(self, weights: GGUFWeights, positions: int | None = None):
        self.w = weights
        self.spec = weights.spec
        self.cfg = weights.config
        self.positions = positions or self.cfg.max_position_embeddings
        self.margins: list[float] = []  # MoE: each row's routing margin (_experts)

    def _decode(self, name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        import gguf

        info = self.w.file.tensors[name]
        values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(info.type))
        return np.asarray(values, dtype=np.float64).reshape(shape)

    def _rows_of(self, name: str) -> np.ndarray:
        """The tensor's bytes as (first dimension, bytes of one entry of it)."""
        info = self.w.file.tensors[name]
        return self.w.file.data(name).reshape(info.shape[0], -1)

    def tensor(self, name: str) -> np.ndarray:
        info = self.w.file.tensors[name]
        return self._decode(name, self.w.file.data(name), info.shape)

    def part(self, name: str, start: int, stop: int) -> np.ndarray:
        """Entries start..stop of the tensor's first dimension (rows of a matrix, experts of
        an experts tensor), only those dequantized."""
        info = self.w.file.tensors[name]
        return self._decode(name, self._rows_of(name)[start:stop], (stop - start, *info.shape[1:]))

    def rows(self, name: str, index: np.ndarray) -> np.ndarray:
        """The matrix's rows at `index` (ids), only those dequantized."""
        unique, inverse = np.unique(np.asarray(index), return_inverse=True)
        info = self.w.file.tensors[name]
        decoded = self._decode(name, self._rows_of(name)[unique], (len(unique), *info.shape[1:]))
        return decoded[inverse]

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

    def logits(self, ids: list[int], last: int | None = None) -> np.ndarray:
        """(n, vocab) float64 logits of the last n = `last` positions (all by default) of one
        sequence from position 0."""
        return self.logits_many([ids], [last])[0]

    def logits_many(self, sequences: list[list[int]], last: list[int | None] | None = None):
        """[(n_i, vocab) float64 logits of the last n_i = last[i] positions (all where None) of
        sequence i]: every sequence from position 0, alone (none sees another), in one pass."""
        cfg, spec, eps = self.cfg, self.spec, self.cfg.rms_norm_eps
        H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        lengths = [len(s) for s in sequences]
        last = [n if k is None else k for n, k in zip(lengths, last or [None] * len(lengths))]
        ends = np.cumsum(lengths)
        spans = [(int(e) - n, int(e)) for e, n in zip(ends, lengths)]
        pos = np.concatenate([np.arange(n) for n in lengths])  # each row's position
        N = len(pos)
        x = self.rows("token_embd.weight", np.concatenate([np.asarray(s) for s in sequences]))
        if spec.embed_scale:
            x = x * np.sqrt(np.float64(cfg.hidden_size))
        angles, local, factor = self._rope_setup(max(lengths))
        scale = self.w.scores_scale() or hd**-0.5
        windows = self.w.layer_windows()
        for i in range(cfg.num_hidden_layers):
            get = lambda part, i=i: self._optional(f"blk.{i}.{part}")  # noqa: E731
            h = _rms(x, get("attn_norm.weight"), eps)
            fused = get("attn_qkv.weight")
            if fused is not None:
                qkv = h @ fused.T
                del fused
                q, k, v = np.split(qkv, [H * hd, (H + KV) * hd], axis=-1)
            else:
                q, k, v = (h @ get(f"attn_{n}.weight").T for n in "qkv")
            biases = [get(f"attn_{n}.bias") for n in "qkv"]
            q, k, v = (t if b is None else t + b for t, b in zip((q, k, v), biases))
            q, k, v = q.reshape(N, H, hd), k.reshape(N, KV, hd), v.reshape(N, KV, hd)
            if spec.qk_norm:
                q = _rms(q, get("attn_q_norm.weight"), eps)
                k = _rms(k, get("attn_k_norm.weight"), eps)
            window = windows[i]
            a = (local if window is not None else angles)[pos]
            q, k = self._rope(q, a, factor), self._rope(k, a, factor)
            att = np.concatenate(
                [_attention(q[s:e], k[s:e], v[s:e], scale, window) for s, e in spans]
            )
            out = att.reshape(N, H * hd) @ get("attn_output.weight").T
            if spec.branch_norms:
                out = _rms(out, get("post_attention_norm.weight"), eps)
            x = x + out
            h = _rms(x, get("ffn_norm.weight"), eps)
            out = self._mlp(h, get, i)
            if spec.branch_norms:
                out = _rms(out, get("post_ffw_norm.weight"), eps)
            x = x + out
        keep = np.concatenate([np.arange(e - n, e) for (_, e), n in zip(spans, last)])
        h = _rms(x[keep], self.tensor("output_norm.weight"), eps)
        head = "output.weight" if "output.weight" in self.w.file.tensors else "token_embd.weight"
        vocab, width = self.w.file.tensors[head].shape
        out = np.empty((len(keep), vocab))
        step = max(1, HEAD_SLICE_BYTES // (8 * width))
        for start in range(0, vocab, step):
            stop = min(vocab, start + step)
            out[:, start:stop] = h @ self.part(head, start, stop).T
        return np.split(out, np.cumsum(last)[:-1])

    def _mlp(self, h: np.ndarray, get, layer: int) -> np.ndarray:
        if self.spec.moe:
            return self._experts(h, get, layer)
        gate_up = get("ffn_gate.weight")
        if gate_up is not None:
            gate = h @ gate_up.T
            del gate_up
            up = h @ get("ffn_up.weight").T
        else:  # phi3: gate | up in ffn_up
            gate, up = np.split(h @ get("ffn_up.weight").T, 2, axis=-1)
        return (_act(gate, self.spec.activation) * up) @ get("ffn_down.weight").T

    def _experts(self, h: np.ndarray, get, layer: int) -> np.ndarray:
        """Qwen3 MoE as llama.cpp computes it: softmax over the router's logits, the top K
        (the lower id among equals), their weights renormalised, each expert's SwiGLU, a row's
        experts summed in ascending id. Each chosen expert's slices are dequantized once, for
        every row that chose it. `self.margins` collects, per row, the gap between the K-th
        and the next probability: where it is tiny, another computation may choose the other
        expert."""
        K = self.cfg.num_experts_per_tok
        logits = h @ get("ffn_gate_inp.weight").T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        order = np.argsort(-p, axis=-1, kind="stable")  # stable: the lower id first
        ranked = np.take_along_axis(p, order, -1)
        self.margins.extend((ranked[:, K - 1] - ranked[:, K]).tolist())
        chosen = np.zeros(p.shape, dtype=bool)
        np.put_along_axis(chosen, order[:, :K], True, -1)
        weights = np.where(chosen, p, 0.0)
        weights /= weights.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        name = f"blk.{layer}.ffn_{{}}_exps.weight"
        for e in np.flatnonzero(chosen.any(0)):  # ascending id: each row's sum in that order
            gate, up, down = (
                self.part(name.format(n), e, e + 1)[0] for n in ("gate", "up", "down")
            )
            rows = np.flatnonzero(chosen[:, e])
            x = h[rows]
            out[rows] += weights[rows, e, None] * ((_act(x @ gate.T, "silu") * (x @ up.T)) @ down.T)
        return out

    def peak_bytes(self, lengths: list[int], last: list[int] | None = None) -> int:
        """Roughly the most memory a pass over sequences of these lengths holds at once (see
        the module's docstring): the largest tensor a layer dequantizes (the gguf package's
        float32 and this float64 copy of it), the output matrix's slice, the activations of
        every row (the residual stream, q / k / v, the feed-forward's widest products, each
        float64 and a few at a time), the attention scores' block and the logits kept."""
        cfg, tensors = self.cfg, self.w.file.tensors
        N, width = sum(lengths), cfg.hidden_size
        largest = 0
        for name, info in tensors.items():
            if name.startswith("blk."):
                shape = info.shape[1:] if name.endswith("_exps.weight") else info.shape
                largest = max(largest, int(np.prod(shape)))
        ffn = cfg.intermediate_size * (2 if "blk.0.ffn_gate.weight" not in tensors else 1)
        qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        rows = N * (4 * width + 2 * qkv + 3 * ffn) * 8
        vocab = tensors["token_embd.weight"].shape[0]
        logits = sum(last if last is not None else lengths) * vocab * 8 * 2
        return largest * 12 + HEAD_SLICE_BYTES * 2 + rows + 3 * SCORES_BYTES + logits


def _attention(q, k, v, scale: float, window: int | None) -> np.ndarray:
    """One sequence's causal attention (a local layer's window: q - k < window), q (T, H, hd),
    k and v (T, KV, hd) -> (T, H, hd); a head and a block of query rows at a time, each a 2-D
    product (numpy's stacked products do not reach BLAS), over the keys the block can see."""
    T, H, hd = q.shape
    group = H // k.shape[1]
    out = np.empty((T, H, hd))
    block = max(1, min(ATTENTION_ROWS, SCORES_BYTES // (8 * T)))
    for head in range(H):
        qh = np.ascontiguousarray(q[:, head])
        kh = np.ascontiguousarray(k[:, head // group])
        vh = np.ascontiguousarray(v[:, head // group])
        for start in range(0, T, block):
            stop = min(T, start + block)
            first = 0 if window is None else max(0, start - window + 1)
            rows, keys = np.arange(start, stop), np.arange(first, stop)
            scores = (qh[start:stop] @ kh[first:stop].T) * scale  # (rows, keys)
            seen = keys[None, :] <= rows[:, None]
            if window is not None:
                seen &= rows[:, None] - keys[None, :] < window
            scores = np.where(seen, scores, -np.inf)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            out[start:stop, head] = scores @ vh[first:stop]
    return out


def _act(g: np.ndarray, kind: str) -> np.ndarray:
    if kind == "gelu_tanh":
        return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
    return g / (1 + np.exp(-g))
