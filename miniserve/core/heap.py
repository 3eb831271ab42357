"""Python's cyclic collector around a model: quiet while the process starts, and kept off what
a loaded model and the imports leave.

A full collection walks every tracked object: ~220,000 once torch and transformers are
imported, 100-180 ms a time. While the modules import, one comes each time the heap has grown
by a quarter (four in a `generate` start, ~0.35 s of its ~2.4 s); in the middle of a reply, one
stalls a decoding step. So a command starts with full collections ten times rarer, and a
model's load ends by freezing what exists (gc.freeze: full collections no longer walk it) and
putting the usual thresholds back; an unload thaws and collects first, so that the model's
reference cycles go.
"""

from __future__ import annotations

import gc

USUAL = gc.get_threshold()  # (700, 10, 10)
STARTING = (USUAL[0], USUAL[1], USUAL[2] * 100)


def starting() -> None:
    """A process starting (the commands call it first): full collections rarer while it imports."""
    gc.set_threshold(*STARTING)


def settle(collect: bool = False) -> None:
    """What exists now (the modules, a model just loaded) lives as long as the process: freeze
    it, and collect as usual from here on. `collect`: first thaw what was frozen before and
    collect it (after an unload)."""
    if collect:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    gc.set_threshold(*USUAL)
