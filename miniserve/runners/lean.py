"""A lean Llama-family forward pass, readable in one screen per part (in the spirit of gpt-fast).

    ids -> embed -> [ RMSNorm -> QKV (one matmul) -> RoPE -> attention over the KV cache
                      -> output proj -> + residual -> RMSNorm -> gate|up (one matmul)
                      -> SiLU(gate) * up -> down proj -> + residual ] x layers
        -> RMSNorm -> lm_head -> logits of the last position

Built from a loaded transformers model of an architecture in miniserve/core/architectures.py
(Llama, SmolLM, Qwen2, Mistral-style configs without sliding windows; Qwen3: q and k RMS-normed
per head before RoPE; Phi-3 / Phi-4-mini without LongRoPE: q|k|v and gate|up fused in its own
weights, RoPE on the first rotary dimensions of each head; and Gemma 3, below); the fused
weights are made once, in one block of memory with the other matrices (WeightArena), and the
transformers modules are pointed at them, so no weight is stored twice. The transformers model
stays the reference (equality tests) and the fallback for every other architecture.

Gemma 3 (transformers' Gemma3ForCausalLM, model_type gemma3_text) is the same loop with:

    embeddings x sqrt(hidden) (the factor in the weights' dtype, as transformers rounds it);
    RMSNorm by (1 + w), in float32; q and k RMS-normed per head before RoPE; the attention
    output and the MLP output RMS-normed before each residual sum (four norms a layer);
    scores scaled by query_pre_attn_scalar^-0.5; GELU (tanh approximation) instead of SiLU;
    local layers that see the last `sliding_window` positions (a query at q sees keys k with
    q - k < window), with a RoPE base of their own, between the global ones (config.layer_types).
"""

from __future__ import annotations

import mmap

import torch

from miniserve.core.architectures import ARCHITECTURES, Architecture, by_model_type
from miniserve.runners.base import KVCache

LAYER_TYPES = ("full_attention", "sliding_attention")


def architecture(cfg) -> Architecture | None:
    """The table's declaration of a transformers config (Mistral's is Llama's), None where the
    table has none the lean runner runs."""
    spec = ARCHITECTURES["llama"] if cfg.model_type == "mistral" else by_model_type(cfg.model_type)
    return spec if spec is not None and spec.lean else None


def supports(model) -> bool:
    cfg = model.config
    spec = architecture(cfg)
    if spec is None:
        return False
    if spec.window is not None and spec.window.global_every:  # Gemma 3's local layers
        return _supports_gemma3(cfg)
    full_attention = cfg.model_type == "llama" or (
        getattr(cfg, "sliding_window", None) in (None, 0)
        or (getattr(cfg, "sliding_window", None) or 0) >= cfg.max_position_embeddings
    )
    plain_rope = getattr(cfg, "rope_parameters", {}).get("rope_type", "default") == "default"
    return (
        full_attention
        and plain_rope
        and cfg.hidden_act == "silu"
        and not getattr(cfg, "mlp_bias", False)
    )


def _supports_gemma3(cfg) -> bool:
    """Gemma 3 without what this pass leaves out: logit softcapping (Gemma 2's; Gemma 3's
    configs set None), bidirectional attention, biases, scaled RoPE (the larger Gemma 3s scale
    their global RoPE), other activations or layer kinds."""
    ropes = getattr(cfg, "rope_parameters", None) or {}
    kinds = set(getattr(cfg, "layer_types", None) or ())
    return (
        bool(kinds)
        and kinds <= set(LAYER_TYPES)
        and all((ropes.get(kind) or {}).get("rope_type") == "default" for kind in kinds)
        and ("sliding_attention" not in kinds or bool(getattr(cfg, "sliding_window", None)))
        and getattr(cfg, "hidden_activation", None) == "gelu_pytorch_tanh"
        and getattr(cfg, "final_logit_softcapping", None) is None
        and getattr(cfg, "attn_logit_softcapping", None) is None
        and not getattr(cfg, "use_bidirectional_attention", False)
        and not getattr(cfg, "attention_bias", False)
    )


HUGE_PAGE = 2 << 20


def huge_page_memory(nbytes: int) -> torch.Tensor | None:
    """nbytes of memory (uint8) starting on a 2 MB boundary, which Linux backs with 2 MB pages
    where it can (transparent huge pages, asked for with madvise before any page is touched, so
    that each fault maps a 2 MB page: private anonymous memory, as shared memory has huge pages
    of its own setting); None where that cannot be asked. See WeightArena for what it gains."""
    if not nbytes or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the map alive
    start = -base.data_ptr() % HUGE_PAGE
    return base[start : start + nbytes]


class WeightArena:
    """One block of memory for a model's weight matrices, which the kernel backs with 2 MB pages
    where it can (Linux's transparent huge pages, asked for with madvise; elsewhere, or on a GPU,
    ordinary tensors). A decoded token streams every matrix once, and with 4 KB pages the
    address translations of that stream cost much of it in a virtual machine: measured on the
    2-core AMD EPYC VM, a 335 MB matrix-vector product read 24-26 GB/s from 4 KB pages and 31-49
    GB/s from 2 MB ones; Gemma 3 270M decoding went from 20.7 to 17.1 ms a token.

    What it costs: the matrices transformers left in its memory-mapped file are copied (their
    file pages stay mapped, clean, until the system wants them back), and the kernel may first
    have to compact memory to find 2 MB pages -- up to ~1 s for 540 MB here, once a model."""

    LINE = 64

    def __init__(self, tensors, device):
        self.device = device
        self.offset = 0
        nbytes = sum(self._size(t.shape, t.dtype) for t in tensors)
        self.base = huge_page_memory(nbytes) if device.type == "cpu" else None

    def _size(self, shape, dtype) -> int:  # with room to start anywhere in a cache line
        return torch.Size(shape).numel() * dtype.itemsize + self.LINE

    def empty(self, shape, dtype, phase: int = 0) -> torch.Tensor:
        """An uninitialised tensor starting `phase` bytes into a cache line."""
        if self.base is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        start = self.offset + (phase - self.base.data_ptr() - self.offset) % self.LINE
        n = torch.Size(shape).numel() * dtype.itemsize
        self.offset = start + n
        return self.base[start : start + n].view(dtype).view(shape)

    def move(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The parameter, its values now in the arena (whoever holds it sees them there); as it
        is where there is no arena. It keeps its offset within a cache line: PyTorch's CPU
        matrix-vector products (MKL's) choose their loops by the alignment of the matrix, and
        so the order of their sums -- the lean runner's results stay the bits they were."""
        if self.base is None:
            return param
        moved = self.empty(param.shape, param.dtype, param.data_ptr() % self.LINE)
        moved.copy_(param.data)
        param.data = moved
        return param


class Int8Weight:
    """A weight stored as int8 with one bf16 scale per output row (weight-only quantization):
    w ~= q * scale. PyTorch's CPU kernel multiplies bf16 activations by it directly."""

    def __init__(self, w: torch.Tensor):
        self.dense = w  # kept for prompts: the int8 kernel is slow for many rows at once
        wf = w.float()
        self.scales = wf.abs().amax(dim=1).clamp(min=1e-8) / 127
        self.q = (wf / self.scales[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = self.scales.to(torch.bfloat16)
        self.shape = w.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scales).view(*x.shape[:-1], -1)


def _linear(x, w, b=None):
    """x @ w.T, where w is a tensor or an Int8Weight.

    For one token, torch.mv(w, x) is used: on the 2-core AVX-512 CPU this was measured on it
    runs the bf16 matrix-vector product up to 1.5x faster than torch's linear, with the same
    float32 results bit for bit (the equality tests hold)."""
    if isinstance(w, Int8Weight):
        if x.shape[-2] > 1:  # prefill: full-precision weights (same memory as the reference)
            return torch.nn.functional.linear(x, w.dense, b)
        y = w.matmul(x)
        return y if b is None else y + b
    if x.dim() == 3 and x.shape[-2] == 1 and x.shape[0] == 1:
        y = torch.mv(w, x.reshape(-1)).view(1, 1, -1)
        return y if b is None else y + b
    return torch.nn.functional.linear(x, w, b)


def _rms_norm(x, weight, eps):
    # as transformers computes it: in float32, then back to the input dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _gemma_norm(x, weight1, eps):
    # Gemma3RMSNorm: the product with (1 + w) in float32 too, then back to the input dtype;
    # weight1 is that 1 + w, computed once
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight1).to(x.dtype)


def _plus_one(norm) -> torch.Tensor:
    """A Gemma3RMSNorm's factor 1 + w, in float32 whatever the weights' dtype (as it computes)."""
    return (1.0 + norm.weight.float()).contiguous()


def _rope_tables(theta, head_dim, positions, dtype, device):
    """cos and sin of every position's angles, (positions, head_dim / 2) each, one number an
    angle (the native pass reads them so; _positions doubles a pass's rows for transformers'
    halves), as transformers computes them (float32), then in `dtype`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return freqs.cos().to(dtype).to(device), freqs.sin().to(dtype).to(device)


def _positions(cos, sin, start: int, count: int):
    """The tables' rows for positions start .. start + count, each angle twice (i and i + rot /
    2, transformers' halves): (count, rot) each, once for a pass's layers."""
    cos, sin = cos[start : start + count], sin[start : start + count]
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _rope(x, cos, sin, rot):
    """RoPE on the first `rot` dimensions of each head (all of them but for partial rotary)."""
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :rot], x[..., rot:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanRunner:
    """Plain tensors and functions; no nn.Module machinery on the hot path. The "lean" runner
    (runners/base.py); native.NativeRunner runs the same weights in compiled code."""

    name = "lean"

    def __init__(self, hf_model, quant: str | None = None, math: str = "auto"):
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
        self.math = self._math(math)
        # The arithmetic of the matrix products.
        self.act_dtype = getattr(torch, self.math)
        table_dtype = self._table_dtype()
        self.arch = spec = architecture(cfg)
        if spec is None:
            raise ValueError(f"the lean runner does not run model_type '{cfg.model_type}'")
        self.gemma = spec.norm_plus_one  # Gemma 3's norms and layer (below)
        self.rope_pairs = False  # transformers' q and k rows: RoPE on halves
        self.rot = int(self.head_dim * getattr(cfg, "partial_rotary_factor", 1.0))
        self.embed = base.embed_tokens.weight
        # Gemma's embeddings are multiplied by sqrt(hidden), a factor transformers first rounds
        # to the weights' dtype (25.25 for 25.30 in bfloat16): the same factor here
        self.embed_scale = (
            base.embed_tokens.embed_scale.to(self.embed.dtype) if spec.embed_scale else None
        )
        self.norm = _gemma_norm if self.gemma else _rms_norm
        self.final_norm = _plus_one(base.norm) if self.gemma else base.norm.weight
        self.lm_head = hf_model.lm_head.weight
        # every matrix a decoded token reads, in one block of memory (WeightArena); the output
        # layer's is also the embedding where they are tied
        arena = WeightArena(
            [
                *(m.weight for m in base.layers.modules() if isinstance(m, torch.nn.Linear)),
                self.lm_head,
            ],
            self.device_,
        )
        self.lm_head = arena.move(self.lm_head)
        self.layers = [
            (_gemma_weights if self.gemma else _llama_weights)(layer, arena)
            for layer in base.layers
        ]
        positions = cfg.max_position_embeddings
        if self.gemma:  # global layers: config's full_attention RoPE; local ones: their own
            ropes = cfg.rope_parameters
            self.cos, self.sin = _rope_tables(
                ropes["full_attention"]["rope_theta"],
                self.head_dim,
                positions,
                table_dtype,
                self.device_,
            )
            self.local_cos, self.local_sin = _rope_tables(
                ropes["sliding_attention"]["rope_theta"],
                self.head_dim,
                positions,
                table_dtype,
                self.device_,
            )
            self.windows = [
                cfg.sliding_window if kind == "sliding_attention" else None
                for kind in cfg.layer_types
            ]
            self.attn_scale = cfg.query_pre_attn_scalar**-0.5
        else:
            theta = (
                cfg.rope_parameters.get("rope_theta", 10000.0)
                if hasattr(cfg, "rope_parameters")
                else getattr(cfg, "rope_theta", 10000.0)
            )
            self.cos, self.sin = _rope_tables(
                theta, self.rot, positions, table_dtype, self.device_
            )  # (max_pos, rotary dims / 2) each
            self.windows = [None] * len(self.layers)
            self.attn_scale = None  # SDPA's default, head_dim^-0.5
        self.generation_config = hf_model.generation_config
        if quant == "int8":  # every matrix but the embedding lookup table
            self.lm_head = Int8Weight(self.lm_head)
            for w in self.layers:
                for name in ("wqkv", "wo", "w13", "w2"):
                    w[name] = Int8Weight(w[name])

    def _math(self, math: str) -> str:
        """PyTorch computes in the weights' dtype."""
        own = str(self.dtype).removeprefix("torch.")
        if math not in ("auto", own):
            raise ValueError(
                f"--math {math} needs the native runner; the lean runner "
                f"computes in the weights' dtype ({own})"
            )
        return own

    def _table_dtype(self) -> torch.dtype:
        return self.dtype

    def layer_tables(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables (cos, sin) of a layer: Gemma's local layers have a base of their own."""
        if self.windows[layer] is not None:
            return self.local_cos, self.local_sin
        return self.cos, self.sin

    def weight_bytes(self) -> int:
        """Bytes of weights read per decoded token (the embedding is looked up, not read)."""
        total = 0
        for w in [
            *(x for layer in self.layers for x in layer.values()),
            self.lm_head,
            self.final_norm,
        ]:
            if isinstance(w, Int8Weight):
                total += w.q.numel() + w.scales.numel() * 2
            elif hasattr(w, "nbytes") and not isinstance(w, torch.Tensor):  # quantized blocks
                total += w.nbytes
            elif w is not None:
                total += w.numel() * w.element_size()
        return total

    @property
    def device(self):
        return self.device_

    def new_cache(self, capacity: int = 256):
        return KVCache(
            len(self.layers), self.n_kv, self.head_dim, self.dtype, self.device_, capacity
        )

    def step(self, entries, all_logits: bool = False) -> torch.Tensor:
        """Several sequences at once: entries of (new ids, cache); the logits of each one's
        last new id (len(entries), vocab), one sequence after another."""
        return torch.cat(
            [
                self.forward(torch.as_tensor(ids).view(1, -1), cache, all_logits)
                for ids, cache in entries
            ]
        )

    def __call__(
        self, input_ids: torch.Tensor, cache: KVCache | None = None, all_logits: bool = False
    ) -> torch.Tensor:
        return self.forward(input_ids, cache, all_logits)

    def forward(
        self, input_ids: torch.Tensor, cache: KVCache | None = None, all_logits: bool = False
    ) -> torch.Tensor:
        """ids (1, T) -> logits of the last position (1, vocab), or of every position
        (T, vocab) with `all_logits`. Appends to `cache` if given."""
        T = input_ids.shape[1]
        start = cache.length if cache is not None else 0
        if cache is not None:
            cache.reserve(start + T)
        cos, sin = _positions(self.cos, self.sin, start, T)  # (T, rot)
        x = torch.nn.functional.embedding(input_ids, self.embed)  # (1, T, D)
        if self.gemma:
            x = x * self.embed_scale
        for i, w in enumerate(self.layers):
            if self.gemma:
                x = self._gemma_layer(x, w, i, cache, start)
                continue
            x = x + self._attention(
                _rms_norm(x, w["attn_norm"], self.eps), w, i, cache, start, cos, sin
            )
            h = _rms_norm(x, w["mlp_norm"], self.eps)
            gate, up = _linear(h, w["w13"]).chunk(2, dim=-1)
            x = x + _linear(torch.nn.functional.silu(gate) * up, w["w2"])
        if cache is not None:
            cache.length = start + T
        if all_logits:
            return _linear(self.norm(x, self.final_norm, self.eps), self.lm_head)[0]
        x = self.norm(x[:, -1:, :], self.final_norm, self.eps)  # only the last position
        return _linear(x, self.lm_head)[:, -1, :]

    def _gemma_layer(self, x, w, layer, cache, start):
        """A Gemma 3 layer: as Llama's, with each branch's output RMS-normed before it is added
        to the residual stream, GELU (tanh) for SiLU, and this layer's RoPE tables."""
        T = x.shape[1]
        cos, sin = _positions(*self.layer_tables(layer), start, T)
        out = self._attention(
            _gemma_norm(x, w["attn_norm"], self.eps), w, layer, cache, start, cos, sin
        )
        x = x + _gemma_norm(out, w["attn_out_norm"], self.eps)
        gate, up = _linear(_gemma_norm(x, w["mlp_norm"], self.eps), w["w13"]).chunk(2, dim=-1)
        out = _linear(torch.nn.functional.gelu(gate, approximate="tanh") * up, w["w2"])
        return x + _gemma_norm(out, w["mlp_out_norm"], self.eps)

    def _attention(self, h, w, layer, cache, start, cos, sin):
        B, T, _ = h.shape
        H, KV, hd = self.n_heads, self.n_kv, self.head_dim
        qkv = _linear(h, w["wqkv"], w["bqkv"])
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        q = q.view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, KV, hd).transpose(1, 2)
        if self.arch.qk_norm:  # each head's query and key RMS-normed, before RoPE
            q = self.norm(q, w["q_norm"], self.eps)
            k = self.norm(k, w["k_norm"], self.eps)
        q, k = _rope(q, cos, sin, self.rot), _rope(k, cos, sin, self.rot)
        if cache is not None:
            cache.k[layer, :, start : start + T] = k[0]
            cache.v[layer, :, start : start + T] = v[0]
            k = cache.k[layer, :, : start + T].unsqueeze(0)  # (1, KV, S, hd), S = start + T
            v = cache.v[layer, :, : start + T].unsqueeze(0)
        window = self.windows[layer]
        if window is not None and start + T > window:  # a local layer past its window
            lo = max(0, start + 1 - window)  # the first key any new row sees
            k, v = k[:, :, lo:], v[:, :, lo:]
            mask, causal = _window_mask(T, start, lo, window, h.device), False
        elif T == 1:
            mask, causal = None, False  # one new token sees everything before it
        elif start == 0:
            mask, causal = None, True
        else:  # a new block after a reused prefix: row i sees positions <= start + i
            S = start + T
            mask = torch.ones(T, S, dtype=torch.bool, device=h.device).tril(diagonal=start)
            causal = False
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.attn_scale, enable_gqa=H != KV
        )
        return _linear(out.transpose(1, 2).reshape(B, T, H * hd), w["wo"])


def _window_mask(T, start, lo, window, device):
    """Which keys (positions lo..start+T-1) each of T new rows (positions start..) sees in a
    local layer: the causal ones within the window, q - k < window as transformers masks them
    (sliding_window_overlay: kv_idx > q_idx - sliding_window). None for a single row: the keys
    from lo are exactly its window."""
    if T == 1:
        return None
    rows = torch.arange(start, start + T, device=device)[:, None]
    keys = torch.arange(lo, start + T, device=device)[None, :]
    return (keys <= rows) & (rows - keys < window)


def _llama_weights(layer, arena: WeightArena) -> dict:
    """Llama's, Qwen2's and Qwen3's (its per-head q and k norms) weights; Phi-3's, whose q|k|v
    and gate|up are fused in its own modules already."""
    a, m = layer.self_attn, layer.mlp
    fused = hasattr(a, "qkv_proj")
    w = {
        "attn_norm": layer.input_layernorm.weight,
        "wqkv": arena.move(a.qkv_proj.weight)
        if fused
        else _fuse(arena, a.q_proj, a.k_proj, a.v_proj),
        "bqkv": None if fused else _fuse_bias(a.q_proj, a.k_proj, a.v_proj),
        "wo": arena.move(a.o_proj.weight),
        "mlp_norm": layer.post_attention_layernorm.weight,
        "w13": arena.move(m.gate_up_proj.weight) if fused else _fuse(arena, m.gate_proj, m.up_proj),
        "w2": arena.move(m.down_proj.weight),
    }
    if hasattr(a, "q_norm"):
        w["q_norm"], w["k_norm"] = a.q_norm.weight, a.k_norm.weight
    return w


def _gemma_weights(layer, arena: WeightArena) -> dict:
    """Llama's names for what Gemma 3 shares with it (its pre_feedforward_layernorm is
    mlp_norm), and its four other norms; every norm as its factor 1 + w."""
    a, m = layer.self_attn, layer.mlp
    return {
        "attn_norm": _plus_one(layer.input_layernorm),
        "wqkv": _fuse(arena, a.q_proj, a.k_proj, a.v_proj),
        "bqkv": None,
        "q_norm": _plus_one(a.q_norm),
        "k_norm": _plus_one(a.k_norm),
        "wo": arena.move(a.o_proj.weight),
        "attn_out_norm": _plus_one(layer.post_attention_layernorm),
        "mlp_norm": _plus_one(layer.pre_feedforward_layernorm),
        "w13": _fuse(arena, m.gate_proj, m.up_proj),
        "w2": arena.move(m.down_proj.weight),
        "mlp_out_norm": _plus_one(layer.post_feedforward_layernorm),
    }


def _fuse(arena: WeightArena, *linears):
    """One weight for several projections of the same input; each module's weight becomes a
    view into it, so memory is not doubled and the transformers model still works."""
    rows = sum(m.weight.shape[0] for m in linears)
    first = linears[0].weight
    fused = arena.empty((rows, first.shape[1]), first.dtype)
    torch.cat([m.weight.data for m in linears], dim=0, out=fused)
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = fused[row : row + n]
        row += n
    return fused


def _fuse_bias(*linears):
    if all(m.bias is None for m in linears):
        return None
    return torch.cat(
        [
            m.bias.data
            if m.bias is not None
            else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype, device=m.weight.device)
            for m in linears
        ]
    )
