"""A heavy module imported at its first use, not where the `import` statement stands.

`defer("torch")` puts an empty module object in `sys.modules`; modules that `import torch` get
it at once, and the first attribute read on it (`torch.zeros`, from any thread) runs torch's
own import into that same object, which then is torch's module, nothing in between. The
commands call it before anything else (cli/__init__.py): importing torch is ~1.2 s of the ~4 s
in which the web app's page should be served, and the page needs nothing from it -- the model,
which loads behind the page, does (its loading thread reads torch first of all). The modules
the page imports read no torch attribute at import time (tests/test_deferred.py builds and
serves the page and checks).

Unlike importlib's LazyLoader (Python 3.11), one thread runs the import and the others wait for
it: a request arriving while the model loads cannot see torch half-imported. A first use that
is an import of a submodule (`import torch.nn`) works too: the submodule, imported by torch's
own import, is not imported a second time. What is not covered: a thread importing a submodule
while another thread's first use is running the import (the two can wait for each other); the
web app's first use is its loading thread's, before any request can import anything of torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import types

_lock = threading.RLock()
_names: set[str] = set()  # the modules deferred
_broken: set[str] = set()  # the deferred modules whose import was cut off (Ctrl-C)
# read without triggering the import: what `import torch` itself and the import of a module
# already in sys.modules look at
_OWN = frozenset(("__class__", "__dict__", "__name__", "__spec__", "__loader__", "__package__"))


class _Deferred(types.ModuleType):
    def __getattribute__(self, name):
        if name in _OWN:
            return types.ModuleType.__getattribute__(self, name)
        with _lock:
            state = types.ModuleType.__getattribute__(self, "__dict__")
            if type(self) is _Deferred and "_deferred_loading" not in state:
                load(self)
        return types.ModuleType.__getattribute__(self, name)


def load(module: _Deferred) -> None:
    """Run the module's import into the placeholder (with _lock held by the caller)."""
    state = module.__dict__
    if "_deferred_error" in state:  # it failed before: the same error, not a second import
        raise ImportError(f"{module.__name__} could not be imported: {state['_deferred_error']}")
    state["_deferred_loading"] = True  # this thread's reads during the import are plain ones
    try:
        module.__spec__.loader.exec_module(module)
    except BaseException as e:
        state["_deferred_error"] = f"{type(e).__name__}: {e}"
        if isinstance(e, KeyboardInterrupt):
            _broken.add(module.__name__)
        if sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]  # a new `import` tries again
        raise
    finally:
        state.pop("_deferred_loading", None)
    module.__class__ = types.ModuleType


class _AlreadyImported(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import torch.nn` as the first use: Python has decided to import torch.nn before the
    read of torch.__path__ runs torch's import, which imports torch.nn; this gives that module
    back instead of running it again (a finder is asked only for a module not in sys.modules,
    except in exactly this case)."""

    def find_spec(self, fullname, path, target=None):
        if target is not None or fullname.partition(".")[0] not in _names:  # reload(): not ours
            return None
        if fullname not in sys.modules or "." not in fullname:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return sys.modules[spec.name]  # its own attributes (__spec__, __file__) are kept

    def exec_module(self, module):
        pass


def defer(name: str) -> None:
    """`import NAME` (a top-level module) from now on gives a module imported at first use. Does
    nothing if NAME is imported already (or is not installed: the import statement says so)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    _names.add(name)
    if not any(isinstance(f, _AlreadyImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _AlreadyImported())
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _Deferred
    sys.modules[name] = module


def import_cut_off() -> bool:
    """Whether Ctrl-C cut off a deferred import. The half-imported module's own exit handlers
    then fail one by one at the interpreter's shutdown (torch's: some hundred tracebacks), so
    a command that ends on that Ctrl-C leaves with os._exit instead."""
    return bool(_broken)


def is_deferred(name: str) -> bool:
    """True while NAME is deferred and not imported yet."""
    return type(sys.modules.get(name)) is _Deferred


def import_now(name: str) -> None:
    """Run NAME's deferred import now, in this thread (nothing if it has run or was not
    deferred): a thread that will use it makes it its first use."""
    module = sys.modules.get(name)
    if type(module) is _Deferred:
        module.__file__  # noqa: B018 -- any read but _OWN's runs the import
