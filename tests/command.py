"""The command line in this test process: `miniserve.cli.main.main(argv)` -- what `python -m
miniserve` runs -- with its own stdin, stdout, stderr and environment variables. A new process
would import torch and transformers again (3-4 s a command); the tests of the process itself
(a pipe, the entry point, one-line errors that anything outside Python could spoil, a missing
native library) start one with `process`."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent

# read once per process (runners/native.py): setting them for one in-process command would be
# silently ignored, so `run` refuses them and such tests use `process`
PER_PROCESS = ("MINISERVE_NATIVE", "MINISERVE_NATIVE_ARCH")


def run(*args, stdin: str | None = None, env: dict | None = None, timeout: float = 240):
    """(returncode, stdout, stderr) of `miniserve ARGS`, as subprocess.run would give them. The
    warnings the command raises are written to its stderr as a new process would write them
    (Python's default filters), and a command still running after `timeout` seconds dumps
    every thread's stack and ends the test run, as a hung process would fail its test."""
    from miniserve.cli.main import main

    assert not set(env or ()) & set(PER_PROCESS), f"{PER_PROCESS}: use process()"
    out, err = io.StringIO(), io.StringIO()
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        with (
            mock.patch.dict(os.environ, env or {}),
            mock.patch.object(sys, "stdin", io.StringIO(stdin or "")),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.resetwarnings()  # a new process's filters, not the test run's
            warnings.simplefilter("default")
            for category in (
                DeprecationWarning,
                PendingDeprecationWarning,
                ImportWarning,
                ResourceWarning,
            ):
                warnings.simplefilter("ignore", category)
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors: code 2, its message on stderr
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        faulthandler.cancel_dump_traceback_later()
    for w in caught:
        err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def process(*args, stdin=None, timeout=240, env=None, script=("-m", "miniserve")):
    """The same in a new process: `python -m miniserve ARGS` (or another script). `stdin`: text,
    or bytes written as they are (stdout and stderr still come back as text)."""
    raw = isinstance(stdin, bytes)
    done = subprocess.run(
        [sys.executable, *script, *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=not raw,
        timeout=timeout,
        env={**os.environ, **env} if env else None,
    )
    if raw:
        done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done
