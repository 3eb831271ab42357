"""From a stream of token ids to a stream of text pieces.

Byte-level tokenizers split multi-byte characters (emoji, CJK, accents) across
tokens, so decoding one token at a time gives U+FFFD halves. `Detokenizer` decodes
a small window of recent tokens and holds text back while it ends in an incomplete
character; the pieces it emits always concatenate to `tokenizer.decode(all_ids)`.

`StopStrings` holds back text that might be the start of a stop string and cuts the
text where one appears.
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"


def _backend_decode(tokenizer):
    """The fast tokenizer's own decode where transformers' decode, without its clean-up, is
    only that call (TokenizersBackend's, not overridden): the same text without the wrapper's
    conversions, which cost as much as the decoding itself twice a token and stream. None
    elsewhere (a slow or custom tokenizer goes through its decode)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover -- transformers without the fast backend
        return None
    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
        and hasattr(backend, "decode")
    ):
        return backend.decode
    return None


class Detokenizer:
    """Incremental decoding: `push(id)` returns the new text (possibly "")."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # decode from here, so context-dependent spacing is right
        self.read_offset = 0  # text of ids[:read_offset] has been emitted
        self._backend = _backend_decode(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend(ids, skip_special_tokens=self.skip_special)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False
        )

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :]

    @property
    def text(self) -> str:
        return self._decode(self.ids)


class StopStrings:
    """Feed text pieces; get back the text that is safe to show and whether to stop."""

    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        self.pending += piece
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        # keep back the longest tail that could still grow into a stop string
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])),
            default=0,
        )
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


# -- a single token's bytes (the API's logprobs) ------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character a byte-level BPE vocabulary writes
    for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_DECODER = _byte_decoder()
METASPACE = "\u2581"  # SentencePiece's word-start mark: a space


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return "ByteLevel" in repr(getattr(backend, "decoder", None))


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for: a byte-level BPE token's own bytes (half a character
    is half a character, not U+FFFD), a byte-fallback token's byte (<0xF0>), a SentencePiece
    piece with its word-start mark as the space it is (decoding one token alone strips it in
    Llama's and Mistral's tokenizers), else its text."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if _byte_level(tokenizer):
            if all(ch in BYTE_DECODER for ch in piece):
                return bytes(BYTE_DECODER[ch] for ch in piece)
        elif METASPACE in piece and int(token_id) not in tokenizer.all_special_ids:
            return piece.replace(METASPACE, " ").encode("utf-8")
    return tokenizer.decode([int(token_id)], clean_up_tokenization_spaces=False).encode("utf-8")


def token_text(tokenizer, token_id: int) -> tuple[str, bytes]:
    """(the text an API's logprobs show for a token, its bytes): the text where the bytes are
    whole characters, else "bytes:\\xf0\\x9f" as OpenAI writes a piece of one."""
    raw = token_bytes(tokenizer, token_id)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


PIECE = re.compile(r"bytes:((?:\\x[0-9a-f]{2})+)")


def text_bytes(text: str) -> bytes:
    """token_text undone: the bytes a logprob entry's token text stands for ("bytes:\\xf0\\x9f"
    for a piece of a character, as OpenAI and this server write one; else the text's UTF-8)."""
    m = PIECE.fullmatch(text)
    if m is None:
        return text.encode("utf-8")
    return bytes(int(h, 16) for h in m.group(1).split("\\x")[1:])
