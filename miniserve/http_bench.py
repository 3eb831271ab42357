"""Streaming over real HTTP, measured next to the same requests made in-process.

`measure_http(engine)` serves the API (`miniserve.api.create_app`) on a free local port in
this process, sends `streams` streaming chat requests at once from as many client threads
(greedy, `max_tokens=new_tokens`, a distinct prompt of about `prompt_tokens` tokens each) and
reads the server-sent events as they arrive. Before that, it sends the same prompts straight
to `engine.complete` from as many threads (the prefix cache is cleared before each run). Both
runs report the same numbers, so what the HTTP layer costs is the difference between them:

- `tokens_per_s`: completion tokens of all streams / wall time from the common start to the
  last stream's end;
- `stream_tokens_per_s_p50`: the median over streams of tokens / (end - start) of that stream;
- `ttft_p50_s`, `ttft_p95_s`: time to first token, from sending the request to the first
  piece of text;
- `itl_p95_s`: inter-token latency, the gaps between consecutive pieces of text of a stream
  (all streams pooled);
- `cpu_s`: CPU time this process spent during the run (engine, server and clients together);
  `client_cpu_s`: the part the client threads spent (reading and parsing the replies), so
  `cpu_s - client_cpu_s` is what serving cost;
- `server_cpu_ms_per_token`: that serving cost per completion token, in milliseconds.

    python -m miniserve.http_bench [--streams 8] [--prompt-tokens 64] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

FILLER = ("The lighthouse keeper wrote in his log every evening: the colour of the sea, the "
          "ships that passed, the birds that rested on the rail, the weather coming in from "
          "the west, and what the radio said about the harbour and the fishing boats. ")
ASK = "\n\nContinue the keeper's log for the next days, in detail."


@dataclass
class _Stream:
    start: float
    end: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # when each piece of text arrived
    tokens: int = 0
    cpu_s: float = 0.0  # CPU time of the client thread itself


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (q in [0, 100]); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _summary(runs: list[_Stream], cpu_s: float) -> dict:
    start = min(r.start for r in runs)
    end = max(r.end for r in runs)
    tokens = sum(r.tokens for r in runs)
    ttft = [r.arrivals[0] - r.start for r in runs if r.arrivals]
    gaps = [b - a for r in runs for a, b in zip(r.arrivals, r.arrivals[1:])]
    per_stream = [r.tokens / (r.end - r.start) for r in runs if r.end > r.start]
    wall = end - start
    client_cpu = sum(r.cpu_s for r in runs)
    return {"tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "stream_tokens_per_s_p50": _percentile(per_stream, 50),
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p95_s": _percentile(ttft, 95),
            "itl_p95_s": _percentile(gaps, 95), "cpu_s": cpu_s, "client_cpu_s": client_cpu,
            "server_cpu_ms_per_token": (cpu_s - client_cpu) * 1000 / tokens if tokens else None}


def make_prompts(engine, streams: int, prompt_tokens: int, params) -> list[list[dict]]:
    """`streams` distinct one-message conversations whose rendered prompt is about
    `prompt_tokens` tokens, or the chat template's own tokens and a short request when that
    is more (they differ from the user's first word on)."""
    filler_ids = engine.tokenizer(FILLER * (prompt_tokens // 20 + 2),
                                  add_special_tokens=False)["input_ids"]
    out = []
    for i in range(streams):
        head = f"Log {i + 1}. "
        overhead = len(engine.chat_prompt([{"role": "user", "content": head + ASK}], params))
        body = engine.tokenizer.decode(filler_ids[:max(0, prompt_tokens - overhead)])
        out.append([{"role": "user", "content": head + body + ASK}])
    return out


def _run_in_process(engine, prompts: list[list[int]], params) -> list[_Stream]:
    barrier = threading.Barrier(len(prompts))
    runs: list[_Stream | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            barrier.wait()
            cpu = time.thread_time()
            run = runs[i] = _Stream(time.perf_counter())
            for chunk in engine.complete(prompts[i], params):
                if chunk.text:
                    run.arrivals.append(time.perf_counter())
                if chunk.done:
                    run.tokens = chunk.stats.new_tokens
            run.end = time.perf_counter()
            run.cpu_s = time.thread_time() - cpu
        except BaseException as e:  # noqa: BLE001 -- re-raised by the caller
            errors.append(e)
            barrier.abort()

    _join([threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))])
    if errors:
        raise errors[0]
    return runs


def _run_http(port: int, conversations: list[list[dict]], new_tokens: int) -> list[_Stream]:
    barrier = threading.Barrier(len(conversations))
    runs: list[_Stream | None] = [None] * len(conversations)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            body = json.dumps({"model": "default", "messages": conversations[i],
                               "temperature": 0, "max_tokens": new_tokens, "stream": True,
                               "stream_options": {"include_usage": True}})
            conn.connect()
            barrier.wait()
            cpu = time.thread_time()
            run = runs[i] = _Stream(time.perf_counter())
            conn.request("POST", "/v1/chat/completions", body,
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']['message']}")
                if any(c["delta"].get("content") for c in event["choices"]):
                    run.arrivals.append(time.perf_counter())
                if event.get("usage"):
                    run.tokens = event["usage"]["completion_tokens"]
            run.end = time.perf_counter()
            run.cpu_s = time.thread_time() - cpu
        except BaseException as e:  # noqa: BLE001 -- re-raised by the caller
            errors.append(e)
            barrier.abort()
        finally:
            conn.close()

    _join([threading.Thread(target=client, args=(i,), daemon=True)
           for i in range(len(conversations))])
    if errors:
        raise errors[0]
    return runs


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextlib.contextmanager
def serve_in_thread(engine, port: int | None = None, api_key: str | None = None):
    """Serve the API on 127.0.0.1:`port` (a free one when None) from a thread of this
    process; yields the port and stops the server on exit."""
    import uvicorn

    from miniserve.api import create_app
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port or 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, api_key), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="miniserve-http-bench")
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


def _clear_prefix_cache(engine) -> None:
    """Both runs send the same prompts: the second must not find the first's in the cache."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is not None:
        engine.run_on_worker(cache.clear)  # the engine thread uses it: clear it there


def measure_http(engine, streams: int = 8, prompt_tokens: int = 64, new_tokens: int = 128,
                 port: int | None = None) -> dict:
    """`streams` concurrent greedy streaming requests over HTTP and the same ones in-process;
    returns {"http": numbers, "in_process": numbers, ...} (see the module docstring)."""
    from miniserve.api import API_DEFAULTS
    from miniserve.config import SamplingParams
    if streams < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise ValueError("streams, prompt_tokens and new_tokens must be at least 1")
    params = SamplingParams(**{**API_DEFAULTS, "temperature": 0.0}, max_new_tokens=new_tokens)
    conversations = make_prompts(engine, streams, prompt_tokens, params)
    prompt_ids = [engine.chat_prompt(c, params) for c in conversations]
    if max(map(len, prompt_ids)) + new_tokens > engine.context_length:
        raise ValueError(f"prompt_tokens + new_tokens must fit the context of "
                         f"{engine.context_length} tokens")
    result = {"streams": streams, "new_tokens": new_tokens,
              "prompt_tokens": round(sum(map(len, prompt_ids)) / streams)}

    _clear_prefix_cache(engine)
    cpu = time.process_time()
    runs = _run_in_process(engine, prompt_ids, params)
    result["in_process"] = _summary(runs, time.process_time() - cpu)

    with serve_in_thread(engine, port) as bound:
        _run_http(bound, [[{"role": "user", "content": "Hi"}]], 1)  # answers before timing
        _clear_prefix_cache(engine)
        cpu = time.process_time()
        runs = _run_http(bound, conversations, new_tokens)
        result["http"] = _summary(runs, time.process_time() - cpu)
        result["port"] = bound
    return result


def format_report(result: dict) -> str:
    rows = [("tokens", "tokens", "{:.0f}"), ("aggregate tokens/s", "tokens_per_s", "{:.1f}"),
            ("per-stream tokens/s (median)", "stream_tokens_per_s_p50", "{:.1f}"),
            ("TTFT p50 (ms)", "ttft_p50_s", "ms"), ("TTFT p95 (ms)", "ttft_p95_s", "ms"),
            ("inter-token p95 (ms)", "itl_p95_s", "ms"), ("CPU time (s)", "cpu_s", "{:.2f}"),
            ("  of it, client threads (s)", "client_cpu_s", "{:.2f}"),
            ("server CPU per token (ms)", "server_cpu_ms_per_token", "{:.2f}")]

    def cell(value, fmt):
        if value is None:
            return "-"
        return f"{value * 1000:.1f}" if fmt == "ms" else fmt.format(value)

    lines = [f"{result['streams']} streams, ~{result['prompt_tokens']} prompt tokens, "
             f"{result['new_tokens']} new tokens each",
             f"{'':30} {'in-process':>12} {'HTTP':>12}"]
    for label, key, fmt in rows:
        lines.append(f"{label:30} {cell(result['in_process'][key], fmt):>12} "
                     f"{cell(result['http'][key], fmt):>12}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m miniserve.http_bench",
                                description="Streaming over HTTP vs in-process.")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    args = p.parse_args(argv)
    from miniserve.engine import start_engine
    engine = start_engine(args.model)
    engine.warm_up()
    result = measure_http(engine, args.streams, args.prompt_tokens, args.new_tokens, args.port)
    print(format_report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
