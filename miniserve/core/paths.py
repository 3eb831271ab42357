"""Where miniserve keeps what it builds and downloads: one cache folder
(`MINISERVE_CACHE`, else `$XDG_CACHE_HOME/miniserve`, else `~/.cache/miniserve`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("MINISERVE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "miniserve"


def file_key(path: Path) -> str:
    """A content hash of the file (streamed: a GGUF can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:16]
