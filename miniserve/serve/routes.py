"""OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions and /v1/completions (and vLLM's
/tokenize), for every model the app serves (miniserve.models.registry.Models). The routes only:
the requests are pydantic models (protocol.py), checked further against the model (parse.py),
served (serving.py) and written (shapes.py).

Models: a request's `model` names one of the served models (GET /v1/models lists them, with
whether each is loaded); none, or a placeholder clients send without asking ("default",
"gpt-4o", ...), means the default. An unknown name is a 404 listing the served ones; a model
that cannot be loaded (a missing file, a remote server that does not answer) a 502 naming it
and why, and the other models keep answering. A model loads on the first request that names
it, on a worker thread (the event loop keeps serving the others), and is not unloaded while
one of its replies is being written. The reply's `model` is the served name.

Every error is OpenAI's error object with the status it means (errors.py): a bad field is a
400 naming it and what is allowed, never FastAPI's 422; a method a path does not take is a 405
with Allow; a /v1 path the API does not have is a 404, also in the web app, whose page (Gradio,
mounted at /) would answer everything else (`api_errors`).
A client that goes away (mid-stream or while waiting for a whole reply) cancels its generations
within one decoding step. A full queue is a 429 and an engine shutting down a 503, each with
`Retry-After` (errors.py says how many seconds and why).

GET /metrics: the server's state in Prometheus' text format (metrics.py), open without the API
key as vLLM's is.

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

Chat takes tools (`tools`, `tool_choice`, `parallel_tool_calls`: calls come back as
`message.tool_calls`, streamed as `delta.tool_calls`), a thinking model's switches
(`chat_template_kwargs`, `reasoning_effort`, `reasoning_budget`; its reasoning comes back as
`reasoning_content`) and `speculate` (README, "Thinking models and tool calls").

Refused with a 400 rather than ignored: `stream_options` without `stream: true`, tools for a
model whose template shows none, and the legacy `functions` / `function_call` (code
"unsupported_parameter").
"""

from __future__ import annotations

import logging
import weakref

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from miniserve.core.errors import UserError
from miniserve.models.registry import Models
from miniserve.serve.errors import (
    RETRY_AFTER_S,
    APIError,
    ErrorResponse,
    error_response,
    from_validation,
)
from miniserve.serve.metrics import add_metrics_route
from miniserve.serve.parse import chat_request, text_request
from miniserve.serve.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from miniserve.serve.serving import OpenAIServing, end, whole_reply
from miniserve.serve.shapes import model_entry

log = logging.getLogger("miniserve.serve")

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE")
EVENT_STREAM = {"text/event-stream": {}}  # `data: {chunk}` events, then `data: [DONE]`


def _errors(*statuses: int) -> dict:
    """The error statuses a route can answer, documented with OpenAI's error object."""
    said = {
        400: "a field is wrong (the message names it and what is allowed)",
        401: "missing or wrong API key",
        404: "no such model",
        429: "the server is busy: too many requests running or waiting",
        500: "a failure of this server",
        502: "the model could not be loaded, or its (remote) server failed",
        503: "the model is shutting down",
    }
    out = {s: {"model": ErrorResponse, "description": said[s]} for s in statuses}
    for s in set(statuses) & set(RETRY_AFTER_S):
        out[s]["headers"] = {
            "Retry-After": {
                "description": "seconds to wait before asking again",
                "schema": {"type": "integer"},
            }
        }
    return out


def _as_json(request: Request) -> Request:
    """The request with its body read as JSON whatever its Content-Type says, as the API always
    has (`curl -d` sends application/x-www-form-urlencoded); FastAPI reads only a JSON type."""
    kind = request.headers.get("content-type", "")
    if request.method != "POST" or "json" in kind:
        return request
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
    return Request(
        {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]},
        request.receive,
    )


def _route_class(api: OpenAIServing) -> type[APIRoute]:
    """Routes that answer every error themselves, so the router behaves the same in whatever
    app includes it (the web app's, the API's own): the key checked first, a request body
    pydantic refuses as today's 400 (not 422), a UserError as its status, a bug as a 500."""

    class Route(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def answer(request: Request):
                try:
                    api.authorize(request)
                    return await handler(_as_json(request))
                except RequestValidationError as e:
                    return error_response(from_validation(e))
                except UserError as e:
                    return error_response(e)
                except StarletteHTTPException as e:  # FastAPI's: a body it could not read
                    return error_response(
                        APIError("the request body is not valid JSON")
                        if e.status_code == 400
                        else APIError(str(e.detail), status=e.status_code)
                    )
                except Exception as e:  # noqa: BLE001 -- a bug: said, and logged in full
                    log.exception("%s %s failed", request.method, request.url.path)
                    return error_response(
                        APIError(f"internal error: {e}", status=500, kind="server_error")
                    )

            return answer

    return Route


def _not_allowed(router: APIRouter, path: str, allowed: tuple[str, ...]) -> None:
    """405 with Allow for the methods `path` does not take, also when the router sits in an
    app with a catch-all mount (the web app's Gradio at /, which would answer 404)."""
    allow = ", ".join(allowed)

    async def not_allowed():
        return JSONResponse(
            status_code=405,
            headers={"Allow": allow},
            content={
                "error": {
                    "message": f"method not allowed; {path} takes {allow}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "method_not_allowed",
                }
            },
        )

    router.add_api_route(
        path, not_allowed, include_in_schema=False, methods=[m for m in METHODS if m not in allowed]
    )


def _no_such_path(router: APIRouter, prefix: str) -> None:
    """`prefix` and every other path under it, any method: a 404 raised for the app's handler
    (`api_error`), so that the web app's Gradio, mounted at /, never answers it. Routes of
    FastAPI's own class: no key asked, as for any path no route has."""

    async def no_such_path():
        raise StarletteHTTPException(status_code=404)

    for path in (prefix, f"{prefix}/{{rest:path}}"):
        router.add_api_route(
            path,
            no_such_path,
            methods=list(METHODS),
            include_in_schema=False,
            route_class_override=APIRoute,
        )


async def api_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """An HTTP error no route answered itself (an unknown path) as OpenAI's error object, with
    the exception's headers."""
    response = error_response(APIError(str(exc.detail), status=exc.status_code))
    response.headers.update(exc.headers or {})
    return response


def api_errors(app: FastAPI) -> FastAPI:
    """`app`'s HTTP errors (a path no route has) answered by `api_error`: the API's own app and
    the web app, which includes the router beside its page, answer them alike."""
    app.add_exception_handler(StarletteHTTPException, api_error)
    return app


def build_router(models, api_key: str | None = None) -> APIRouter:
    """The /v1 routes (and /tokenize) over `models` (a Models registry, or one Engine)."""
    api = OpenAIServing(models, api_key)
    router = APIRouter(route_class=_route_class(api))  # /v1/..., and /tokenize where vLLM has it
    auth = (401,) if api_key else ()

    @router.get("/v1/models", responses=_errors(*auth, 500))
    def list_models():
        return {
            "object": "list",
            "data": [model_entry(api.models, d) for d in api.models.describe()],
        }

    @router.get("/v1/models/{model:path}", responses=_errors(*auth, 404, 500))
    def get_model(model: str):
        name = api.resolve(model)
        return next(model_entry(api.models, d) for d in api.models.describe() if d["name"] == name)

    async def answer(request: Request, body, kind: str):
        lease = None
        try:
            lease = await api.open(body.model)
            parse = chat_request if kind == "chat" else text_request
            req = await parse(body, lease.name, lease.engine)
            if req.settings.max_tokens == 0:  # completions: the prompt scored, nothing made
                return api.prompt_only(req)
            choices = await api.start(req)
            if req.settings.stream:
                stream = api.stream(req, choices, lease)
                # a response dropped before its first write never runs the generator's
                # `finally`: end the choices when the generator is collected
                weakref.finalize(stream, end, choices, lease)
                lease = None  # the stream releases it when it ends
                return StreamingResponse(
                    stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            return await whole_reply(request, api.complete(req, choices), choices)
        finally:
            if lease is not None:
                lease.release()

    replies = {
        200: {
            "description": "the reply; with stream: true, server-sent events",
            "content": EVENT_STREAM,
        },
        **_errors(400, *auth, 404, 429, 500, 502, 503),
    }

    @router.post("/v1/chat/completions", responses=replies)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await answer(request, body, "chat")

    @router.post("/v1/completions", responses=replies)
    async def completions(body: CompletionRequest, request: Request):
        return await answer(request, body, "text")

    @router.post("/tokenize", responses=_errors(400, *auth, 404, 500, 502))
    async def tokenize(body: TokenizeRequest):
        """vLLM's token count endpoint: {model, prompt} or {model, messages} -> count, tokens
        and the model's context (what a MiniServeLM using this one as a remote model asks)."""
        lease = await api.open(body.model)
        try:
            return api.tokenize(body, lease.engine)
        finally:
            lease.release()

    for path, allowed in (
        ("/v1/models", ("GET",)),
        ("/v1/models/{model:path}", ("GET",)),
        ("/v1/chat/completions", ("POST",)),
        ("/v1/completions", ("POST",)),
        ("/tokenize", ("POST",)),
        ("/metrics", ("GET",)),
    ):
        _not_allowed(router, path, allowed)
    add_metrics_route(router, api.models)
    _no_such_path(router, "/v1")  # last: the routes above answer their own paths first
    return router


def document(app: FastAPI) -> FastAPI:
    """Drop from `app`'s OpenAPI document the 422 FastAPI lists for every route with a body
    or parameters: these routes answer a request pydantic refuses with a 400 (its error
    object is ErrorResponse), so a 422 is never sent."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = build()  # FastAPI's, kept as app.openapi_schema: changed in place once
            for operations in doc.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                doc.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
    return app


def create_app(models, api_key: str | None = None) -> FastAPI:
    """The API as an app of its own (`serve`, tests, the HTTP benchmark): what no route
    answers (an unknown path) is OpenAI's error object too."""
    app = document(FastAPI(title="MiniServeLM API"))
    app.include_router(build_router(models, api_key))
    return api_errors(app)


def serve(models, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    """Serve the API until Ctrl-C; it says where once it listens (a port already taken or a
    host that does not resolve: uvicorn's one error line, and exit code 3)."""
    import uvicorn

    models = Models.of(models)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:  # bound: now it is true
                print(
                    f"MiniServeLM API on http://{host}:{port}/v1 (models: "
                    f"{', '.join(models.names)}; default {models.default})",
                    flush=True,
                )

    server = Server(
        uvicorn.Config(create_app(models, api_key), host=host, port=port, log_level="warning")
    )
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: the server has shut down
        pass
    if not server.started:
        raise SystemExit(3)
