"""The runner interface: what the decode loop drives, whichever forward pass is behind it.

    runner.new_cache(capacity=None)                      an empty KV cache
    runner.forward(ids (1, T), cache=None, all_logits=False)
        -> logits of the last position (1, vocab), or of every position (T, vocab);
           with a cache, positions continue from its length and the new keys/values are
           appended to it
    runner.step([(ids, cache), ...]) (optional)
        -> the logits of each sequence's last new id (n, vocab), all in one pass (the native
           runner); without it the scheduler calls forward for one sequence after another
    runner.name               "transformers", "lean" or "native"
    runner.dtype              the weights';  runner.act_dtype: the arithmetic's
    runner.device, runner.config, runner.generation_config
    runner.weight_bytes()     bytes of weights read per decoded token

`lean.LeanModel` (with the compiled step of native.py when it has one) implements it;
`TransformersRunner` wraps a transformers model, the reference and the fallback for every
other architecture. `as_runner` lets the loop take a bare transformers model too.
"""

from __future__ import annotations

import functools
import inspect

import torch


class TransformersRunner:
    """A transformers causal LM behind the runner interface."""

    name = "transformers"

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.generation_config = model.generation_config
        self.dtype = self.act_dtype = model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, capacity: int | None = None):
        from transformers import DynamicCache
        return DynamicCache(config=self.config)

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
    return model if hasattr(model, "new_cache") else TransformersRunner(model)


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_class: type) -> str:
    """transformers 5 renamed `past_key_values=` to `cache=`; use what this version takes."""
    names = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in names else "past_key_values"
