"""The web app's launcher: the browser chat, the benchmark tab and the OpenAI-compatible
API, served on one port (http://127.0.0.1:7860 by default).

    python app.py | miniserve app  [--model SRC ...] [--models-file models.yaml] [--max-loaded-models N]
                  [--host 127.0.0.1] [--port 7860] [--share] [--api-key KEY]
                  [--math auto|float32|bfloat16] [--kv-budget N] [--max-batch N] [--max-queue N]
                  [--history-db PATH | --no-history] [--history-max-conversations N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from miniserve.cli.args import Parser, add_history_args, add_model_args, load_engine, open_history
from miniserve.core.config import ConfigError, load_presets


def parse_args(argv=None, prog: str = "python app.py") -> argparse.Namespace:
    p = Parser(prog=prog, description="MiniServeLM: local chat, benchmark and API.")
    p.add_argument("--host", default=os.environ.get("MINISERVE_HOST", "127.0.0.1"),
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=int(os.environ.get("MINISERVE_PORT", 7860)))
    p.add_argument("--share", action="store_true",
                   help="also open a public Gradio share link (off by default; no API there)")
    p.add_argument("--api-key", default=os.environ.get("MINISERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--presets-file", default=None, help="another presets.yaml")
    p.add_argument("--preset", default="balanced", help="the preset selected at start")
    add_model_args(p)
    add_history_args(p)
    return p.parse_args(argv)


def main(argv=None, prog: str = "python app.py") -> int:
    args = parse_args(argv, prog)
    started = time.perf_counter()
    try:
        presets = load_presets(args.presets_file)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine, code = load_engine(args)  # the default model, warmed up; a bad flag: one line
    if engine is None:
        return code
    models = args.models  # the others load when first chosen
    store = open_history(args)  # a damaged or unwritable file: said once, then kept aside

    import gradio as gr
    import uvicorn
    from fastapi import FastAPI

    from miniserve.serve.routes import build_router
    from miniserve.ui import CSS, build_ui

    demo = build_ui(models, presets, args.preset, store)
    url = f"http://{args.host}:{args.port}"
    if args.share:
        print(f"MiniServeLM ready in {time.perf_counter() - started:.1f} s (share link below)",
              flush=True)
        demo.launch(server_name=args.host, server_port=args.port, share=True, css=CSS,
                    run_history=False)
        return 0
    app = FastAPI(title="MiniServeLM")
    app.include_router(build_router(models, args.api_key))
    # run_history off: Gradio would otherwise keep every event's inputs and outputs (whole
    # conversations, the sidebar's list, the owner id) in the browser's local storage, in plain
    # text, rewritten at each event: after ~80 searches of a 1,000-entry list every event took
    # 0.7 s instead of 0.1-0.2 (BENCHMARKS.md, "Saved conversations")
    app = gr.mount_gradio_app(app, demo, path="/", css=CSS, footer_links=[], run_history=False)
    served = "" if len(models.names) == 1 else f" ({len(models.names)} models: " + \
        ", ".join(models.names) + ")"
    print(f"MiniServeLM ready in {time.perf_counter() - started:.1f} s: chat at {url} , "
          f"API at {url}/v1{served}", flush=True)
    # Ctrl-C: open browser tabs hold connections; they get a few seconds, not forever
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=3)
    return 0
