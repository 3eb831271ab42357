"""Fuzz the HTTP API from its own OpenAPI document with schemathesis (not part of `make test`).

    .venv/bin/pip install schemathesis        # once; not a requirement of the product
    .venv/bin/python benchmarks/schemathesis_run.py [--max-examples 25] [--port 8765]

Starts `python -m miniserve serve --port PORT` (the embedded model), waits for
/openapi.json, then runs

    schemathesis run http://127.0.0.1:PORT/openapi.json --checks all --workers 1 ...

Every route's request body is generated from the schema (valid and invalid), and each reply is
checked: no 5xx, every status and content type documented, schema-valid requests accepted,
invalid ones rejected, 405 (with Allow) for a method a path does not take. The report (JUnit and
NDJSON) goes to $TMPDIR/miniserve-schemathesis/; the script's exit status is schemathesis'.

To keep a run to minutes on a small CPU, a hook (`map_case` below, loaded through
SCHEMATHESIS_HOOKS) caps the tokens a request may generate at MAX_TOKENS: a generated
max_tokens above it is lowered, and a request that sets none (or null) gets it (the defaults
are 1024 for chat and 16 for completions). And a conversation (chat, /tokenize) that ends with
the system prompt gets a user message after it: the system message is the simplest a schema
of messages allows, so it is what the coverage phase builds its requests on, and each would
be refused for where the conversation ends (the first item below) before the part it is
about were looked at. All three keep a schema-valid request valid and an invalid one invalid.

What a schema cannot say, so schemathesis reports it as "schema-valid request rejected"
(ST202) by design:

- the last message must not be the system prompt (system or developer): a conversation ends
  with a user message, tool results or an assistant message to continue, and a schema cannot
  single out the last item of a list (the hook above keeps generated requests off it);
- token ids (prompt, logit_bias) must be below the model's vocabulary size, which is the
  model's, not the document's;
- a grammar, pattern or JSON Schema (structured_outputs, response_format, a tool's
  parameters) must compile;
- a prompt must fit the model's context;
- `tools` only for a model whose chat template shows them to it: the embedded SmolLM2's
  template has no tools, so any non-empty `tools` is a 400 naming the model (param "tools").
  The document is the server's, for every model it serves (here or over the network), so it
  cannot say which of them take tools; nor can it say that a named tool_choice must name one
  of `tools` (a schema cannot compare the values of two fields);
- a model's chat template may refuse a conversation itself (its raise_exception).

And one that is schemathesis' own: a `seed` just past 2**63 - 1 (9223372036854775999). The
document's bound is exact (maximum 9223372036854775807); schemathesis reads it as a double,
2**63, and counts its near-boundary "valid" seeds down from that.

Each phase stops an operation at its first failure, so one of these can hide another failure
behind it: `-- --continue-on-failure` runs every case and lists them all.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import schemathesis

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
GENERATING = ("/v1/chat/completions", "/v1/completions")
CONVERSATIONS = ("/v1/chat/completions", "/tokenize")
SYSTEM = ("system", "developer")


@schemathesis.hook
def map_case(context, case):
    """At most MAX_TOKENS generated tokens a request, and no conversation that ends with the
    system prompt (see the module docstring). A case hook: the coverage phase applies those,
    not `map_body`."""
    body = case.body
    messages = body.get("messages") if isinstance(body, dict) else None
    if (
        case.operation.path in CONVERSATIONS
        and isinstance(messages, list)
        and messages
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") in SYSTEM
    ):
        messages.append({"role": "user", "content": "hi"})
    if case.operation.path in GENERATING and isinstance(body, dict):
        for key in TOKEN_FIELDS:
            value = body.get(key)
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value > MAX_TOKENS
            ):  # 4096.0 too: the coverage phase sends whole floats
                body[key] = MAX_TOKENS
        if all(body.get(key) is None for key in TOKEN_FIELDS):  # left out or null
            body["max_tokens"] = MAX_TOKENS
    return case


def wait_for(url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--max-examples",
        type=int,
        default=25,
        help="test cases per operation and phase (schemathesis -n)",
    )
    parser.add_argument("--seed", type=int, default=1, help="schemathesis' random seed")
    parser.add_argument(
        "--report-dir", default=str(Path(tempfile.gettempdir()) / "miniserve-schemathesis")
    )
    parser.add_argument("extra", nargs="*", help="more schemathesis options (after --)")
    args = parser.parse_args()

    base = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "miniserve", "serve", "--port", str(args.port)], cwd=ROOT
    )
    try:
        wait_for(base + "/openapi.json", server)
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "schemathesis_run",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
            ),
        }
        command = [
            str(Path(sys.executable).with_name("schemathesis")),
            "run",
            base + "/openapi.json",
            "--checks",
            "all",
            "--workers",
            "1",
            "--max-examples",
            str(args.max_examples),
            "--seed",
            str(args.seed),
            "--request-timeout",
            "120",
            "--report",
            "junit,ndjson",
            "--report-dir",
            args.report_dir,
            "--no-color",
            *args.extra,
        ]
        print("$", " ".join(command), flush=True)
        started = time.monotonic()
        code = subprocess.call(command, cwd=ROOT, env=env)
        print(f"schemathesis finished in {time.monotonic() - started:.0f} s (exit {code})")
        return code
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
