"""OpenAI-compatible HTTP API: /v1/models and /v1/chat/completions, on the same Engine.

Requests are checked field by field; a bad one gets a 400 with an OpenAI-style error
object naming the field. A client that drops a stream cancels its generation within
one decoding step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import uuid

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miniserve.chat import ChatError
from miniserve.config import MAX_NEW_TOKENS, ConfigError, SamplingParams, check_seed
from miniserve.engine import Engine, EngineBusy

PLACEHOLDER_MODELS = {"", "default", "miniserve", "local", "gpt-3.5-turbo", "gpt-4", "gpt-4o",
                      "gpt-4o-mini"}
DEFAULT_MAX_TOKENS = 1024
# OpenAI's defaults (sampling with temperature 1, no filters) where a request is silent
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                "repetition_penalty": 1.0}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code}})


def _number(body: dict, name: str, default, low=None, high=None, integer=False):
    """A request field that is not a sampling setting (those are checked by SamplingParams)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and isinstance(value, float) and not value.is_integer()):
        kind = "an integer" if integer else "a number"
        raise APIError(400, f"'{name}' must be {kind}, got {value!r}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise APIError(400, f"'{name}' must be in [{low}, {high}], got {value!r}", name)
    return int(value) if integer else float(value)


class LogprobRecorder:
    """Observer for the decode loop: log-probabilities of each chosen token (before filters)."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer, self.top, self.entries = tokenizer, top, []

    def observe(self, logits, previous_ids, token_id):
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
        n = _number(body, "n", 1, 1, 1, integer=True)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be true or false", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "'stream_options' must be an object", "stream_options")
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
            params = SamplingParams(**sampling, max_new_tokens=min(max_tokens, MAX_NEW_TOKENS), seed=seed,
                                    stop=tuple(stop))
        except ConfigError as e:
            raise APIError(400, str(e), e.field) from None
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
    def check_capacity(self) -> None:
        """Answer 429 before a response starts (the engine re-checks when it admits)."""
        if self.engine.queue_depth >= self.engine.max_queue:
            raise APIError(429, "the server is busy; try again in a moment", None,
                           "rate_limit_error", "server_busy")

    def _start(self, req: dict, cancel: threading.Event):
        recorder = LogprobRecorder(self.engine.tokenizer, req["top_logprobs"]) \
            if req["logprobs"] else None
        stream = self.engine.complete(req["prompt_ids"], req["params"], cancel=cancel,
                                      observer=recorder.observe if recorder else None)
        return stream, recorder

    def _usage(self, stats) -> dict:
        return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
                "total_tokens": stats.prompt_tokens + stats.new_tokens}

    @staticmethod
    def _finish(stats) -> str:
        return "length" if stats.finish_reason == "length" else "stop"

    def complete(self, req: dict) -> dict:
        stream, recorder = self._start(req, threading.Event())
        parts, last = [], None
        try:
            for last in stream:
                parts.append(last.text)
        except EngineBusy as e:
            raise APIError(429, str(e), None, "rate_limit_error", "server_busy") from None
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                  "finish_reason": self._finish(last.stats),
                  "logprobs": {"content": recorder.entries} if recorder else None}
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                "created": int(time.time()), "model": self.engine.name, "choices": [choice],
                "usage": self._usage(last.stats), "system_fingerprint": "miniserve"}

    async def stream(self, req: dict):
        cancel = threading.Event()
        try:
            stream, recorder = self._start(req, cancel)
        except EngineBusy as e:  # lost the race for the last place since check_capacity
            err = {"error": {"message": str(e), "type": "rate_limit_error", "param": None,
                             "code": "server_busy"}}
            yield f"data: {json.dumps(err)}\n\n"
            return
        ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        sent_logprobs = 0

        def event(delta: dict, finish=None, usage=None, with_choice=True) -> str:
            nonlocal sent_logprobs
            chunk = {"id": ident, "object": "chat.completion.chunk", "created": created,
                     "model": self.engine.name, "system_fingerprint": "miniserve",
                     "choices": []}
            if with_choice:
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                if recorder and len(recorder.entries) > sent_logprobs:
                    choice["logprobs"] = {"content": recorder.entries[sent_logprobs:]}
                    sent_logprobs = len(recorder.entries)
                chunk["choices"] = [choice]
            if usage is not None or req["include_usage"]:
                chunk["usage"] = usage
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        yield event({"role": "assistant", "content": ""})
        last = None
        try:
            async for last in _in_thread(stream, cancel):
                if last.text:
                    yield event({"content": last.text})
        except Exception as e:  # noqa: BLE001 -- the stream has started: report in-band
            err = {"error": {"message": f"generation failed: {e}", "type": "server_error",
                             "param": None, "code": None}}
            yield f"data: {json.dumps(err)}\n\n"
            return
        yield event({}, finish=self._finish(last.stats))
        if req["include_usage"]:
            yield event({}, usage=self._usage(last.stats), with_choice=False)
        yield "data: [DONE]\n\n"


async def _in_thread(stream, cancel: threading.Event):
    """Run a blocking chunk generator in a thread; if the consumer goes away (client
    disconnect cancels this coroutine), tell the engine to stop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def post(item):
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone
            cancel.set()

    def worker():
        try:
            for chunk in stream:
                post(("chunk", chunk))
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer
            post(("error", e))
        finally:
            post(("end", None))

    threading.Thread(target=worker, daemon=True, name="miniserve-stream").start()
    try:
        while True:
            kind, item = await queue.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        cancel.set()


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
            api.check_capacity()
            if req["stream"]:
                return StreamingResponse(api.stream(req), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await asyncio.to_thread(api.complete, req)
        except APIError as e:
            return e.response()
        except EngineBusy as e:
            return APIError(429, str(e), None, "rate_limit_error", "server_busy").response()

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
