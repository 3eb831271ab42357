"""The declared interfaces hold: every runner implements the runner protocol (and its caches the
cache protocol), both engines the engine surface; one runner class per runner."""

import torch

from miniserve.engine.engine import Engine
from miniserve.engine.surface import LOCAL, REMOTE, EngineSurface
from miniserve.models.remote import RemoteEngine
from miniserve.runners.base import Cache, Runner
from miniserve.runners.hf import TransformersRunner
from miniserve.runners.lean import LeanRunner
from miniserve.runners.native import NativeRunner
from miniserve.runners.stored import StoredRunner

from conftest import needs_native


def _check(runner, name):
    assert isinstance(runner, Runner), f"{type(runner).__name__} misses part of Runner"
    assert runner.name == name
    cache = runner.new_cache(8)
    assert isinstance(cache, Cache)
    cache.reserve(4)
    ids = [1, 2, 3]
    one = runner.forward(torch.tensor([ids]), cache)
    assert one.shape == (1, runner.config.vocab_size) or one.shape[0] == 1
    assert cache.get_seq_length() == 3
    cache.crop(-1)
    assert cache.get_seq_length() == 2
    other = runner.new_cache(8)
    both = runner.step([([3], cache), (ids, other)])
    assert both.shape[0] == 2
    assert runner.weight_bytes() > 0


def test_the_float_runners_implement_the_protocol(bf16):
    _check(TransformersRunner(bf16.model), "transformers")
    _check(LeanRunner(bf16.model), "lean")


@needs_native
def test_the_native_runners_implement_the_protocol(bf16, stored_engine):
    _check(NativeRunner(bf16.model), "native")
    assert isinstance(stored_engine.runner, StoredRunner)
    _check(stored_engine.runner, "native")


def test_no_runner_is_two_classes():
    """A class is one runner: its name is the class's, not decided by a flag at run time."""
    for cls, name in (
        (TransformersRunner, "transformers"),
        (LeanRunner, "lean"),
        (NativeRunner, "native"),
        (StoredRunner, "native"),
    ):
        assert cls.__dict__.get("name", cls.name) == name
        assert not isinstance(cls.name, property)


def test_both_engines_have_the_engine_surface():
    for cls, caps in ((Engine, LOCAL), (RemoteEngine, REMOTE)):
        declared = [n for n in vars(EngineSurface) if not n.startswith("_")]
        missing = [m for m in declared if not hasattr(cls, m)]
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert cls.capabilities == caps


def test_the_command_line_does_not_import_the_web_stack():
    """generate, chat, step and bench start without Gradio or FastAPI (~3 s of imports): the
    web app's launcher and `serve` import them when they run."""
    import subprocess
    import sys

    code = (
        "import sys, miniserve.cli.main; "
        "print(sorted(m for m in ('gradio', 'fastapi', 'uvicorn') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
