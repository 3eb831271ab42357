"""The benchmarks' prompts: the filler text, cut to a number of the model's tokens, one prompt
a stream. (benchmarks/vs_llamacpp.py reads FILLER from this file's source.)"""

from __future__ import annotations

FILLER = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Science is a body of "
    "empirical, theoretical, and practical knowledge about the natural world, produced by "
    "scientists who emphasize the observation, explanation, and prediction of real-world "
    "phenomena. "
)


def prompt_of_length(tokenizer, n: int) -> list[int]:
    ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]


def stream_prompt(tokenizer, n: int, index: int) -> list[int]:
    """Stream `index`'s prompt: exactly n tokens, "<index + 1>. " then the filler, so no two
    streams share a prompt (nor a cached prefix)."""
    lead = tokenizer(f"{index + 1}. ", add_special_tokens=False)["input_ids"]
    return (lead + prompt_of_length(tokenizer, n))[:n]
