"""A heavy module imported at its first use, not where the `import` statement stands.

`defer("torch")` puts an empty module object in `sys.modules`; modules that `import torch` get
it at once, and the first attribute read on it (any thread; `torch.zeros`, `torch.nn`, an
`import torch.nn` beneath it) runs torch's own import into that same object, which then is
torch's module, nothing in between. The web app calls it before anything else (cli/__init__.py):
importing torch is ~1.2 s of the ~4 s in which the page should be served, and the page needs
nothing from it -- the model, which loads behind the page, does. The modules the page imports
read no torch attribute at import time (`tests/test_reliability.py` starts the app and checks).

Unlike importlib's LazyLoader (Python 3.11), one thread runs the import and the others wait for
it: a request arriving while the model loads cannot see torch half-imported.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

_lock = threading.RLock()
# read without triggering the import: what `import torch` itself and the import of a module
# already in sys.modules look at
_OWN = frozenset(("__class__", "__dict__", "__name__", "__spec__", "__loader__", "__package__"))


class _Deferred(types.ModuleType):
    _loading = False  # set on the instance while its import runs (by the thread holding _lock)

    def __getattribute__(self, name):
        if name in _OWN:
            return types.ModuleType.__getattribute__(self, name)
        with _lock:
            if type(self) is _Deferred and not types.ModuleType.__getattribute__(self, "_loading"):
                load(self)
        return types.ModuleType.__getattribute__(self, name)


def load(module: _Deferred) -> None:
    module.__dict__["_loading"] = True  # this thread's reads during the import are plain ones
    try:
        module.__spec__.loader.exec_module(module)
    except BaseException:
        del sys.modules[module.__name__]  # the next import tries again, and fails the same way
        raise
    finally:
        module.__dict__.pop("_loading", None)
    module.__class__ = types.ModuleType


def defer(name: str) -> None:
    """`import NAME` (a top-level module) from now on gives a module imported at first use. Does
    nothing if NAME is imported already (or is not installed: the import statement says so)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _Deferred
    sys.modules[name] = module


def is_deferred(name: str) -> bool:
    """True while NAME is deferred and not imported yet."""
    return type(sys.modules.get(name)) is _Deferred
