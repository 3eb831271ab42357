"""Start the real app (or API server) as a subprocess on a free port, for end-to-end tests."""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def send(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """GET (no body) or POST a JSON body with plain HTTP: the status and the decoded reply
    (errors included, as the server wrote them)."""
    req = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, args: list[str], ready_path: str = "/", timeout: float = 180, port: int | None = None
    ):
        self.args, self.ready_path, self.timeout = args, ready_path, timeout
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (
            open(ROOT / ".pytest_cache" / f"server-{self.port}.log", "w")
            if (ROOT / ".pytest_cache").is_dir()
            else subprocess.DEVNULL
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, *args, "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {args}")
            try:
                urllib.request.urlopen(self.url + ready_path, timeout=2)
                if self._default_model_loaded():
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not answer within {timeout} s: {args}")

    def _default_model_loaded(self) -> bool:
        """The app serves its page while the default model loads; the tests start once it
        has (/v1/models says so), as a person would see the header's model details."""
        key = self.args[self.args.index("--api-key") + 1] if "--api-key" in self.args else None
        request = urllib.request.Request(
            self.url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}
        )
        with urllib.request.urlopen(request, timeout=2) as r:
            models = json.loads(r.read())["data"]
        return any(m.get("default") and m.get("loaded") for m in models)

    def restart(self, kill: bool = False) -> None:
        """Stop the server (`kill`: SIGKILL, as a crash would) and start it again on the same
        port (the browser's local storage belongs to the address, port included)."""
        if kill:
            self.proc.kill()
            self.proc.wait(timeout=20)
        else:
            self.stop()
        self.__init__(self.args, self.ready_path, self.timeout, self.port)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextlib.contextmanager
def app_in_thread(models, presets=None, run_history: bool = False):
    """The web app over `models` (a registry or one engine: build_ui, mounted by the launcher's
    mount_ui) on a free port, served from a thread of this process; yields its URL.
    `run_history`: Gradio's run history on, as mount_ui never has it (to measure its cost)."""
    import uvicorn
    from fastapi import FastAPI

    from miniserve.core.config import load_presets
    from miniserve.ui import build_ui, mount_ui

    demo = build_ui(models, presets or load_presets())
    app = mount_ui(FastAPI(), demo, run_history=run_history)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "the app did not start"
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
