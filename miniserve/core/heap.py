"""Python's cyclic collector around a model: quiet while the process starts, and kept off what
a loaded model and the imports leave.

A full collection walks every tracked object: ~220,000 once torch and transformers are
imported, 100-180 ms a time. While the modules import, one comes each time the heap has grown
by a quarter (four in a `generate` start, ~0.35 s of its ~2.4 s); in the middle of a reply, one
stalls a decoding step. So a command starts with full collections ten times rarer, and a
model's load ends by freezing what exists (gc.freeze: full collections no longer walk it) and
putting the usual thresholds back. A closed engine thaws the heap, since a runner sits in
reference cycles: the next settle collects first, so that a model's memory goes with it.
"""

from __future__ import annotations

import gc
import threading

USUAL = gc.get_threshold()  # (700, 10, 10)
STARTING = (USUAL[0], USUAL[1], USUAL[2] * 100)
_lock = threading.Lock()
_thawed = False  # an engine closed since the last freeze: collect before the next


def starting() -> None:
    """A process starting (the commands call it first): full collections rarer while it imports."""
    gc.set_threshold(*STARTING)


def settle() -> None:
    """What exists now (the modules, a model just loaded) lives as long as the process: freeze
    it, and collect as usual from here on. After a thaw, collect first: a closed engine's
    cycles go, rather than being frozen for good."""
    global _thawed
    with _lock:
        if _thawed:
            gc.collect()
            _thawed = False
        gc.freeze()
        gc.set_threshold(*USUAL)


def thaw() -> None:
    """An engine closed: what was frozen is collectable again (its runner's cycles among it)."""
    global _thawed
    with _lock:
        gc.unfreeze()
        _thawed = True
