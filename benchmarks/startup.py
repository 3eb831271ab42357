"""What a start and an idle minute of the web app cost.

    python -m benchmarks.startup [--starts 5] [--idle-s 60] [--json FILE]

For each of `--starts` warm starts of `python app.py` (weights in the page cache, the
native library and the tokenizer cached): seconds from launching the process until the page
answers (HTTP 200 on /), and until the first token of a one-token chat completion sent as soon
as the page is up (it waits for the default model, which loads behind the page). Then, on the
last start, the app left alone with no client: its CPU time over `--idle-s` seconds (from
/proc/PID/stat, as a share of one core) and its resident memory. Medians are printed; run it
with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_page(url: str, proc, timeout: float = 120) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/", timeout=1) as r:
                if r.status == 200:
                    return time.monotonic()
        except OSError:
            time.sleep(0.02)
    raise RuntimeError("the page did not answer")


def first_token(url: str) -> float:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
    ).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"content"' in line:
                return time.monotonic()
    raise RuntimeError("no token came")


def ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.startup")
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--idle-s", type=float, default=60)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    page, token, out = [], [], {}
    for i in range(args.starts):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "app.py", "--port", str(port), "--no-history"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            page.append(wait_page(url, proc) - started)
            token.append(first_token(url) - started)
            print(
                f"start {i + 1}: page {page[-1]:.2f} s, first token {token[-1]:.2f} s", flush=True
            )
            if i == args.starts - 1:
                time.sleep(5)  # the request's aftermath settles
                hz = os.sysconf("SC_CLK_TCK")
                a = ticks(proc.pid)
                time.sleep(args.idle_s)
                used = (ticks(proc.pid) - a) / hz
                out["idle_cpu_percent"] = round(100 * used / args.idle_s, 3)
                out["idle_rss_mb"] = round(rss_mb(proc.pid))
                print(
                    f"idle {args.idle_s:.0f} s: {out['idle_cpu_percent']}% of a core, "
                    f"RSS {out['idle_rss_mb']} MB",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    out.update(
        page_s=[round(x, 3) for x in page],
        first_token_s=[round(x, 3) for x in token],
        page_median_s=round(statistics.median(page), 3),
        first_token_median_s=round(statistics.median(token), 3),
    )
    print(
        f"median of {args.starts}: page {out['page_median_s']} s, first token "
        f"{out['first_token_median_s']} s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
