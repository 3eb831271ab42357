
class Detokenizer:
    """Incremental decoding: `push(id)` returns the new text (possibly "")."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # decode from here, so context-dependent spacing is right
        self.read_offset = 0  # text of ids[:read_offset] has been emitted

    def _decode(self, ids: list[int]) -> str:
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
