"""torch imported at first use (core/deferred.py): the web app's page is built and served
without it, and a deferred module is imported once, whole, whichever thread reads it first."""

import subprocess
import sys
import textwrap
import threading

import pytest

from miniserve.core.deferred import defer, is_deferred

from conftest import same_on_every_cpu

pytestmark = same_on_every_cpu


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_page_is_built_and_served_before_torch_is_imported():
    """The launcher's own steps (flags, registry, the page and the API mounted), then GET / --
    all with torch still deferred; then the model's first use of torch imports it. Fails if a
    module the page imports reads a torch attribute at import time, or a widget does, or if
    loading the embedded model imports transformers' whole model registry."""
    out = _run(
        """
        from starlette.testclient import TestClient

        from miniserve.cli import app as launcher
        from miniserve.core.config import load_presets
        from miniserve.core.deferred import is_deferred
        from miniserve.ui import build_ui

        args = launcher.parse_args(["--no-history"])
        models, _ = launcher.open_registry(args)
        demo = build_ui(models, load_presets(None), args.preset, None)
        client = TestClient(launcher.web_app(args, models, demo))
        page = client.get("/")
        assert page.status_code == 200 and "<html" in page.text.lower(), page.status_code
        for path in ("/config", "/v1/models", "/openapi.json"):  # what comes next
            assert client.get(path).status_code == 200, path
        print("deferred after the page:", is_deferred("torch"))
        engine = models.get(None)  # loads the model: torch now
        print("deferred after the model:", is_deferred("torch"))
        import sys

        print("transformers' model registry imported:", "transformers.models" in sys.modules)
        from miniserve.core.config import SamplingParams

        chunks = engine.complete_text("Hi", SamplingParams(max_new_tokens=2, temperature=0))
        print("reply:", "".join(c.text for c in chunks))
        models.close()  # as the launcher does: the engine thread ends before the process
        """
    )
    assert "deferred after the page: True" in out
    assert "deferred after the model: False" in out
    # the stored model's tokenizer is read back without AutoTokenizer (~0.3 s of each start)
    assert "transformers' model registry imported: False" in out
    assert out.split("reply:", 1)[1].strip(), out  # the model answered


def _write_module(tmp_path, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))


def test_a_deferred_module_is_imported_once_and_whole_by_concurrent_first_uses(
    tmp_path, monkeypatch
):
    """Eight threads read a deferred module at once while its import takes 0.3 s: one import,
    and every thread sees its last attribute (importlib's LazyLoader on Python 3.11 lets the
    others read a half-imported module)."""
    _write_module(
        tmp_path,
        "slow_mod",
        """
        import time
        import counter_mod
        counter_mod.runs += 1
        first = 1
        time.sleep(0.3)
        last = 2
        """,
    )
    _write_module(tmp_path, "counter_mod", "runs = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_mod", raising=False)
    defer("slow_mod")
    assert is_deferred("slow_mod")
    import counter_mod
    import slow_mod

    assert counter_mod.runs == 0  # the import statement ran nothing
    seen, start = [], threading.Barrier(8)

    def read():
        start.wait()
        seen.append(slow_mod.last)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [2] * 8
    assert counter_mod.runs == 1 and not is_deferred("slow_mod")
    assert type(slow_mod) is type(sys)  # a plain module now: no cost on later reads
    monkeypatch.delitem(sys.modules, "slow_mod")


def test_a_deferred_module_that_fails_raises_at_first_use_and_again_after(tmp_path, monkeypatch):
    _write_module(tmp_path, "broken_mod", "raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    defer("broken_mod")
    import broken_mod

    with pytest.raises(RuntimeError, match="broken on purpose"):
        broken_mod.anything  # noqa: B018
    assert "broken_mod" not in sys.modules
    with pytest.raises(ImportError, match="broken on purpose"):  # the same object read again
        broken_mod.anything  # noqa: B018
    with pytest.raises(RuntimeError, match="broken on purpose"):
        import broken_mod  # noqa: F401, F811


def test_a_submodule_import_as_the_first_use_imports_each_module_once(tmp_path, monkeypatch):
    """`import pkg.sub` first: reading pkg.__path__ runs pkg's import, which imports pkg.sub;
    Python, already importing pkg.sub, must get that module, not run it a second time."""
    pkg = tmp_path / "deferred_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from deferred_pkg import sub\n")
    (pkg / "sub.py").write_text(
        "import counter_mod2\ncounter_mod2.runs += 1\nvalue = counter_mod2.runs\n"
    )
    _write_module(tmp_path, "counter_mod2", "runs = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    defer("deferred_pkg")
    import counter_mod2
    import deferred_pkg.sub

    assert counter_mod2.runs == 1
    assert deferred_pkg.sub is sys.modules["deferred_pkg.sub"] and deferred_pkg.sub.value == 1
    for name in ("deferred_pkg", "deferred_pkg.sub"):
        monkeypatch.delitem(sys.modules, name)


def test_ctrl_c_during_a_deferred_import_ends_a_command_with_one_line(tmp_path):
    """Ctrl-C while torch imports (the first second of a command): the half-imported module's
    exit handlers would each fail at shutdown (torch's printed some 1,900 lines of tracebacks);
    the command says nothing more than a blank line and exits 130."""
    _write_module(
        tmp_path,
        "cut_mod",
        """
        import atexit, sys
        me = sys.modules[__name__]
        for _ in range(20):  # as torch's own: they read the module at exit
            atexit.register(lambda: me.value)
        raise KeyboardInterrupt
        """,
    )
    script = f"""
        import argparse, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from miniserve.core.deferred import defer
        defer("cut_mod")
        import cut_mod
        from miniserve.cli import main as cli

        def command(args):
            return cut_mod.value  # the first use: its import is cut off

        def parser():
            p = argparse.ArgumentParser()
            p.set_defaults(func=command)
            return p

        cli.build_parser = parser
        sys.exit(cli.main([]))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip() == ""
