"""Streaming over real HTTP, measured next to the same requests made in-process.

`measure_http(engine)` serves the API (`miniserve.serve.routes.create_app`) on a free local port in
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
- `itl_p95_s`: inter-token latency per token, as `bench --concurrency` reports it: each piece
  of text's gap from the previous one, divided among the tokens it carries (all streams
  pooled; `bench.StreamTimeline.token_gaps`). In-process a chunk names its token ids; over
  HTTP a piece's tokens are counted by encoding its text with the model's tokenizer, after
  the run;
- `cpu_s`: CPU time this process spent during the run (engine, server and clients together);
  `client_cpu_s`: the part the client threads spent (reading and parsing the replies), so
  `cpu_s - client_cpu_s` is what serving cost;
- `server_cpu_ms_per_token`: that serving cost per completion token, in milliseconds.

    python -m benchmarks.http_bench [--streams 8] [--prompt-tokens 64] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time

from miniserve.bench.prompts import stream_prompt
from miniserve.bench.runs import clear_prefix_cache
from miniserve.bench.streams import StreamTimeline, at_once, percentile, run_streams
from miniserve.serve.in_thread import serve_in_thread

ASK = "\n\nGo on writing this text, in detail."


def _summary(runs: list[StreamTimeline], tokens: list[int], cpu_s: float) -> dict:
    """The numbers of one run: its streams' timelines and the tokens each produced."""
    start = min(r.submit for r in runs)
    end = max(r.end for r in runs)
    total = sum(tokens)
    ttft = [t for r in runs if (t := r.ttft()) is not None]
    gaps = [g for r in runs for g in r.token_gaps()]
    per_stream = [n / (r.end - r.submit) for r, n in zip(runs, tokens) if r.end > r.submit]
    wall = end - start
    client_cpu = sum(r.cpu_s for r in runs)
    return {
        "tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall if wall > 0 else 0.0,
        "stream_tokens_per_s_p50": percentile(per_stream, 50, None),
        "ttft_p50_s": percentile(ttft, 50, None),
        "ttft_p95_s": percentile(ttft, 95, None),
        "itl_p95_s": percentile(gaps, 95, None),
        "cpu_s": cpu_s,
        "client_cpu_s": client_cpu,
        "server_cpu_ms_per_token": (cpu_s - client_cpu) * 1000 / total if total else None,
    }


def make_prompts(engine, streams: int, prompt_tokens: int, params) -> list[list[dict]]:
    """`streams` distinct one-message conversations whose rendered prompt is about
    `prompt_tokens` tokens, or the chat template's own tokens and a short request when that
    is more: the benchmark's stream prompts (bench.stream_prompt: "<i>. " and the filler) as
    text, and a request to go on."""
    overhead = len(engine.chat_prompt([{"role": "user", "content": ASK}], params))
    body = max(4, prompt_tokens - overhead)  # at least the stream's number and a word
    return [
        [
            {
                "role": "user",
                "content": engine.tokenizer.decode(stream_prompt(engine.tokenizer, body, i)) + ASK,
            }
        ]
        for i in range(streams)
    ]


Pieces = list[tuple[float, str]]  # (arrival, text) of each piece of a stream's reply


def _run_http(
    port: int, conversations: list[list[dict]], new_tokens: int
) -> tuple[list[StreamTimeline], list[Pieces], list[int]]:
    """The conversations as streaming requests at once, a client thread each: their timelines
    (without arrivals: see _count_tokens), the pieces of text each received and the
    completion tokens the server reported for each."""
    pieces: list[Pieces] = [[] for _ in conversations]
    reported = [0] * len(conversations)

    def client(i: int, start) -> StreamTimeline:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            body = json.dumps(
                {
                    "model": "default",
                    "messages": conversations[i],
                    "temperature": 0,
                    "max_tokens": new_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            conn.connect()
            start()
            cpu = time.thread_time()
            run = StreamTimeline(time.perf_counter())
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
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
                text = "".join(c["delta"].get("content") or "" for c in event["choices"])
                if text:
                    pieces[i].append((time.perf_counter(), text))
                if event.get("usage"):
                    reported[i] = event["usage"]["completion_tokens"]
            run.end = time.perf_counter()
            run.cpu_s = time.thread_time() - cpu
            return run
        finally:
            conn.close()

    runs = at_once(len(conversations), client, name="http-bench-client")
    return runs, pieces, reported


def _count_tokens(runs: list[StreamTimeline], pieces: list[Pieces], tokenizer) -> None:
    """Each piece of text as an arrival of the tokens its text encodes to (at least one): the
    server does not say how many ids an event carries. Done after the run, off its clock."""
    for run, own in zip(runs, pieces):
        run.arrivals = [
            (t, max(1, len(tokenizer(text, add_special_tokens=False)["input_ids"])))
            for t, text in own
        ]


def measure_http(
    engine,
    streams: int = 8,
    prompt_tokens: int = 64,
    new_tokens: int = 128,
    port: int | None = None,
) -> dict:
    """`streams` concurrent greedy streaming requests over HTTP and the same ones in-process;
    returns {"http": numbers, "in_process": numbers, ...} (see the module docstring)."""
    from miniserve.core.config import SamplingParams
    from miniserve.serve.protocol import api_defaults

    if streams < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise ValueError("streams, prompt_tokens and new_tokens must be at least 1")
    params = SamplingParams(**{**api_defaults(), "temperature": 0.0}, max_new_tokens=new_tokens)
    conversations = make_prompts(engine, streams, prompt_tokens, params)
    prompt_ids = [engine.chat_prompt(c, params) for c in conversations]
    if max(map(len, prompt_ids)) + new_tokens > engine.context_length:
        raise ValueError(
            f"prompt_tokens + new_tokens must fit the context of {engine.context_length} tokens"
        )
    result = {
        "streams": streams,
        "new_tokens": new_tokens,
        "prompt_tokens": round(sum(map(len, prompt_ids)) / streams),
    }

    # both runs reuse prefixes as the API does (the streams share the chat template's head),
    # each starting from an empty prefix cache
    clear_prefix_cache(engine)
    cpu = time.process_time()
    runs = run_streams(engine, prompt_ids, [params] * streams, reuse_prefix=True)
    cpu = time.process_time() - cpu
    result["in_process"] = _summary(runs, [r.tokens for r in runs], cpu)

    with serve_in_thread(engine, port) as bound:
        _run_http(bound, [[{"role": "user", "content": "Hi"}]], 1)  # answers before timing
        clear_prefix_cache(engine)
        cpu = time.process_time()
        runs, pieces, tokens = _run_http(bound, conversations, new_tokens)
        cpu = time.process_time() - cpu
        _count_tokens(runs, pieces, engine.tokenizer)
        result["http"] = _summary(runs, tokens, cpu)
        result["port"] = bound
    return result


def format_report(result: dict) -> str:
    rows = [
        ("tokens", "tokens", "{:.0f}"),
        ("aggregate tokens/s", "tokens_per_s", "{:.1f}"),
        ("per-stream tokens/s (median)", "stream_tokens_per_s_p50", "{:.1f}"),
        ("TTFT p50 (ms)", "ttft_p50_s", "ms"),
        ("TTFT p95 (ms)", "ttft_p95_s", "ms"),
        ("inter-token p95 (ms)", "itl_p95_s", "ms"),
        ("CPU time (s)", "cpu_s", "{:.2f}"),
        ("  of it, client threads (s)", "client_cpu_s", "{:.2f}"),
        ("server CPU per token (ms)", "server_cpu_ms_per_token", "{:.2f}"),
    ]

    def cell(value, fmt):
        if value is None:
            return "-"
        return f"{value * 1000:.1f}" if fmt == "ms" else fmt.format(value)

    lines = [
        f"{result['streams']} streams, ~{result['prompt_tokens']} prompt tokens, "
        f"{result['new_tokens']} new tokens each",
        f"{'':30} {'in-process':>12} {'HTTP':>12}",
    ]
    for label, key, fmt in rows:
        lines.append(
            f"{label:30} {cell(result['in_process'][key], fmt):>12} "
            f"{cell(result['http'][key], fmt):>12}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.http_bench", description="Streaming over HTTP vs in-process."
    )
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    args = p.parse_args(argv)
    from miniserve.engine.engine import start_engine

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
