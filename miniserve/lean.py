"""A lean Llama-family forward pass, readable in one screen per part (in the spirit of gpt-fast).

    ids -> embed -> [ RMSNorm -> QKV (one matmul) -> RoPE -> attention over the KV cache
                      -> output proj -> + residual -> RMSNorm -> gate|up (one matmul)
                      -> SiLU(gate) * up -> down proj -> + residual ] x layers
        -> RMSNorm -> lm_head -> logits of the last position

Built from a loaded transformers model (Llama, SmolLM, Qwen2, Mistral-style configs without
sliding windows); the fused weights are made once and the transformers modules are pointed
at slices of them, so no weight is stored twice. The transformers model stays the reference
(equality tests) and the fallback for every other architecture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = {"llama", "qwen2", "mistral"}


def supports(model) -> bool:
    cfg = model.config
    full_attention = cfg.model_type == "llama" or (
        cfg.model_type in SUPPORTED and getattr(cfg, "sliding_window", None) in (None, 0))
    plain_rope = getattr(cfg, "rope_parameters", {}).get("rope_type", "default") == "default"
    return (full_attention and plain_rope and cfg.hidden_act == "silu"
            and not getattr(cfg, "mlp_bias", False))


class KVCache:
    """Keys and values of every layer, (layers, kv_heads, capacity, head_dim) each, grown by
    doubling. `length` positions are valid. Same small interface as transformers' caches."""

    TILE = 1  # capacities are a multiple of this

    def __init__(self, layers, kv_heads, head_dim, dtype, device, capacity=256):
        shape = (layers, kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.v.shape[2]  # V is (layers, kv_heads, capacity, ...) in every layout

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        """transformers' convention: a negative n removes that many positions."""
        self.length = self.length + n if n < 0 else min(n, self.length)

    def reserve(self, needed: int, exact: bool = False) -> None:
        """Room for `needed` positions: doubling, so that a growing sequence copies rarely, or
        `exact`ly that many (rounded up to a multiple of TILE)."""
        capacity = self.capacity
        if needed <= capacity:
            return
        if exact:
            capacity = -(-needed // self.TILE) * self.TILE
        while capacity < needed:
            capacity *= 2
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:2], capacity, old.shape[3]))
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)


class Int8Weight:
    """A weight stored as int8 with one bf16 scale per output row (weight-only quantization):
    w ~= q * scale. PyTorch's CPU kernel multiplies bf16 activations by it directly."""

    def __init__(self, w: torch.Tensor):
        self.dense = w  # kept for prompts: the int8 kernel is slow for many rows at once
        wf = w.float()
        self.scales = (wf.abs().amax(dim=1).clamp(min=1e-8) / 127)
        self.q = (wf / self.scales[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = self.scales.to(torch.bfloat16)
        self.shape = w.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scales).view(
            *x.shape[:-1], -1)


def _linear(x, w, b=None):
    """x @ w.T, where w is a tensor or an Int8Weight.

    For one token, torch.mv(w, x) is used: on the 2-core AVX-512 CPU this was measured on it
    runs the bf16 matrix-vector product up to 1.5x faster than F.linear, with the same float32
    results bit for bit (the equality tests hold)."""
    if isinstance(w, Int8Weight):
        if x.shape[-2] > 1:  # prefill: full-precision weights (same memory as the reference)
            return F.linear(x, w.dense, b)
        y = w.matmul(x)
        return y if b is None else y + b
    if x.dim() == 3 and x.shape[-2] == 1 and x.shape[0] == 1:
        y = torch.mv(w, x.reshape(-1)).view(1, 1, -1)
        return y if b is None else y + b
    return F.linear(x, w, b)


def _rms_norm(x, weight, eps):
    # as transformers computes it: in float32, then back to the input dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanModel:
    """Plain tensors and functions; no nn.Module machinery on the hot path. A runner
    (miniserve/runner.py): "native" when its passes run in compiled code, else "lean"."""

    def __init__(self, hf_model, quant: str | None = None, native: bool = False,
                 math: str = "auto"):
        if quant not in (None, "int8"):
            raise ValueError(f"unknown quantization '{quant}': use int8 or none")
        if quant == "int8" and hf_model.dtype != torch.bfloat16:
            raise ValueError("int8 weights run with bfloat16 activations: load with dtype bfloat16")
        self.quant = quant
        cfg = hf_model.config
        base = hf_model.model
        self.config = cfg
        self.device_ = hf_model.device
        self.dtype = hf_model.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        if native:  # every pass in compiled code (miniserve/native.py)
            from miniserve import native as native_mod
            if not native_mod.supports(self.device_, self.dtype, quant):
                reason = native_mod.unavailable_reason()
                raise ValueError("the native runner needs a CPU model with float32 or "
                                 "bfloat16 weights and no --quant"
                                 + (f"; {reason}" if reason else ""))
            self.math = native_mod.resolve_math(math, self.dtype)
        else:  # PyTorch computes in the weights' dtype
            self.math = str(self.dtype).removeprefix("torch.")
            if math not in ("auto", self.math):
                raise ValueError(f"--math {math} needs the native runner; the lean runner "
                                 f"computes in the weights' dtype ({self.math})")
        # The arithmetic of the matrix products. The native pass keeps activations, RoPE
        # tables and the KV cache in float32 whatever the products' arithmetic.
        self.act_dtype = getattr(torch, self.math)
        table_dtype = torch.float32 if native else self.dtype
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append({
                "attn_norm": layer.input_layernorm.weight,
                "wqkv": _fuse(a.q_proj, a.k_proj, a.v_proj),
                "bqkv": _fuse_bias(a.q_proj, a.k_proj, a.v_proj),
                "wo": a.o_proj.weight,
                "mlp_norm": layer.post_attention_layernorm.weight,
                "w13": _fuse(m.gate_proj, m.up_proj),
                "w2": m.down_proj.weight,
            })
        theta = cfg.rope_parameters.get("rope_theta", 10000.0) if hasattr(
            cfg, "rope_parameters") else getattr(cfg, "rope_theta", 10000.0)
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64)
                                    .float() / self.head_dim))
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(table_dtype).to(self.device_)  # (max_pos, head_dim)
        self.sin = emb.sin().to(table_dtype).to(self.device_)
        self.generation_config = hf_model.generation_config
        if quant == "int8":  # every matrix but the embedding lookup table
            self.lm_head = Int8Weight(self.lm_head)
            for w in self.layers:
                for name in ("wqkv", "wo", "w13", "w2"):
                    w[name] = Int8Weight(w[name])
        self.native = native_mod.NativeForward(self, self.math) if native else None

    def weight_bytes(self) -> int:
        """Bytes of weights read per decoded token (the embedding is looked up, not read)."""
        total = 0
        for w in [*(x for layer in self.layers for x in layer.values()), self.lm_head,
                  self.final_norm]:
            if isinstance(w, Int8Weight):
                total += w.q.numel() + w.scales.numel() * 2
            elif w is not None:
                total += w.numel() * w.element_size()
        return total

    @property
    def device(self):
        return self.device_

    @property
    def name(self) -> str:
        return "lean" if self.native is None else "native"

    def new_cache(self, capacity: int = 256):
        if self.native is not None:
            return self.native.new_cache(capacity)
        return KVCache(len(self.layers), self.n_kv, self.head_dim, self.dtype, self.device_,
                       capacity)

    def step(self, entries, all_logits: bool = False) -> torch.Tensor:
        """Several sequences at once: entries of (new ids, cache); the logits of each one's
        last new id (len(entries), vocab). Native: one pass over all their rows. PyTorch: one
        sequence after another."""
        if self.native is not None:
            return self.native(entries, all_logits)
        return torch.cat([self.forward(torch.as_tensor(ids).view(1, -1), cache, all_logits)
                          for ids, cache in entries])

    def __call__(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                 all_logits: bool = False) -> torch.Tensor:
        return self.forward(input_ids, cache, all_logits)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """ids (1, T) -> logits of the last position (1, vocab), or of every position
        (T, vocab) with `all_logits`. Appends to `cache` if given."""
        if self.native is not None:  # the same computation, compiled, all rows in one pass
            ids = input_ids[0].tolist()
            logits = self.native([(ids, cache if cache is not None else
                                   self.new_cache(len(ids)))], all_logits)
            return logits if all_logits else logits.view(1, -1)
        T = input_ids.shape[1]
        start = cache.length if cache is not None else 0
        if cache is not None:
            cache.reserve(start + T)
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]  # (T, hd)
        x = F.embedding(input_ids, self.embed)  # (1, T, D)
        for i, w in enumerate(self.layers):
            x = x + self._attention(_rms_norm(x, w["attn_norm"], self.eps), w, i, cache, start,
                                    cos, sin)
            h = _rms_norm(x, w["mlp_norm"], self.eps)
            gate, up = _linear(h, w["w13"]).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, w["w2"])
        if cache is not None:
            cache.length = start + T
        if all_logits:
            return _linear(_rms_norm(x, self.final_norm, self.eps), self.lm_head)[0]
        x = _rms_norm(x[:, -1:, :], self.final_norm, self.eps)  # only the last position
        return _linear(x, self.lm_head)[:, -1, :]

    def _attention(self, h, w, layer, cache, start, cos, sin):
        B, T, _ = h.shape
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        qkv = _linear(h, w["wqkv"], w["bqkv"])
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)   # (B, H, T, hd)
        k = k.view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, KV, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            cache.k[layer, :, start:start + T] = k[0]
            cache.v[layer, :, start:start + T] = v[0]
            k = cache.k[layer, :, :start + T].unsqueeze(0)  # (1, KV, S, hd), S = start + T
            v = cache.v[layer, :, :start + T].unsqueeze(0)
        if T == 1:
            mask, causal = None, False  # one new token sees everything before it
        elif start == 0:
            mask, causal = None, True
        else:  # a new block after a reused prefix: row i sees positions <= start + i
            S = start + T
            mask = torch.ones(T, S, dtype=torch.bool, device=h.device).tril(diagonal=start)
            causal = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=H != KV)
        return _linear(out.transpose(1, 2).reshape(B, T, H * hd), w["wo"])


def _fuse(*linears):
    """One weight for several projections of the same input; each module's weight becomes a
    view into it, so memory is not doubled and the transformers model still works."""
    fused = torch.cat([m.weight.data for m in linears], dim=0).contiguous()
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = fused[row:row + n]
        row += n
    return fused


def _fuse_bias(*linears):
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias.data if m.bias is not None else
                      torch.zeros(m.weight.shape[0], dtype=m.weight.dtype, device=m.weight.device)
                      for m in linears])
