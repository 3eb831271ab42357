"""The command line in this test process: `miniserve.cli.main.main(argv)` -- what `python -m
miniserve` runs -- with its own stdin, stdout, stderr and environment variables. A new process
would import torch and transformers again (3-4 s a command); the tests of the process itself
(a pipe, the entry point, a missing native library) start one with `process`."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent


def run(*args, stdin: str | None = None, env: dict | None = None, timeout=None):
    """(returncode, stdout, stderr) of `miniserve ARGS`, as subprocess.run would give them.
    (`timeout` is the process's: here an engine that hung would hang the test.)"""
    from miniserve.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, env or {}),
        mock.patch.object(sys, "stdin", io.StringIO(stdin or "")),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors: code 2, its message on stderr
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def process(*args, stdin=None, timeout=240, env=None, script=("-m", "miniserve")):
    """The same in a new process: `python -m miniserve ARGS` (or another script)."""
    return subprocess.run(
        [sys.executable, *script, *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env} if env else None,
    )
