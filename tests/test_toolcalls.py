"""Tool calls: each committed sample reply, fed in every split we can afford, streams deltas that
the openai SDK accumulates into exactly the calls (ids, names, argument texts) and content that
parsing the whole reply gives, and those are the sample's expected calls."""

import itertools
import json
import random
from pathlib import Path

import pytest
from openai import NOT_GIVEN
from openai.lib.streaming._deltas import accumulate_delta
from openai.lib.streaming.chat._completions import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from miniserve.core.toolcalls import (
    FORMATS,
    CallStream,
    Parsed,
    ToolCall,
    detect_format,
    get_format,
    new_call_id,
    parse,
)

DATA = Path(__file__).parent / "data" / "toolcalls"
EXPECTED = json.loads((DATA / "expected.json").read_text(encoding="utf-8"))

# small cases beside the samples: (format, reply, content, [(name, arguments)], errors)
CASES = [
    ("mistral", '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1}', "", [("add", {"a": 1})], 0),
    ("mistral", "[TOOL_CALLS]", "", [], 1),
    ("hermes", "Checking.\n<tool_call>\n\n</tool_call>\nDone.", "Checking.Done.", [], 1),
    (
        "hermes",
        "Text that ends in half an opener <tool",
        "Text that ends in half an opener <tool",
        [],
        0,
    ),
    ("llama3", "  \n", "  \n", [], 0),
    ("llama3", '\n{"name": "f", "parameters": {}}\n', "", [("f", {})], 0),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"a": 2}}', "", [], 1),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "", [], 1),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}]</tool_call>', "", [], 1),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": 1}}}</tool_call>',
        "",
        [("f", {"a": 1})],
        1,
    ),
]


def samples():
    for name, want in EXPECTED.items():
        text = (DATA / name).read_text(encoding="utf-8")
        calls = [tuple(call) for call in want["calls"]]
        yield pytest.param(want["format"], text, want["content"], calls, want["errors"], id=name)
    for i, case in enumerate(CASES):
        yield pytest.param(*case, id=f"{case[0]}-case{i}")


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n):03d}"


def splits(text: str):
    """One piece; every character alone; every split point into two; random splits (fixed seed)."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(20240917)
    for _ in range(40):
        yield random_pieces(text, rng)


def random_pieces(text: str, rng: random.Random) -> list[str]:
    if len(text) < 3:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, min(len(text) - 1, 16))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def run_stream(fmt, pieces):
    stream = CallStream(fmt, new_id=counter_ids())
    outputs = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return outputs, stream.result()


def chunk(delta: dict, finish_reason=None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(
        {
            "id": "chatcmpl-test",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "test",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
    )


def sdk_accumulate(outputs, full: bool = True):
    """The message the openai SDK builds from the chunks a server would send: its whole stream
    state (`full`), or only the delta merge that state runs on each chunk (the same joins, a
    hundred times faster, for the many two-piece splits)."""
    deltas = [{"role": "assistant", "content": ""}]
    for content, tool_calls in outputs:
        delta = {"content": content} if content else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        if delta:
            deltas.append(delta)
    if not full:
        message = {}
        for delta in json.loads(json.dumps(deltas)):  # the SDK's merge keeps and extends them
            accumulate_delta(message, delta)
        calls = [
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])
        ]
        return message["content"], calls
    state = ChatCompletionStreamState(input_tools=[], response_format=NOT_GIVEN)
    for delta in deltas:
        state.handle_chunk(chunk(delta))
    state.handle_chunk(chunk({}, "tool_calls"))
    message = state.get_final_completion().choices[0].message
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content or "", calls


def check_delta_shapes(outputs):
    """A call's first delta names it once; later ones carry only arguments (the SDK joins every
    string it is sent again, so a repeated id or name would be doubled)."""
    begun = 0
    for _, deltas in outputs:
        for d in deltas:
            if d["index"] == begun:
                assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
                assert set(d["function"]) == {"name", "arguments"} and d["function"]["name"]
                begun += 1
            else:
                assert d["index"] < begun, "a call's first delta must come before its arguments"
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                assert d["function"]["arguments"]


def check_stream(outputs, whole: Parsed, streamed: Parsed, full: bool = True):
    """The streamed deltas, accumulated as the SDK does, agree with the reply parsed whole."""
    check_delta_shapes(outputs)
    assert streamed == whole
    check_accumulated(outputs, whole, full)


def check_accumulated(outputs, whole: Parsed, full: bool = True):
    content, calls = sdk_accumulate(outputs, full)
    assert content == whole.content
    by_id = {call_id: (name, arguments) for call_id, name, arguments in calls}
    for call in whole.calls:
        assert by_id.get(call.id) == (call.name, call.arguments)
    # a call that began streaming and then failed to parse is the only other kind
    assert len(by_id) == len(whole.calls) or whole.errors


@pytest.mark.parametrize("fmt_name, text, content, calls, errors", samples())
def test_every_split_streams_what_parsing_whole_gives(fmt_name, text, content, calls, errors):
    fmt = get_format(fmt_name)
    whole = parse(fmt, text, new_id=counter_ids())
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert len(whole.errors) == errors, whole.errors
    for i, pieces in enumerate(splits(text)):
        outputs, streamed = run_stream(fmt, pieces)
        check_stream(outputs, whole, streamed, full=i < 2 or i % 25 == 0)


def test_arguments_stream_while_they_are_generated():
    text = (DATA / "hermes_tricky_strings.txt").read_text(encoding="utf-8")
    outputs, result = run_stream(get_format("hermes"), list(text))
    (call,) = result.calls
    pieces = [d["function"]["arguments"] for _, ds in outputs for d in ds]
    assert "".join(pieces) == call.arguments
    assert len(pieces) > len(call.arguments) // 2
    # the first piece of the arguments is out before their last character has been fed
    first = next(
        i for i, (_, ds) in enumerate(outputs) if any(d["function"]["arguments"] for d in ds)
    )
    assert first < text.index(call.arguments) + len(call.arguments) - 1


@pytest.mark.parametrize("sample", ["hermes_parallel.txt", "mistral_v11_args.txt"])
def test_a_misjoined_stream_is_caught(sample):
    """The check above fails when argument pieces are lost, doubled, swapped or moved to the
    wrong call: each corruption of a correct stream must be caught."""
    fmt = get_format(EXPECTED[sample]["format"])
    text = (DATA / sample).read_text(encoding="utf-8")
    whole = parse(fmt, text, new_id=counter_ids())
    outputs, streamed = run_stream(fmt, list(text))
    check_stream(outputs, whole, streamed)  # the honest stream passes

    def argument_deltas(outs):
        return [d for _, ds in outs for d in ds if "id" not in d]

    def corrupted(change):
        outs = json.loads(json.dumps(outputs))
        change(argument_deltas(outs))
        return outs

    def drop(ds):
        ds[len(ds) // 2]["function"]["arguments"] = ""

    def double(ds):
        ds[len(ds) // 2]["function"]["arguments"] *= 2

    def swap(ds):
        i = next(
            i for i in range(len(ds) // 2, len(ds)) if ds[i]["function"] != ds[i + 1]["function"]
        )
        ds[i]["function"], ds[i + 1]["function"] = ds[i + 1]["function"], ds[i]["function"]

    def move(ds):  # a piece of the second call's arguments joined to the first call's
        ds[-2]["index"] = 0

    for change, full in itertools.product((drop, double, swap, move), (True, False)):
        with pytest.raises(AssertionError):
            check_accumulated(corrupted(change), whole, full)


# excerpts of real chat templates (their tool parts), and one without tools
TEMPLATES = {
    "qwen3.jinja": "hermes",
    "llama-3.2.jinja": "llama3",
    "llama-3.1-builtin.jinja": "llama3",
    "mistral-v0.3.jinja": "mistral",
    "chatml-no-tools.jinja": None,
}


@pytest.mark.parametrize("template, family", TEMPLATES.items())
def test_detect_the_family_from_its_chat_template(template, family):
    text = (DATA / "templates" / template).read_text(encoding="utf-8")
    assert [f.name for f in FORMATS if f.detect(text)] == ([family] if family else [])
    assert getattr(detect_format(text), "name", None) == family
    assert detect_format(None) is None


def test_call_ids_and_the_message_entry():
    call_id = new_call_id()
    assert call_id.startswith("call_") and len(call_id) == 29 and call_id[5:].isalnum()
    assert new_call_id() != call_id
    call = ToolCall("call_1", "f", '{"a": 1}')
    assert call.to_openai() == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }


def test_damaged_replies_never_raise_and_stream_as_they_parse():
    """Samples with characters deleted, doubled or replaced (fixed seed): feeding never raises,
    and the stream still agrees with the whole parse."""
    rng = random.Random(7)
    names = sorted(EXPECTED)
    for _ in range(300):
        name = rng.choice(names)
        fmt = get_format(EXPECTED[name]["format"])
        text = list((DATA / name).read_text(encoding="utf-8"))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            text[i : i + 1] = rng.choice([[], [text[i]] * 2, [rng.choice('{}[]",:; \\\nab')]])
        text = "".join(text)
        whole = parse(fmt, text, new_id=counter_ids())
        for pieces in (list(text), random_pieces(text, rng)):
            outputs, streamed = run_stream(fmt, pieces)
            check_stream(outputs, whole, streamed, full=False)
