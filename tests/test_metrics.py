"""/metrics (Prometheus' text format) and the refusals that carry Retry-After."""

import http.client
import json
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from miniserve.serve.in_thread import serve_in_thread

Q = [{"role": "user", "content": "Name three fruits."}]
LONG = "Repeat the word 'apple' forever."


def scrape(port: int) -> dict:
    """{(sample name, frozen labels): value} of GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples[("miniserve:" + name, frozenset(labels.items()))]


def count(samples: dict, name: str, **labels) -> float:
    """A counter's value, 0 where it has no sample yet (a finish reason not seen so far)."""
    return samples.get(("miniserve:" + name, frozenset(labels.items())), 0)


def post(port: int, body: dict, headers: dict | None = None) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {"Content-Type": "application/json", **(headers or {})},
    )
    return conn


def stream_long(port: int) -> http.client.HTTPConnection:
    """A streamed greedy reply that would run on and on, its first event read (the role: it
    may not be queued yet); closing the connection cancels it."""
    conn = post(
        port,
        {
            "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 2000,
            "temperature": 0,
            "stream": True,
        },
    )
    assert conn.getresponse().readline().startswith(b"data: ")
    return conn


def wait_for_idle(engine, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while engine.queue_depth and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.queue_depth == 0


@pytest.fixture(scope="module")
def api(engine):
    with serve_in_thread(engine) as port:
        yield port


def test_tokens_first_tokens_and_an_idle_engine_as_the_api_answered(engine, api):
    assert wait_for_idle(engine)
    name = engine.name
    before = scrape(api)

    whole = post(api, {"messages": Q, "max_tokens": 6, "temperature": 0}).getresponse()
    usage = [json.loads(whole.read())["usage"]]
    stream = post(
        api,
        {
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ).getresponse()
    events = [
        json.loads(line[6:])
        for line in stream.read().decode().splitlines()
        if line.startswith("data: {")
    ]
    usage.append(events[-1]["usage"])

    # the last chunk reaches the client just before the engine thread counts its request
    deadline = time.monotonic() + 10
    while True:
        after = scrape(api)
        counted = value(after, "e2e_request_latency_seconds_count", model_name=name)
        if counted == value(before, "e2e_request_latency_seconds_count", model_name=name) + 2:
            break
        assert time.monotonic() < deadline, "the two requests were not counted"
        time.sleep(0.02)

    def grew(metric: str, **labels) -> float:
        labels = {"model_name": name, **labels}
        return value(after, metric, **labels) - value(before, metric, **labels)

    assert grew("prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert grew("generation_tokens_total") == sum(u["completion_tokens"] for u in usage) == 11
    assert grew("time_to_first_token_seconds_count") == 2
    assert grew("time_to_first_token_seconds_sum") > 0
    assert grew("time_to_first_token_seconds_bucket", le="+Inf") == 2
    reasons = ("length", "eos", "stop")
    assert (
        sum(
            count(after, "request_success_total", model_name=name, finished_reason=r)
            - count(before, "request_success_total", model_name=name, finished_reason=r)
            for r in reasons
        )
        == 2
    )
    # at rest: nothing running or waiting, and the only KV positions held are the prefix
    # cache's (the replies' caches it keeps for a prompt that comes again)
    assert value(after, "model_loaded", model_name=name, remote="0") == 1
    assert value(after, "num_requests_running", model_name=name) == 0
    assert value(after, "num_requests_waiting", model_name=name) == 0
    assert value(after, "queue_depth", model_name=name) == 0
    assert value(after, "queue_limit", model_name=name) == engine.max_queue
    used = value(after, "kv_cache_used_positions", model_name=name)
    assert used == value(after, "kv_cache_prefix_positions", model_name=name) > 0
    assert used == engine.prefix_cache.held_positions()
    assert value(after, "kv_cache_budget_positions", model_name=name) == engine.scheduler.kv_budget
    # speculation's counters are there before any drafter runs
    assert value(after, "spec_draft_tokens_total", model_name=name) >= 0
    assert value(after, "spec_accepted_tokens_total", model_name=name) >= 0


def test_a_running_request_is_seen_then_counted_as_cancelled(engine, api):
    assert wait_for_idle(engine)
    name = engine.name
    before = scrape(api)
    conn = stream_long(api)
    deadline = time.monotonic() + 30
    while not value(during := scrape(api), "num_requests_running", model_name=name):
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.02)
    assert value(during, "num_requests_running", model_name=name) == 1
    assert value(during, "kv_cache_used_positions", model_name=name) > value(
        during, "kv_cache_prefix_positions", model_name=name
    )
    conn.close()  # the client goes away: its generation is cancelled
    assert wait_for_idle(engine)
    cancelled = {"model_name": name, "finished_reason": "cancelled"}
    deadline = time.monotonic() + 10
    while True:
        after = scrape(api)
        if count(after, "request_success_total", **cancelled) == (
            count(before, "request_success_total", **cancelled) + 1
        ):
            break
        assert time.monotonic() < deadline, "the cancelled request was not counted"
        time.sleep(0.02)
    assert value(after, "num_requests_running", model_name=name) == 0


def test_a_full_queue_is_429_with_retry_after(engine, api, monkeypatch):
    assert wait_for_idle(engine)
    saved = engine.max_queue
    engine.max_queue = 3
    monkeypatch.setattr(type(engine), "queue_depth", property(lambda self: 2))  # 1 place free
    try:
        busy = post(api, {"messages": Q, "n": 2, "max_tokens": 4}).getresponse()
        error = json.loads(busy.read())["error"]
    finally:
        engine.max_queue = saved
        monkeypatch.undo()
    assert busy.status == 429 and error["code"] == "server_busy"
    assert busy.getheader("Retry-After") == "1"  # nothing holds a place: no estimate, 1 s


def test_retry_after_says_when_places_are_likely_free():
    from miniserve.serve.metrics import MAX_RETRY_AFTER_S, wait_estimate

    # 4 requests holding places for 10 s each: one leaves every 2.5 s
    assert wait_estimate(10.0, 4) == 3
    assert wait_estimate(10.0, 4, places=2) == 5
    assert wait_estimate(0.2, 8) == 1  # never 0
    assert wait_estimate(900.0, 1) == MAX_RETRY_AFTER_S
    assert wait_estimate(None, 4) is None and wait_estimate(10.0, 0) is None


def test_a_full_queue_answers_how_long_its_requests_hold_their_places(engine, api):
    from miniserve.serve.metrics import tally_of

    assert wait_for_idle(engine)
    tally, saved = tally_of(engine), engine.max_queue
    conn = stream_long(api)
    try:
        engine.max_queue = 1  # the one place is taken
        held, tally.held_s = tally.held_s, 7.2  # as if requests had held theirs 7.2 s lately
        busy = post(api, {"messages": Q, "max_tokens": 4}).getresponse()
        busy.read()
    finally:
        tally.held_s = held
        engine.max_queue = saved
        conn.close()
    assert busy.status == 429 and busy.getheader("Retry-After") == "8"
    assert wait_for_idle(engine)


def test_a_request_refused_by_the_engines_own_admission_has_retry_after(engine, api):
    # the engine's count (its Admission) is what refuses a request that raced another to the
    # last place: the same 429 and header
    assert wait_for_idle(engine)
    admit = engine._admission.admit
    engine._admission.admit = lambda max_queue, n=1: admit(0, n)
    try:
        busy = post(api, {"messages": Q, "max_tokens": 4}).getresponse()
        busy.read()
    finally:
        engine._admission.admit = admit
    assert busy.status == 429 and busy.getheader("Retry-After") == "1"


def test_an_engine_shutting_down_is_503_with_retry_after(loaded):
    from miniserve.engine.engine import Engine

    engine = Engine(loaded)
    with serve_in_thread(engine) as port:
        conn = post(port, {"messages": [{"role": "user", "content": LONG}], "max_tokens": 2000})
        deadline = time.monotonic() + 60
        while not engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.02)
        closing = threading.Thread(target=engine.close)
        closing.start()
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        closing.join(30)
    assert response.status == 503 and error["code"] == "model_unavailable"
    assert response.getheader("Retry-After") == "5"


def test_models_not_loaded_and_remote_models_are_listed_without_failing(engine):
    from miniserve.models.registry import Models, ModelSpec

    def factory(spec, progress=None):
        raise AssertionError("a scrape must not load a model")

    models = Models(
        [
            ModelSpec("later", "/nonexistent/later.gguf"),
            ModelSpec("far", "http://127.0.0.1:9/v1", remote=True),
        ],
        factory,
    )
    with serve_in_thread(models) as port:
        samples = scrape(port)
    assert value(samples, "model_loaded", model_name="later", remote="0") == 0
    assert value(samples, "model_loaded", model_name="far", remote="1") == 0
    later = [n for n, labels in samples if ("model_name", "later") in labels]
    assert later == ["miniserve:model_loaded"]  # nothing only a loaded engine knows


def test_metrics_are_open_when_the_api_asks_a_key(engine):
    with serve_in_thread(engine, api_key="sesame") as port:
        samples = scrape(port)  # no key
        refused = post(port, {"messages": Q, "max_tokens": 2}).getresponse()
        refused.read()
    assert value(samples, "model_loaded", model_name=engine.name, remote="0") == 1
    assert refused.status == 401


def test_the_web_app_serves_metrics_beside_its_page(app_server):
    port = int(app_server.url.rsplit(":", 1)[1])
    samples = scrape(port)
    assert any(n == "miniserve:num_requests_running" for n, _ in samples)
