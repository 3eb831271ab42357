"""OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions and /v1/completions, for every
model the app serves (miniserve.models.registry.Models).

Models: a request's `model` names one of the served models (GET /v1/models lists them, with
whether each is loaded); none, or a placeholder clients send without asking ("default",
"gpt-4o", ...), means the default. An unknown name is a 404 listing the served ones; a model
that cannot be loaded (a missing file, a remote server that does not answer) a 502 naming it
and why, and the other models keep answering. A model loads on the first request that names
it, on a worker thread (the event loop keeps serving the others), and is not unloaded while
one of its replies is being written. The reply's `model` is the served name.

Requests are checked field by field; a bad one gets a 400 with an OpenAI-style error
object naming the field. A client that goes away (mid-stream or while waiting for a whole
reply) cancels its generations within one decoding step.

`n` (1..MAX_CHOICES) asks for several choices: each is its own engine request, started
together so the engine advances them together, and each takes one place in the queue (a
request whose choices do not all fit gets 429 and starts none). With a `seed`, choice i
samples with seed + i (modulo 2**63), so choice i equals a request for one choice with that
seed; without one, each choice draws its own random numbers. Greedy choices are identical.

Structured output: `response_format` ({"type": "text"}, {"type": "json_object"}, or
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}), or the extension
`structured_outputs` (vLLM's name) with exactly one of `json` (a JSON Schema), `regex`,
`choice` (a list of strings) or `grammar` (Lark, or GBNF as llama.cpp writes it); never both.
A schema, pattern or grammar the library (llguidance) cannot compile is a 400 naming the field
with the library's reason; a JSON Schema keyword it cannot enforce (`uniqueItems`, `not`,
`if`/`then`/`else`, `contains`, ...) is a 400 naming the keyword, never silently relaxed.
`logit_bias` maps token ids (< the vocabulary size) to a bias in [-100, 100]; -100 bans the
token. Finish reasons: "stop" (an end token, a stop string, or the output format complete),
"length" (max_tokens), and ours, "no_token_allowed": the output format and the logit bias
left no token that could come next.

Chat to a model without a chat template (a base model) is a 400 (code
"model_has_no_chat_template") pointing to /v1/completions.

Completions (OpenAI's legacy /v1/completions): the text continues the prompt, no template, so
base and chat models alike. `prompt` is a string, a list of token ids, or a list of up to
MAX_PROMPTS of either; with several, choice p * n + j is prompt p's choice j (with a `seed`,
sampled with seed + j), and usage counts each prompt once. `max_tokens` is 16 by default, as
OpenAI's; `max_tokens: 0` generates nothing and answers the prompt (with `echo`) and, with
`logprobs`, its tokens' log-probabilities: how evaluation harnesses score a text (not for a
remote model). `logprobs` (0..5): {tokens, token_logprobs, top_logprobs, text_offset}, each
top_logprobs entry the `logprobs` most likely tokens and the chosen one (so up to logprobs + 1,
as OpenAI's), text_offset where each token starts when the tokens' texts are laid end to end
from the start of the returned text. `echo` puts the prompt in front of the text; with
logprobs, the prompt's tokens come first, the first one's logprob null (nothing predicts it).
The sampling fields and extensions are the chat route's. Refused with a 400: `suffix`
(insertion), `best_of` other than n, and for a remote model `echo` with `logprobs` or of token
ids (the prompt's log-probabilities and tokens are the remote server's, not known here).

Refused with a 400 rather than ignored: `stream_options` without `stream: true`, and tool or
function calling (`tools`, `tool_choice`, `functions`, `function_call`,
`parallel_tool_calls`; code "unsupported_parameter").
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miniserve.engine.chat import ChatError, NoChatTemplate, check_messages
from miniserve.core.config import (MAX_CHOICES, MAX_NEW_TOKENS, MAX_PROMPTS, SEED_MAX, ConfigError,
                              Constraint, Field, SamplingParams, check_number, check_seed)
from miniserve.engine.engine import EngineBusy, RequestTooLarge
from miniserve.engine.grammar import GrammarError
from miniserve.models.registry import Models, UnknownModel

DEFAULT_MAX_TOKENS = 1024        # chat
DEFAULT_COMPLETION_TOKENS = 16   # /v1/completions, as OpenAI's
MAX_COMPLETION_LOGPROBS = 5      # /v1/completions `logprobs`, as OpenAI's
# OpenAI's defaults (sampling with temperature 1, no filters) where a request is silent
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                "repetition_penalty": 1.0}


# Fields that would change what a reply means if they were ignored: refused, never dropped.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")
# The extension for output formats OpenAI's response_format has no type for (vLLM's name):
# {"structured_outputs": {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json": ...}}
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code}})


def _number(body: dict, name: str, default, low, high, integer=False):
    """A request field that is not a sampling setting (those are checked by SamplingParams),
    checked as every number is (config.check_number)."""
    value = body.get(name, default)
    if value is None:
        return default
    try:
        return check_number(name, value, Field(int if integer else float, low, high, default,
                                                name, ""))
    except ConfigError as e:
        raise APIError(400, str(e), name) from None


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be true or false", name)
    return value


def _constraint(body: dict) -> tuple[Constraint | None, str | None]:
    """`response_format` or `structured_outputs` as a Constraint, and the field it came from.
    The format is checked here (its shape); whether the library can compile and enforce it,
    by the engine's grammar compiler."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and extra is not None:
        raise APIError(400, "give either 'response_format' or 'structured_outputs', not both",
                       "structured_outputs")
    if fmt is not None:
        field = "response_format"
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                                  "json_schema"):
            raise APIError(400, "'response_format' must be {\"type\": \"text\"}, "
                                "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                                "\"json_schema\": {\"name\": ..., \"schema\": {...}}}", field)
        if fmt["type"] == "text":
            return None, None
        if fmt["type"] == "json_object":
            return Constraint("json_object"), field
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "'response_format.json_schema' must be an object with 'name' "
                                "and 'schema'", "response_format.json_schema")
        name = spec.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise APIError(400, "'response_format.json_schema.name' must be a non-empty string",
                           "response_format.json_schema.name")
        if not isinstance(spec.get("strict", False), bool):
            raise APIError(400, "'response_format.json_schema.strict' must be true or false",
                           "response_format.json_schema.strict")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "'response_format.json_schema.schema' is required: the JSON "
                                "Schema the reply must follow (an object)",
                           "response_format.json_schema.schema")
        return Constraint("json_schema", json.dumps(schema)), "response_format.json_schema.schema"
    if extra is None:
        return None, None
    if not isinstance(extra, dict) or len([k for k in extra if extra[k] is not None]) != 1 or \
            next(k for k in extra if extra[k] is not None) not in STRUCTURED_KINDS:
        raise APIError(400, "'structured_outputs' must hold exactly one of "
                            f"{', '.join(STRUCTURED_KINDS)}", "structured_outputs")
    key = next(k for k in extra if extra[k] is not None)
    value, field = extra[key], f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise APIError(400, f"'{field}' is not JSON: {e.msg}", field) from None
        if not isinstance(value, dict):
            raise APIError(400, f"'{field}' must be a JSON Schema (an object)", field)
        return Constraint("json_schema", json.dumps(value)), field
    if key == "choice":
        if not isinstance(value, list) or not value or \
                any(not isinstance(c, str) or not c for c in value):
            raise APIError(400, f"'{field}' must be a list of non-empty strings", field)
        return Constraint("choice", json.dumps(value)), field
    if not isinstance(value, str) or not value.strip():
        raise APIError(400, f"'{field}' must be a non-empty string", field)
    return Constraint(STRUCTURED_KINDS[key], value), field


@dataclass
class Settings:
    """What both routes take alike, checked."""
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int  # as asked: 0 (completions only) scores the prompt, generating nothing


def parse_settings(body: dict, engine, default_max_tokens: int,
                   max_tokens_fields: tuple[str, ...] = ("max_tokens",),
                   least_tokens: int = 1) -> Settings:
    """The fields the chat and completion routes share: n, stream, stream_options, stop, the
    token limit (the first of `max_tokens_fields` given, at least `least_tokens`), seed, the
    penalties, the sampling settings, logit_bias and the output format; then what only the
    model can check (ids in its vocabulary, the format compiled once)."""
    n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true",
                       "stream_options")
    options = options or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    constraint, constraint_field = _constraint(body)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or \
            any(not isinstance(s, str) or not s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them",
                       "stop")
    field = next((f for f in max_tokens_fields if body.get(f) is not None),
                 max_tokens_fields[-1])
    # a remote model whose server does not say its context: the API's own ceiling
    max_tokens = _number(body, field, default_max_tokens, least_tokens,
                         engine.context_length or MAX_NEW_TOKENS, integer=True)
    try:
        seed = check_seed(body.get("seed"))
    except ConfigError as e:
        raise APIError(400, str(e), "seed") from None
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, 0.0, -2.0, 2.0)
    try:
        # ranges and types are checked by SamplingParams, from the one table in config
        sampling = {name: body[name] if body.get(name) is not None else default
                    for name, default in API_DEFAULTS.items()}
        bias = body.get("logit_bias")
        if bias is not None and not isinstance(bias, dict):
            raise ConfigError("'logit_bias' must be an object mapping token ids to a bias "
                              "in [-100, 100]", "logit_bias")
        params = SamplingParams(**sampling,
                                max_new_tokens=min(max(max_tokens, 1), MAX_NEW_TOKENS),
                                seed=seed, stop=tuple(stop), logit_bias=bias,
                                constraint=constraint)
        engine.check(params)  # ids in the vocabulary; the format compiled once
    except ConfigError as e:
        raise APIError(400, str(e), e.field) from None
    except GrammarError as e:
        raise APIError(400, f"'{constraint_field}': {e}", constraint_field) from None
    return Settings(params, n, stream, bool(options.get("include_usage")), max_tokens)


def _prompt_list(value) -> list:
    """`prompt` as a list of prompts, each a string or a list of token ids: OpenAI's four
    shapes (a string, a list of ids, a list of strings, a list of id lists)."""
    shapes = ("'prompt' must be a string, a list of token ids, or a list of strings or of "
              "token id lists")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise APIError(400, shapes, "prompt")
    if not value:
        raise APIError(400, "'prompt' is empty; give the text to continue, or token ids",
                       "prompt")
    if all(_is_id(t) for t in value):
        return [value]
    if not (all(isinstance(p, str) for p in value) or
            all(isinstance(p, list) and all(_is_id(t) for t in p) for p in value)):
        raise APIError(400, shapes, "prompt")
    if len(value) > MAX_PROMPTS:
        raise APIError(400, f"'prompt' holds {len(value)} prompts; at most {MAX_PROMPTS} in "
                            "one request", "prompt")
    return list(value)


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class LogprobRecorder:
    """Observer for the decode loop: log-probabilities of each chosen token (before filters).
    A remote engine hands it what its server sent instead (add_remote_step)."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top, self.entries = tokenizer, top, []

    def observe(self, logits, previous_ids, token_id, allowed=None):
        logp = torch.log_softmax(logits[0].float(), -1)
        entry = self._item(self.tokenizer.decode([token_id]), float(logp[token_id]))
        if self.top:
            values, indices = torch.topk(logp, self.top)
            entry["top_logprobs"] = [self._item(self.tokenizer.decode([i]), v)
                                     for v, i in zip(values.tolist(), indices.tolist())]
        else:
            entry["top_logprobs"] = []
        self.entries.append(entry)

    def add_remote_step(self, text: str, logprob: float, top=()) -> None:
        entry = self._item(text, logprob)
        entry["top_logprobs"] = [self._item(t, lp) for t, lp in list(top)[:self.top]]
        self.entries.append(entry)

    @staticmethod
    def _item(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


@dataclass
class APIRequest:
    """A checked request, ready to start: `prompts` are token ids for a local engine, what
    the remote engine takes (messages, a prompt) for a remote one."""
    model: str          # the served name
    engine: object
    kind: str           # "chat" or "text"
    prompts: list
    settings: Settings
    logprobs: bool = False
    top_logprobs: int = 0
    echo: list | None = None  # text: per prompt, (its text, its tokens' logprob entries)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.settings.n


class _Lease:
    """`models.use(name)` held across awaits: the model is loaded (on a worker thread when it
    is not yet: loading takes seconds) and is not unloaded until release()."""

    def __init__(self, models: Models, name: str):
        self.models, self.name = models, name
        self._use = models.use(name)
        self.engine = None

    async def acquire(self):
        if self.models.is_loaded(self.name):  # `use` only looks it up: no thread needed
            self.engine = self._use.__enter__()
            return self.engine
        loading = asyncio.ensure_future(asyncio.to_thread(self._use.__enter__))
        try:
            self.engine = await asyncio.shield(loading)
        except asyncio.CancelledError:  # the request was dropped: release once it is loaded
            loading.add_done_callback(self._release_late)
            raise
        return self.engine

    def _release_late(self, loading: asyncio.Future) -> None:
        if not loading.cancelled() and loading.exception() is None:
            self._use.__exit__(None, None, None)

    def release(self) -> None:
        if self.engine is not None:
            self.engine = None
            self._use.__exit__(None, None, None)


def _model_entry(models: Models, described: dict) -> dict:
    engine = models.loaded_engine(described["name"])
    return {"id": described["name"], "object": "model", "created": 0, "owned_by": "miniserve",
            "default": described["default"], "loaded": described["loaded"],
            "remote": described["remote"], "context_length": described["context_length"],
            "chat": engine.has_chat_template if engine is not None else None}


class OpenAIAPI:
    def __init__(self, models, api_key: str | None = None):
        self.models = Models.of(models)
        self.api_key = api_key

    # -- checks ---------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           None, "authentication_error", "invalid_api_key")

    def resolve(self, model) -> str:
        if model is not None and not isinstance(model, str):
            raise APIError(400, "'model' must be a string", "model")
        try:
            return self.models.resolve(model)
        except UnknownModel as e:
            raise APIError(404, str(e), "model", code="model_not_found") from None

    def tokenize(self, body: dict, engine) -> dict:
        """vLLM's /tokenize: `prompt` (text, as completions tokenizes it) or `messages` (with
        the chat template, the assistant's turn opened)."""
        if engine.remote:
            raise APIError(400, f"'model': {engine.name} is a remote model; ask its server",
                           "model")
        try:
            if "messages" in body:
                if not engine.has_chat_template:
                    raise APIError(400, str(NoChatTemplate(engine.name)), "messages",
                                   code="model_has_no_chat_template")
                from miniserve.engine.chat import render
                ids = render(engine.tokenizer, check_messages(body["messages"]))
            elif isinstance(body.get("prompt"), str):
                ids = engine.tokenizer(body["prompt"])["input_ids"]
            else:
                raise APIError(400, "give 'prompt' (a string) or 'messages'", "prompt")
        except ChatError as e:
            raise APIError(400, str(e), e.field) from None
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}

    async def open(self, body: dict) -> _Lease:
        """The lease on the model the request names, loaded."""
        lease = _Lease(self.models, self.resolve(body.get("model")))
        try:
            await lease.acquire()
        except Exception as e:  # noqa: BLE001 -- whatever loading raised, said with the name
            raise APIError(502, f"model '{lease.name}' could not be loaded: {e}", "model",
                           "server_error", "model_unavailable") from None
        return lease

    async def parse_chat(self, body: dict, model: str, engine) -> APIRequest:
        for name in UNSUPPORTED:
            if body.get(name) not in (None, [], {}, "none"):
                raise APIError(400, f"'{name}' is not supported by this server (no tool or "
                                    f"function calling); for JSON output use "
                                    f"'response_format'", name, code="unsupported_parameter")
        if not engine.has_chat_template:
            raise APIError(400, str(NoChatTemplate(model)), "messages",
                           code="model_has_no_chat_template")
        settings = parse_settings(body, engine, DEFAULT_MAX_TOKENS,
                                  ("max_completion_tokens", "max_tokens"))
        logprobs = _flag(body, "logprobs")
        top_logprobs = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        params = settings.params
        try:
            if engine.remote:  # counted by its server (a request): off the event loop
                trimmed = await asyncio.to_thread(engine.trim, body["messages"], params)
                prompt = trimmed.messages
            else:
                trimmed = engine.trim(body["messages"], params)
                prompt = trimmed.prompt_ids
        except ChatError as e:
            raise APIError(400, str(e), e.field) from None
        except (RuntimeError, OSError) as e:  # a remote server that could not count them
            raise APIError(502, f"model '{model}' failed: {e}", None, "server_error",
                           "model_unavailable") from None
        if trimmed.dropped:  # sent on purpose: never cut it
            raise APIError(400, f"the conversation is longer than the context window of "
                                f"{engine.context_length} tokens allows with "
                                f"max_tokens={params.max_new_tokens}; shorten it",
                           "messages", code="context_length_exceeded")
        return APIRequest(model, engine, "chat", [prompt], settings, logprobs,
                          top_logprobs if logprobs else 0)

    async def parse_text(self, body: dict, model: str, engine) -> APIRequest:
        if body.get("suffix") not in (None, ""):
            raise APIError(400, "'suffix' is not supported by this server (no insertion): "
                                "send the text before the gap as 'prompt'", "suffix",
                           code="unsupported_parameter")
        settings = parse_settings(body, engine, DEFAULT_COMPLETION_TOKENS, least_tokens=0)
        best_of = _number(body, "best_of", None, 1, MAX_CHOICES, integer=True)
        if best_of is not None and best_of != settings.n:
            raise APIError(400, f"'best_of' must equal n ({settings.n}) or be left out: this "
                                "server returns every choice it generates", "best_of",
                           code="unsupported_parameter")
        echo = _flag(body, "echo")
        top = _number(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS, integer=True)
        prompts = _prompt_list(body.get("prompt"))
        fields = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        for prompt, field in zip(prompts, fields):
            if not prompt:
                raise APIError(400, f"'{field}' is empty; give the text to continue, or token "
                                    "ids", field)
        req = APIRequest(model, engine, "text", prompts, settings, top is not None, top or 0)
        if engine.remote:
            if settings.max_tokens == 0:
                raise APIError(400, f"'max_tokens': 0 (the prompt scored, nothing generated) is "
                                    f"not available for the remote model '{model}': its "
                                    "prompt's log-probabilities are its server's", "max_tokens",
                               code="unsupported_parameter")
            if echo and (top is not None or any(isinstance(p, list) for p in prompts)):
                raise APIError(400, f"'echo' with {'logprobs' if top is not None else 'token ids'}"
                                    f" is not available for the remote model '{model}': its "
                                    "prompt tokens and their log-probabilities are its "
                                    "server's", "echo", code="unsupported_parameter")
            req.echo = [(p, []) for p in prompts] if echo else None
            return req
        req.prompts = [self._prompt_ids(engine, p, settings, f) for p, f in zip(prompts, fields)]
        if echo:
            req.echo = [await self._echo(engine, p, ids, top)
                        for p, ids in zip(prompts, req.prompts)]
        return req

    @staticmethod
    def _prompt_ids(engine, prompt, settings: Settings, field: str) -> list[int]:
        vocab = engine.model.config.vocab_size
        if isinstance(prompt, list):
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"'{field}': token id {bad} is out of range: the "
                                    f"vocabulary has ids 0..{vocab - 1}", field)
        try:
            return engine.prompt_ids(prompt, settings.params, field=field,
                                     new_tokens=min(settings.max_tokens, MAX_NEW_TOKENS))
        except ChatError as e:  # too long for the context with max_tokens
            raise APIError(400, str(e), e.field) from None

    @staticmethod
    async def _echo(engine, prompt, ids: list[int], top: int | None) -> tuple[str, list]:
        """The echoed prompt: its text, and with logprobs its tokens' entries (the first
        without a logprob: nothing comes before it to predict it)."""
        text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)
        if top is None:
            return text, []
        token = [engine.tokenizer.decode([i]) for i in ids]
        # the model runs on its engine thread; this waits for it off the event loop
        scored = await asyncio.to_thread(engine.prompt_logprobs, ids, top)
        entries = [(token[0], None, None)]
        for pos, (logprob, alts) in enumerate(scored, 1):
            best = {engine.tokenizer.decode([i]): lp for i, lp in alts}
            best.setdefault(token[pos], logprob)
            entries.append((token[pos], logprob, best))
        return text, entries

    # -- responses --------------------------------------------------------------------------
    async def start(self, req: APIRequest) -> "_Choices":
        """Admit the request's choices as engine requests, all or none (429 when they do not
        all fit). The engine hands their chunks to the event loop: no thread waits on them
        (a remote engine's reply is read on a thread of its own: it waits on the network)."""
        engine, n, total = req.engine, req.settings.n, req.choices
        free = engine.max_queue - engine.queue_depth
        if total > free:
            need = f"n={n}" if len(req.prompts) == 1 else f"{len(req.prompts)} prompts x n={n}"
            raise _busy("the server is busy; try again in a moment" if total == 1 else
                        f"the server is busy: {need} needs {total} places in the queue and "
                        f"{max(free, 0)} are free; try again in a moment")
        choices = _Choices(asyncio.get_running_loop())
        try:
            for i in range(total):
                if engine.remote:  # sent now: a refusal or a failure is this reply's status
                    await self._start_remote_choice(req, i, choices)
                else:
                    self._start_choice(req, i, choices)
        except BaseException as e:  # start none: cancel those already queued
            choices.stop()
            if engine.remote and isinstance(e, Exception):
                raise _failed(req, e) from None
            if isinstance(e, EngineBusy):  # lost a race for the last places
                raise _busy(str(e)) from None
            if isinstance(e, RequestTooLarge):
                raise APIError(400, str(e), "max_tokens",
                               code="context_length_exceeded") from None
            if isinstance(e, (ConfigError, GrammarError)):  # the engine's own admission checks
                raise APIError(400, str(e), e.field) from None
            raise
        return choices

    @staticmethod
    def _choice(req: APIRequest, index: int):
        """(prompt, params, logprob recorder) of choice `index`: choice j of a prompt."""
        prompt, j = divmod(index, req.settings.n)
        params = req.settings.params
        if params.seed is not None and j:
            params = params.replace(seed=(params.seed + j) % (SEED_MAX + 1))
        recorder = LogprobRecorder(req.engine.tokenizer, req.top_logprobs) \
            if req.logprobs else None
        return req.prompts[prompt], params, recorder

    def _start_choice(self, req: APIRequest, index: int, choices: "_Choices") -> None:
        prompt, params, recorder = self._choice(req, index)
        req.engine.submit(prompt, params, choices.sink(index), cancel=choices.cancel,
                          observer=recorder.observe if recorder else None)
        choices.started(recorder)  # after submit: a choice that did not start is not waited for

    async def _start_remote_choice(self, req: APIRequest, index: int,
                                   choices: "_Choices") -> None:
        """Send one choice to a remote engine (off the event loop: it waits on the network),
        then read its reply on a thread of its own, which hands each item to the sink as the
        local engine thread does. Its own cancel event: a finished stream may set the event it
        was given, which must not end the other choices; the request's Stop closes it."""
        prompt, params, recorder = self._choice(req, index)
        reply = req.engine.chat if req.kind == "chat" else req.engine.complete_text
        own = threading.Event()
        stream = await asyncio.to_thread(reply, prompt, params, cancel=own,
                                         observer=recorder.observe if recorder else None)
        choices.on_stop(lambda: (own.set(), stream.close()))
        _read_remote(stream, choices.sink(index))
        choices.started(recorder)

    @staticmethod
    def _usage(req: APIRequest, last: list) -> dict:
        # each prompt counted once, whatever its number of choices
        prompt = sum(last[p * req.settings.n].stats.prompt_tokens
                     for p in range(len(req.prompts)))
        completion = sum(c.stats.new_tokens for c in last)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    @staticmethod
    def _finish(stats) -> str:
        """OpenAI's finish reasons, and one of ours: "no_token_allowed" when the output
        format (its grammar) and logit_bias left no token that could come next."""
        if stats.finish_reason in ("length", "no_token_allowed"):
            return stats.finish_reason
        return "stop"

    async def complete(self, req: APIRequest, choices: "_Choices") -> dict:
        parts: list[list[str]] = [[] for _ in range(req.choices)]
        last: list = [None] * req.choices
        try:
            while choices.running:
                for i, chunk, error in await choices.next_batch():
                    if error is not None:
                        raise _failed(req, error) from None
                    if chunk is not None:
                        parts[i].append(chunk.text)
                        if chunk.done:
                            last[i] = chunk
                    elif last[i] is None:
                        raise RuntimeError(f"choice {i} ended without its final chunk")
        finally:
            choices.stop()
        shape = _shape(req, choices)
        return {"id": f"{shape.prefix}-{uuid.uuid4().hex[:24]}", "object": shape.object,
                "created": int(time.time()), "model": req.model,
                "choices": [shape.whole(i, "".join(parts[i]), self._finish(last[i].stats))
                            for i in range(req.choices)],
                "usage": self._usage(req, last), "system_fingerprint": "miniserve"}

    def prompt_only(self, req: APIRequest):
        """`max_tokens: 0` on /v1/completions: nothing generated, the prompt (with echo) and
        its log-probabilities (with logprobs) -- how evaluation harnesses score a text's
        likelihood. Every choice alike, finish_reason "length"."""
        shape = _TextShape(req, None)
        choices = [shape.prompt_only(i) for i in range(req.choices)]
        prompt_tokens = sum(len(p) for p in req.prompts)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                 "total_tokens": prompt_tokens}
        if not req.settings.stream:
            return {"id": f"{shape.prefix}-{uuid.uuid4().hex[:24]}", "object": shape.object,
                    "created": int(time.time()), "model": req.model, "choices": choices,
                    "usage": usage, "system_fingerprint": "miniserve"}
        event = _events(req, shape)
        body = "".join(event(c) for c in choices) + \
            (event(None, usage) if req.settings.include_usage else "") + "data: [DONE]\n\n"
        return StreamingResponse(iter([body]), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def stream(self, req: APIRequest, choices: "_Choices", lease: _Lease):
        shape = _shape(req, choices)
        event = _events(req, shape)

        last: list = [None] * req.choices
        try:
            opening = "".join(event(c) for i in range(req.choices)
                              if (c := shape.opening(i)) is not None)
            if opening:
                yield opening
            while choices.running:
                # every chunk that arrived since the last write goes out in one write
                out = []
                for i, chunk, error in await choices.next_batch():
                    if error is not None or (chunk is None and last[i] is None):
                        out.append(_error_event(error))
                        yield "".join(out)
                        return
                    if chunk is None:
                        continue
                    if chunk.text:
                        out.append(event(shape.piece(i, chunk.text)))
                    if chunk.done:
                        last[i] = chunk
                        out.append(event(shape.piece(i, "", self._finish(chunk.stats))))
                if out:
                    yield "".join(out)
            tail = [event(None, usage=self._usage(req, last))] \
                if req.settings.include_usage else []
            yield "".join(tail) + "data: [DONE]\n\n"
        finally:
            _end(choices, lease)  # the client went away (this generator was cancelled) or done


def _events(req: APIRequest, shape):
    """A function writing one server-sent event of this reply: a choice's chunk, or (choice
    None) the usage chunk."""
    ident, created = f"{shape.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())

    def event(choice: dict | None, usage=None) -> str:
        chunk = {"id": ident, "object": shape.chunk_object, "created": created,
                 "model": req.model, "system_fingerprint": "miniserve",
                 "choices": [choice] if choice is not None else []}
        if usage is not None or req.settings.include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    return event


def _end(choices: "_Choices", lease: _Lease) -> None:
    choices.stop()
    lease.release()


def _read_remote(stream, sink) -> None:
    """Hand a remote reply's items to the sink from a thread of its own (Chunks, an exception
    if it failed, then None). Closing the stream (Stop) ends it."""

    def run() -> None:
        try:
            for chunk in stream:
                sink(chunk)
        except BaseException as e:  # noqa: BLE001 -- reported to the client
            sink(e)
        finally:
            sink(None)

    threading.Thread(target=run, name="miniserve-remote-reply", daemon=True).start()


def _failed(req: APIRequest, error: BaseException) -> APIError:
    """An error from a choice before the reply was sent, as the status it means."""
    if isinstance(error, EngineBusy):
        return _busy(str(error))
    if isinstance(error, (ChatError, ConfigError)):  # a remote server refused the request
        return APIError(400, str(error), error.field)
    if req.engine.remote:
        return APIError(502, f"model '{req.model}' failed: {error}", None, "server_error",
                        "model_unavailable")
    return APIError(500, f"generation failed: {error}", None, "server_error")


class _ChatShape:
    """How a chat reply is written: messages, and streamed deltas."""
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, req: APIRequest, choices: "_Choices"):
        self.choices = choices
        self.sent = [0] * req.choices  # logprob entries already streamed, per choice

    def _recorder(self, i: int):
        return self.choices.choices[i].recorder

    def whole(self, i: int, text: str, finish: str) -> dict:
        recorder = self._recorder(i)
        return {"index": i, "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": {"content": recorder.entries} if recorder else None}

    def opening(self, i: int) -> dict:
        return {"index": i, "delta": {"role": "assistant", "content": ""},
                "finish_reason": None, "logprobs": None}

    def piece(self, i: int, text: str, finish: str | None = None) -> dict:
        choice = {"index": i, "delta": {"content": text} if text else {},
                  "finish_reason": finish, "logprobs": None}
        recorder = self._recorder(i)
        if recorder and len(recorder.entries) > self.sent[i]:
            choice["logprobs"] = {"content": recorder.entries[self.sent[i]:]}
            self.sent[i] = len(recorder.entries)
        return choice


class _TextShape:
    """How a completion is written: text (the prompt in front with echo) and OpenAI's legacy
    logprobs, streamed as pieces of text."""
    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, req: APIRequest, choices: "_Choices"):
        self.req, self.choices = req, choices
        self.sent = [0] * req.choices     # recorder entries already written, per choice
        self.offset = [0] * req.choices   # text_offset of the next token, per choice

    def _echo(self, i: int) -> tuple[str, list]:
        return self.req.echo[i // self.req.settings.n] if self.req.echo else ("", [])

    def _logprobs(self, i: int, entries: list, generated: bool = True) -> dict | None:
        """The legacy logprobs of `entries` (the echoed prompt's), then of choice i's
        generated tokens not written yet."""
        if not self.req.logprobs:
            return None
        if generated:
            recorder = self.choices.choices[i].recorder
            for e in recorder.entries[self.sent[i]:]:
                best = {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                best.setdefault(e["token"], e["logprob"])  # the chosen token is always there
                entries = entries + [(e["token"], e["logprob"], best)]
            self.sent[i] = len(recorder.entries)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, best in entries:
            out["tokens"].append(token)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(best)
            out["text_offset"].append(self.offset[i])
            self.offset[i] += len(token)
        return out

    def whole(self, i: int, text: str, finish: str) -> dict:
        echo, entries = self._echo(i)
        return {"index": i, "text": echo + text, "logprobs": self._logprobs(i, entries),
                "finish_reason": finish}

    def prompt_only(self, i: int) -> dict:
        """Choice i of a request that generates nothing (max_tokens 0)."""
        echo, entries = self._echo(i)
        return {"index": i, "text": echo, "logprobs": self._logprobs(i, entries, False),
                "finish_reason": "length"}

    def opening(self, i: int) -> dict | None:
        if not self.req.echo:
            return None
        echo, entries = self._echo(i)
        return {"index": i, "text": echo, "logprobs": self._logprobs(i, entries, False),
                "finish_reason": None}

    def piece(self, i: int, text: str, finish: str | None = None) -> dict:
        logprobs = self._logprobs(i, [])
        return {"index": i, "text": text,
                "logprobs": logprobs if logprobs and logprobs["tokens"] else None,
                "finish_reason": finish}


def _shape(req: APIRequest, choices: "_Choices"):
    return (_ChatShape if req.kind == "chat" else _TextShape)(req, choices)


def _busy(message: str) -> APIError:
    return APIError(429, message, None, "rate_limit_error", "server_busy")


def _error_event(error: BaseException | None) -> str:
    """An error after the stream has started, reported in-band."""
    if isinstance(error, EngineBusy):
        err = {"message": str(error), "type": "rate_limit_error", "param": None,
               "code": "server_busy"}
    else:
        reason = error or "the generation ended without its final chunk"
        err = {"message": f"generation failed: {reason}", "type": "server_error",
               "param": None, "code": None}
    return f"data: {json.dumps({'error': err})}\n\n"


@dataclass
class _Choice:
    recorder: LogprobRecorder | None


class _Choices:
    """The engine requests of one request's choices. The engine calls each choice's sink on
    its own thread; the sink appends (choice, chunk, error) to one deque and asks the loop's
    _Waker to wake this request only when no wake-up for it is already pending, so one
    wake-up delivers every chunk that arrived meanwhile, and the response writes them at
    once. (choice, None, None) marks the end of a choice. One event cancels them all."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.choices: list[_Choice] = []
        self.cancel = threading.Event()
        self._waker = _Waker.of(loop)
        self._items: deque = deque()
        self._wake_pending = False
        self._waiter: asyncio.Future | None = None
        self._open = 0
        self._on_stop: list = []

    @property
    def running(self) -> bool:
        return self._open > 0

    def started(self, recorder: LogprobRecorder | None) -> None:  # event loop
        self.choices.append(_Choice(recorder))
        self._open += 1

    def stop(self) -> None:
        """Cancel every choice still generating (a no-op for those that finished)."""
        self.cancel.set()
        while self._on_stop:
            try:
                self._on_stop.pop()()
            except Exception:  # noqa: BLE001 -- a stream already closed
                pass

    def on_stop(self, fn) -> None:
        """Also call fn at stop (a remote choice's stream: closed, not waited out)."""
        self._on_stop.append(fn)
        if self.cancel.is_set():
            self.stop()

    def sink(self, i: int):
        """What the engine calls with choice i's items: Chunks, an exception, then None."""
        post = self._post

        def sink(item) -> None:  # the engine thread: must return at once and never raise
            if item is None:
                post((i, None, None))
            elif isinstance(item, BaseException):
                post((i, None, item))
            else:
                post((i, item, None))
        return sink

    def _post(self, item) -> None:  # the engine thread
        self._items.append(item)
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self._waker.wake(self)
            except Exception:  # noqa: BLE001 -- the event loop is gone: nobody is listening
                self.stop()

    def _wake(self) -> None:  # event loop
        self._wake_pending = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_batch(self) -> list[tuple]:
        """Everything the engine posted since the last call (waits for at least one)."""
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch = []
        while self._items:
            item = self._items.popleft()
            if item[1] is None and item[2] is None:
                self._open -= 1
            batch.append(item)
        return batch


class _Waker:
    """One per event loop. The engine thread asks it to wake a request; it asks the loop (a
    write to its self-pipe) only when no wake-up is already pending, then wakes every request
    that became ready meanwhile: when the engine emits one chunk for each of many streams in
    one step, the loop wakes once, not once per stream."""

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waker]" = \
        weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # a strong one would keep the loop as a key for ever
        self._ready: deque = deque()
        self._pending = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_Waker":  # called on the loop's thread
        waker = cls._by_loop.get(loop)
        if waker is None:
            waker = cls._by_loop[loop] = cls(loop)
        return waker

    def wake(self, choices: _Choices) -> None:  # the engine thread
        self._ready.append(choices)
        if not self._pending:
            self._pending = True
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:  # the event loop
        self._pending = False
        while self._ready:
            self._ready.popleft()._wake()


async def _until_disconnect(receive) -> None:
    """Return when the client has gone away (after the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(request: Request, required: str | None) -> dict:
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if required and required not in body:
        raise APIError(400, f"'{required}' is required", required)
    return body


def build_router(models, api_key: str | None = None) -> APIRouter:
    """The /v1 routes (and /tokenize) over `models` (a Models registry, or one Engine)."""
    api = OpenAIAPI(models, api_key)
    router = APIRouter()  # /v1/..., and /tokenize at the root where vLLM has it

    @router.get("/v1/models")
    def list_models(request: Request):
        try:
            api.authorize(request)
        except APIError as e:
            return e.response()
        return {"object": "list", "data": [_model_entry(api.models, d)
                                           for d in api.models.describe()]}

    @router.get("/v1/models/{model:path}")
    def get_model(model: str, request: Request):
        try:
            api.authorize(request)
            name = api.resolve(model)
        except APIError as e:
            return e.response()
        return next(_model_entry(api.models, d) for d in api.models.describe()
                    if d["name"] == name)

    async def answer(request: Request, kind: str):
        lease = None
        try:
            api.authorize(request)
            body = await _read_body(request, "messages" if kind == "chat" else "prompt")
            lease = await api.open(body)
            parse = api.parse_chat if kind == "chat" else api.parse_text
            req = await parse(body, lease.name, lease.engine)
            if req.settings.max_tokens == 0:  # completions: the prompt scored, nothing made
                return api.prompt_only(req)
            choices = await api.start(req)
            if req.settings.stream:
                stream = api.stream(req, choices, lease)
                # a response dropped before its first write never runs the generator's
                # `finally`: end the choices when the generator is collected
                weakref.finalize(stream, _end, choices, lease)
                lease = None  # the stream releases it when it ends
                return StreamingResponse(stream, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await _whole_reply(request, api.complete(req, choices), choices)
        except APIError as e:
            return e.response()
        except EngineBusy as e:
            return _busy(str(e)).response()
        finally:
            if lease is not None:
                lease.release()

    @router.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's token count endpoint: {model, prompt} or {model, messages} -> count, tokens
        and the model's context (what a MiniServeLM using this one as a remote model asks)."""
        lease = None
        try:
            api.authorize(request)
            body = await _read_body(request, None)
            lease = await api.open(body)
            return api.tokenize(body, lease.engine)
        except APIError as e:
            return e.response()
        finally:
            if lease is not None:
                lease.release()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, "chat")

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, "text")

    return router


async def _whole_reply(request: Request, reply, choices: "_Choices"):
    """The reply once it is complete, unless the client goes away first (then its choices
    are cancelled)."""
    reply = asyncio.ensure_future(reply)
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait((reply, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not reply.done():  # the client went away: nobody reads the reply
            reply.cancel()
            choices.stop()
    if not reply.done():
        return JSONResponse(status_code=499, content={})
    return reply.result()


def create_app(models, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="MiniServeLM API")
    app.include_router(build_router(models, api_key))
    return app


def serve(models, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None) -> None:
    import uvicorn
    models = Models.of(models)
    print(f"MiniServeLM API on http://{host}:{port}/v1 (models: {', '.join(models.names)}; "
          f"default {models.default})", flush=True)
    uvicorn.run(create_app(models, api_key), host=host, port=port, log_level="warning")
