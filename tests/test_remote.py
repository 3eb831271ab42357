"""A remote model: RemoteEngine against our own `serve` in another process (the same tokens
as the engine here), against servers that misbehave (one clear error each), and against
llama-cpp-python's server (llama.cpp's own tokens through our client)."""

import http.server
import json
import math
import threading
import time

import httpx
import pytest

from miniserve.core.config import Constraint, SamplingParams
from miniserve.engine.engine import EngineBusy
from miniserve.engine.grammar import GrammarError
from miniserve.engine.inspector import Inspector
from miniserve.models.registry import parse_spec
from miniserve.models.remote import RemoteEngine, RemoteError, RemoteRefused
from miniserve.runners.loader import ModelLoadError

from servers import Server, free_port

GREEDY = SamplingParams(
    temperature=0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, max_new_tokens=24
)
ASK = [{"role": "user", "content": "Name three animals."}]


def collect(stream):
    chunks = list(stream)
    assert chunks[-1].done and all(not c.done for c in chunks[:-1])
    return "".join(c.text for c in chunks), chunks[-1]


class Background:
    """Start a Server on a thread, so the model here loads meanwhile."""

    def __init__(self, args):
        self.server, self.error = None, None
        self.thread = threading.Thread(target=self._start, args=(args,), daemon=True)
        self.thread.start()

    def _start(self, args):
        try:
            self.server = Server(args, ready_path="/v1/models")
        except Exception as e:  # noqa: BLE001 -- raised in the test
            self.error = e

    def wait(self) -> Server:
        self.thread.join()
        if self.error:
            raise self.error
        return self.server


@pytest.fixture(scope="module")
def ours_started():
    """Our own API server, float32 as the `engine` fixture, at most 2 requests at once."""
    started = Background(["-m", "miniserve", "serve", "--dtype", "float32", "--max-queue", "2"])
    yield started
    if started.server:
        started.server.stop()


@pytest.fixture(scope="module")
def ours(ours_started, engine):  # `engine` loads here while the server starts
    return ours_started.wait()


@pytest.fixture(scope="module")
def remote(ours):
    engine = RemoteEngine(parse_spec(ours.url + "/v1"))
    yield engine
    engine.close()


# -- our own server: the same tokens ----------------------------------------------------------


def test_describes_the_server(remote):
    info = remote.info()
    assert info["remote"] and info["device"] == "remote" and info["runner"] == "remote"
    assert info["served_model"] == "SmolLM2-135M-Instruct" and info["server"] == "miniserve"
    assert remote.context_length == 8192 and "context_length" in info["context_from"]
    assert remote.has_chat_template and remote.tokenizer is None
    assert info["token_counts"].startswith("the server's /tokenize")


def test_counts_are_the_servers_own(engine, remote):
    from conftest import chat_ids

    assert remote.count_chat(ASK) == len(chat_ids(engine.tokenizer, ASK[-1]["content"]))
    assert remote.count_text("Once upon a time") == len(
        engine.tokenizer("Once upon a time")["input_ids"]
    )


def test_chat_greedy_equals_the_local_engine(engine, remote):
    local_text, local = engine.chat_text(ASK, GREEDY)
    text, last = collect(remote.chat(ASK, GREEDY))
    assert text == local_text and text.strip()
    stats = last.stats
    assert stats.new_tokens == local.stats.new_tokens  # the server's usage
    assert stats.prompt_tokens == local.stats.prompt_tokens
    assert stats.finish_reason == ("length" if local.stats.finish_reason == "length" else "stop")
    assert 0 < stats.ttft_s <= stats.total_s and stats.tokens_per_s > 0
    assert remote.queue_depth == 0


def test_completion_greedy_equals_the_local_engine(engine, remote):
    params = GREEDY.replace(max_new_tokens=16)
    local_text = "".join(c.text for c in engine.complete_text("The capital of France is", params))
    text, last = collect(remote.complete_text("The capital of France is", params))
    assert text == local_text and text.strip()
    assert last.stats.new_tokens == 16 and last.stats.finish_reason == "length"


def test_compare_runs_each_column(engine, remote):
    local_text, _ = engine.chat_text(ASK, GREEDY)
    texts = {0: "", 1: ""}
    ends = {}
    for col, chunk, seconds in remote.compare_prompt(
        ASK[0]["content"], [GREEDY, GREEDY.replace(temperature=0.8, seed=3)]
    ):
        texts[col] += chunk.text
        assert seconds >= 0
        if chunk.done:
            ends[col] = chunk.stats.finish_reason
    assert texts[0] == local_text and texts[1].strip() and set(ends) == {0, 1}


def test_stop_closes_the_remote_stream(remote):
    """The server admits 2 requests: a long reply A is stopped after 3 chunks while B runs;
    a third request gets in soon after, so A ended on the server (it had ~2000 tokens to go)."""
    long = GREEDY.replace(max_new_tokens=2000, temperature=0.8, seed=1)
    story = [{"role": "user", "content": "Write a very long story about a dragon."}]
    a = remote.chat(story, long)
    for _, _chunk in zip(range(3), a):
        pass
    b = remote.chat(story, long)
    next(b)
    with pytest.raises(EngineBusy):  # A and B fill the server's queue
        remote.chat(ASK, GREEDY.replace(max_new_tokens=1))
    a.close()
    assert remote.queue_depth == 1
    deadline = time.monotonic() + 10
    while True:
        try:
            text, last = collect(remote.chat(ASK, GREEDY.replace(max_new_tokens=1)))
            break
        except EngineBusy:
            assert time.monotonic() < deadline, "the stopped request still runs on the server"
            time.sleep(0.05)
    assert last.stats.new_tokens == 1
    cancel = b.cancel
    cancel.set()  # setting the event stops it too, and says so in the last chunk
    rest = list(b)
    assert rest[-1].done and rest[-1].stats.finish_reason == "cancelled"
    assert remote.queue_depth == 0


def test_inspector_gets_the_server_logprobs(engine, remote):
    params = GREEDY.replace(max_new_tokens=12)
    here, there = Inspector(engine.tokenizer, params), Inspector(None, params)
    engine.chat_text(ASK, params, observer=here.observe)
    collect(remote.chat(ASK, params, observer=there.observe))
    assert len(there.steps) == len(here.steps) == 12
    for a, b in zip(here.steps, there.steps):
        assert b.token_id is None and b.text == a.text
        assert math.isclose(b.prob, a.prob, rel_tol=1e-4)
        assert [c.text for c in b.candidates] == [c.text for c in a.candidates]
        for ca, cb in zip(a.candidates, b.candidates):
            assert math.isclose(cb.prob, ca.prob, rel_tol=1e-4, abs_tol=1e-7)
    text = there.as_text()
    assert text.splitlines()[0].startswith("server logprobs") and "->" not in text
    assert there.as_json()[0]["source"] == "server logprobs"
    assert "server logprobs" in there.as_html() and there.as_html().count('class="ms-tok"') == 12


def test_output_formats_reach_the_server(remote):
    """A choice goes as vLLM's structured_outputs and holds the reply; a pattern the server's
    grammar library refuses comes back as its 400 message."""
    yes_no = GREEDY.replace(constraint=Constraint("choice", json.dumps(["yes", "no"])))
    text, last = collect(remote.chat([{"role": "user", "content": "Is the sky blue?"}], yes_no))
    assert text in ("yes", "no") and last.stats.finish_reason == "stop"
    with pytest.raises(RemoteRefused) as e:
        remote.chat(ASK, GREEDY.replace(constraint=Constraint("regex", "(unclosed")))
    assert "refused the request" in str(e.value) and "structured_outputs.regex" in str(e.value)
    assert remote.queue_depth == 0


def test_history_is_trimmed_to_the_context(remote):
    """A context of 200 tokens: the oldest turns go, the reply still comes, and the last chunk
    says how many messages were left out."""
    small = RemoteEngine(parse_spec(remote.url))
    small.context_length = 200
    turn = "Tell me about the history of science and its many branches. " * 3
    history = []
    for i in range(6):
        history += [
            {"role": "user", "content": f"{i}: {turn}"},
            {"role": "assistant", "content": turn},
        ]
    text, last = collect(small.chat(history + ASK, GREEDY.replace(max_new_tokens=8)))
    assert text.strip() and 0 < last.dropped_messages < len(history)
    assert last.dropped_messages % 2 == 0  # whole turns: never an answer without its question
    assert last.stats.prompt_tokens <= 200 - 8  # what the server counted fits
    small.close()


def test_bench_runs_what_applies(remote):
    from miniserve.bench.bench import BenchConfig, format_table, run_bench

    result = run_bench(remote, BenchConfig(prompt_tokens=[32, 128], new_tokens=4, repeat=1))
    assert [r.mode for r in result.rows] == ["remote", "remote"]
    for row, asked in zip(result.rows, (32, 128)):
        assert abs(row.prompt_tokens - asked) <= 8  # as the server counted them
        assert row.new_tokens == 4 and 0 < row.ttft_s < row.total_s and row.verified is None
    table = format_table(result)
    assert "only our streaming loop through its server ran" in table
    assert "network included" in table and remote.url in table


# -- servers that cannot be used ---------------------------------------------------------------


def test_unreachable_url_is_one_line():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ModelLoadError) as e:
        RemoteEngine(parse_spec(url))
    message = str(e.value)
    assert url in message and "\n" not in message and "refused" in message


MODELS = {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "x"}]}


def sse(*events, done=True) -> bytes:
    body = "".join(f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def delta(text=None, finish=None):
    return {
        "choices": [
            {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        ]
    }


class Garbage(http.server.BaseHTTPRequestHandler):
    """One misbehaviour per first path segment: /html/v1/..., /cut/v1/..., ..."""

    REPLIES = {
        "html": (200, "text/html", b"<!DOCTYPE html><html><body>It works!</body></html>"),
        "500": (500, "text/plain", b"Internal Server Error"),
        "refuse": (
            400,
            "application/json",
            json.dumps(
                {"error": {"message": "grammar: unexpected '('", "param": "structured_outputs"}}
            ).encode(),
        ),
        "cut": (200, "text/event-stream", sse(delta("Hello"), delta(" there"), done=False)),
        "notjson": (200, "text/event-stream", sse(delta("Hi"), "<html>oops</html>")),
        "failed": (
            200,
            "text/event-stream",
            sse(
                delta("Hi"),
                {"error": {"message": "out of memory", "type": "server_error"}},
                done=False,
            ),
        ),
        "nologprobs": (
            200,
            "text/event-stream",
            sse(delta("Hi"), delta(" you"), delta(finish="stop")),
        ),
    }

    def do_GET(self):
        mode = self.path.split("/")[1]
        if mode == "htmlmodels":
            return self._send(200, "text/html", b"<html><body>Welcome</body></html>")
        self._send(200, "application/json", json.dumps(MODELS).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if "/chat/completions" not in self.path:
            return self._send(404, "application/json", b'{"detail": "Not Found"}')
        self._send(*self.REPLIES[self.path.split("/")[1]])

    def _send(self, status, kind, body):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        if kind != "text/event-stream":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)  # an event stream ends where the connection closes

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def garbage():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def failure(garbage, mode, kind=RemoteError):
    engine = RemoteEngine(parse_spec(f"{garbage}/{mode}/v1#fake"))
    with pytest.raises(kind) as e:
        collect(engine.chat(ASK, GREEDY))
    message = str(e.value)
    assert "\n" not in message and f"{garbage}/{mode}/v1" in message and "'fake'" in message
    assert engine.queue_depth == 0
    return message


def test_garbage_servers_each_get_one_clear_error(garbage):
    assert "HTML page" in failure(garbage, "html")
    assert "500" in failure(garbage, "500") and "Internal Server Error" in failure(garbage, "500")
    assert "stopped in the middle of the reply" in failure(garbage, "cut")
    assert "not JSON" in failure(garbage, "notjson")
    assert "out of memory" in failure(garbage, "failed")


def test_a_refusal_carries_the_servers_message(garbage):
    message = failure(garbage, "refuse", RemoteRefused)
    assert "refused the request: grammar: unexpected '('" in message


def test_a_page_that_is_not_an_api_is_a_load_error(garbage):
    with pytest.raises(ModelLoadError) as e:
        RemoteEngine(parse_spec(f"{garbage}/htmlmodels/v1"))
    assert "not an OpenAI-compatible API" in str(e.value) and "HTML page" in str(e.value)


def test_no_logprobs_is_said_in_one_line(garbage):
    engine = RemoteEngine(parse_spec(f"{garbage}/nologprobs/v1"))
    inspector = Inspector(None, GREEDY)
    text, last = collect(engine.chat(ASK, GREEDY, observer=inspector.observe))
    assert text == "Hi you" and last.stats.new_tokens == 2 and last.stats.finish_reason == "stop"
    assert [s.text for s in inspector.steps] == ["Hi", " you"]
    assert inspector.as_text().splitlines()[0] == (
        "server logprobs: the server gave none (its tokens are shown without probabilities)"
    )


# -- llama-cpp-python's server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llamacpp():
    pytest.importorskip(
        "llama_cpp.server.app",
        reason="llama-cpp-python[server] is not installed (pip install 'llama-cpp-python[server]')",
    )
    from miniserve.runners.loader import embedded_gguf

    server = Server(
        [
            "-m",
            "llama_cpp.server",
            "--model",
            str(embedded_gguf()),
            "--host",
            "127.0.0.1",
            "--n_ctx",
            "2048",
        ],
        ready_path="/v1/models",
        timeout=120,
    )
    yield server
    server.stop()


def llamacpp_own(server, path, body):
    """llama.cpp's own reply to the same request, not streamed and without our client."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(f"{server.url}/v1{path}", json=body, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_llamacpp_chat_and_completion(llamacpp):
    remote = RemoteEngine(parse_spec(llamacpp.url + "/v1"))
    info = remote.info()
    assert info["server"] == "llama-cpp-python" and "extras/tokenize" in info["token_counts"]
    body = remote._body(GREEDY, None, True)  # what our client sends, as fields
    text, last = collect(remote.chat(ASK, GREEDY))
    assert text.strip() and text == llamacpp_own(
        llamacpp, "/chat/completions", {**body, "messages": ASK}
    )
    stats = last.stats
    assert 0 < stats.new_tokens <= 24 and stats.finish_reason in ("stop", "length")
    assert 0 < stats.ttft_s <= stats.total_s and stats.tokens_per_s > 0

    prompt = "The capital of France is"
    text, last = collect(remote.complete_text(prompt, GREEDY.replace(max_new_tokens=12)))
    body = remote._body(GREEDY.replace(max_new_tokens=12), None, False)
    assert "Paris" in text and text == llamacpp_own(
        llamacpp, "/completions", {**body, "prompt": prompt}
    )
    assert last.stats.new_tokens == 12 and last.stats.finish_reason == "length"
    assert last.stats.prompt_tokens == 5  # no usage from this server: its /extras/tokenize
    inspector = Inspector(None, GREEDY)
    collect(
        remote.complete_text(prompt, GREEDY.replace(max_new_tokens=4), observer=inspector.observe)
    )
    assert len(inspector.steps) == 4 and inspector.steps[0].text == " Paris"
    assert 0 < inspector.steps[0].prob <= 1 and len(inspector.steps[0].candidates) == 5

    # a choice goes as llama.cpp's GBNF grammar; a regex it has no way to hold is refused here
    yes_no = GREEDY.replace(constraint=Constraint("choice", json.dumps(["yes", "no"])))
    text, _ = collect(remote.chat([{"role": "user", "content": "Is the sky blue?"}], yes_no))
    assert text in ("yes", "no")
    with pytest.raises(GrammarError, match="cannot hold a reply to a regex"):
        remote.chat(ASK, GREEDY.replace(constraint=Constraint("regex", "[0-9]+")))
    remote.close()


def test_a_remote_answer_split_inside_a_character_is_placed_by_its_characters():
    """The logprob steps a server sends for a character split over two tokens ("bytes:\\xf0\\x9f",
    then "bytes:\\x98\\x80", as OpenAI writes pieces of one): they start the answer's event and
    make one character of it, so with a stop string's cut the entries shown are those whose
    text starts before it. (Before, the pieces were not taken for the answer's start, and the
    tokens after them were placed a character early.)"""
    from miniserve.engine.stream import text_bytes
    from miniserve.models.remote_stream import RemoteStream
    from miniserve.serve.shapes import LogprobRecorder

    recorder = LogprobRecorder(None, 0, local=False, places=True)
    stream = RemoteStream.__new__(RemoteStream)
    stream.inspector = recorder
    events = [("A", ["A"]), ("😀", ["bytes:\\xf0\\x9f", "bytes:\\x98\\x80"]), (" b", [" b"])]
    for text, tokens in events:
        stream._inspect(text, [(t, -0.5, []) for t in tokens], True)
    assert b"".join(text_bytes(t) for _, ts in events for t in ts).decode() == "A😀 b"
    assert [recorder.shown(n) for n in (1, 2, 4)] == [1, 3, 4]  # "A", "A😀", "A😀 b"
    assert text_bytes("bytes: no escapes") == b"bytes: no escapes"  # a token's own words
