"""Faults and abuse: bad input, long conversations, concurrency, overload, cancellation, memory.

Every loop is bounded. `make soak` runs the same tests at larger sizes (MINISERVE_SOAK=1) and
prints a summary: requests, errors, p50/p95 latency, resident memory.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from miniserve.core.config import SamplingParams
from miniserve.core.platform import rss_mb
from miniserve.engine.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
SOAK = bool(os.environ.get("MINISERVE_SOAK"))
STREAMS = 32 if SOAK else 8
TURNS = 1000 if SOAK else 28  # trimming starts near turn 9 (256-token context; 15 at 512)
CONVERSATIONS = 200 if SOAK else 20  # five times the prefix cache's 4 entries
GREEDY = SamplingParams(temperature=0, top_k=0, top_p=1.0, max_new_tokens=12)


def summary(name, latencies, errors, extra=""):
    lat = sorted(latencies)
    p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))] if lat else 0
    print(
        f"\n[{name}] requests={len(latencies) + errors} errors={errors} "
        f"p50={statistics.median(lat) if lat else 0:.2f}s p95={p95:.2f}s {extra}"
    )


def post(url, body, timeout=120):
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 100}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            400,
            "max_completion_tokens",
        ),
        ({"messages": [{"role": "user", "content": "\t \n"}]}, 400, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "/etc/passwd"}, 404, "model"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": -5}, 400, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_k": -1}, 400, "top_k"),
    ],
)
def test_extreme_api_values_are_named(app_server, body, status, param):
    code, out = post(app_server.url, body)
    assert code == status and out["error"]["param"] == param


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 0},
        {"top_p": 1},
        {"top_k": 10**6},
        {"top_p": 1e-9},
        {"min_p": 1.0},
        {"repetition_penalty": 2.0},
    ],
)
def test_edge_values_that_are_allowed_work(app_server, extra):
    code, out = post(
        app_server.url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra}
    )
    assert code == 200 and out["usage"]["completion_tokens"] >= 1


def test_invalid_utf8_and_control_characters(app_server):
    code, out = post(app_server.url, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')
    assert code == 400 and "JSON" in out["error"]["message"]
    code, out = post(
        app_server.url,
        {"messages": [{"role": "user", "content": "a\u0000b\u0007 \ud800 c"}], "max_tokens": 3},
    )
    assert code == 200


@pytest.mark.parametrize(
    "args, words",
    [
        (["--presets-file", "/nonexistent/presets.yaml"], ["presets", "not found"]),
        (["--model", "/nonexistent/model.gguf"], ["/nonexistent/model.gguf", "does not exist"]),
        (["--port", "http"], ["--port"]),
    ],
)
def test_app_start_errors_are_one_line(args, words):
    r = subprocess.run(
        [sys.executable, "app.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("Loading")]
    assert r.returncode != 0 and len(lines) == 1 and all(w in lines[0] for w in words), r.stderr


def test_bad_presets_files_at_start(tmp_path):
    for body in ("", "presets: [", "presets:\n  x:\n    colour: 1\n"):
        f = tmp_path / "p.yaml"
        f.write_text(body)
        r = subprocess.run(
            [sys.executable, "app.py", "--presets-file", str(f)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and str(f) in r.stderr and "Traceback" not in r.stderr


def test_defaults_are_safe():
    from miniserve.cli import app

    args = app.parse_args([])
    assert args.host == "127.0.0.1" and not args.share and args.api_key is None


# -- long conversations ------------------------------------------------------------------------
def test_long_conversation_is_trimmed_and_bounded(loaded):
    engine = Engine(loaded)
    engine.context_length = 512 if SOAK else 256  # small, so trimming happens often
    system = {"role": "system", "content": "You are a patient tutor."}
    params = GREEDY.replace(max_new_tokens=4)
    history, trimmed_turns, latencies = [], 0, []
    start_rss = None
    for turn in range(TURNS):
        if turn == min(20, TURNS // 3):  # after warm-up: the first generations allocate buffers
            start_rss = rss_mb()
        history.append({"role": "user", "content": f"Turn {turn}: tell me a fact about {turn}."})
        messages = [system] + history
        prompt = engine.chat_prompt(messages, params)
        assert len(prompt) + params.max_new_tokens <= engine.context_length
        t = time.perf_counter()
        reply, last = engine.chat_text(messages, params)
        latencies.append(time.perf_counter() - t)
        trimmed_turns += last.dropped_messages > 0
        kept = engine.trim(messages, params).messages
        assert kept[0] == system and kept[-1] == history[-1]
        history.append({"role": "assistant", "content": reply})
    assert trimmed_turns > TURNS // 2
    assert len(engine.prefix_cache.entries) <= engine.prefix_cache.max_entries
    growth = rss_mb() - start_rss
    summary(
        "long conversation",
        latencies,
        0,
        f"turns={TURNS} trimmed={trimmed_turns} rss_growth={growth:.0f}MiB",
    )
    assert growth < 150  # measured: flat at ~1 GB from turn 20 to turn 400


def test_many_conversations_keep_memory_bounded(loaded):
    engine = Engine(loaded)
    params = GREEDY.replace(max_new_tokens=8)
    before = rss_mb()
    for i in range(CONVERSATIONS):
        messages = [
            {"role": "system", "content": f"Conversation {i}: answer briefly."},
            {"role": "user", "content": "Describe the weather in a long paragraph. " * 8},
        ]
        engine.chat_text(messages, params)
    cached = engine.prefix_cache.total_tokens()
    assert len(engine.prefix_cache.entries) <= engine.prefix_cache.max_entries
    after = rss_mb()
    summary(
        "conversations",
        [],
        0,
        f"n={CONVERSATIONS} rss_before={before:.0f}MiB "
        f"rss_after={after:.0f}MiB cached_tokens={cached}",
    )
    assert after - before < 400


# -- concurrency and overload -------------------------------------------------------------------
def test_simultaneous_streams_all_complete_unmixed(app_server):
    client = openai.OpenAI(base_url=app_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    # A system prompt of its own per question: no two share a prefix long enough for the
    # prefix cache, so each stream either repeats its expected request from the cache (the
    # prompt and its logits reused) or computes it from scratch again -- either way the same
    # arithmetic as the expected one, so equal answers are exact by construction.
    questions = [f"What is {i} plus {i}? Answer in one sentence." for i in range(STREAMS)]
    messages = {
        q: [{"role": "system", "content": f"{i}: you answer sums."}, {"role": "user", "content": q}]
        for i, q in enumerate(questions)
    }
    expected = {
        q: client.chat.completions.create(
            model="default", temperature=0, max_tokens=12, messages=messages[q]
        )
        .choices[0]
        .message.content
        for q in questions[:4]
    }
    got, latencies, errors = {}, [], []

    def one(q):
        t = time.perf_counter()
        try:
            stream = client.chat.completions.create(
                model="default", temperature=0, max_tokens=12, stream=True, messages=messages[q]
            )
            got[q] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            latencies.append(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 -- counted
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    summary("simultaneous streams", latencies, len(errors))
    assert not errors and len(got) == STREAMS
    for q, text in expected.items():
        assert got[q] == text  # each stream got its own answer, intact


def test_overflow_gets_429_not_a_hang():
    from servers import Server

    server = Server(["-m", "miniserve", "serve", "--max-queue", "2"], ready_path="/docs")
    try:
        codes = []

        def one():
            codes.append(
                post(
                    server.url,
                    {
                        "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 40,
                        "temperature": 0,
                    },
                )[0]
            )

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(codes) == 8 and set(codes) <= {200, 429}
        assert 429 in codes and 200 in codes
        assert (
            post(server.url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})[0]
            == 200
        )  # and it recovers
    finally:
        server.stop()


# -- cancellation -----------------------------------------------------------------------------
def test_ctrl_c_in_cli_chat_stops_the_reply_and_keeps_the_session():
    # SIGINT back to its default for the child: a suite started in the background by a shell
    # without job control inherits it ignored, and Python then installs no Ctrl-C handler
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "miniserve",
            "chat",
            "--preset",
            "factual",
            "--max-new-tokens",
            "2000",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        proc.stdin.write("Write a very long story about a lighthouse keeper.\n")
        proc.stdin.flush()
        got = ""
        deadline = time.time() + 120
        while len(got.split()) < 5 and time.time() < deadline:
            got += proc.stdout.read(1)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("Say hi.\n/exit\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "[stopped]" in out
    assert "cancelled" in out and out.count("tokens/s") == 2  # the next message got its reply
