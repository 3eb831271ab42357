"""Python's cyclic collector around a model: quiet while the process starts, and kept off what
a loaded model and the imports leave.

A full collection walks every tracked object: ~220,000 once torch and transformers are
imported, 100-180 ms a time. While the modules import, one comes each time the heap has grown
by a quarter (four in a `generate` start, ~0.35 s of its ~2.4 s); in the middle of a reply, one
stalls a decoding step. So a command starts with full collections about a hundred times rarer
(the oldest generation's threshold: the young ones are collected as usual), and a model's load
ends by collecting, freezing what is left (gc.freeze: full collections no longer walk it) and
putting the usual thresholds back. A process that never loads a model (a remote-only server)
keeps the rarer full collections. A closed engine thaws the heap, since a runner sits in
reference cycles: the next settle's collection then takes it, once nothing refers to it.
"""

from __future__ import annotations

import gc
import threading

USUAL = gc.get_threshold()  # (700, 10, 10)
STARTING = (USUAL[0], USUAL[1], USUAL[2] * 100)
_lock = threading.Lock()


def starting() -> None:
    """A process starting (the commands call it first): full collections rarer while it imports."""
    gc.set_threshold(*STARTING)


def settle() -> None:
    """After a model's load or unload: collect, then freeze what is left -- the modules and the
    models loaded, which live as long as the process (and the objects of requests in flight,
    which stay until the next thaw) -- and collect as usual from here on."""
    with _lock:
        gc.collect()
        gc.freeze()
        gc.set_threshold(*USUAL)


def thaw() -> None:
    """An engine closed: what was frozen is collectable again (its runner's cycles among it)."""
    with _lock:
        gc.unfreeze()
