"""The OpenAI-compatible API, driven by the official `openai` client against the real server."""

import json
import threading
import urllib.request

import openai
import pytest

from conftest import chat_ids

Q = [{"role": "user", "content": "Name three fruits."}]


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
    assert r.usage.completion_tokens == 10 == \
        len(tokenizer(choice.message.content, add_special_tokens=False)["input_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_stream_equals_non_stream(client):
    # Exact by construction: the streamed request repeats the prompt, so it reuses the first
    # one's cached prompt and its logits (the prefix cache), and samples with the same seed.
    kwargs = dict(model="default", messages=Q, max_tokens=24, temperature=0.8, seed=5)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={
        "include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_stop_is_honoured(client):
    # Exact by construction: the second request repeats the prompt (the prefix cache gives it
    # the first one's prompt and logits), so it decodes the same tokens until the stop string.
    full = client.chat.completions.create(model="default", messages=Q, temperature=0,
                                          max_tokens=30).choices[0].message.content
    word = full.split()[1]
    r = client.chat.completions.create(model="default", messages=Q, temperature=0,
                                       max_tokens=30, stop=[word])
    assert r.choices[0].message.content == full[:full.index(word)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.chat.completions.create(model="default", messages=Q, temperature=0, max_tokens=5,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the top-1


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": Q, "temperature": -1}, "temperature"),
    ({"messages": Q, "temperature": "hot"}, "temperature"),
    ({"messages": Q, "top_p": 0}, "top_p"),
    ({"messages": Q, "top_p": 1.5}, "top_p"),
    ({"messages": Q, "max_tokens": 0}, "max_tokens"),
    ({"messages": Q, "n": 2}, "n"),
    ({"messages": Q, "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
])
def test_bad_requests_get_400_naming_the_field(app_server, body, param):
    req = urllib.request.Request(app_server.url + "/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
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
    stream = client.chat.completions.create(model="default", messages=Q, max_tokens=2000,
                                            temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-reply
    done = threading.Event()
    result = {}

    def follow_up():
        result["r"] = client.chat.completions.create(model="default", messages=Q, max_tokens=4)
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
