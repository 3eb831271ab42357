"""A soak under load: `python app.py` (the embedded model) driven by locust for a while, with
the server's memory sampled and its /metrics read at the end.

    python benchmarks/soak.py [--clients 64] [--minutes 10] [--out out/soak] [-- APP ARGS...]

Each of `--clients` locust users loops: wait 0.5-3 s, then one chat request with a prompt of
mixed length (about 15, 250 or 900 tokens, half / a third / the rest) and max_tokens of 16 to
128, sampled with a seed of its own:
  ~5%   a dropped connection: the request sent (or half its body), then the socket reset
        (SO_LINGER 0) before any answer is read;
  ~10%  streamed and cancelled: the connection closed after 1-8 pieces of text;
  the rest, half streamed (with usage), half whole.
A 429 or 503 is answered by waiting its Retry-After, as a client that honours it would. Every
request is written as one JSON line (kind, status, Retry-After, first token, tokens, outcome).

Meanwhile the server's resident memory (VmRSS) is sampled every 10 s. After the run (users
finish the request they are in), the script waits for the server to drain, reads /metrics,
and reports (printed, and `OUT/report.json`; the last scrape in `OUT/metrics.txt`):
  - RSS at minute 1 and at the last minute, and the change (the target: within 5%);
  - every request answered or refused with a header: counts by kind and outcome, the 429s
    and 503s and whether each had Retry-After, and every other outcome as an error;
  - /metrics at the end: nothing running or waiting, and all KV positions returned (those
    held are the prefix cache's: kv_cache_used_positions == kv_cache_prefix_positions);
  - first token p50/p99: measured by the clients (streamed replies) and from the server's
    histogram (every reply; interpolated within its buckets, as Prometheus'
    histogram_quantile does); tokens/s: the server's generation_tokens_total over the run.
The script installs locust into this Python's environment when it is missing (it is a tool of
this script, not of MiniServeLM). The load tool runs on the same machine as the server and
takes some of its CPU; say so with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS_ENV = "MINISERVE_SOAK_RECORDS"
PASSAGE = (
    "The river town kept its old ways long after the railway came. Each morning the ferry "
    "crossed twice, the baker opened before dawn, and the clock on the square ran four "
    "minutes slow, which nobody ever fixed because everyone had learned to expect it. "
)
QUESTIONS = [
    "Name three fruits.",
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "What is a prime number?",
    "Give me a tip for learning to cook.",
]


def prompt(rng: random.Random) -> str:
    """A user message of about 15, 250 or 900 tokens, starting with a token of its own (so the
    prefix cache shares only the template's opening)."""
    question = rng.choice(QUESTIONS)
    size = rng.random()
    repeat = 0 if size < 0.5 else 5 if size < 0.85 else 18
    return f"[{uuid.uuid4().hex[:8]}] {PASSAGE * repeat}{question}"


def request_body(rng: random.Random, stream: bool) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt(rng)}],
        "max_tokens": rng.choice([16, 32, 64, 128]),
        "temperature": 0.7,
        "seed": rng.randrange(2**31),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# -- the locust side: this file is also the locustfile (`locust -f benchmarks/soak.py`) ---------
if __name__ != "__main__" and os.environ.get(RECORDS_ENV):
    import gevent
    from locust import HttpUser, between, task

    _records = open(os.environ[RECORDS_ENV], "a", buffering=1)  # noqa: SIM115 -- the run's

    def record(**fields) -> None:
        _records.write(json.dumps({"t": time.time(), **fields}) + "\n")

    class ChatUser(HttpUser):
        wait_time = between(0.5, 3.0)

        def on_start(self):
            self.rng = random.Random()

        @task
        def one_request(self):
            roll = self.rng.random()
            if roll < 0.05:
                self.drop()
            elif roll < 0.15:
                self.chat(stream=True, cancel_after=self.rng.randint(1, 8))
            else:
                self.chat(stream=self.rng.random() < 0.5)

        def refused(self, kind: str, response) -> None:
            retry = response.headers.get("Retry-After")
            record(kind=kind, status=response.status_code, retry_after=retry, outcome="refused")
            gevent.sleep(float(retry) if retry and retry.isdigit() else 1.0)

        def chat(self, stream: bool, cancel_after: int | None = None) -> None:
            kind = "cancel" if cancel_after else "stream" if stream else "whole"
            body = request_body(self.rng, stream)
            started = time.perf_counter()
            try:
                with self.client.post(
                    "/v1/chat/completions",
                    json=body,
                    stream=stream,
                    catch_response=True,
                    name=kind,
                    timeout=600,
                ) as response:
                    if response.status_code in (429, 503):
                        response.success()  # an answer, not a failure: counted apart
                        self.refused(kind, response)
                    elif response.status_code != 200:
                        response.failure(f"HTTP {response.status_code}")
                        record(
                            kind=kind,
                            status=response.status_code,
                            outcome="error",
                            error=response.text[:200],
                        )
                    elif not stream:
                        usage = response.json()["usage"]
                        record(
                            kind=kind,
                            status=200,
                            outcome="answered",
                            tokens=usage["completion_tokens"],
                            elapsed=time.perf_counter() - started,
                        )
                    else:
                        self.read_stream(kind, response, started, cancel_after)
            except Exception as e:  # noqa: BLE001 -- a connection error: the server's fault here
                record(kind=kind, status=None, outcome="error", error=f"{type(e).__name__}: {e}")

        def read_stream(self, kind, response, started, cancel_after) -> None:
            first, pieces, usage, done = None, 0, None, False
            for line in response.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    break
                usage = event.get("usage") or usage
                if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                    pieces += 1
                    first = first if first is not None else time.perf_counter() - started
                    if cancel_after and pieces >= cancel_after:
                        response.close()  # the client goes away mid-stream
                        record(kind=kind, status=200, outcome="cancelled", ttft=first)
                        return
            outcome = "answered" if done and usage else "error"
            record(
                kind=kind,
                status=200,
                outcome=outcome,
                ttft=first,
                tokens=usage["completion_tokens"] if usage else 0,
                elapsed=time.perf_counter() - started,
                error=None if done else "the stream ended without [DONE]",
            )
            if outcome == "answered":
                response.success()
            else:
                response.failure("incomplete stream")

        def drop(self) -> None:
            """Send a request (or half of its body), then reset the connection."""
            host, port = self.host.removeprefix("http://").rsplit(":", 1)
            body = json.dumps(request_body(self.rng, self.rng.random() < 0.5)).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            half = self.rng.random() < 0.3
            try:
                with socket.create_connection((host, int(port)), timeout=30) as s:
                    s.sendall(head + (body[: len(body) // 2] if half else body))
                    gevent.sleep(self.rng.uniform(0, 2))  # mid-body, queued or generating
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                record(kind="drop", status=None, outcome="dropped", half_body=half)
            except OSError as e:
                record(kind="drop", status=None, outcome="error", error=f"{type(e).__name__}: {e}")


# -- the orchestrating side ---------------------------------------------------------------------
def ensure_locust() -> None:
    try:
        import locust  # noqa: F401
    except ImportError:
        print("installing locust (the load tool of this script) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "locust"], check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def scrape(url: str) -> dict:
    """{(sample name, frozen labels): value} of /metrics (the model label dropped: one model)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = get(url + "/metrics").decode()
    return {
        (
            s.name.removeprefix("miniserve:"),
            tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")),
        ): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def histogram_quantile(q: float, before: dict, after: dict, name: str) -> float | None:
    """The q-quantile of what a histogram counted between two scrapes, interpolated linearly
    within the bucket it falls in (Prometheus' histogram_quantile)."""
    bounds = sorted(
        (float(dict(labels)["le"]), value - before.get((n, labels), 0.0))
        for (n, labels), value in after.items()
        if n == f"{name}_bucket"
    )
    total = bounds[-1][1] if bounds else 0
    if not total:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in bounds:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower  # above the last finite bound: that bound, as Prometheus says
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_name() -> str | None:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def start_server(port: int, app_args: list[str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "app.py", "--port", str(port), *app_args],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}; see {log}")
        try:
            if all(m["loaded"] for m in json.loads(get(url + "/v1/models"))["data"][:1]):
                return proc
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"the app did not load its model in 600 s; see {log}")


def drain(url: str, seconds: float = 180) -> dict:
    """/metrics once nothing is running, waiting or queued (or after `seconds`)."""
    deadline = time.time() + seconds
    while True:
        samples = scrape(url)
        busy = ("num_requests_running", "num_requests_waiting", "queue_depth")
        if not any(metric(samples, n) for n in busy) or time.time() > deadline:
            return samples
        time.sleep(1)


def summarize(records: list[dict]) -> dict:
    by: dict[str, dict[str, int]] = {}
    for r in records:
        by.setdefault(r["kind"], {}).setdefault(r["outcome"], 0)
        by[r["kind"]][r["outcome"]] += 1
    refused = [r for r in records if r["outcome"] == "refused"]
    errors = [r for r in records if r["outcome"] == "error"]
    ttft = [r["ttft"] for r in records if r.get("ttft") is not None]
    waits = [int(r["retry_after"]) for r in refused if (r.get("retry_after") or "").isdigit()]
    return {
        "requests": len(records),
        "by_kind": by,
        "refused_429": sum(r["status"] == 429 for r in refused),
        "refused_503": sum(r["status"] == 503 for r in refused),
        "refused_without_retry_after": sum(not r.get("retry_after") for r in refused),
        "retry_after_s_min_median_max": [percentile(waits, q) for q in (0, 0.5, 1)],
        "errors": len(errors),
        "error_examples": [r.get("error") or r.get("status") for r in errors[:5]],
        "client_ttft_p50_s": percentile(ttft, 0.5),
        "client_ttft_p99_s": percentile(ttft, 0.99),
        "client_tokens": sum(r.get("tokens") or 0 for r in records),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--spawn-rate", type=float, default=8, help="users started a second")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "soak")
    parser.add_argument("app_args", nargs="*", help="after --: more flags for app.py")
    args = parser.parse_args(argv)
    ensure_locust()
    args.out.mkdir(parents=True, exist_ok=True)
    records_path = args.out / "requests.jsonl"
    records_path.unlink(missing_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"starting python app.py {' '.join(args.app_args)} on port {port} ...", flush=True)
    server = start_server(port, args.app_args, args.out / "server.log")
    try:
        get(url + "/v1/models")
        before = scrape(url)
        seconds = int(args.minutes * 60)
        print(f"{args.clients} clients for {seconds} s ...", flush=True)
        started = time.time()
        load = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                __file__,
                "--headless",
                "--host",
                url,
                "-u",
                str(args.clients),
                "-r",
                str(args.spawn_rate),
                "-t",
                f"{seconds}s",
                "--stop-timeout",
                "600",
                "--only-summary",
                "--loglevel",
                "WARNING",
                "--csv",
                str(args.out / "locust"),
            ],
            cwd=ROOT,
            env={**os.environ, RECORDS_ENV: str(records_path)},
            stdout=(args.out / "locust.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        rss: list[tuple[float, float]] = []
        while load.poll() is None:
            rss.append((round(time.time() - started, 1), round(rss_mb(server.pid), 1)))
            time.sleep(10)
        load_s = time.time() - started
        final = drain(url)
        (args.out / "metrics.txt").write_bytes(get(url + "/metrics"))
        after_rss = rss_mb(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    records = [json.loads(line) for line in records_path.read_text().splitlines()]

    def rss_at(minute: float) -> float | None:
        near = [m for t, m in rss if t <= minute * 60 + 5]
        return near[-1] if near else None

    last_minute = max(1, int(seconds // 60))
    first, last = rss_at(1), rss_at(last_minute)
    generated = metric(final, "generation_tokens_total") - metric(before, "generation_tokens_total")
    report = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "clients": args.clients,
        "seconds": seconds,
        "load_s": round(load_s, 1),
        "app_args": args.app_args,
        "rss_mb_minute_1": first,
        "last_minute": last_minute,
        "rss_mb_last_minute": last,
        "rss_change_pct": round(100 * (last - first) / first, 2) if first and last else None,
        "rss_mb_after_drain": round(after_rss, 1),
        "rss_samples": rss,
        **summarize(records),
        "server_ttft_p50_s": histogram_quantile(0.5, before, final, "time_to_first_token_seconds"),
        "server_ttft_p99_s": histogram_quantile(0.99, before, final, "time_to_first_token_seconds"),
        "server_finished": {
            dict(labels)["finished_reason"]: value - metric(before, name, **dict(labels))
            for (name, labels), value in final.items()
            if name == "request_success_total"
        },
        "generated_tokens": generated,
        "tokens_per_s": round(generated / load_s, 1),
        "server_tracebacks": (args.out / "server.log").read_text().count("Traceback"),
        "end_running": metric(final, "num_requests_running"),
        "end_waiting": metric(final, "num_requests_waiting"),
        "end_queue_depth": metric(final, "queue_depth"),
        "end_kv_used": metric(final, "kv_cache_used_positions"),
        "end_kv_prefix_cache": metric(final, "kv_cache_prefix_positions"),
    }
    report["kv_returned"] = report["end_kv_used"] == report["end_kv_prefix_cache"]
    report["checks"] = {
        "rss_within_5pct": report["rss_change_pct"] is not None
        and abs(report["rss_change_pct"]) <= 5,
        "every_request_answered_or_refused_with_header": report["errors"] == 0
        and report["refused_without_retry_after"] == 0
        and report["server_tracebacks"] == 0,
        "idle_at_end": not (report["end_running"] or report["end_waiting"]),
        "kv_returned": report["kv_returned"],
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    shown = {k: v for k, v in report.items() if k != "rss_samples"}
    print(json.dumps(shown, indent=2))
    print(f"report: {args.out / 'report.json'}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
