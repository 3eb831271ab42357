"""The API served from a thread of this process (tests, the HTTP benchmark)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from miniserve.serve.routes import create_app


@contextlib.contextmanager
def serve_in_thread(engine, port: int | None = None, api_key: str | None = None):
    """Serve the API on 127.0.0.1:`port` (a free one when None) from a thread of this
    process; yields the port and stops the server on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port or 0))
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, api_key), log_level="warning", lifespan="off")
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="miniserve-http"
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start")
            time.sleep(0.02)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
