"""The OpenAI-compatible API, driven by the official `openai` client against the real server."""

import http.client
import json
import re
import threading
import time
import urllib.request

import openai
import pytest

from miniserve.core.config import MAX_CHOICES

from conftest import chat_ids
from servers import send

Q = [{"role": "user", "content": "Name three fruits."}]
LONG = "Repeat the word 'apple' forever."


@pytest.fixture(scope="module")
def client(app_server):
    return openai.OpenAI(base_url=app_server.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_loaded_model(client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def test_completion_with_usage_from_the_tokenizer(client, tokenizer):
    r = client.chat.completions.create(model="default", messages=Q, temperature=0, max_tokens=10)
    assert r.model == "SmolLM2-135M-Instruct" and r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, Q[0]["content"]))
    assert (
        r.usage.completion_tokens
        == 10
        == len(tokenizer(choice.message.content, add_special_tokens=False)["input_ids"])
    )
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_stream_equals_non_stream(client):
    # Exact by construction: the streamed request repeats the prompt, so it reuses the first
    # one's cached prompt and its logits (the prefix cache), and samples with the same seed.
    kwargs = dict(model="default", messages=Q, max_tokens=24, temperature=0.8, seed=5)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_stop_is_honoured(client):
    # Exact by construction: the second request repeats the prompt (the prefix cache gives it
    # the first one's prompt and logits), so it decodes the same tokens until the stop string.
    full = (
        client.chat.completions.create(model="default", messages=Q, temperature=0, max_tokens=30)
        .choices[0]
        .message.content
    )
    word = full.split()[1]
    r = client.chat.completions.create(
        model="default", messages=Q, temperature=0, max_tokens=30, stop=[word]
    )
    assert r.choices[0].message.content == full[: full.index(word)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.chat.completions.create(
        model="default", messages=Q, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the top-1


def test_logprobs_cover_the_reply_not_its_end_token(client):
    # a reply ended by the model: its end token is neither in the text nor in the usage, and was
    # in the logprobs
    r = client.chat.completions.create(
        model="default", messages=Q, temperature=0, max_tokens=200, logprobs=True
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # by the end token (no stop strings here)
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    text = b"".join(bytes(e.bytes) for e in entries).decode()
    assert text == choice.message.content


def test_logprobs_stop_where_a_stop_string_cuts_the_reply(client):
    # the tokens that made the stop string (and the text held back in case it became one) are
    # not in the reply: before, their logprobs were, streamed or not
    ask = dict(model="default", messages=Q, temperature=0, max_tokens=40, logprobs=True)
    whole = client.chat.completions.create(**ask).choices[0].message.content
    stop = whole[12:18]
    cut = client.chat.completions.create(**ask, stop=[stop]).choices[0]
    content, entries = cut.message.content, cut.logprobs.content
    assert content == whole[: whole.find(stop)] and cut.finish_reason == "stop"
    texts = [bytes(e.bytes).decode("utf-8", "replace") for e in entries]
    # every character of the reply is covered, and no token starts past it
    assert "".join(texts).startswith(content) and len("".join(texts[:-1])) < len(content)
    streamed = [
        e.token
        for chunk in client.chat.completions.create(**ask, stop=[stop], stream=True)
        for choice in chunk.choices
        if choice.logprobs and choice.logprobs.content
        for e in choice.logprobs.content
    ]
    assert streamed == [e.token for e in entries]
    # completions: the same rule over the legacy logprobs
    prompt = "The capital of France is Paris. The capital of Italy is"
    text = dict(model="default", prompt=prompt, temperature=0, max_tokens=12, logprobs=1)
    whole = client.completions.create(**text).choices[0].text
    stop = whole[6:10]
    cut = client.completions.create(**text, stop=[stop]).choices[0]
    tokens = cut.logprobs.tokens
    assert cut.text == whole[: whole.find(stop)]
    assert "".join(tokens).startswith(cut.text) and len("".join(tokens[:-1])) < len(cut.text)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": Q, "temperature": -1}, "temperature"),
        ({"messages": Q, "temperature": "hot"}, "temperature"),
        ({"messages": Q, "top_p": 0}, "top_p"),
        ({"messages": Q, "top_p": 1.5}, "top_p"),
        ({"messages": Q, "max_tokens": 0}, "max_tokens"),
        (
            {"messages": Q, "max_tokens": 5000},
            "max_tokens",
        ),  # past 4096: it was cut there, silently
        ({"messages": Q, "n": 0}, "n"),
        ({"messages": Q, "n": MAX_CHOICES + 1}, "n"),
        ({"messages": Q, "n": 1.5}, "n"),
        ({"messages": Q, "stop": 5}, "stop"),
        ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
    ],
)
def test_bad_requests_get_400_naming_the_field(app_server, body, param):
    req = urllib.request.Request(
        app_server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 400
    error = json.loads(info.value.read())["error"]
    assert error["param"] == param and error["message"]


def test_server_keeps_working_after_bad_requests(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=Q, temperature=5)
    assert client.chat.completions.create(model="default", messages=Q, max_tokens=3).choices


def test_dropped_stream_frees_the_engine(client, app_server):
    stream = client.chat.completions.create(
        model="default", messages=Q, max_tokens=2000, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-reply
    done = threading.Event()
    result = {}

    def follow_up():  # greedy: the first stream's own first tokens (a sampled reply may end
        # on an end token before 4)
        result["r"] = client.chat.completions.create(
            model="default", messages=Q, max_tokens=4, temperature=0
        )
        done.set()

    threading.Thread(target=follow_up, daemon=True).start()
    assert done.wait(60), "the next request was not served: the dropped stream kept the engine"
    assert result["r"].usage.completion_tokens == 4


def test_api_key_required_when_set():
    from servers import Server

    server = Server(["-m", "miniserve", "serve", "--api-key", "s3cret"], ready_path="/docs")
    try:
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="default", messages=Q, max_tokens=2).choices
    finally:
        server.stop()


# -- n choices ----------------------------------------------------------------------------


def test_n_choices_with_usage_summed(client, tokenizer):
    r = client.chat.completions.create(
        model="default", messages=Q, temperature=0, max_tokens=4, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert len({c.message.content for c in r.choices}) == 1  # greedy: the same reply 3 times
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, Q[0]["content"]))  # counted once
    assert r.usage.completion_tokens == 3 * 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_choice_i_is_the_request_with_seed_plus_i(client):
    # Exact by construction: each choice is its own sequence with its own random generator.
    kwargs = dict(model="default", messages=Q, temperature=0.9, max_tokens=6)
    many = client.chat.completions.create(n=3, seed=11, **kwargs).choices
    for i in range(3):
        one = client.chat.completions.create(seed=11 + i, **kwargs).choices[0]
        assert many[i].message.content == one.message.content, i


def test_n_out_of_range_names_n_and_the_range(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=Q, n=MAX_CHOICES + 1)
    error = info.value.body
    assert error["param"] == "n" and f"[1, {MAX_CHOICES}]" in error["message"]


def sse_events(url: str, body: dict) -> list:
    """POST a streaming request; the decoded `data:` payloads, '[DONE]' kept as a string."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as response:
        lines = [line.decode()[6:].strip() for line in response if line.startswith(b"data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_streaming_n_choices_carry_their_index_and_finish(app_server):
    events = sse_events(
        app_server.url,
        {
            "messages": Q,
            "n": 2,
            "max_tokens": 5,
            "stream": True,
            "temperature": 0.8,
            "seed": 3,
            "stream_options": {"include_usage": True},
        },
    )
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    for i in (0, 1):
        own = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert own[0]["delta"]["role"] == "assistant"
        finishes = [c["finish_reason"] for c in own if c["finish_reason"]]
        assert finishes == ["length"] and own[-1]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content") or "" for c in own)
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["completion_tokens"] == 2 * 5


# -- the API served in this process, to look at the engine it drives ------------------------


@pytest.fixture(scope="module")
def local_api(engine):
    from miniserve.serve.in_thread import serve_in_thread

    with serve_in_thread(engine) as port:
        yield port


def wait_for_idle(engine, seconds=60) -> bool:
    deadline = time.monotonic() + seconds
    while engine.queue_depth and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.queue_depth == 0


def post(port: int, body: dict) -> http.client.HTTPConnection:
    """Send a request; read the reply from the connection (`getresponse`) or leave."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    return conn


def test_n_that_does_not_fit_the_queue_gets_429_and_starts_nothing(engine, local_api, monkeypatch):
    """n past the queue's free places: 429, try again later; past the queue itself: 400 naming
    n (later would not help: a client's retries would never end)."""
    assert wait_for_idle(engine)
    saved = engine.max_queue
    engine.max_queue = 3
    monkeypatch.setattr(type(engine), "queue_depth", property(lambda self: 1))  # one waiting
    try:
        answers = []
        for n in (3, 4):
            response = post(local_api, {"messages": Q, "n": n, "max_tokens": 4}).getresponse()
            answers.append((response.status, json.loads(response.read())["error"]))
    finally:
        engine.max_queue = saved
        monkeypatch.undo()
    (busy, error), (never, refusal) = answers
    assert busy == 429 and error["code"] == "server_busy" and "n=3" in error["message"]
    assert never == 400 and refusal["param"] == "n" and "--max-queue" in refusal["message"]
    assert engine.queue_depth == 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_leaves_cancels_all_its_choices(engine, local_api, stream, monkeypatch):
    # Greedy, this prompt gets 'apple, apple, ...' far past 2000 tokens: only cancelling ends
    # these replies within the test.
    stats, submit = [], engine.submit

    def recording(prompt_ids, params, sink, **kwargs):
        def keep(item):  # keeps each choice's stats (the engine updates them)
            if item is not None and not isinstance(item, BaseException):
                stats.append(item.stats)
            sink(item)

        return submit(prompt_ids, params, keep, **kwargs)

    monkeypatch.setattr(engine, "submit", recording)
    assert wait_for_idle(engine)
    conn = post(
        local_api,
        {
            "messages": [{"role": "user", "content": LONG}],
            "n": 2,
            "max_tokens": 2000,
            "temperature": 0,
            "stream": stream,
        },
    )
    deadline = time.monotonic() + 60
    while len({id(s) for s in stats}) < 2 and time.monotonic() < deadline:  # both generating
        time.sleep(0.05)
    if stream:
        assert conn.getresponse().readline().startswith(b"data: ")
    conn.close()  # the client goes away mid-reply
    assert wait_for_idle(engine), "the choices of a client that left kept running"
    assert len({id(s) for s in stats}) == 2
    assert all(s.finish_reason == "cancelled" and s.new_tokens < 2000 for s in stats)


def test_measure_http_numbers_are_consistent(engine):
    from benchmarks.http_bench import format_report, measure_http

    result = measure_http(engine, streams=2, prompt_tokens=32, new_tokens=8)
    assert result["streams"] == 2 and result["new_tokens"] == 8
    for mode in ("http", "in_process"):
        m = result[mode]
        assert 0 < m["tokens"] <= 2 * 8
        assert m["wall_s"] > 0 and m["tokens_per_s"] == pytest.approx(m["tokens"] / m["wall_s"])
        assert 0 < m["ttft_p50_s"] <= m["ttft_p95_s"] <= m["wall_s"]
        assert 0 <= m["itl_p95_s"] <= m["wall_s"]
        assert 0 < m["stream_tokens_per_s_p50"]
        assert 0 <= m["client_cpu_s"] <= m["cpu_s"] + 0.01
        assert m["server_cpu_ms_per_token"] == pytest.approx(
            (m["cpu_s"] - m["client_cpu_s"]) * 1000 / m["tokens"]
        )
    assert "server CPU per token (ms)" in format_report(result)


def test_no_thread_is_held_per_request_or_choice(engine, local_api):
    assert wait_for_idle(engine)
    before = set(threading.enumerate())
    conn = post(
        local_api,
        {
            "messages": [{"role": "user", "content": LONG}],
            "n": 3,
            "max_tokens": 2000,
            "temperature": 0,
            "stream": True,
        },
    )
    response = conn.getresponse()
    for _ in range(8):  # the role chunks, then text: every choice is generating
        assert response.readline()
    new = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    conn.close()
    assert wait_for_idle(engine)
    assert new == []


def test_streamed_logprobs_follow_their_tokens(engine, local_api):
    events = sse_events(
        f"http://127.0.0.1:{local_api}",
        {
            "messages": Q,
            "n": 2,
            "max_tokens": 5,
            "stream": True,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "stream_options": {"include_usage": True},
        },
    )
    for i in (0, 1):
        own = [
            c["choices"][0] for c in events[:-1] if c["choices"] and c["choices"][0]["index"] == i
        ]
        entries = [e for c in own if c["logprobs"] for e in c["logprobs"]["content"]]
        assert len(entries) == 5 and all(len(e["top_logprobs"]) == 2 for e in entries)
        assert "".join(e["token"] for e in entries) == "".join(
            c["delta"].get("content") or "" for c in own
        )
    assert events[-2]["usage"]["completion_tokens"] == 10


def test_an_error_mid_stream_is_reported_in_band(engine, local_api, monkeypatch):
    submit = engine.submit

    def failing(prompt_ids, params, sink, *, cancel=None, **kwargs):
        state = {"chunks": 0, "over": False}

        def fail_after_two(item):  # the engine thread
            if state["over"]:
                return
            if item is not None and not isinstance(item, BaseException):
                state["chunks"] += 1
                if state["chunks"] > 2:
                    state["over"] = True
                    cancel.set()
                    sink(RuntimeError("the device fell over"))
                    sink(None)
                    return
            sink(item)

        return submit(prompt_ids, params, fail_after_two, cancel=cancel, **kwargs)

    monkeypatch.setattr(engine, "submit", failing)
    assert wait_for_idle(engine)
    events = sse_events(
        f"http://127.0.0.1:{local_api}",
        {"messages": Q, "max_tokens": 20, "temperature": 0, "stream": True},
    )
    assert "[DONE]" not in events
    assert "the device fell over" in events[-1]["error"]["message"]
    assert (
        sum(bool(e.get("choices") and e["choices"][0]["delta"].get("content")) for e in events[:-1])
        == 2
    )
    assert wait_for_idle(engine)


# -- structured output: response_format, structured_outputs, logit_bias ---------------------

FRUIT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "kind": {"type": "string", "enum": ["fruit", "vegetable"]},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "origin": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 20}},
            "required": ["country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "rating", "tags", "origin"],
    "additionalProperties": False,
}
FRUIT_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "fruit", "schema": FRUIT_SCHEMA, "strict": True},
}


def call(url: str, body: dict) -> tuple[int, dict]:
    """POST a (non-streaming) chat request with raw HTTP: the status and the decoded body."""
    return send(url, "/v1/chat/completions", body)


def test_json_object_reply_is_a_json_object(client):
    r = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=120,
        response_format={"type": "json_object"},
        # the keys named: asked for "an apple in JSON" alone, the 135M model's greedy reply
        # can run on inside the object past any budget (json_object does not bound it)
        messages=[
            {"role": "user", "content": "Describe an apple in JSON with the keys name and color."}
        ],
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_reply_validates_streamed_or_not(client):
    import jsonschema

    kwargs = dict(
        model="default", messages=Q, temperature=0, max_tokens=150, response_format=FRUIT_FORMAT
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), FRUIT_SCHEMA)
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_every_sampled_choice_follows_the_schema(client):
    import jsonschema

    r = client.chat.completions.create(
        model="default",
        messages=Q,
        temperature=0.8,
        seed=7,
        n=3,
        max_tokens=150,
        response_format=FRUIT_FORMAT,
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), FRUIT_SCHEMA)


def test_max_tokens_cuts_a_schema_reply_with_length(client):
    r = client.chat.completions.create(
        model="default", messages=Q, temperature=0, max_tokens=5, response_format=FRUIT_FORMAT
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "extension, check",
    [
        (
            {"regex": r"[A-Z][a-z]{2,9}(, [A-Z][a-z]{2,9}){2}"},
            lambda text: re.fullmatch(r"[A-Z][a-z]{2,9}(, [A-Z][a-z]{2,9}){2}", text),
        ),
        (
            {"choice": ["apple", "banana", "cherry"]},
            lambda text: text in ("apple", "banana", "cherry"),
        ),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
    ],
)
def test_structured_outputs_extension(app_server, extension, check):
    status, body = call(
        app_server.url,
        {"messages": Q, "temperature": 0, "max_tokens": 40, "structured_outputs": extension},
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert check(choice["message"]["content"]), choice["message"]["content"]
    assert choice["finish_reason"] == "stop"


def test_logit_bias_bans_the_greedy_first_token(client, tokenizer):
    kwargs = dict(model="default", messages=Q, temperature=0, max_tokens=5)
    free = client.chat.completions.create(**kwargs).choices[0].message.content
    first = tokenizer(free, add_special_tokens=False)["input_ids"][0]
    biased = client.chat.completions.create(logit_bias={str(first): -100}, **kwargs)
    text = biased.choices[0].message.content
    assert text and text != free
    assert tokenizer(text, add_special_tokens=False)["input_ids"][0] != first


def test_no_token_allowed_when_the_grammar_and_the_bias_leave_nothing(app_server, tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    digits = [i for i, piece in enumerate(pieces) if piece[:1] in tuple("0123456789")]
    assert 10 <= len(digits) <= 300  # every digit, and few enough for one logit_bias
    body = {
        "messages": Q,
        "temperature": 0,
        "max_tokens": 10,
        "structured_outputs": {"regex": "[0-9]+"},
        "logit_bias": {str(i): -100 for i in digits},
    }
    status, reply = call(app_server.url, body)
    assert status == 200, reply
    assert reply["choices"][0]["finish_reason"] == "no_token_allowed"
    assert reply["choices"][0]["message"]["content"] == ""
    assert reply["usage"]["completion_tokens"] == 0
    events = sse_events(app_server.url, {**body, "stream": True})
    assert events[-1] == "[DONE]"
    assert [
        e["choices"][0]["finish_reason"]
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["finish_reason"]
    ] == ["no_token_allowed"]


SCHEMA_FIELD = "response_format.json_schema.schema"


def schema_format(schema) -> dict:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            SCHEMA_FIELD,
            ["schema", "required"],
        ),
        (schema_format("an object, please"), SCHEMA_FIELD, ["schema", "object"]),
        (
            schema_format({"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
            SCHEMA_FIELD,
            ["uniqueItems"],
        ),
        (
            schema_format({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
            SCHEMA_FIELD,
            ['"not"'],
        ),
        (
            schema_format(
                {"if": {"type": "string"}, "then": {"maxLength": 3}, "else": {"type": "number"}}
            ),
            SCHEMA_FIELD,
            ['"if"', '"then"', '"else"'],
        ),
        (
            schema_format({"type": "array", "contains": {"type": "string"}}),
            SCHEMA_FIELD,
            ["contains"],
        ),
        (
            {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
            "structured_outputs.json",
            ["uniqueItems"],
        ),
        (
            {"structured_outputs": {"regex": "([a-z"}},
            "structured_outputs.regex",
            ["structured_outputs.regex", "invalid regex", "([a-z"],
        ),
        (
            {"structured_outputs": {"grammar": "root ::= fruit"}},
            "structured_outputs.grammar",
            ["structured_outputs.grammar", "fruit"],
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
            "structured_outputs",
            ["response_format", "structured_outputs", "not both"],
        ),
        (
            {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
            "structured_outputs",
            ["exactly one"],
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["list"]),
        ({"stream_options": {"include_usage": True}}, "stream_options", ["'stream': true"]),
        (
            {"stream": False, "stream_options": {"include_usage": True}},
            "stream_options",
            ["'stream': true"],
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
            ["does not take tools", "chat template"],
        ),
        ({"tool_choice": "required"}, "tool_choice", ["'tool_choice'", "needs 'tools'"]),
        ({"logit_bias": {"5": 101}}, "logit_bias[5]", ["[-100, 100]", "101"]),
        ({"logit_bias": {"abc": -100}}, "logit_bias", ["token ids", "'abc'"]),
        ({"logit_bias": {"²": -100}}, "logit_bias", ["token ids"]),
        ({"logit_bias": {"49152": -100}}, "logit_bias", ["49152", "out of range"]),
        ({"logit_bias": {"99999999999999999999": -100}}, "logit_bias", ["out of range"]),
        ({"n": 2, "logit_bias": {"49152": -100}}, "logit_bias", ["out of range"]),
        ({"response_format": {"type": "yaml"}}, "response_format", ["json_object", "json_schema"]),
    ],
)
def test_bad_output_formats_get_400_naming_the_problem(app_server, extra, param, words):
    status, body = call(app_server.url, {"messages": Q, "max_tokens": 3, **extra})
    assert status == 400, body
    error = body["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert all(w in error["message"] for w in words), error["message"]


# -- several models: each request answered by the one it names ------------------------------


@pytest.fixture(scope="module")
def routed():
    """Two local models over the embedded weights, each its own engine, and one whose file is
    missing; nothing is loaded before a request names it."""
    from miniserve.models.registry import open_models
    from miniserve.serve.in_thread import serve_in_thread

    # room for all three: a failed load must not cost a loaded model its place here
    models = open_models(
        ["default", "second=default", "broken=/nonexistent/missing.gguf"], max_loaded=3
    )
    with serve_in_thread(models) as port:
        yield models, f"http://127.0.0.1:{port}"
    models.close()


def test_each_model_loads_on_first_use_and_answers_by_name(routed):
    models, url = routed
    default = models.default
    status, listed = send(url, "/v1/models")
    assert status == 200
    assert [(m["id"], m["loaded"], m["default"], m["owned_by"]) for m in listed["data"]] == [
        (default, False, True, "miniserve"),
        ("second", False, False, "miniserve"),
        ("broken", False, False, "miniserve"),
    ]

    status, reply = send(
        url, "/v1/chat/completions", {"model": "second", "messages": Q, "max_tokens": 3}
    )
    assert status == 200 and reply["model"] == "second"
    assert models.is_loaded("second") and not models.is_loaded(default)  # second answered

    # the default loads on a worker thread: meanwhile the event loop serves the other model
    # (the load is held until that answer came: had the answer waited for the load, it would
    # come after the release, with the default loaded)
    loading, release, make = threading.Event(), threading.Event(), models.factory

    def factory(spec, progress):
        loading.set()
        release.wait(60)
        return make(spec, progress)

    models.factory = factory
    first = {}
    request = threading.Thread(
        target=lambda: first.update(
            reply=send(
                url, "/v1/completions", {"model": "gpt-4o", "prompt": "Hello", "max_tokens": 2}
            )
        )
    )
    request.start()
    try:
        assert loading.wait(60)
        status, reply = send(
            url, "/v1/completions", {"model": "second", "prompt": "Hi", "max_tokens": 2}
        )
        assert status == 200 and reply["model"] == "second"
        assert not models.is_loaded(default), "the other model waited for the load"
    finally:
        release.set()
    request.join(120)
    status, reply = first["reply"]
    assert status == 200 and reply["model"] == default  # a placeholder: the default

    _, listed = send(url, "/v1/models")
    assert [m["loaded"] for m in listed["data"]] == [True, True, False]
    assert [m["context_length"] for m in listed["data"][:2]] == [8192, 8192]
    status, one = send(url, "/v1/models/second")
    assert status == 200 and one["id"] == "second" and one["loaded"] and one["chat"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"model": "gpt-5-turbo", "messages": Q}),
        ("/v1/completions", {"model": "gpt-5-turbo", "prompt": "Hi"}),
        ("/v1/models/gpt-5-turbo", None),
    ],
)
def test_an_unknown_model_is_a_404_listing_the_served_ones(routed, path, body):
    models, url = routed
    status, reply = send(url, path, body)
    error = reply["error"]
    assert status == 404 and error["param"] == "model" and error["code"] == "model_not_found"
    assert "gpt-5-turbo" in error["message"]
    assert all(name in error["message"] for name in models.names)


def test_a_model_that_fails_to_load_is_a_502_and_the_others_keep_answering(routed):
    models, url = routed
    status, reply = send(
        url, "/v1/chat/completions", {"model": "broken", "messages": Q, "max_tokens": 2}
    )
    error = reply["error"]
    assert status == 502 and error["param"] == "model" and error["type"] == "server_error"
    assert "'broken'" in error["message"] and "does not exist" in error["message"]
    status, reply = send(
        url, "/v1/chat/completions", {"model": "second", "messages": Q, "max_tokens": 2}
    )
    assert status == 200 and reply["model"] == "second"


# -- the API's own document: every request body, with the limits from config ----------------


def test_openapi_documents_every_request_body_with_the_limits_from_config(engine):
    from miniserve.core.config import FIELDS, MAX_PROMPTS
    from miniserve.serve.routes import create_app

    doc = create_app(engine).openapi()
    schemas = doc["components"]["schemas"]
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert set(posts) == {"/v1/chat/completions", "/v1/completions", "/tokenize"}
    bodies = {}
    for path, operation in posts.items():
        body = operation["requestBody"]
        assert body["required"], path
        ref = body["content"]["application/json"]["schema"]["$ref"]
        bodies[path] = schemas[ref.rsplit("/", 1)[1]]
        # every status these routes answer, and not FastAPI's 422 (a bad field is a 400)
        assert {"200", "400", "404", "500", "502"} <= set(operation["responses"]), path
        assert "422" not in operation["responses"], path
    chat, text = bodies["/v1/chat/completions"], bodies["/v1/completions"]
    assert chat["required"] == ["messages"] and text["required"] == ["prompt"]
    for body in (chat, text):
        for name in ("temperature", "top_k", "min_p", "repetition_penalty"):
            number = body["properties"][name]["anyOf"][0]
            assert (number["minimum"], number["maximum"]) == (
                FIELDS[name].low,
                FIELDS[name].high,
            ), name
        top_p = body["properties"]["top_p"]["anyOf"][0]  # (0, 1]: zero itself is refused
        assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0, 1)
        assert body["properties"]["n"]["anyOf"][0]["maximum"] == MAX_CHOICES
    assert text["properties"]["prompt"]["anyOf"][2]["maxItems"] == MAX_PROMPTS
    assert chat["properties"]["stream"]["anyOf"][0]["type"] == "boolean"
    assert {"429"} <= set(posts["/v1/chat/completions"]["responses"])


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"messages": Q, "temperature": 3},
            "temperature",
            "'temperature' must be in [0, 2], got 3",
        ),
        ({"messages": Q, "top_p": "all"}, "top_p", "'top_p' must be a number (0, 1], got 'all'"),
        ({"messages": Q, "stream": "yes"}, "stream", "'stream' must be true or false"),
        ({"messages": Q, "seed": -1}, "seed", "'seed' must be in [0, 9223372036854775807], got -1"),
        ({"temperature": 0.5}, "messages", "'messages' is required"),
    ],
)
def test_a_bad_field_is_still_the_400_naming_it_not_a_422(local_api, body, param, message):
    status, reply = send(f"http://127.0.0.1:{local_api}", "/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


def test_bodies_that_are_not_json_objects_and_methods_a_path_does_not_take(local_api):
    def raw(method: str, path: str, data: bytes | None = None, kind: str | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", local_api, timeout=60)
        conn.request(method, path, data, {"Content-Type": kind} if kind else {})
        response = conn.getresponse()
        return response.status, response.getheader("Allow"), json.loads(response.read())

    status, _, reply = raw("POST", "/v1/chat/completions", b"{not json", "application/json")
    assert status == 400 and reply["error"]["message"] == "the request body is not valid JSON"
    status, _, reply = raw("POST", "/v1/completions", b"[1, 2]", "application/json")
    assert status == 400 and reply["error"]["message"] == "the request body must be a JSON object"
    # read as JSON whatever the Content-Type says (curl -d sends a form's)
    status, _, reply = raw(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "Hello", "max_tokens": 1}).encode(),
        "application/x-www-form-urlencoded",
    )
    assert status == 200 and reply["usage"]["completion_tokens"] == 1
    for method, path, allow in (
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/models", "GET"),
        ("PUT", "/tokenize", "POST"),
    ):
        status, allowed, reply = raw(method, path)
        assert (status, allowed) == (405, allow), (method, path)
        assert reply["error"]["code"] == "method_not_allowed"
