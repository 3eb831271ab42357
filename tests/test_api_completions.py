"""POST /v1/completions (OpenAI's legacy completions) on the real model: a chat model, and the
same weights without a chat template standing in for a base model, served side by side."""

import copy
import dataclasses
import http.client
import json
import time
import urllib.request

import pytest
import torch

from miniserve.core.config import SamplingParams
from miniserve.engine.surface import REMOTE

from servers import send

PROMPT = "The capital of France is"
BASE = "base"
FAR = "far"  # a remote model


@pytest.fixture(scope="module")
def base_engine(loaded):
    """The embedded model with no chat template: what a base model looks like to the API
    (its own tokenizer copy, so the session's engine keeps its template)."""
    from miniserve.engine.engine import Engine

    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = None
    engine = Engine(dataclasses.replace(loaded, tokenizer=tokenizer), name=BASE)
    yield engine
    engine.close()


class SeenAsRemote:
    """The session's engine behind only what a remote engine offers (no tokenizer, no
    submit, replies as iterators): the API's path for remote models, on the real model."""

    capabilities, tokenizer, has_chat_template = REMOTE, None, True

    def __init__(self, engine, name: str):
        self._engine, self.name = engine, name
        self.context_length, self.max_queue = engine.context_length, engine.max_queue

    @property
    def queue_depth(self) -> int:
        return self._engine.queue_depth

    def check(self, params):
        self._engine.check(params)

    def chat(self, messages, params, options=None, cancel=None, observer=None):
        return self._engine.chat(messages, params, options, cancel=cancel)

    def complete_text(self, prompt, params, cancel=None, observer=None):
        return self._engine.complete_text(prompt, params, cancel=cancel)

    def trim(self, messages, params, options=None):
        return self._engine.trim(messages, params, options)


@pytest.fixture(scope="module")
def port(engine, base_engine):
    from miniserve.models.registry import Models, ModelSpec
    from miniserve.serve.in_thread import serve_in_thread

    engines = {engine.name: engine, BASE: base_engine, FAR: SeenAsRemote(engine, FAR)}
    models = Models(
        [
            ModelSpec(engine.name, None),
            ModelSpec(BASE, None),
            ModelSpec(FAR, "http://127.0.0.1:9/v1", remote=True),
        ],
        factory=lambda spec, progress: engines[spec.name],
        max_loaded=2,
    )
    with serve_in_thread(models) as port:
        yield port


def request(port: int, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    return send(f"http://127.0.0.1:{port}", path, body)


def complete(port: int, **body) -> dict:
    status, reply = request(port, body)
    assert status == 200, reply
    return reply


def events(port: int, body: dict) -> list:
    """A streamed request's `data:` payloads, decoded ('[DONE]' kept as a string)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as response:
        lines = [line.decode()[6:].strip() for line in response if line.startswith(b"data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def reference_text(engine, prompt, max_tokens=16) -> tuple[str, list[int]]:
    """engine.complete_text's greedy continuation: its text and token ids."""
    chunks = list(
        engine.complete_text(prompt, SamplingParams(temperature=0, max_new_tokens=max_tokens))
    )
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


def reference_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    """log-softmax of the library's forward pass over `ids`: row i predicts ids[i + 1]."""
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1)


@pytest.mark.parametrize("model, as_ids", [("default", False), ("default", True), (BASE, False)])
def test_greedy_text_is_complete_text(port, engine, base_engine, tokenizer, model, as_ids):
    own = base_engine if model == BASE else engine
    prompt = tokenizer(PROMPT)["input_ids"] if as_ids else PROMPT
    reply = complete(port, model=model, prompt=prompt, temperature=0)  # max_tokens: 16
    expected, ids = reference_text(own, prompt)
    choice = reply["choices"][0]
    assert reply["object"] == "text_completion" and reply["model"] == own.name
    assert choice["text"] == expected and choice["index"] == 0
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert len(ids) == 16
    assert reply["usage"] == {
        "prompt_tokens": len(tokenizer(PROMPT)["input_ids"]),
        "completion_tokens": 16,
        "total_tokens": len(tokenizer(PROMPT)["input_ids"]) + 16,
    }


def test_echo_puts_the_prompt_in_front(port):
    plain = complete(port, prompt=PROMPT, temperature=0, max_tokens=6)["choices"][0]["text"]
    echoed = complete(port, prompt=PROMPT, temperature=0, max_tokens=6, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + plain


def test_logprobs_match_a_reference_forward_pass(port, engine, loaded, tokenizer):
    reply = complete(port, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3)
    lp = reply["choices"][0]["logprobs"]
    _, generated = reference_text(engine, PROMPT, 6)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    ref = reference_logprobs(loaded, prompt_ids + generated)
    assert lp["tokens"] == [tokenizer.decode([t]) for t in generated]
    for k, token_id in enumerate(generated):
        row = ref[len(prompt_ids) - 1 + k]
        assert lp["token_logprobs"][k] == pytest.approx(float(row[token_id]), abs=2e-3)
        top = lp["top_logprobs"][k]
        assert len(top) == 3  # greedy: the chosen token is the most likely, so no 4th entry
        assert max(top, key=top.get) == lp["tokens"][k]
        values, ids = row.topk(3)
        assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=2e-3)
        assert set(top) == {tokenizer.decode([i]) for i in ids.tolist()}
    offsets = [sum(len(t) for t in lp["tokens"][:k]) for k in range(6)]
    assert lp["text_offset"] == offsets


def test_echo_with_logprobs_scores_the_prompt_first(port, engine, loaded, tokenizer):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    reply = complete(port, prompt=PROMPT, temperature=0, max_tokens=3, logprobs=2, echo=True)
    lp = reply["choices"][0]["logprobs"]
    _, generated = reference_text(engine, PROMPT, 3)
    ids = prompt_ids + generated
    ref = reference_logprobs(loaded, ids)
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        assert lp["token_logprobs"][pos] == pytest.approx(
            float(ref[pos - 1, ids[pos]]), abs=2e-3
        ), pos
        top = lp["top_logprobs"][pos]
        assert lp["tokens"][pos] in top  # the token there, even when not among the 2 best
        assert 2 <= len(top) <= 3
    assert "".join(lp["tokens"]) == reply["choices"][0]["text"]
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len("".join(lp["tokens"][:2]))]


def _token_bytes(token: str) -> bytes:
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])
    return token.encode("utf-8")


def test_logprobs_of_tokens_that_split_a_character_are_their_own_bytes(port):
    """Byte-level tokens that each hold a piece of an emoji: OpenAI's "bytes:\\xf0\\x9f" as
    their text and their own bytes (not U+FFFD's), so that they join to the reply's text, and
    no two alternatives share a key; the offsets count whole characters."""
    text = "Party emoji: \U0001f389\U0001f389 \u65e5\u672c \U0001f389"
    reply = complete(port, prompt=text, temperature=0, max_tokens=4, logprobs=5, echo=True)
    choice = reply["choices"][0]
    lp = choice["logprobs"]
    assert any(t.startswith("bytes:") for t in lp["tokens"])
    joined = b"".join(_token_bytes(t) for t in lp["tokens"])
    assert joined.decode("utf-8", errors="replace") == choice["text"]
    for pos in range(1, len(lp["tokens"])):
        top = lp["top_logprobs"][pos]
        assert top[lp["tokens"][pos]] == lp["token_logprobs"][pos], pos
        assert 5 <= len(top) <= 6, pos  # the 5 best, and the chosen one when not among them
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(choice["text"])
    # chat: each entry's bytes, joined, are the reply's text
    status, chat = request(
        port,
        {
            "messages": [{"role": "user", "content": "Repeat: " + text}],
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
        "/v1/chat/completions",
    )
    assert status == 200
    entries = chat["choices"][0]["logprobs"]["content"]
    joined = b"".join(bytes(e["bytes"]) for e in entries)
    assert joined.decode("utf-8", errors="replace") == chat["choices"][0]["message"]["content"]
    assert all(
        e["token"].startswith("bytes:") or bytes(e["bytes"]) == e["token"].encode() for e in entries
    )


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(port, tokenizer):
    """How evaluation harnesses score a text: echo + logprobs + max_tokens 0. The same
    computation as the prompt part of an echo with generated tokens, so equal to it."""
    count = len(tokenizer(PROMPT)["input_ids"])
    kwargs = dict(prompt=PROMPT, echo=True, logprobs=2)
    scored = complete(port, max_tokens=0, n=2, **kwargs)
    generated = complete(port, max_tokens=3, temperature=0, **kwargs)["choices"][0]["logprobs"]
    assert [c["index"] for c in scored["choices"]] == [0, 1]
    choice = scored["choices"][0]
    assert scored["choices"][1] == {**choice, "index": 1}
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"] == {key: value[:count] for key, value in generated.items()}
    usage = {"prompt_tokens": count, "completion_tokens": 0, "total_tokens": count}
    assert scored["usage"] == usage
    streamed = events(port, {**kwargs, "max_tokens": 0, "stream_options": {"include_usage": True}})
    assert streamed[-1] == "[DONE]" and streamed[-2]["usage"] == usage
    assert [e["choices"] for e in streamed[:-2]] == [[choice]]
    plain = complete(port, prompt=PROMPT, max_tokens=0)["choices"][0]
    assert plain["text"] == "" and plain["logprobs"] is None
    # nothing generated, so a prompt may fill the whole context (8192 here), not one more
    whole = complete(port, prompt=[1] * 8192, max_tokens=0)
    assert whole["usage"]["prompt_tokens"] == 8192
    status, reply = request(port, {"prompt": [1] * 8193, "max_tokens": 0})
    assert status == 400 and "8193 tokens" in reply["error"]["message"], reply
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for path, body in [
        ("/v1/completions", {"model": FAR, "prompt": PROMPT}),
        ("/v1/chat/completions", chat),
    ]:
        status, reply = request(port, {**body, "max_tokens": 0}, path)
        assert status == 400 and reply["error"]["param"] == "max_tokens", reply


def test_stop_ends_the_text_before_the_stop_string(port):
    # Exact by construction: greedy, the same prompt, so the same tokens until the stop string
    full = complete(port, prompt=PROMPT, temperature=0, max_tokens=16)["choices"][0]["text"]
    word = full.split()[1]
    choice = complete(port, prompt=PROMPT, temperature=0, max_tokens=16, stop=[word])["choices"][0]
    assert choice["text"] == full[: full.index(word)] and choice["finish_reason"] == "stop"


def test_n_choices_with_a_seed_are_the_seeded_single_requests(port):
    # Exact by construction: each choice is its own sequence, choice j sampled with seed + j
    kwargs = dict(prompt=PROMPT, temperature=0.9, max_tokens=6)
    reply = complete(port, n=2, seed=21, **kwargs)
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for j in (0, 1):
        one = complete(port, seed=21 + j, **kwargs)["choices"][0]["text"]
        assert reply["choices"][j]["text"] == one
    assert reply["usage"]["completion_tokens"] == 12


def test_several_prompts_get_a_block_of_choices_each(port, tokenizer):
    prompts = [PROMPT, "Once upon a time"]
    kwargs = dict(temperature=0.9, max_tokens=4, seed=3)
    reply = complete(port, prompt=prompts, n=2, **kwargs)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for j in (0, 1):
            one = complete(port, prompt=prompt, **{**kwargs, "seed": 3 + j})
            assert reply["choices"][2 * p + j]["text"] == one["choices"][0]["text"], (p, j)
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts)  # each once
    assert reply["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 16,
        "total_tokens": prompt_tokens + 16,
    }


def test_stream_concatenates_to_the_whole_reply(port):
    kwargs = dict(prompt=PROMPT, temperature=0.8, seed=5, max_tokens=12, echo=True, logprobs=1)
    whole = complete(port, **kwargs)["choices"][0]
    got = events(port, {**kwargs, "stream_options": {"include_usage": True}})
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1
    chunks = [e["choices"][0] for e in got[:-1] if e["choices"]]
    assert all(e["object"] == "text_completion" for e in got[:-1])
    assert chunks[0]["text"] == PROMPT  # the echo comes first
    assert "".join(c["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == [whole["finish_reason"]]
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 12


def test_a_client_that_leaves_a_stream_cancels_it(port, engine, monkeypatch):
    stats, submit = [], engine.submit

    def recording(prompt_ids, params, sink, **kwargs):
        def keep(item):
            if item is not None and not isinstance(item, BaseException):
                stats.append(item.stats)
            sink(item)

        return submit(prompt_ids, params, keep, **kwargs)

    monkeypatch.setattr(engine, "submit", recording)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {"prompt": "apple, " * 20, "max_tokens": 2000, "temperature": 0, "stream": True}
        ),
        {"Content-Type": "application/json"},
    )
    assert conn.getresponse().readline().startswith(b"data: ")
    conn.close()  # the client goes away mid-reply
    deadline = time.monotonic() + 60
    while engine.queue_depth and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.queue_depth == 0 and stats
    assert stats[-1].finish_reason == "cancelled" and stats[-1].new_tokens < 2000


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": PROMPT, "suffix": "!"}, "suffix", ["'suffix'", "not supported"]),
        ({"prompt": PROMPT, "logprobs": 6}, "logprobs", ["[0, 5]", "6"]),
        ({"prompt": PROMPT, "logprobs": True}, "logprobs", ["whole number"]),
        ({"prompt": ""}, "prompt", ["empty"]),
        ({"prompt": []}, "prompt", ["empty"]),
        ({"prompt": [PROMPT, ""]}, "prompt[1]", ["empty"]),
        ({"prompt": 5}, "prompt", ["string", "token ids"]),
        ({"prompt": [1, "a"]}, "prompt", ["string", "token ids"]),
        ({"prompt": "word " * 9000}, "prompt", ["9001 tokens", "context window of 8192"]),
        ({"prompt": [1, 49152]}, "prompt", ["49152", "out of range", "0..49151"]),
        ({"prompt": [[1, 2], [-1]]}, "prompt[1]", ["-1", "out of range"]),
        ({"prompt": PROMPT, "best_of": 2}, "best_of", ["n (1)"]),
        ({"prompt": PROMPT, "echo": "yes"}, "echo", ["true or false"]),
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens", ["[0, 4096]"]),
        ({"prompt": PROMPT, "top_p": 0}, "top_p", ["top_p"]),
        (
            {"prompt": PROMPT, "stream_options": {"include_usage": True}},
            "stream_options",
            ["'stream': true"],
        ),
        ({"prompt": PROMPT, "logit_bias": {"49152": -100}}, "logit_bias", ["out of range"]),
        (
            {"prompt": PROMPT, "structured_outputs": {"regex": "([a-z"}},
            "structured_outputs.regex",
            ["invalid regex"],
        ),
        ({}, "prompt", ["required"]),
    ],
)
def test_bad_requests_get_400_naming_the_field(port, body, param, words):
    status, reply = request(port, body)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert all(w in error["message"] for w in words), error["message"]


def test_structured_output_applies_to_completions(port):
    reply = complete(
        port,
        model=BASE,
        prompt="My favourite fruit:",
        temperature=0,
        max_tokens=10,
        structured_outputs={"choice": ["apple", "banana"]},
    )
    choice = reply["choices"][0]
    assert choice["text"] in ("apple", "banana") and choice["finish_reason"] == "stop"


def test_chat_with_a_model_without_a_template_is_refused(port):
    status, reply = request(
        port,
        {"model": BASE, "messages": [{"role": "user", "content": "Hi"}]},
        "/v1/chat/completions",
    )
    assert status == 400
    error = reply["error"]
    assert error["param"] == "messages" and error["code"] == "model_has_no_chat_template"
    assert "no chat template" in error["message"] and "/v1/completions" in error["message"]


def test_a_remote_model_answers_through_its_reply_iterators(port):
    kwargs = dict(prompt=PROMPT, temperature=0, max_tokens=8)
    local = complete(port, **kwargs)
    far = complete(port, model=FAR, echo=True, **kwargs)
    assert far["model"] == FAR
    assert far["choices"][0]["text"] == PROMPT + local["choices"][0]["text"]
    assert far["usage"] == local["usage"]
    streamed = events(port, {"model": FAR, "n": 2, **kwargs})
    for i in (0, 1):
        assert (
            "".join(e["choices"][0]["text"] for e in streamed[:-1] if e["choices"][0]["index"] == i)
            == local["choices"][0]["text"]
        )
    chat = {
        "messages": [{"role": "user", "content": "Name a fruit."}],
        "temperature": 0,
        "max_tokens": 6,
    }
    status, here = request(port, chat, "/v1/chat/completions")
    status_far, there = request(port, {**chat, "model": FAR}, "/v1/chat/completions")
    assert status == status_far == 200, there
    assert there["choices"][0]["message"] == here["choices"][0]["message"]


@pytest.mark.parametrize("extra", [{"logprobs": 1}, {"prompt": [504, 3458]}])
def test_echo_that_needs_the_remote_tokenizer_is_refused(port, extra):
    status, reply = request(port, {"model": FAR, "prompt": PROMPT, "echo": True, **extra})
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == "echo" and f"remote model '{FAR}'" in error["message"]


def test_tokenize_counts_as_the_engine_does(port, engine):
    """vLLM's /tokenize (what a MiniServeLM using this server as a remote model asks)."""
    from conftest import chat_ids

    status, got = request(port, {"prompt": PROMPT}, "/tokenize")
    assert status == 200 and got["tokens"] == engine.tokenizer(PROMPT)["input_ids"]
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == engine.context_length
    messages = [{"role": "user", "content": "Name a fruit."}]
    status, got = request(port, {"messages": messages}, "/tokenize")
    assert status == 200 and got["tokens"] == chat_ids(engine.tokenizer, "Name a fruit.")
    for body, param in (
        ({"prompt": 3}, "prompt"),
        ({"messages": []}, "messages"),
        ({"model": BASE, "messages": messages}, "messages"),
        ({"model": "nope", "prompt": "x"}, "model"),
    ):
        status, got = request(port, body, "/tokenize")
        assert status in (400, 404) and got["error"]["param"] == param, (body, got)


def test_a_remote_refusal_is_the_status_of_a_streamed_request(port):
    """A remote model's request is sent before the response starts: a refusal is a 4xx even
    with stream: true, not a 200 with an error inside."""
    for stream in (False, True):
        status, got = request(
            port, {"model": FAR, "prompt": "word " * 9000, "max_tokens": 8, "stream": stream}
        )
        assert status == 400 and got["error"]["param"] == "prompt", (stream, got)
