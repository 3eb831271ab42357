"""The transformers runner: a transformers causal LM behind the runner interface
(runners/base.py) -- the reference every other runner is measured against, and the fallback
for every architecture the lean and native runners do not implement."""

from __future__ import annotations

import functools
import inspect

import torch

from miniserve.runners.base import Runner


class TransformersRunner:
    """A transformers causal LM behind the runner interface."""

    name = "transformers"

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.generation_config = model.generation_config
        self.dtype = self.act_dtype = model.dtype
        self.math = str(model.dtype).removeprefix("torch.")

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, capacity: int | None = None):
        return _cache_class()(config=self.config)

    def step(self, entries, all_logits: bool = False) -> torch.Tensor:
        """One sequence after another (transformers' caches are one sequence each)."""
        return torch.cat(
            [
                self.forward(torch.as_tensor(ids).view(1, -1), cache, all_logits)
                for ids, cache in entries
            ]
        )

    def forward(self, input_ids: torch.Tensor, cache=None, all_logits: bool = False):
        kwargs = {_cache_kwarg(type(self.model)): cache, "use_cache": cache is not None}
        # logits_to_keep=1, as generate() passes: else a prompt computes logits for every
        # position (~393 MB in float32 at 2,000 tokens); 0 keeps them all.
        out = self.model(input_ids=input_ids, logits_to_keep=0 if all_logits else 1, **kwargs)
        return out.logits[0] if all_logits else out.logits[:, -1, :]

    __call__ = forward

    def weight_bytes(self) -> int:
        """Embeddings are looked up, not read whole (unless tied to the output layer)."""
        m = self.model
        total = sum(p.numel() * p.element_size() for p in m.parameters())
        embed = m.get_input_embeddings().weight
        out = m.get_output_embeddings()
        tied = out is not None and out.weight.data_ptr() == embed.data_ptr()
        return total if tied else total - embed.numel() * embed.element_size()


def as_runner(model):
    """A runner as is; a transformers model wrapped."""
    return model if isinstance(model, Runner) else TransformersRunner(model)


@functools.cache
def _cache_class() -> type:
    """transformers' DynamicCache with the rest of the cache protocol: it grows on its own, so
    it reserves nothing and holds no capacity ahead."""
    from transformers import DynamicCache

    class TransformersCache(DynamicCache):
        capacity = 0

        def reserve(self, needed: int, exact: bool = False) -> None:
            pass

    return TransformersCache


@functools.cache
def _cache_kwarg(model_class: type) -> str:
    """transformers 5 renamed `past_key_values=` to `cache=`; use what this version takes."""
    names = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in names else "past_key_values"
