"""The API's requests as pydantic models (as vLLM's entrypoints/openai/protocol.py): what
/openapi.json documents, /docs shows and API fuzzers generate, and what FastAPI checks before a
route runs.

Ranges come from the one table in miniserve.core.config (`FIELDS`, `MAX_CHOICES`, ...), or,
for fields only the API has, the `Limit`s below. Each field is declared once, as its pydantic
type with its limits (`number`, `flag`, ...), and pydantic alone checks it; what it refuses is
worded in one place, errors.explain, from the error and the request's own declaration (its
JSON Schema; `Allowed` for a field of several shapes), naming the field and what is allowed:
"'top_p' must be a number (0, 1], got 'all'" (`_Explained`); the route answers 400. What no
type says is a validator here, once: a rule across fields, token ids as logit_bias's keys,
the stages `samplers` names, the template switches the server keeps, an OpenAI field refused
with its own code, a prompt's or output format's shapes. A conversation's messages
are documented as a model for each role; `_messages` checks what those state (the types of the
fields the engine reads, text in every user message) before chat.check_messages, the engine's
own check, makes them what it takes. What needs the model -- its context window (the ceiling
of max_tokens), its vocabulary, compiling a grammar, its chat template -- is checked after,
in parse.py.
"""

import dataclasses
import functools
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SkipValidation,
    StrictBool,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from miniserve.core.config import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_NEW_TOKENS,
    MAX_PROMPTS,
    SEED_MAX,
    ConfigError,
    Constraint,
)
from miniserve.core.config import Field as Limit
from miniserve.core.samplers import MAX_BREAKER_CHARS, PARAMS, check_order, default_order
from miniserve.engine.chat import ChatError, ChatOptions, check_messages
from miniserve.serve.errors import Allowed, APIError, explain

DEFAULT_MAX_TOKENS = 1024  # chat
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions, as OpenAI's
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions `logprobs`, as OpenAI's
# A request that says nothing of a stage gets it off (OpenAI's defaults: temperature 1, no
# filters); the values come from the stages' declarations (miniserve/core/samplers.py).


def api_defaults() -> dict:
    """Every stage setting's value where a request is silent: the stage's off value."""
    return {name: param.off for name, (_, param) in PARAMS.items()}


# The API's own numeric fields, checked as every number is (config.check_number)
N = Limit(
    int,
    1,
    MAX_CHOICES,
    1,
    "n",
    "choices to generate (for each prompt); each takes one "
    "place in the queue; with a seed, choice i samples with seed + i",
)
BEST_OF = Limit(int, 1, MAX_CHOICES, 1, "best_of", "must equal n: every choice is returned")
TOP_LOGPROBS = Limit(
    int,
    0,
    20,
    0,
    "top_logprobs",
    "the most likely tokens listed at each position (with logprobs: true)",
)
REASONING_BUDGET = Limit(
    int,
    0,
    MAX_NEW_TOKENS,
    0,
    "reasoning_budget",
    "reasoning tokens at most; then the reasoning is closed and the answer follows (default: "
    "the server's --reasoning-budget, else no limit). max_tokens counts reasoning and answer",
)
SEED = Limit(int, 0, SEED_MAX, 0, "seed", "choice i samples with seed + i")
COMPLETION_LOGPROBS = Limit(
    int,
    0,
    MAX_COMPLETION_LOGPROBS,
    0,
    "logprobs",
    "log-probabilities of each token and of the `logprobs` most likely",
)
# The extension for output formats OpenAI's response_format has no type for (vLLM's name)
STRUCTURED_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def _checked(check):
    """A check pydantic cannot make (a cross-reference, a refusal with its own code), run on
    the value as sent (None: the field left out)."""

    def run(value):
        return None if value is None else check(value)

    return BeforeValidator(run)


def _json_number(value):
    """A JSON number as pydantic's strict int takes it: 5.0 is 5 (JSON Schema's integer says
    so); true and false are no numbers (a Literal of ints would take false for 0)."""
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return int(value) if isinstance(value, float) and value.is_integer() else value


def number(spec: Limit):
    """A number as `spec` declares it, checked by pydantic alone: its kind (strict: no
    strings, no booleans; a float finite), its range or its choices. The sentence a refusal
    reads is errors.explain's, from this declaration."""
    if spec.choices:
        return Annotated[Literal[spec.choices], BeforeValidator(_json_number)]
    bounds = {"gt" if spec.low_open else "ge": spec.low, "le": spec.high}
    if spec.kind is int:
        return Annotated[int, Field(strict=True, **bounds), BeforeValidator(_json_number)]
    return Annotated[float, Field(strict=True, allow_inf_nan=False, **bounds)]


def limited(spec: Limit, default=None):
    """A number (or null: `default`) documented and checked with `spec`'s kind and range."""
    return Annotated[number(spec) | None, Field(default, description=spec.help)]


def _listed(value):
    """A string as the list of it (llama-server takes either)."""
    return [value] if isinstance(value, str) else value


def sampling(name: str):
    """A stage's setting, as its declaration states it: its range and its off value when left
    out; a list of strings for a list (its length the declaration's high)."""
    stage, param = PARAMS[name]
    help = f"{param.field.help} ({stage.label}: {stage.help})"
    if param.field.kind is tuple:
        text = Annotated[str, Field(min_length=1, max_length=MAX_BREAKER_CHARS)]
        return Annotated[
            Annotated[list[text], Field(max_length=int(param.field.high))] | None,
            BeforeValidator(_listed),
            Allowed(f"a list of strings of 1 to {MAX_BREAKER_CHARS} characters"),
            Field(list(param.off), description=help),
        ]
    return limited(dataclasses.replace(param.field, help=help), param.off)


def _samplers(value):
    order = check_order(value)
    return list(order) if order is not None else None


def stage_fields() -> dict:
    """The request fields every declared stage brings (llama-server's names), and `samplers`."""
    fields = {name: sampling(name) for name in PARAMS}
    fields["samplers"] = Annotated[
        SkipValidation[list[str] | str | None],
        _checked(_samplers),
        Field(
            None,
            description="the stages' order, as llama-server names them ("
            + ", ".join(default_order())
            + " by default); a stage left out is off; the logit bias and the output format "
            "always come first; Mirostat (mirostat: 2) replaces the truncation stages",
        ),
    ]
    return fields


def flag(default: bool | None = False, description: str | None = None):
    """true or false (null: the default)."""
    return Annotated[StrictBool | None, Field(default, description=description)]


# what a refused field may hold: nothing asked (null, [], {}, "none")
NOTHING = (
    Literal["none"]
    | Annotated[list[Any], Field(max_length=0)]
    | Annotated[dict[str, Any], Field(max_length=0)]
)


def unsupported(name: str, description: str):
    """A field OpenAI has that this server refuses (400, code unsupported_parameter) unless
    it asks for nothing (null, [], {}, "none"), documented as only that: ignoring it would
    change what the reply means."""

    def check(value):
        if value in ([], {}, "none"):
            return None
        raise APIError(
            f"'{name}' is not supported by this server (the legacy function calling): "
            "use 'tools' and 'tool_choice'",
            name,
            code="unsupported_parameter",
        )

    return Annotated[NOTHING | None, _checked(check), Field(None, description=description)]


def _structured_outputs(extra):
    given = [k for k in extra if extra[k] is not None] if isinstance(extra, dict) else []
    if len(given) != 1 or given[0] not in STRUCTURED_KINDS:
        raise ConfigError(
            f"'structured_outputs' must hold exactly one of {', '.join(STRUCTURED_KINDS)}",
            "structured_outputs",
        )
    key = given[0]
    value, field = extra[key], f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"'{field}' is not JSON: {e.msg}", field) from None
        if not isinstance(value, dict):
            raise ConfigError(f"'{field}' must be a JSON Schema (an object)", field)
    elif key == "choice":
        if (
            not isinstance(value, list)
            or not value
            or any(not isinstance(c, str) or not c for c in value)
        ):
            raise ConfigError(f"'{field}' must be a list of non-empty strings", field)
    elif not isinstance(value, str) or not value.strip():
        raise ConfigError(f"'{field}' must be a non-empty string", field)
    return {key: value}


# a logit_bias key: a token id as JSON writes an object's keys, digits (the vocabulary: later)
TOKEN_ID = r"^\s*[0-9]+\s*$"


def _token_id(key: str) -> str:
    """A logit_bias key is a token id (checked with its entry, before its bias)."""
    if not re.fullmatch(TOKEN_ID, key):
        raise ConfigError(
            f"'logit_bias': keys must be token ids (whole numbers >= 0), got {key!r}",
            "logit_bias",
        )
    return key


def _is_id(value) -> bool:
    """A token id: a whole number (JSON's 5.0 is 5, as JSON Schema's integer says)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )


def _ids(prompt):
    """A prompt with its token ids as ints."""
    return prompt if isinstance(prompt, str) else [int(t) for t in prompt]


def _prompt(value):
    """OpenAI's four shapes of `prompt` (a string, a list of token ids, a list of strings, a
    list of id lists), at most MAX_PROMPTS prompts, none empty."""
    shapes = (
        "'prompt' must be a string, a list of token ids, or a list of strings or of token id lists"
    )
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(_is_id(t) for t in value)
    ):
        prompts = [value]
    elif not isinstance(value, list):
        raise ConfigError(shapes, "prompt")
    elif not value:
        raise ConfigError("'prompt' is empty; give the text to continue, or token ids", "prompt")
    elif not (
        all(isinstance(p, str) for p in value)
        or all(isinstance(p, list) and all(_is_id(t) for t in p) for p in value)
    ):
        raise ConfigError(shapes, "prompt")
    elif len(value) > MAX_PROMPTS:
        raise ConfigError(
            f"'prompt' holds {len(value)} prompts; at most {MAX_PROMPTS} in one request", "prompt"
        )
    else:
        prompts = value
    fields = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
    for prompt, field in zip(prompts, fields):
        if not prompt:
            raise ConfigError(f"'{field}' is empty; give the text to continue, or token ids", field)
    return _ids(value) if prompts is not value else [_ids(p) for p in value]


def _suffix(value):
    if value != "":
        raise APIError(
            "'suffix' is not supported by this server (no insertion): send the text "
            "before the gap as 'prompt'",
            "suffix",
            code="unsupported_parameter",
        )
    return value


# apply_chat_template's own arguments and what it hands every template itself: the call's,
# not switches of the template (the conversation, the tools, another template, tokenizing)
TEMPLATE_ARGUMENTS = (
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "sanitize_control_tokens",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)


def _template_kwargs(value: dict) -> dict:
    """No key the server sets itself (a name check pydantic's propertyNames cannot word)."""
    for key in value:
        if key in TEMPLATE_ARGUMENTS:
            field = f"chat_template_kwargs.{key}"
            raise ConfigError(
                f"'{field}' is not a switch of the chat template: the server sets it "
                "(the conversation, the tools, how the template is applied)",
                field,
            )
    return value


def _tokenize_prompt(value):
    if not isinstance(value, str):
        raise ConfigError("give 'prompt' (a string) or 'messages'", "prompt")
    return value


# -- the parts of a request ------------------------------------------------------------------


def _optional(schema: dict) -> None:
    """JSON Schema: a property that may be left out, but not sent as null (pydantic writes
    the model's None default, which a client would read as a value to send)."""
    schema.pop("default", None)


class ContentPart(BaseModel):
    """OpenAI's content parts: text ones. Others (images, audio) are refused: a model that
    cannot see them would answer as if they were not there."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"] = Field(
        description='"text" (image and audio parts are refused: the models here read text)'
    )
    text: str = Field(None, description="a text part's text", json_schema_extra=_optional)


# Text with something to read: a character that is neither a space nor a control character
# (chat.clean_text drops those). Asked of every user message, though the server only needs it
# of the last: an empty turn in the middle says nothing either, and a schema cannot single out
# the last item of a list.
VISIBLE = r"[^\s\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"

Content = str | list[ContentPart]
# a user message's content: text to read, or parts of which one is text to read
UserContent = (
    Annotated[str, Field(pattern=VISIBLE)]
    | Annotated[
        list[ContentPart],
        Field(
            json_schema_extra={
                "contains": {
                    "type": "object",
                    "required": ["type", "text"],
                    "properties": {
                        "type": {"const": "text"},
                        "text": {"type": "string", "pattern": VISIBLE},
                    },
                }
            }
        ),
    ]
)
# what a message that is not the assistant's holds as tool_calls: nothing
NoCalls = Annotated[
    Annotated[list[Any], Field(max_length=0)] | None,
    Field(None, description="only an assistant message makes calls"),
]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1)]
    arguments: str | dict[str, Any] = Field("{}", description="JSON text (or the object)")


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = Field(None, description="left out or null: call_<index>")
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(BaseModel):
    """The system prompt (developer: OpenAI's newer name of it); never the last message."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer"]
    content: Content
    tool_calls: NoCalls


class UserMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user"]
    content: UserContent
    tool_calls: NoCalls


class AssistantMessage(BaseModel):
    """A reply: its text (null or left out beside calls), its calls, its reasoning. The last
    message may be the assistant's: the reply continues it (prefill)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallItem] | None = Field(None, description="the calls it made")
    reasoning_content: str | None = Field(
        None, description="its reasoning; the template keeps or drops it"
    )


class ToolMessage(BaseModel):
    """A call's result."""

    model_config = ConfigDict(extra="allow")
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = Field(None, description="the call it answers")
    tool_calls: NoCalls


# the user's first: what a generator that takes the first kind makes is a conversation to send
ChatMessage = Annotated[
    UserMessage | AssistantMessage | ToolMessage | SystemMessage, Field(discriminator="role")
]


def _readable(content) -> bool:
    """Whether a message's content (text or parts) has something to read (VISIBLE)."""
    if isinstance(content, list):
        content = "".join(p["text"] for p in content if p.get("type") == "text" and "text" in p)
    return re.search(VISIBLE, content) is not None


def _message(m: dict, where: str) -> None:
    """What the message models state of one message that check_messages leaves alone: the
    types of the fields it reads, and text in every user message."""
    role, content = m.get("role"), m.get("content")
    role = role if isinstance(role, str) else None  # any other: check_messages says so
    if isinstance(content, list):
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ChatError(
                    f"'{at}' must be a content part: an object with a 'type' "
                    "(\"text\", with its 'text')",
                    at,
                )
            if part["type"] == "refusal" and role == "assistant":
                continue  # OpenAI's record of a refusal in an earlier reply: kept out, as before
            if part["type"] != "text":
                raise ChatError(
                    f"'{at}' is a part of type {json.dumps(part['type'])}: the models here read "
                    'text only (parts of type "text")',
                    f"{at}.type",
                )
            if "text" in part and not isinstance(part["text"], str):
                raise ChatError(f"'{at}.text' must be a string", f"{at}.text")
    if role == "user" and isinstance(content, (str, list)) and not _readable(content):
        raise ChatError(
            f"'{where}.content' has no text: a user message needs something to read",
            f"{where}.content",
        )
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise ChatError(f"'{where}.tool_calls' must be a list of calls", f"{where}.tool_calls")
    for j, call in enumerate((calls or []) if role == "assistant" else []):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            continue  # check_messages: "function.name must be a non-empty string"
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise ChatError(f"'{at}.id' must be a string", f"{at}.id")
        if "type" in call and call["type"] != "function":
            raise ChatError(f"'{at}.type' must be \"function\"", f"{at}.type")
    key = {"assistant": "reasoning_content", "tool": "tool_call_id"}.get(role)
    if key is not None and m.get(key) is not None and not isinstance(m[key], str):
        raise ChatError(f"'{where}.{key}' must be a string", f"{where}.{key}")


def _messages(value):
    """The conversation checked: each message as its model states (`_message`), then as
    the engine takes it (check_messages, whose sentences name the message and the part)."""
    if isinstance(value, list):
        for i, m in enumerate(value):
            if isinstance(m, dict):
                _message(m, f"messages[{i}]")
    return check_messages(value)


# _messages is the whole check; the models document what it takes, and it returns
# [{"role", "content": text}, ...]
Messages = Annotated[
    SkipValidation[Annotated[list[ChatMessage], Field(min_length=1)]],
    BeforeValidator(_messages),
    Field(
        description="the conversation, oldest first; it ends with the user's message, tool "
        "results, or an assistant message the reply continues (prefill), never the system "
        "prompt; too long for the context with max_tokens: 400, never cut"
    ),
]
TokenId = Annotated[
    int,
    Field(
        json_schema_extra={"minimum": 0},
        description="a token id (below the model's vocabulary size)",
    ),
]

Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (
    Text
    | Ids
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[list[Ids], Field(min_length=1, max_length=MAX_PROMPTS)]
)


MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    # the arguments are always an object: a schema with another type could never be met
    parameters: (
        Annotated[
            dict[str, Any],
            Field(json_schema_extra={"properties": {"type": {"const": "object"}}}),
        ]
        | None
    ) = Field(
        None,
        description='a JSON Schema of the arguments object (its type, if given, "object"); '
        "left out: no arguments",
    )
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = Field(None, description="a last chunk with the usage")


class JSONSchemaFormat(BaseModel):
    name: Annotated[str, Field(min_length=1)] | None = None
    schema_: dict[str, Any] = Field(
        alias="schema",
        description="the JSON Schema the reply "
        "follows; a keyword the library cannot enforce is a 400",
    )
    strict: StrictBool = False


class TextFormat(BaseModel):
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaResponseFormat, Field(discriminator="type")
]


def _present(name: str) -> dict:
    """JSON Schema: `name` is sent, and not null."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def _rules(*never: dict) -> list[dict]:
    """JSON Schema of what one field cannot say alone: stream_options only with stream: true;
    never response_format and structured_outputs both, nor any of `never`. What is never sent
    is one `not`: a generator that folds a document's rules into one schema (schemathesis'
    coverage phase) takes one `if` and one `not` side by side, not two of either."""
    both_formats = {"allOf": [_present("response_format"), _present("structured_outputs")]}
    return [
        {
            "if": _present("stream_options"),
            "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        },
        {"not": {"anyOf": [both_formats, *never]}},
    ]


class StructuredOutputs(BaseModel):
    """vLLM's extension: exactly one of these."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [_present(k) for k in STRUCTURED_KINDS],
            "additionalProperties": {"type": "null"},
        }
    )

    json_: dict[str, Any] | None = Field(None, alias="json", description="a JSON Schema")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="Lark, or GBNF as llama.cpp writes it"
    )


# -- the requests ----------------------------------------------------------------------------


class _Explained(BaseModel):
    """A request whose refusal names the field and what it allows: what pydantic finds wrong,
    worded once (errors.explain) from the request's own declaration (its JSON Schema, its
    fields' Allowed)."""

    @model_validator(mode="wrap")
    @classmethod
    def _explained(cls, data, handler):
        try:
            return handler(data)
        except ValidationError as e:
            raise explain(e.errors(), *_declared(cls)) from None


@functools.cache
def _declared(model: type[BaseModel]) -> tuple[dict, dict[str, Allowed]]:
    """A request model's JSON Schema and its fields' Allowed (errors.explain reads both)."""
    allowed = {
        name: m
        for name, info in model.model_fields.items()
        for m in info.metadata
        if isinstance(m, Allowed)
    }
    return model.model_json_schema(), allowed


# Fields other servers (llama-server, vLLM) take that would change the reply: (what this one
# takes instead, None: nothing; the values that ask for nothing, which pass). Refused, never
# ignored as unknown fields are.
NOTHING_ASKED = (None, False, "", [], {})
FOREIGN = {
    "grammar": ("'structured_outputs': {\"grammar\": ...} (GBNF)", NOTHING_ASKED),
    "json_schema": ('\'response_format\': {"type": "json_schema", ...}', NOTHING_ASKED),
    "guided_json": ("'structured_outputs': {\"json\": ...}", NOTHING_ASKED),
    "guided_regex": ("'structured_outputs': {\"regex\": ...}", NOTHING_ASKED),
    "guided_choice": ("'structured_outputs': {\"choice\": [...]}", NOTHING_ASKED),
    "guided_grammar": ("'structured_outputs': {\"grammar\": ...}", NOTHING_ASKED),
    "repeat_penalty": ("'repetition_penalty'", (*NOTHING_ASKED, 1)),  # llama-server's off: 1
    "n_predict": ("'max_tokens'", (*NOTHING_ASKED, -1)),  # llama-server's -1: no limit
    "ignore_eos": (None, NOTHING_ASKED),
    "min_tokens": (None, (*NOTHING_ASKED, 0)),
    "modalities": (None, (*NOTHING_ASKED, ["text"])),
    "audio": (None, NOTHING_ASKED),
}


def _asks_nothing(value, nothing) -> bool:
    """`value` is one of `nothing` (a number only as a number: 0 is not false)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in nothing)


def _foreign(data):
    if not isinstance(data, dict):
        return data
    for name, (instead, nothing) in FOREIGN.items():
        if _asks_nothing(data.get(name), nothing):
            continue
        raise APIError(
            f"'{name}' is not supported by this server: "
            + (
                f"use {instead}"
                if instead
                else "it would change the reply, and nothing here does it"
            ),
            name,
            code="unsupported_parameter",
        )
    return data


class _Request(_Explained):
    """What /v1/chat/completions and /v1/completions take alike. Unknown fields are ignored,
    except those of FOREIGN (other servers' fields that change the reply): refused."""

    model_config = ConfigDict(json_schema_extra={"allOf": _rules()})  # _together's

    @model_validator(mode="before")
    @classmethod
    def _refuse_foreign(cls, data):
        return _foreign(data)

    model: str | None = Field(
        None,
        description="a served model (GET /v1/models); left out or a placeholder "
        '("default", "gpt-4o", ...): the default',
    )
    n: limited(N, 1)
    stream: flag()
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    response_format: Annotated[
        ResponseFormat | None,
        Allowed(
            '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            '"json_schema": {"name": ..., "schema": {...}}}',
            within=False,
        ),
        Field(None, description="text, any JSON object, or JSON following a schema"),
    ]
    structured_outputs: Annotated[
        StructuredOutputs | None,
        _checked(_structured_outputs),
        Field(
            None,
            description="extension: exactly one of json, regex, choice, grammar; never with "
            "response_format",
        ),
    ]
    stop: Annotated[
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=4)]
        | None,
        AfterValidator(_listed),
        Allowed("a non-empty string or a list of up to 4 of them"),
        Field(None, description="up to 4 stop strings"),
    ]
    seed: limited(SEED)
    speculate: Literal["ngram", "off"] | None = Field(
        None,
        description="extension: prompt-lookup speculation for this request (default: the "
        "server's --speculate); the reply is the same either way, only its speed differs",
    )
    logit_bias: Annotated[
        Annotated[
            dict[
                Annotated[str, AfterValidator(_token_id)],
                Annotated[float, Field(ge=-100, le=100, strict=True, allow_inf_nan=False)],
            ],
            Field(
                max_length=MAX_LOGIT_BIAS_TOKENS,
                json_schema_extra={"propertyNames": {"pattern": TOKEN_ID}},
            ),
        ]
        | None,
        Allowed("an object mapping token ids to a bias in [-100, 100]", within=False),
        Field(None, description="token id -> bias added to its logit; -100 bans the token"),
    ]

    @model_validator(mode="after")
    def _together(self):
        """What one field cannot say alone."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise ConfigError(
                "give either 'response_format' or 'structured_outputs', not both",
                "structured_outputs",
            )
        if self.stream_options is not None and not self.stream:
            raise ConfigError(
                "'stream_options' is only allowed with 'stream': true", "stream_options"
            )
        return self

    def constraint(self) -> tuple[Constraint | None, str | None]:
        """The output format as a Constraint, and the field it came from (a compile error
        names it)."""
        fmt, extra = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type == "json_object":
            return Constraint("json_object"), "response_format"
        if fmt is not None and fmt.type == "json_schema":
            return (
                Constraint("json_schema", json.dumps(fmt.json_schema.schema_)),
                "response_format.json_schema.schema",
            )
        if extra is None:
            return None, None
        key, value = next(
            (k, v) for k, v in extra.model_dump(by_alias=True).items() if v is not None
        )
        text = value if isinstance(value, str) else json.dumps(value)
        return Constraint(STRUCTURED_KINDS[key], text), f"structured_outputs.{key}"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


SamplingRequest = create_model(
    "SamplingRequest", __base__=_Request, __doc__=_Request.__doc__, **stage_fields()
)


MaxTokens = SkipValidation[Annotated[int, Field(ge=1)] | None]  # checked in parse.py


# JSON Schema: tool_choice required, or a named function, without tools (one or more)
CHOICE_WITHOUT_TOOLS = {
    "required": ["tool_choice"],
    "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
    "not": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": _rules(CHOICE_WITHOUT_TOOLS)})
    messages: Messages
    max_tokens: MaxTokens = Field(
        None,
        description=(
            f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}): up to {MAX_NEW_TOKENS}, "
            "and the prompt and these within the model's context window (GET /v1/models: "
            "context_length)"
        ),
    )
    max_completion_tokens: MaxTokens = Field(
        None, description="OpenAI's newer name of max_tokens (wins over it)"
    )
    logprobs: flag()
    top_logprobs: limited(TOP_LOGPROBS, 0)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None,
        description="functions the model may call, shown to it through its chat template (a "
        "template that does not show them: 400 naming the model); calls come back as "
        "message.tool_calls, finish_reason tool_calls",
    )
    tool_choice: Annotated[
        Literal["auto", "none", "required"] | NamedToolChoice | None,
        Allowed(
            "auto, none, required, or "
            '{"type": "function", "function": {"name": ...}} naming one of \'tools\''
        ),
        Field(
            None,
            description="auto (default): the model chooses; none: the tools are shown, no call is "
            "made; required or a named function: a call that parses, arguments valid against the "
            "function's parameters (enforced by the grammar); required or named: only with "
            "tools",
        ),
    ]
    parallel_tool_calls: flag(None, "more than one call in a reply (default true)")
    functions: unsupported("functions", "refused: the legacy function calling; use tools")
    function_call: unsupported("function_call", "refused: the legacy function calling; use tools")
    chat_template_kwargs: Annotated[
        Annotated[
            dict[str, Any],
            Field(json_schema_extra={"propertyNames": {"not": {"enum": list(TEMPLATE_ARGUMENTS)}}}),
            AfterValidator(_template_kwargs),
        ]
        | None,
        Allowed("an object of the chat template's switches", within=False),
        Field(
            None,
            description='passed to the chat template, e.g. {"enable_thinking": false} for '
            "Qwen3; never what the server sets itself (messages, tools, chat_template, "
            "add_generation_prompt, tokenize, ...)",
        ),
    ]
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None,
        description="none: thinking off (enable_thinking false, or a reasoning budget of 0); "
        "the others leave it on",
    )
    reasoning_budget: limited(REASONING_BUDGET)

    @field_validator("tools")
    @classmethod
    def _parameters_of_an_object(cls, tools):
        for i, tool in enumerate(tools or []):
            kind = (tool.function.parameters or {}).get("type", "object")
            if kind != "object":
                field = f"tools[{i}].function.parameters"
                raise ConfigError(
                    f"'{field}' must be the JSON Schema of an object (the arguments), "
                    f"got type {kind!r}",
                    field,
                )
        return tools

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not self.tools:
            name = "required" if choice == "required" else "a named function"
            raise ConfigError(f"'tool_choice': {name} needs 'tools'", "tool_choice")
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM: not silently none
            raise ConfigError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return self

    def options(self) -> ChatOptions:
        """The chat options this request asks for (tools, template switches, thinking)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
        kwargs = dict(self.chat_template_kwargs or {})
        thinking = False if self.reasoning_effort == "none" else None
        if isinstance(kwargs.get("enable_thinking"), bool):
            thinking = kwargs["enable_thinking"]
        return ChatOptions(
            tools=[t.model_dump(exclude_none=True) for t in self.tools or []],
            tool_choice=choice or "auto",
            parallel_tool_calls=self.parallel_tool_calls is not False,
            template_kwargs=kwargs,
            thinking=thinking,
            reasoning_budget=self.reasoning_budget,
        )


def _best_of_not_n() -> list[dict]:
    """JSON Schema of "best_of given and not n" (n left out or null: 1), one for each value
    of best_of: a schema cannot compare two fields, but it can list their values."""
    return [
        {
            "required": ["best_of"],
            "properties": {"best_of": {"const": k}},
            "not": (
                {"properties": {"n": {"enum": [1, None]}}}
                if k == 1
                else {"required": ["n"], "properties": {"n": {"const": k}}}
            ),
        }
        for k in range(1, MAX_CHOICES + 1)
    ]


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": _rules(*_best_of_not_n())})
    prompt: Annotated[
        SkipValidation[Prompt],
        BeforeValidator(_prompt),
        Field(
            description=(
                f"the text to continue: a string, token ids, or a list of up to "
                f"{MAX_PROMPTS} of either (each gets n choices)"
            )
        ),
    ]
    max_tokens: SkipValidation[Annotated[int, Field(ge=0)] | None] = Field(
        None,
        description=(
            f"tokens to generate at most (default {DEFAULT_COMPLETION_TOKENS}): up to "
            f"{MAX_NEW_TOKENS}, and the prompt and these within the model's context window; 0 "
            "generates nothing and scores the prompt (echo, logprobs)"
        ),
    )
    echo: flag()
    logprobs: limited(COMPLETION_LOGPROBS)
    best_of: limited(BEST_OF)
    suffix: Annotated[
        Literal[""] | None, _checked(_suffix), Field(None, description="refused: no insertion")
    ]

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(
                f"'best_of' must equal n ({self.n or 1}) or be left out: this server "
                "returns every choice it generates",
                "best_of",
                code="unsupported_parameter",
            )
        return self

    def prompts(self) -> list:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and _is_id(p[0])) else list(p)


class TokenizeRequest(_Explained):
    """vLLM's /tokenize: `prompt` (tokenized as completions does) or `messages` (with the chat
    template, the assistant's turn opened)."""

    # one of prompt and messages, neither null (the checks run only for a field sent)
    model_config = ConfigDict(
        json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
    )
    model: str | None = None
    prompt: Annotated[SkipValidation[str], BeforeValidator(_tokenize_prompt), Field(None)]
    messages: Annotated[
        SkipValidation[Annotated[list[ChatMessage], Field(min_length=1)]],
        BeforeValidator(_messages),
        Field(None),
    ]
