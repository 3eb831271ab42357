"""The runner interface: what the decode loop and the scheduler drive, whichever forward pass
is behind it. Every runner implements `Runner` (tests/test_structure.py checks each one):

    runner.new_cache(capacity)                           an empty KV cache (a `Cache`)
    runner.forward(ids (1, T), cache=None, all_logits=False)
        -> logits of the last position (1, vocab), or of every position (T, vocab);
           with a cache, positions continue from its length and the new keys/values are
           appended to it
    runner.step([(ids, cache), ...], all_logits=False)
        -> the logits of each sequence's last new id (n, vocab): one pass over all their rows
           (native), or one sequence after another (lean, transformers)
    runner.name               "transformers", "lean" or "native"
    runner.dtype              the weights';  runner.act_dtype, runner.math: the arithmetic's
    runner.device, runner.config, runner.generation_config
    runner.weight_bytes()     bytes of weights read per decoded token

The runners: `hf.TransformersRunner` (a transformers model: the reference, and the fallback for
every other architecture), `lean.LeanRunner` (the PyTorch pass), `native.NativeRunner` (the
same weights, every pass in compiled code), `stored.StoredRunner` (a GGUF's weights as stored,
in compiled code).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Cache(Protocol):
    """A sequence's keys and values: `crop` cuts it back (negative: that many positions),
    `reserve` makes room ahead, `capacity` is the positions it holds room for."""

    def get_seq_length(self) -> int: ...

    def crop(self, n: int) -> None: ...

    def reserve(self, needed: int, exact: bool = False) -> None: ...

    @property
    def capacity(self) -> int: ...


@runtime_checkable
class Runner(Protocol):
    name: str
    dtype: torch.dtype
    act_dtype: torch.dtype
    math: str
    config: Any
    generation_config: Any

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, capacity: int = 256) -> Cache: ...

    def forward(
        self, input_ids: torch.Tensor, cache: Cache | None = None, all_logits: bool = False
    ) -> torch.Tensor: ...

    def step(self, entries: list[tuple[Any, Cache]], all_logits: bool = False) -> torch.Tensor: ...

    def weight_bytes(self) -> int: ...


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
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
