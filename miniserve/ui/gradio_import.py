"""Importing Gradio without rewriting its type stubs: imported (for its effect) before Gradio.

Gradio's component metaclass calls `create_or_modify_pyi` for every component class it
defines, at every import: it reads the class's source file, parses it with `ast` and compares
(and may rewrite) the `.pyi` stub beside it in site-packages -- a tool for Gradio's own
developers. For ~80 components that is ~1.3 s of each start of the app on a 2-core VM (`import
gradio` 2.7-3.4 s with it, 1.4-1.8 s without; BENCHMARKS.md, "Start-up and idle"), more than
a third of the 4 s in which the page should be served. The stubs are already installed with
the package; nothing at run time reads them.

Importing this module installs an import hook that, once `gradio.component_meta` has run and
before any component class is defined, replaces that function with one that does nothing.
`tests/test_ui.py` checks that Gradio still calls it by that name (else the saving is lost,
silently) and that a component class defined afterwards writes nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

META = "gradio.component_meta"
STUB_WRITER = "create_or_modify_pyi"


def no_stub_writing(component_class, class_name, events) -> None:
    """Gradio's stub writer, made to do nothing (its signature kept)."""
    no_stub_writing.calls += 1


no_stub_writing.calls = 0


def patch(module) -> None:
    if not hasattr(module, STUB_WRITER):
        raise RuntimeError(
            f"this Gradio has no {META}.{STUB_WRITER}: check miniserve/ui/gradio_import.py "
            "against gradio/component_meta.py"
        )
    setattr(module, STUB_WRITER, no_stub_writing)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != META:
            return None
        sys.meta_path.remove(self)  # once; find the real spec without this finder
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if META in sys.modules:  # Gradio came first (a test, a script): patch what is left to define
    patch(sys.modules[META])
elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnImport())
