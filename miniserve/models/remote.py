"""A model on another machine: any OpenAI-compatible server behind the engine surface.

    --model http://HOST:PORT/v1[#served-name]

vLLM, llama.cpp's llama-server, Ollama, llama-cpp-python's server or another MiniServeLM:
`RemoteEngine` streams replies from its /v1/chat/completions and /v1/completions (server-sent
events) as the local engine's Chunks, so the chat, the notebook, Compare, the CLI and the API
use it unchanged. What differs, and why:

- No tokenizer here. Chunks carry text, not token ids. History is trimmed to the context as
  chat.trim_history does, over the server's own token counts where it has a tokenize endpoint
  (vLLM's /tokenize with the chat template -- any server that answers that form --,
  llama.cpp's /apply-template + /tokenize, llama-cpp-python's /extras/tokenize), else over an
  estimate; info() says which.
- The context is what the server reports (vLLM's max_model_len, llama.cpp's /props n_ctx,
  Ollama's /api/show num_ctx, MiniServeLM's /v1/models context_length), else --context,
  else config.CONTEXT's default; info() says where it came from.
- Stats are measured here, at the client: time to first token and tokens/s include the
  network. New tokens are the server's usage count when it sends one, else counted here.
- The token inspector gets the server's logprobs (Inspector.add_remote_step), not logits.
- Stop closes the HTTP response (the server sees the client leave and stops) at the next
  chunk it sends.

Errors: the server refusing a request (400, 413, 422) is RemoteRefused, a ConfigError with
the server's own message; a busy server (429) EngineBusy; anything else -- unreachable, a 500,
an HTML page, a stream cut off -- RemoteError, one line naming the model and the URL.

The engine is here; its parts, by job: remote_probe (what the server is: ServerFacts, its
flavor, its context), remote_counts (token counts and trimming without a tokenizer here),
remote_body (a request's fields: stages, output format, tools), remote_stream (the streamed
reply read as Chunks) and remote_http (timeouts, errors, reading an answer).
"""

from __future__ import annotations

import queue
import threading
import time

import httpx

from miniserve.core.config import SamplingParams
from miniserve.engine.chat import ChatOptions
from miniserve.engine.engine import Admission, Admitting, EngineBusy, Stream, columns
from miniserve.engine.grammar import GrammarError
from miniserve.engine.surface import REMOTE
from miniserve.models.remote_body import (
    MAX_TOP_LOGPROBS,
    ORDERS,
    TOP_LOGPROBS,
    _chat_fields,
    _format_fields,
    stage_fields,
)
from miniserve.models.remote_counts import (
    BYTES_PER_TOKEN,
    MESSAGE_TOKENS,
    TEMPLATE_TOKENS,
    TokenCounts,
    _count_source,
)
from miniserve.models.remote_http import (
    PROBE_TIMEOUT,
    TIMEOUT,
    RemoteError,
    RemoteRefused,
    _error_message,
    _json,
    _network_reason,
    _what,
)
from miniserve.models.remote_probe import ServerFacts, ServerProbe
from miniserve.models.remote_stream import RemoteStream, _inspector

# The module's public names as before the split (the parts live in remote_http, remote_probe,
# remote_counts, remote_body and remote_stream).
__all__ = [
    "BYTES_PER_TOKEN",
    "MAX_TOP_LOGPROBS",
    "MESSAGE_TOKENS",
    "ORDERS",
    "PROBE_TIMEOUT",
    "TEMPLATE_TOKENS",
    "TIMEOUT",
    "TOP_LOGPROBS",
    "RemoteEngine",
    "RemoteError",
    "RemoteRefused",
    "RemoteStream",
    "ServerFacts",
    "stage_fields",
]


class RemoteEngine(ServerProbe, TokenCounts, Admitting):
    """The engine surface over an OpenAI-compatible server (see the module's docstring): what
    the server is (ServerProbe), token counts (TokenCounts), requests here."""

    capabilities = REMOTE
    tokenizer = None

    def __init__(self, spec, max_queue: int = 16, progress=None):
        self.spec = spec
        self.name = spec.name
        self.url = spec.source.rstrip("/")
        self.max_queue = max_queue
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self.client = httpx.Client(timeout=TIMEOUT, headers=headers)
        self._admission = Admission(
            lambda n: (
                f"model '{self.name}' has {n} requests in flight "
                "to its server; try again in a moment"
            )
        )
        if progress:
            progress(f"Connecting to {self.url} ...")
        try:
            self.facts = self._discover()
        except BaseException:
            self.client.close()
            raise
        self.context_length, self.context_from = self._context()
        if progress:
            progress(
                f"{self.url}: model '{self.facts.served}' ({self.facts.flavor}), "
                f"context {self.context_length} ({self.context_from})"
            )

    @property
    def has_chat_template(self) -> bool:
        return self.facts.chat

    def info(self) -> dict:
        return {
            "name": self.name,
            "remote": True,
            "device": "remote",
            "runner": "remote",
            "url": self.url,
            "server": self.facts.flavor,
            "served_model": self.facts.served,
            "chat": self.has_chat_template,
            "context_length": self.context_length,
            "context_from": self.context_from,
            "token_counts": _count_source(self.facts.tokenize),
        }

    def close(self) -> None:
        self.client.close()

    # -- requests -------------------------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        """What can be checked here without asking the server: that it can hold the reply to
        the output format at all (others the server checks, and its 400 says why)."""
        stage_fields(params, self.facts.flavor, self.name)
        body = _format_fields(params, self.facts.flavor)
        if body is None:
            kind = params.constraint.kind.replace("_", " ")
            raise GrammarError(
                f"the server of model '{self.name}' ({self.facts.flavor}) "
                f"cannot hold a reply to a {kind}; use JSON or JSON schema",
                "constraint",
            )

    def _body(self, params: SamplingParams, inspector, chat: bool) -> dict:
        self.check(params)
        body = {
            "model": self.facts.served,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": params.max_new_tokens,
        }
        body.update(stage_fields(params, self.facts.flavor, self.name))
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in params.logit_bias}
        if inspector is not None:  # as many alternatives as it shows (OpenAI allows 0-20)
            top = min(max(int(getattr(inspector, "top", TOP_LOGPROBS)), 0), MAX_TOP_LOGPROBS)
            body.update(
                {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": min(top, 5)}
            )  # completions: 0-5
        body.update(_format_fields(params, self.facts.flavor))
        return body

    def chat(
        self,
        messages: list[dict],
        params: SamplingParams,
        options: ChatOptions | None = None,
        *,
        cancel=None,
        observer=None,
        **ignored,
    ) -> RemoteStream:
        """Stream the reply to a conversation, its history trimmed to fit the context. Tools,
        tool_choice and the template's switches are forwarded as they came."""
        trimmed = self.trim(messages, params)
        inspector = _inspector(observer)
        body = {**self._body(params, inspector, True), "messages": trimmed.messages}
        body.update(_chat_fields(options))
        exact = self.facts.tokenize in ("vllm", "llama.cpp")  # the template counted too
        return self._start(
            "/chat/completions",
            body,
            cancel,
            inspector,
            trimmed.dropped,
            (lambda: self.count_chat(trimmed.messages)) if exact else None,
        )

    def complete_text(
        self,
        prompt,
        params: SamplingParams,
        trim: bool = False,
        *,
        cancel=None,
        observer=None,
        **ignored,
    ) -> RemoteStream:
        """Completion mode: stream the continuation of a text (or of token ids)."""
        text = self._prompt_text(prompt, params, trim)
        inspector = _inspector(observer)
        body = {**self._body(params, inspector, False), "prompt": text}
        return self._start("/completions", body, cancel, inspector, 0, self._counter(text))

    def _start(
        self, path: str, body: dict, cancel, inspector, dropped: int, prompt_tokens=None
    ) -> RemoteStream:
        """Send the request now (a refusal is raised here, before any chunk), and return the
        stream that reads its reply. prompt_tokens(): the prompt's tokens as the server counts
        them, asked for when it sends no usage (None: no exact count to ask for)."""
        self._admit()
        started = time.perf_counter()
        try:
            response = self._send(path, body)
        except BaseException:
            self._release()
            raise
        return RemoteStream(
            self,
            response,
            started,
            cancel or threading.Event(),
            inspector,
            dropped,
            path == "/chat/completions",
            prompt_tokens,
        )

    def _send(self, path: str, body: dict) -> httpx.Response:
        request = self.client.build_request("POST", self.url + path, json=body)
        try:
            response = self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise self._error(_network_reason(e)) from None
        if response.status_code != 200:
            try:
                response.read()
            except httpx.HTTPError:
                pass
            finally:
                response.close()
            raise self._refusal(response)
        if "event-stream" not in response.headers.get("content-type", ""):
            try:
                response.read()
                data = _json(response)
            except httpx.HTTPError:
                data = None
            finally:
                response.close()
            if isinstance(data, dict) and _error_message(data):
                raise self._error(_error_message(data))
            raise self._error(f"it answered with {_what(response)}, not an event stream")
        return response

    def _post_json(self, path: str, body: dict) -> dict:
        """One of the server's own endpoints (token counts), as JSON."""
        try:
            r = self.client.post(self.root + path, json=body, timeout=PROBE_TIMEOUT)
        except httpx.HTTPError as e:
            raise self._error(_network_reason(e)) from None
        if r.status_code != 200:
            raise self._refusal(r)
        data = _json(r)
        if not isinstance(data, dict):
            raise self._error(f"{path} answered with {_what(r)}")
        return data

    def _refusal(self, r: httpx.Response) -> Exception:
        """A non-200 answer as the error it means for the user."""
        data = _json(r)
        message = _error_message(data) if data is not None else None
        said = message or _what(r)
        if r.status_code in (400, 413, 422):
            error = data.get("error") if isinstance(data, dict) else None
            param = error.get("param") if isinstance(error, dict) else None
            return RemoteRefused(
                f"the server of model '{self.name}' at {self.url} refused the request: {said}",
                param if isinstance(param, str) else None,
            )
        if r.status_code == 429:
            return EngineBusy(
                f"the server of model '{self.name}' at {self.url} is busy "
                f"({said}); try again in a moment"
            )
        if r.status_code in (401, 403):
            said += " -- check --remote-api-key (or MINISERVE_REMOTE_API_KEY)"
        return self._error(f"it answered {r.status_code}: {said}", r.status_code)

    def _error(self, reason: str, status: int | None = None) -> RemoteError:
        return RemoteError(f"model '{self.name}' at {self.url}: {reason}", status)

    def _cut(self, how: str = "") -> RemoteError:
        return RemoteError(
            f"the server at {self.url} stopped in the middle of the reply "
            f"(model '{self.name}'" + (f"; {how})" if how else ")")
        )

    def compare_prompt(
        self, prompt: str, settings: list[SamplingParams], *, raw: bool = False, cancel=None
    ) -> Stream:
        """One prompt under several settings at once: one request per column, each read on a
        thread of its own. Yields (column, chunk, that column's seconds so far)."""
        cancel = cancel or threading.Event()
        if len(settings) > self.max_queue - self.queue_depth:
            raise EngineBusy(
                f"model '{self.name}': {len(settings)} columns need "
                f"{len(settings)} places and {self.max_queue - self.queue_depth} "
                "are free; try again in a moment"
            )
        out: queue.Queue = queue.Queue()

        def column(col: int, params: SamplingParams) -> None:
            try:
                stream = (
                    self.complete_text(prompt, params, cancel=cancel)
                    if raw
                    else self.chat([{"role": "user", "content": prompt}], params, cancel=cancel)
                )
                for chunk in stream:
                    out.put((col, chunk))
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller
                out.put(e)
            finally:
                out.put(None)

        for col, params in enumerate(settings):
            threading.Thread(
                target=column, args=(col, params), name=f"miniserve-remote-{col}", daemon=True
            ).start()
        return columns(out, cancel, len(settings))
