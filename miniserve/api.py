"""OpenAI-compatible HTTP API: /v1/models and /v1/chat/completions, on the same Engine.

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

from miniserve.chat import ChatError
from miniserve.config import (MAX_CHOICES, MAX_NEW_TOKENS, SEED_MAX, ConfigError, Constraint,
                              Field, SamplingParams, check_number, check_seed)
from miniserve.engine import Engine, EngineBusy, RequestTooLarge
from miniserve.grammar import GrammarError

PLACEHOLDER_MODELS = {"", "default", "miniserve", "local", "gpt-3.5-turbo", "gpt-4", "gpt-4o",
                      "gpt-4o-mini"}
DEFAULT_MAX_TOKENS = 1024
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


class LogprobRecorder:
    """Observer for the decode loop: log-probabilities of each chosen token (before filters)."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top, self.entries = tokenizer, top, []

    def observe(self, logits, previous_ids, token_id, allowed=None):
        logp = torch.log_softmax(logits[0].float(), -1)
        entry = self._item(token_id, float(logp[token_id]))
        if self.top:
            values, indices = torch.topk(logp, self.top)
            entry["top_logprobs"] = [self._item(i, v) for v, i in zip(values.tolist(),
                                                                      indices.tolist())]
        else:
            entry["top_logprobs"] = []
        self.entries.append(entry)

    def _item(self, token_id, logprob):
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class ChatAPI:
    def __init__(self, engine: Engine, api_key: str | None = None):
        self.engine = engine
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

    def parse(self, body) -> dict:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if "messages" not in body:
            raise APIError(400, "'messages' is required", "messages")
        model = body.get("model", "default")
        if model is not None and not isinstance(model, str):
            raise APIError(400, "'model' must be a string", "model")
        if model not in PLACEHOLDER_MODELS and model != self.engine.name and model is not None:
            raise APIError(404, f"model '{model}' is not served here; use '{self.engine.name}' "
                                f"(or 'default')", "model", code="model_not_found")
        n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be true or false", "stream")
        options = body.get("stream_options")
        if options is not None and not stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true",
                           "stream_options")
        options = options or {}
        if not isinstance(options, dict):
            raise APIError(400, "'stream_options' must be an object", "stream_options")
        for name in UNSUPPORTED:
            if body.get(name) not in (None, [], {}, "none"):
                raise APIError(400, f"'{name}' is not supported by this server (no tool or "
                                    f"function calling); for JSON output use "
                                    f"'response_format'", name, code="unsupported_parameter")
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
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = _number({field: max_tokens}, field, DEFAULT_MAX_TOKENS, 1,
                             self.engine.context_length, integer=True)
        try:
            seed = check_seed(body.get("seed"))
        except ConfigError as e:
            raise APIError(400, str(e), "seed") from None
        for name in ("presence_penalty", "frequency_penalty"):
            _number(body, name, 0.0, -2.0, 2.0)
        logprobs = body.get("logprobs", False)
        if not isinstance(logprobs, bool):
            raise APIError(400, "'logprobs' must be true or false", "logprobs")
        top_logprobs = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        try:
            # ranges and types are checked by SamplingParams, from the one table in config
            sampling = {name: body[name] if body.get(name) is not None else default
                        for name, default in API_DEFAULTS.items()}
            bias = body.get("logit_bias")
            if bias is not None and not isinstance(bias, dict):
                raise ConfigError("'logit_bias' must be an object mapping token ids to a bias "
                                  "in [-100, 100]", "logit_bias")
            params = SamplingParams(**sampling, max_new_tokens=min(max_tokens, MAX_NEW_TOKENS), seed=seed,
                                    stop=tuple(stop), logit_bias=bias, constraint=constraint)
            self.engine.check(params)  # ids in the vocabulary; the format compiled once
        except ConfigError as e:
            raise APIError(400, str(e), e.field) from None
        except GrammarError as e:
            raise APIError(400, f"'{constraint_field}': {e}", constraint_field) from None
        try:
            trimmed = self.engine.trim(body["messages"], params)
        except ChatError as e:
            raise APIError(400, str(e), e.field) from None
        if trimmed.dropped:  # an API caller sent this history on purpose: do not cut it
            raise APIError(400, f"the conversation is longer than the context window of {self.engine.context_length} tokens allows "
                                f"with max_tokens={params.max_new_tokens}; shorten it",
                           "messages", code="context_length_exceeded")
        return {"params": params, "prompt_ids": trimmed.prompt_ids, "stream": stream, "n": n,
                "include_usage": bool(options.get("include_usage")), "logprobs": logprobs,
                "top_logprobs": top_logprobs if logprobs else 0}

    # -- responses --------------------------------------------------------------------------
    def start(self, req: dict) -> "_Choices":
        """Admit the request's n choices as n engine requests, all or none (429 when they
        do not all fit). The engine hands their chunks to the event loop: no thread waits
        on them."""
        n = req["n"]
        free = self.engine.max_queue - self.engine.queue_depth
        if n > free:
            raise _busy("the server is busy; try again in a moment" if n == 1 else
                        f"the server is busy: n={n} needs {n} places in the queue and "
                        f"{max(free, 0)} are free; try again in a moment")
        choices = _Choices(asyncio.get_running_loop())
        try:
            for i in range(n):
                self._start_choice(req, i, choices)
        except BaseException as e:  # start none: cancel those already queued
            choices.stop()
            if isinstance(e, EngineBusy):  # lost a race for the last places
                raise _busy(str(e)) from None
            if isinstance(e, RequestTooLarge):
                raise APIError(400, str(e), "max_tokens",
                               code="context_length_exceeded") from None
            if isinstance(e, (ConfigError, GrammarError)):  # the engine's own admission checks
                raise APIError(400, str(e), e.field) from None
            raise
        return choices

    def _start_choice(self, req: dict, index: int, choices: "_Choices") -> None:
        params = req["params"]
        if params.seed is not None and index:
            params = params.replace(seed=(params.seed + index) % (SEED_MAX + 1))
        recorder = LogprobRecorder(self.engine.tokenizer, req["top_logprobs"]) \
            if req["logprobs"] else None
        self.engine.submit(req["prompt_ids"], params, choices.sink(index),
                           cancel=choices.cancel,
                           observer=recorder.observe if recorder else None)
        choices.started(recorder)  # after submit: a choice that did not start is not waited for

    @staticmethod
    def _usage(stats: list) -> dict:
        prompt = stats[0].prompt_tokens  # the same prompt for every choice: counted once
        completion = sum(s.new_tokens for s in stats)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    @staticmethod
    def _finish(stats) -> str:
        """OpenAI's finish reasons, and one of ours: "no_token_allowed" when the output
        format (its grammar) and logit_bias left no token that could come next."""
        if stats.finish_reason in ("length", "no_token_allowed"):
            return stats.finish_reason
        return "stop"

    async def complete(self, req: dict, choices: "_Choices") -> dict:
        parts: list[list[str]] = [[] for _ in range(req["n"])]
        last: list = [None] * req["n"]
        try:
            while choices.running:
                for i, chunk, error in await choices.next_batch():
                    if error is not None:
                        if isinstance(error, EngineBusy):
                            raise _busy(str(error)) from None
                        raise error
                    if chunk is not None:
                        parts[i].append(chunk.text)
                        if chunk.done:
                            last[i] = chunk
                    elif last[i] is None:
                        raise RuntimeError(f"choice {i} ended without its final chunk")
        finally:
            choices.stop()
        body = [{"index": i, "message": {"role": "assistant", "content": "".join(parts[i])},
                 "finish_reason": self._finish(last[i].stats),
                 "logprobs": {"content": c.recorder.entries} if c.recorder else None}
                for i, c in enumerate(choices.choices)]
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                "created": int(time.time()), "model": self.engine.name, "choices": body,
                "usage": self._usage([c.stats for c in last]),
                "system_fingerprint": "miniserve"}

    async def stream(self, req: dict, choices: "_Choices"):
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        sent_logprobs = [0] * req["n"]

        def event(index: int | None, delta: dict | None = None, finish=None, usage=None,
                  logprobs: bool = True) -> str:
            chunk = {"id": ident, "object": "chat.completion.chunk", "created": created,
                     "model": self.engine.name, "system_fingerprint": "miniserve",
                     "choices": []}
            if index is not None:
                choice = {"index": index, "delta": delta, "finish_reason": finish,
                          "logprobs": None}
                recorder = choices.choices[index].recorder
                if logprobs and recorder and len(recorder.entries) > sent_logprobs[index]:
                    choice["logprobs"] = {"content": recorder.entries[sent_logprobs[index]:]}
                    sent_logprobs[index] = len(recorder.entries)
                chunk["choices"] = [choice]
            if usage is not None or req["include_usage"]:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        last: list = [None] * req["n"]
        try:
            yield "".join(event(i, {"role": "assistant", "content": ""}, logprobs=False)
                          for i in range(req["n"]))
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
                        out.append(event(i, {"content": chunk.text}))
                    if chunk.done:
                        last[i] = chunk
                        out.append(event(i, {}, finish=self._finish(chunk.stats)))
                if out:
                    yield "".join(out)
            tail = [event(None, usage=self._usage([c.stats for c in last]))] \
                if req["include_usage"] else []
            yield "".join(tail) + "data: [DONE]\n\n"
        finally:
            choices.stop()  # the client went away (this generator was cancelled) or done


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

    @property
    def running(self) -> bool:
        return self._open > 0

    def started(self, recorder: LogprobRecorder | None) -> None:  # event loop
        self.choices.append(_Choice(recorder))
        self._open += 1

    def stop(self) -> None:
        """Cancel every choice still generating (a no-op for those that finished)."""
        self.cancel.set()

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


def build_router(engine: Engine, api_key: str | None = None) -> APIRouter:
    api = ChatAPI(engine, api_key)
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    def models(request: Request):
        try:
            api.authorize(request)
        except APIError as e:
            return e.response()
        return {"object": "list", "data": [{"id": engine.name, "object": "model",
                                            "created": 0, "owned_by": "local"}]}

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        try:
            api.authorize(request)
            try:
                body = json.loads(await request.body() or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise APIError(400, "the request body is not valid JSON") from None
            req = api.parse(body)
            choices = api.start(req)
            if req["stream"]:
                stream = api.stream(req, choices)
                # a response dropped before its first write never runs the generator's
                # `finally`: stop the choices when the generator is collected
                weakref.finalize(stream, choices.stop)
                return StreamingResponse(stream, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            reply = asyncio.ensure_future(api.complete(req, choices))
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
        except APIError as e:
            return e.response()
        except EngineBusy as e:
            return _busy(str(e)).response()

    return router


def create_app(engine: Engine, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="MiniServeLM API")
    app.include_router(build_router(engine, api_key))
    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None) -> None:
    import uvicorn
    print(f"MiniServeLM API on http://{host}:{port}/v1 (model {engine.name})", flush=True)
    uvicorn.run(create_app(engine, api_key), host=host, port=port, log_level="warning")
