"""The web app's launcher: the browser chat, the benchmark tab and the OpenAI-compatible
API, served on one port (http://127.0.0.1:7860 by default).

    python app.py | miniserve app  [--model SRC ...] [--models-file models.yaml]
                  [--max-loaded-models N]
                  [--host 127.0.0.1] [--port 7860] [--share] [--api-key KEY]
                  [--math auto|float32|bfloat16] [--kv-budget N] [--max-batch N] [--max-queue N]
                  [--history-db PATH | --no-history] [--history-max-conversations N]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from miniserve.cli.args import (
    Parser,
    add_history_args,
    add_model_args,
    checked_models,
    fail,
    fail_with,
    open_history,
    port_number,
)
from miniserve.core.config import ConfigError, load_presets
from miniserve.core.deferred import import_now
from miniserve.core.errors import UserError
from miniserve.runners.loader import KNOWN_MODELS, ModelLoadError, resolve_source


def parse_args(argv=None, prog: str = "python app.py") -> argparse.Namespace:
    p = Parser(prog=prog, description="MiniServeLM: local chat, benchmark and API.")
    p.add_argument(
        "--host",
        default=os.environ.get("MINISERVE_HOST", "127.0.0.1"),
        help="address to bind (default 127.0.0.1: this machine only)",
    )
    p.add_argument(
        "--port",
        type=port_number,
        default=os.environ.get("MINISERVE_PORT", "7860"),
        help="default: $MINISERVE_PORT, else 7860",
    )
    p.add_argument(
        "--share",
        action="store_true",
        help="also open a public Gradio share link (off by default; no API there)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MINISERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (not the web page's own "
        "endpoints: the app says so at start)",
    )
    p.add_argument("--presets-file", default=None, help="another presets.yaml")
    p.add_argument(
        "--preset",
        default=None,
        help="the preset selected at start (default: balanced, where the presets have it)",
    )
    add_model_args(p)
    add_history_args(p)
    return p.parse_args(argv)


def main(argv=None, prog: str = "python app.py") -> int:
    """Serve the page and the API at once; the default model loads behind them (the header
    says so, a request waits for it), so the page is up in seconds. A bad flag, presets file or
    model path is one line and exit code 2 (1: the model could not be loaded) before anything
    is served; a model that fails while loading ends the app the same way."""
    args = parse_args(argv, prog)
    started = time.perf_counter()
    try:
        presets = load_presets(args.presets_file)
        if args.preset is not None and args.preset not in presets:
            raise ConfigError(
                f"--preset: unknown preset '{args.preset}' (available: {', '.join(presets)})",
                "preset",
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    models, code = open_registry(args)  # flags and model entries checked; nothing loaded
    if models is None:
        return code
    store = open_history(args)  # a damaged or unwritable file: said once, then kept aside

    # the web stack (Gradio, FastAPI, uvicorn: ~2 s to import) only once the flags are good
    import uvicorn

    from miniserve.ui import CSS, build_ui

    Server = serving_server()
    demo = build_ui(models, presets, args.preset or "balanced", store)
    url = f"http://{args.host}:{args.port}"
    if args.share:
        load_in_background(models, started, on_failure=lambda code: os._exit(code))
        print(
            f"MiniServeLM page ready in {time.perf_counter() - started:.1f} s (share link below)",
            flush=True,
        )
        demo.launch(
            server_name=args.host, server_port=args.port, share=True, css=CSS, run_history=False
        )  # the run history off, as mount_ui has it
        return 0
    app = web_app(args, models, demo)
    failed = {}
    served = (
        ""
        if len(models.names) == 1
        else f" ({len(models.names)} models: " + ", ".join(models.names) + ")"
    )

    def stop(code: int) -> None:
        failed["code"] = code
        server.should_exit = True

    def on_serving() -> None:
        print(
            f"MiniServeLM page ready in {time.perf_counter() - started:.1f} s: chat at {url} , "
            f"API at {url}/v1{served}",
            flush=True,
        )
        if args.api_key:  # the page's own endpoints generate too, and carry no key
            print(
                "note: --api-key guards the /v1 routes only; the web page on this port (and "
                "its Gradio endpoints) is open to whoever reaches it: for the API alone, run "
                "`python -m miniserve serve`",
                flush=True,
            )
        load_in_background(models, started, on_failure=stop)

    # Ctrl-C: open browser tabs hold connections; they get a few seconds, not forever
    server = Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=3
        ),
        on_serving,
    )
    server.run()
    return failed.get("code", 0)


def web_app(args, models, demo):
    """The ASGI app: the API's routes, and the page (`demo`, from ui.build_ui) at /. Nothing in
    it reads torch: the page is served before the model (and torch) has loaded. A /v1 path the
    API does not have is the API's 404, in its error shape, as in the API's own app."""
    from fastapi import FastAPI

    from miniserve.serve.routes import api_errors, build_router, document
    from miniserve.ui import mount_ui

    app = api_errors(document(FastAPI(title="MiniServeLM")))
    app.include_router(build_router(models, args.api_key))
    return mount_ui(app, demo)  # Gradio's run history off (mount_ui says why)


def serving_server():
    """uvicorn's Server that calls `on_serving()` once it listens: the model starts loading
    then, not while the page is still being set up (on 2 cores the two would share them and
    the page would come later; a request sent meanwhile waits for the model)."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config, on_serving):
            super().__init__(config)
            self.on_serving = on_serving

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:  # the port was free
                self.on_serving()

    return Server


def open_registry(args):
    """(the models the flags name, None) -- nothing loaded, but the default model's file must
    exist -- or (None, exit code) after a one-line error."""
    models, code = checked_models(args)
    if models is None:
        return None, code
    spec = models.specs[models.default]
    try:
        if not spec.remote and spec.source not in KNOWN_MODELS:
            resolve_source(spec.source)  # a path that is not there, no embedded model: said
            # now, before anything is served (a known model may still have to be installed)
    except ModelLoadError as e:
        return None, fail_with(e)
    return models, None


def load_in_background(models, started: float, on_failure) -> threading.Thread:
    """Load and warm up the default model on a thread of its own; say when it is ready, or say
    why it failed in one line and call on_failure(exit code)."""

    def load():
        try:
            import_now("torch")  # this thread's, before anything of it is imported here
            engine = models.get(None)
        except UserError as e:  # ModelLoadError: 1
            on_failure(fail_with(e))
            return
        except (ValueError, RuntimeError, OSError, ImportError) as e:
            on_failure(fail(str(e)))
            return
        print(f"{engine.name} loaded in {time.perf_counter() - started:.1f} s", flush=True)

    thread = threading.Thread(target=load, name="miniserve-load", daemon=True)
    thread.start()
    return thread
