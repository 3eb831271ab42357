"""The chat request's JSON Schema (what /openapi.json documents and API fuzzers generate from)
and its checks (protocol.py) agree: a body the schema takes is taken, a body it refuses is a
400 naming the field, never a 500. No model is loaded: only the request is checked here; what
needs the model (its template, its vocabulary) is parse.py's."""

import pytest
from fastapi.exceptions import RequestValidationError
from jsonschema import Draft202012Validator
from pydantic import ValidationError

from miniserve.serve.errors import from_validation
from miniserve.serve.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

SCHEMA = Draft202012Validator(ChatCompletionRequest.model_json_schema())
HI = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def refusal(body: dict, model=ChatCompletionRequest):
    """The 400 the API answers for `body` (its UserError), or None where it is taken."""
    try:
        model.model_validate(body)
    except ValidationError as e:
        return from_validation(RequestValidationError(e.errors()))
    return None


TAKEN = [
    [HI],
    [{"role": "developer", "content": "be brief"}, HI],
    [HI, {"role": "assistant"}],  # prefill of nothing
    [HI, {"role": "assistant", "content": None, "tool_calls": [CALL]}],
    [HI, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}],
    [HI, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": ""}],
    [HI, {"role": "assistant", "content": " ", "reasoning_content": "hmm"}],
    [{"role": "tool", "content": [], "tool_call_id": "c1"}],
    [{"role": "user", "content": "hi", "tool_calls": [], "tool_call_id": 5}],  # ignored extra
]


@pytest.mark.parametrize("messages", TAKEN)
def test_a_conversation_the_schema_takes_is_taken(messages):
    body = {"messages": messages}
    assert SCHEMA.is_valid(body)
    assert refusal(body) is None


REFUSED = [
    (
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
        "messages[0].content[0].text",
    ),
    ([{"role": "user", "content": [[None, None]]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"text": "hi"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "tool", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": " \n"}, HI], "messages[0].content"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0]"),
    ([{"role": "user", "content": "x", "tool_calls": {}}], "messages[0].tool_calls"),
    ([HI, {"role": "assistant", "tool_calls": {}}], "messages[1].tool_calls"),
    (
        [HI, {"role": "assistant", "tool_calls": [{**CALL, "id": 5}]}],
        "messages[1].tool_calls[0].id",
    ),
    (
        [HI, {"role": "assistant", "tool_calls": [{**CALL, "type": "x"}]}],
        "messages[1].tool_calls[0].type",
    ),
    (
        [HI, {"role": "assistant", "content": "a", "reasoning_content": ["x"]}],
        "messages[1].reasoning_content",
    ),
    ([{"role": "tool", "content": "42", "tool_call_id": 1}], "messages[0].tool_call_id"),
    ([{"role": {}, "content": "x"}], "messages[0].role"),
    (  # an image (or audio) part: a model reading text only would answer without it
        [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]}],
        "messages[0].content[1].type",
    ),
    ([HI, {"role": "tool", "content": [{"type": "input_audio"}]}], "messages[1].content[0].type"),
]


@pytest.mark.parametrize("messages, field", REFUSED)
def test_a_conversation_the_schema_refuses_is_a_400_naming_the_part(messages, field):
    body = {"messages": messages}
    assert not SCHEMA.is_valid(body)
    error = refusal(body)
    assert error is not None and error.status == 400 and error.field == field, error
    assert refusal(body, TokenizeRequest).field == field  # /tokenize takes messages alike


FIELDS_TAKEN = [
    {"tools": []},
    {"tools": [TOOL], "tool_choice": "required"},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"tool_choice": "none", "parallel_tool_calls": False},
    {"reasoning_budget": 0, "reasoning_effort": "none"},
    {"chat_template_kwargs": {"enable_thinking": False}},
]


@pytest.mark.parametrize("fields", FIELDS_TAKEN)
def test_tool_and_template_fields_the_schema_takes_are_taken(fields):
    body = {"messages": [HI], **fields}
    assert SCHEMA.is_valid(body)
    assert refusal(body) is None


FIELDS_REFUSED = [
    ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"reasoning_budget": False}, "reasoning_budget"),
    ({"reasoning_budget": -1}, "reasoning_budget"),
    ({"tool_choice": "bogus"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools[0].function.strict",
    ),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    (
        {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
        "chat_template_kwargs.chat_template",
    ),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("fields, field", FIELDS_REFUSED)
def test_tool_and_template_fields_the_schema_refuses_are_a_400_naming_them(fields, field):
    body = {"messages": [HI], **fields}
    assert not SCHEMA.is_valid(body)
    error = refusal(body)
    assert error is not None and error.status == 400 and error.field == field, error


@pytest.mark.parametrize(
    "fields, taken",
    [
        ({"grammar": 'root ::= "yes"'}, False),  # llama-server's: it would be ignored
        ({"grammar": ""}, True),
        ({"json_schema": {"type": "object"}}, False),
        ({"guided_choice": ["yes", "no"]}, False),
        ({"repeat_penalty": 1.3}, False),
        ({"repeat_penalty": 1.0}, True),  # llama-server's off, as its clients send it
        ({"n_predict": 8}, False),
        ({"n_predict": -1}, True),
        ({"ignore_eos": True}, False),
        ({"ignore_eos": False}, True),
        ({"min_tokens": 5}, False),
        ({"modalities": ["text", "audio"]}, False),
        ({"modalities": ["text"]}, True),
        ({"top_logprobs": 3}, False),  # without logprobs: OpenAI and vLLM refuse it too
        ({"top_logprobs": 3, "logprobs": True}, True),
        ({"presence_penalty": 1.5, "frequency_penalty": -0.5}, True),  # applied: a stage
        ({"presence_penalty": 2.5}, False),
    ],
)
def test_fields_that_would_steer_the_reply_are_taken_or_refused_never_ignored(fields, taken):
    error = refusal({"messages": [HI], **fields})
    if taken:
        assert error is None, error
    else:
        name = next(iter(fields))
        assert error is not None and error.status == 400 and error.field == name, error


COMPLETIONS = Draft202012Validator(CompletionRequest.model_json_schema())
LEFT_OUT = object()


@pytest.mark.parametrize("n", [LEFT_OUT, None, 1, 2, 3])
@pytest.mark.parametrize("best_of", [LEFT_OUT, None, 1, 2, 3])
def test_best_of_is_n_in_the_schema_as_in_the_check(n, best_of):
    body = {"prompt": "hi"}
    body.update({k: v for k, v in (("n", n), ("best_of", best_of)) if v is not LEFT_OUT})
    error = refusal(body, CompletionRequest)
    assert COMPLETIONS.is_valid(body) == (error is None), error
    assert error is None or error.field == "best_of"


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_a_request_schema_has_one_if_and_one_not(model):
    """What no field says alone stays one if/then and one `not` side by side: schemathesis'
    coverage phase folds the rules into one schema and gives up on two of either (it then
    sends a single request for the route)."""
    rules = model.model_json_schema()["allOf"]
    assert sum("if" in rule for rule in rules) == 1
    assert sum("not" in rule for rule in rules) == 1


# What pydantic refuses, worded once from the declaration (errors.explain): the sentences the
# hand-written checks used to say, the field as `param`.
TOOL_CHOICE = (
    "'tool_choice' must be auto, none, required, or "
    '{"type": "function", "function": {"name": ...}} naming one of \'tools\''
)
WORDED = [
    ({"temperature": 3}, "temperature", "'temperature' must be in [0, 2], got 3"),
    ({"temperature": True}, "temperature", "'temperature' must be a number [0, 2], got True"),
    (
        {"temperature": float("inf")},
        "temperature",
        "'temperature' must be a finite number [0, 2], got inf",
    ),
    ({"top_p": "all"}, "top_p", "'top_p' must be a number (0, 1], got 'all'"),
    ({"top_p": 0}, "top_p", "'top_p' must be in (0, 1], got 0"),
    ({"n": 1.5}, "n", "'n' must be a whole number [1, 8], got 1.5"),
    ({"n": "2"}, "n", "'n' must be a whole number [1, 8], got '2'"),
    ({"mirostat": 1}, "mirostat", "'mirostat' must be one of 0, 2, got 1"),
    ({"mirostat": False}, "mirostat", "'mirostat' must be a whole number one of 0, 2, got False"),
    ({"seed": -1}, "seed", "'seed' must be in [0, 9223372036854775807], got -1"),
    ({"stream": 1}, "stream", "'stream' must be true or false"),
    (
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
        "'stream_options.include_usage' must be true or false",
    ),
    (
        {"stream": True, "stream_options": "x"},
        "stream_options",
        "'stream_options' must be an object",
    ),
    ({"model": 5}, "model", "'model' must be a string"),
    ({"stop": ["a", ""]}, "stop", "'stop' must be a non-empty string or a list of up to 4 of them"),
    ({"stop": ["a"] * 5}, "stop", "'stop' must be a non-empty string or a list of up to 4 of them"),
    (
        {"logit_bias": {"5": 101}},
        "logit_bias[5]",
        "'logit_bias[5]' must be in [-100, 100], got 101",
    ),
    (
        {"logit_bias": {"abc": 101}},
        "logit_bias",
        "'logit_bias': keys must be token ids (whole numbers >= 0), got 'abc'",
    ),
    (
        {"logit_bias": [5]},
        "logit_bias",
        "'logit_bias' must be an object mapping token ids to a bias in [-100, 100]",
    ),
    (
        {"dry_sequence_breakers": ["a" * 65]},
        "dry_sequence_breakers",
        "'dry_sequence_breakers' must be a list of strings of 1 to 64 characters",
    ),
    (
        {"dry_sequence_breakers": ["a"] * 33},
        "dry_sequence_breakers",
        "'dry_sequence_breakers' may hold at most 32 strings, got 33",
    ),
    ({"tool_choice": {"type": "function"}}, "tool_choice", TOOL_CHOICE),
    ({"tool_choice": "bogus"}, "tool_choice", TOOL_CHOICE),
    (
        {"chat_template_kwargs": [1]},
        "chat_template_kwargs",
        "'chat_template_kwargs' must be an object of the chat template's switches",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}},
        "response_format.json_schema.strict",
        "'response_format.json_schema.strict' must be true or false",
    ),
]


@pytest.mark.parametrize("fields, field, message", WORDED)
def test_what_pydantic_refuses_is_worded_from_the_declaration(fields, field, message):
    error = refusal({"messages": [HI], **fields})
    assert error is not None and (error.status, error.field, str(error)) == (400, field, message)


def test_json_numbers_and_strings_are_taken_as_the_api_always_took_them():
    body = ChatCompletionRequest.model_validate(
        {"messages": [HI], "n": 2.0, "seed": 4.0, "stop": "x", "dry_sequence_breakers": "\n"}
    )
    assert (body.n, body.seed, body.stop, body.dry_sequence_breakers) == (2, 4, ["x"], ["\n"])
    # null is the default (it used to be a 500: a length limit applied to None)
    assert refusal({"messages": [HI], "dry_sequence_breakers": None}) is None
