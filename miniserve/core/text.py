"""Text as miniserve keeps and sends it: valid UTF-8, no control characters but newlines and
tabs (the chat templates, the store and the API all take it so)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def clean_text(text: str) -> str:
    """Drop control characters (keeping newlines and tabs) and unpaired surrogates ('?')."""
    text = str(text).encode("utf-8", errors="replace").decode("utf-8")
    return _CONTROL.sub("", text)
