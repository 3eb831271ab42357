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
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from miniserve.core.config import CONTEXT, ConfigError, SamplingParams
from miniserve.core.samplers import STAGES
from miniserve.core.toolcalls import ToolCall, new_call_id
from miniserve.engine.chat import (
    TOOL_CHOICES,
    ChatError,
    ChatOptions,
    NoChatTemplate,
    Trimmed,
    check_messages,
    clean_text,
    trim_history,
)
from miniserve.engine.decode import GenerationStats
from miniserve.engine.engine import Admission, Admitting, Chunk, EngineBusy, Stream, columns
from miniserve.engine.grammar import GrammarError
from miniserve.engine.surface import REMOTE
from miniserve.runners.loader import ModelLoadError

# A slow server may take minutes over a long prompt before its first token: reads wait long,
# connecting does not (an address that does not answer is said at once).
TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=30.0)
PROBE_TIMEOUT = httpx.Timeout(connect=5.0, read=15.0, write=15.0, pool=15.0)
TOP_LOGPROBS = 5  # alternatives asked for when the token inspector is on
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (an API client may ask for more than the inspector)
# Token counts without the server's tokenizer: bytes a token (English runs 4-5 with BPE
# tokenizers, so this errs toward too many and drops a turn early rather than overflowing),
# and a chat template's own tokens.
BYTES_PER_TOKEN = 3
TEMPLATE_TOKENS, MESSAGE_TOKENS = 32, 8
# Which stages each kind of server has, and its names for their settings: the stages'
# declarations (miniserve/core/samplers.py, Stage.remote and Stage.remote_names).
ORDERS = ("llama.cpp", "miniserve")  # servers that take a `samplers` order


class RemoteError(RuntimeError):
    """A remote server failed (unreachable, an error, a reply that is not OpenAI's format, a
    stream cut off). `status`: its HTTP status, when it sent one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteRefused(ConfigError):
    """The server refused the request (400, 413, 422): its own message, and the field it
    named, if any."""


@dataclass
class ServerFacts:
    """What the construction learned from the server."""

    flavor: str  # vllm | llama.cpp | ollama | llama-cpp-python | miniserve | openai
    served: str  # the model name to send
    context: int | None  # what the server reports, if it does
    context_from: str  # where `context` came from
    chat: bool = True  # False: the server says the model has no chat template
    tokenize: str = ""  # vllm | llama.cpp | extras | "" (estimate)


class RemoteEngine(Admitting):
    """The engine surface over an OpenAI-compatible server (see the module's docstring)."""

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

    # -- what the server is ------------------------------------------------------------------
    @property
    def root(self) -> str:
        """The server's address without /v1: where vLLM's and llama.cpp's own endpoints are."""
        return self.url[:-3] if self.url.endswith("/v1") else self.url

    def _discover(self) -> ServerFacts:
        """One GET /v1/models (which must answer as OpenAI's does), then what the server's own
        endpoints say about the context, the chat template and token counts."""
        models = self._list_models()
        served = self._served(models)
        entry = next((m for m in models if m.get("id") == served), {})
        facts = ServerFacts(_flavor(entry), served, None, "")
        if isinstance(entry.get("max_model_len"), int):  # vLLM
            facts.context, facts.context_from = entry["max_model_len"], "vLLM max_model_len"
            facts.tokenize = "vllm"
        elif isinstance(entry.get("context_length"), int):  # MiniServeLM
            facts.context, facts.context_from = (
                entry["context_length"],
                "the server's /v1/models context_length",
            )
            facts.chat = entry.get("chat") is not False
        if facts.flavor in ("llama.cpp", "openai"):
            self._ask_llamacpp(facts)
        if facts.flavor in ("ollama", "openai"):
            self._ask_ollama(facts)
        if not facts.tokenize and facts.flavor in ("miniserve", "openai"):  # vLLM's form
            counted = self._probe("POST", "/tokenize", {"model": served, "prompt": "a"})
            if isinstance(counted, dict) and isinstance(counted.get("count"), int):
                facts.tokenize = "vllm"
                if not facts.context and isinstance(counted.get("max_model_len"), int):
                    # a MiniServeLM whose model was not loaded yet: this request loaded it
                    facts.context = counted["max_model_len"]
                    facts.context_from = "the server's /tokenize max_model_len"
        if not facts.tokenize and facts.flavor in ("llama-cpp-python", "openai"):
            if self._probe("POST", "/extras/tokenize", {"input": "a"}) is not None:
                facts.tokenize = "extras"
                facts.flavor = "llama-cpp-python"
        return facts

    def _list_models(self) -> list[dict]:
        """The server's models; ModelLoadError naming the URL when it does not answer as an
        OpenAI-compatible API (tries URL/v1 too when the URL has no /v1)."""
        tried = [self.url] + ([] if self.url.endswith("/v1") else [self.url + "/v1"])
        reason = ""
        for url in tried:
            try:
                r = self.client.get(url + "/models", timeout=PROBE_TIMEOUT)
            except httpx.HTTPError as e:
                raise ModelLoadError(
                    f"cannot reach an OpenAI-compatible server at {self.url}: {_network_reason(e)}"
                ) from None
            if r.status_code in (401, 403):
                raise ModelLoadError(
                    f"the server at {self.url} asks for an API key: pass "
                    "--remote-api-key KEY (or set MINISERVE_REMOTE_API_KEY)"
                    if not self.spec.api_key
                    else f"the server at {self.url} refused the API key given ({r.status_code})"
                )
            data = _json(r)
            if (
                r.status_code == 200
                and isinstance(data, dict)
                and isinstance(data.get("data"), list)
            ):
                self.url = url
                return [m for m in data["data"] if isinstance(m, dict)]
            reason = reason or f"GET {url}/models answered {r.status_code} " + (
                "with JSON that is not a model list" if data is not None else f"with {_what(r)}"
            )
        raise ModelLoadError(
            f"{self.url} is not an OpenAI-compatible API ({reason}); give the "
            "server's address ending in /v1, e.g. http://HOST:8000/v1"
        )

    def _served(self, models: list[dict]) -> str:
        ids = [m["id"] for m in models if isinstance(m.get("id"), str)]
        wanted = self.spec.served_name
        if wanted:
            if ids and wanted not in ids:
                raise ModelLoadError(
                    f"the server at {self.url} does not serve '{wanted}'; it "
                    f"serves: {', '.join(ids)}"
                )
            return wanted
        if not ids:
            raise ModelLoadError(
                f"the server at {self.url} lists no models: name one with {self.url}#MODEL"
            )
        return ids[0]

    def _ask_llamacpp(self, facts: ServerFacts) -> None:
        """llama.cpp's llama-server: /props has the context of a slot and the template."""
        props = self._probe("GET", "/props")
        if not isinstance(props, dict) or "default_generation_settings" not in props:
            return
        facts.flavor, facts.tokenize = "llama.cpp", "llama.cpp"
        if props.get("chat_template") == "":
            facts.chat = False
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx") or props.get("n_ctx")
        if not isinstance(n_ctx, int):  # older servers: per slot
            slots = self._probe("GET", "/slots")
            n_ctx = (
                slots[0].get("n_ctx")
                if isinstance(slots, list) and slots and isinstance(slots[0], dict)
                else None
            )
        if isinstance(n_ctx, int) and n_ctx > 0:
            facts.context, facts.context_from = n_ctx, "llama.cpp /props n_ctx"

    def _ask_ollama(self, facts: ServerFacts) -> None:
        """Ollama: /api/show has the model's parameters (num_ctx, when its Modelfile sets it)
        and its template. Without num_ctx Ollama runs its own default context, not the one the
        model was trained for: --context, or the default, is then the honest guess."""
        show = self._probe("POST", "/api/show", {"model": facts.served})
        if not isinstance(show, dict) or "modelfile" not in show and "model_info" not in show:
            return
        facts.flavor = "ollama"
        if show.get("template") == "":
            facts.chat = False
        for line in str(show.get("parameters") or "").splitlines():
            key, _, value = line.strip().partition(" ")
            if key == "num_ctx" and value.strip().isdigit():
                facts.context, facts.context_from = int(value), "Ollama /api/show num_ctx"

    def _probe(self, method: str, path: str, body: dict | None = None):
        """JSON from one of the server's own endpoints, or None (absent, or not JSON)."""
        try:
            r = self.client.request(method, self.root + path, json=body, timeout=PROBE_TIMEOUT)
        except httpx.HTTPError:
            return None
        return _json(r) if r.status_code == 200 else None

    def _context(self) -> tuple[int, str]:
        if self.facts.context:
            return self.facts.context, self.facts.context_from
        if self.spec.context:
            return self.spec.context, "--context (the server does not say)"
        return int(CONTEXT.default), "the default (the server does not say; set --context)"

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

    # -- token counts ---------------------------------------------------------------------------
    def count_text(self, text: str) -> int:
        """Tokens of a completion prompt: the server's count, or an estimate."""
        kind = self.facts.tokenize
        if kind == "vllm":
            return int(
                self._post_json("/tokenize", {"model": self.facts.served, "prompt": text})["count"]
            )
        if kind == "llama.cpp":
            return len(
                self._post_json("/tokenize", {"content": text, "add_special": True})["tokens"]
            )
        if kind == "extras":
            return len(self._post_json("/extras/tokenize", {"input": text})["tokens"])
        return len(text.encode("utf-8")) // BYTES_PER_TOKEN + 1

    def count_chat(self, messages: list[dict]) -> int:
        """Tokens of a conversation with its template: exact where the server renders it
        (vLLM, llama.cpp), else the contents' tokens and an estimate of the template's."""
        kind = self.facts.tokenize
        if kind == "vllm":
            return int(
                self._post_json(
                    "/tokenize",
                    {
                        "model": self.facts.served,
                        "messages": messages,
                        "add_generation_prompt": True,
                    },
                )["count"]
            )
        if kind == "llama.cpp":
            prompt = self._post_json("/apply-template", {"messages": messages})["prompt"]
            return len(self._post_json("/tokenize", {"content": prompt})["tokens"])
        text = "\n".join(f"{m['role']}\n{m.get('content') or ''}" for m in messages)
        return self.count_text(text) + TEMPLATE_TOKENS + MESSAGE_TOKENS * len(messages)

    def _most_tokens(self, text: str) -> int:
        """An upper bound without asking the server: a token is at least a byte (plus the
        template's tokens, for a chat)."""
        return len(text.encode("utf-8")) + 2

    def trim(
        self, messages: list[dict], params: SamplingParams, options: ChatOptions | None = None
    ) -> Trimmed:
        """Check the messages and drop the oldest turns until the reply fits the context
        (chat.trim_history, over the server's counts). Trimmed.prompt_ids is empty: the
        server tokenizes."""
        if not self.has_chat_template:
            raise NoChatTemplate(self.name)
        messages = check_messages(messages)
        limit = self.context_length - params.max_new_tokens
        bound = sum(
            self._most_tokens(json.dumps(m, ensure_ascii=False)) + 4 * MESSAGE_TOKENS
            for m in messages
        )
        if bound + 8 * TEMPLATE_TOKENS <= limit:  # surely fits: no request to count it
            return Trimmed(messages, [], 0)
        trimmed = trim_history(
            _ServerCounts(self), messages, self.context_length, params.max_new_tokens
        )
        return Trimmed(trimmed.messages, [], trimmed.dropped)

    def _prompt_text(self, prompt, params: SamplingParams, trim: bool):
        """A completion prompt as sent: text (control characters dropped) or token ids; too
        long for the context with max_new_tokens: ChatError, or with `trim` the oldest part
        dropped (by the server's counts, or the estimate)."""
        limit = self.context_length - params.max_new_tokens
        if not isinstance(prompt, str):
            ids = list(prompt)
            if not ids:
                raise ChatError("'prompt' is empty; give at least one token", "prompt")
            if len(ids) > limit and not (trim and limit > 0):
                raise _too_long(len(ids), params, self.context_length)
            return ids[max(len(ids) - limit, 0) :]
        text = clean_text(prompt)
        if not text:
            raise ChatError("'prompt' is empty; give the text to continue", "prompt")
        if self._most_tokens(text) <= limit:
            return text
        n = self.count_text(text)
        if n <= limit:
            return text
        if not trim or limit <= 0:
            if not self.facts.tokenize:  # only an estimate: the server decides
                return text
            raise _too_long(n, params, self.context_length)
        while n > limit and text:  # keep the newest part: cut in proportion, then recount
            text = text[len(text) - int(len(text) * limit / n * 0.95) :]
            n = self.count_text(text)
        return text

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

    def _counter(self, prompt):
        """prompt_tokens() of a completion prompt for _start: ids are their own count, text
        the server's (None with only an estimate)."""
        if not isinstance(prompt, str):
            return lambda: len(prompt)
        return (lambda: self.count_text(prompt)) if self.facts.tokenize else None

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


class _ServerCounts:
    """What chat.trim_history asks of a tokenizer, answered with the server's counts: the
    "rendered" prompt is the messages themselves, its "ids" as many as the server counts."""

    chat_template = "the server's"

    def __init__(self, engine: RemoteEngine):
        self.engine = engine

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        return messages

    def __call__(self, messages, add_special_tokens=False):
        return {"input_ids": range(self.engine.count_chat(messages))}


class RemoteStream:
    """A reply read from the server's event stream, as the local engine's Stream: iterate for
    Chunks (the last has done=True and the stats). Closing it, dropping it or setting `cancel`
    closes the HTTP response at the next chunk, and the last chunk says "cancelled"."""

    def __init__(
        self,
        engine: RemoteEngine,
        response: httpx.Response,
        started: float,
        cancel: threading.Event,
        inspector,
        dropped: int,
        chat: bool,
        prompt_tokens=None,
    ):
        self.engine, self.response, self.cancel = engine, response, cancel
        self.inspector, self.dropped, self.chat = inspector, dropped, chat
        self.prompt_tokens = prompt_tokens
        self.stats = GenerationStats()
        self.stats.started = started
        self._closed = threading.Event()  # this stream only (`cancel` may be shared)
        self._ended = False
        self._end_lock = threading.Lock()
        self._items = self._chunks()

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        return next(self._items)

    def close(self) -> None:
        self._closed.set()
        try:
            self._items.close()
        except ValueError:  # being read on another thread: it stops at its next chunk
            return
        self._end()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- at interpreter exit the client may be gone
            pass

    def _count_prompt(self) -> int:
        try:
            return self.prompt_tokens()
        except (RemoteError, ConfigError, KeyError, TypeError, ValueError):
            return 0  # a count that fails costs the reply nothing

    def _stopping(self) -> bool:
        return self.cancel.is_set() or self._closed.is_set()

    def _end(self) -> None:
        """Close the response and give back the place in the queue, once."""
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
        self.response.close()
        self.engine._release()

    def _chunks(self) -> Iterator[Chunk]:
        stats, finish, done, usage = self.stats, None, False, None
        calls = _Calls()
        try:
            for event in self._events():
                if event is None:  # [DONE]
                    done = True
                    break
                if self._stopping():
                    break
                usage = event.get("usage") or usage
                for text, finish_now, reasoning, deltas in self._take(event):
                    finish = finish_now or finish
                    calls.add(deltas)
                    if text or reasoning or deltas:
                        yield Chunk(text, [], stats, reasoning=reasoning, tool_calls=deltas)
                if self._stopping():
                    break
            if self._stopping() and not done:
                stats.finish_reason = "cancelled"
            elif finish is None and not done:
                raise self.engine._cut()
            else:
                stats.finish_reason = finish or "stop"
            if isinstance(usage, dict):
                stats.prompt_tokens = _int(usage.get("prompt_tokens"), stats.prompt_tokens)
                stats.new_tokens = _int(usage.get("completion_tokens"), stats.new_tokens)
            if (
                not stats.prompt_tokens
                and self.prompt_tokens
                and stats.finish_reason != "cancelled"
            ):  # the server sent no usage
                stats.prompt_tokens = self._count_prompt()
            stats.total_s = time.perf_counter() - stats.started
            yield Chunk(
                "", [], stats, done=True, dropped_messages=self.dropped, calls=calls.whole()
            )
        finally:
            self._end()

    def _events(self) -> Iterator[dict | None]:
        """The stream's JSON events, then None for [DONE]; RemoteError for an error event,
        something that is not JSON, or a connection that broke."""
        try:
            for line in self.response.iter_lines():
                if self._stopping():
                    return
                field, _, value = line.partition(":")
                value = value.strip()
                if field == "data" and value == "[DONE]":
                    yield None
                    return
                if field in ("data", "error"):
                    yield self._event(value, field)
                elif line and not line.startswith(":") and field not in ("event", "id", "retry"):
                    raise self.engine._error(
                        f"it sent a line that is not an event: {_snippet(line)}"
                    )
        except httpx.TimeoutException:
            raise self.engine._error(f"the server sent nothing for {TIMEOUT.read:.0f} s") from None
        except httpx.HTTPError as e:
            if self._stopping():
                return
            raise self.engine._cut(_network_reason(e)) from None

    def _event(self, value: str, field: str) -> dict:
        try:
            event = json.loads(value)
        except json.JSONDecodeError:
            raise self.engine._error(
                f"it sent an event that is not JSON: {_snippet(value)}"
            ) from None
        if not isinstance(event, dict):
            raise self.engine._error(f"it sent an event that is not an object: {_snippet(value)}")
        message = _error_message(event)
        if field == "error" or message:
            raise self.engine._error(f"the server failed: {message or _snippet(value)}")
        if not isinstance(event.get("choices", []), list):
            raise self.engine._error(f"it sent an event without choices: {_snippet(value)}")
        return event

    def _take(self, event: dict) -> Iterator[tuple[str, str | None]]:
        """(text, finish reason) of the event's first choice; counts its tokens, times the
        first one, and hands its logprobs to the inspector."""
        for choice in event.get("choices", [])[:1]:
            if not isinstance(choice, dict):
                continue
            delta = (choice.get("delta") if self.chat else choice) or {}
            text = delta.get("content" if self.chat else "text") or ""
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            deltas = delta.get("tool_calls") or []
            steps = _logprob_steps(choice.get("logprobs"))
            if text or steps or reasoning or deltas:
                now = time.perf_counter()
                if not self.stats.ttft_s:
                    self.stats.ttft_s = now - self.stats.started
                self.stats.total_s = now - self.stats.started
                self.stats.new_tokens += len(steps) or 1
                self._inspect(text, steps)
            yield (
                text if isinstance(text, str) else str(text),
                choice.get("finish_reason"),
                reasoning if isinstance(reasoning, str) else "",
                [d for d in deltas if isinstance(d, dict)] if isinstance(deltas, list) else [],
            )

    def _inspect(self, text: str, steps: list) -> None:
        if self.inspector is None:
            return
        if not steps:  # the server gave no logprobs: the text, without probabilities
            self.inspector.add_remote_step(text, None, [])
        for token, logprob, top in steps:
            self.inspector.add_remote_step(token, logprob, top)


def _chat_fields(options: ChatOptions | None) -> dict:
    """A chat request's tools and switches as the OpenAI API names them (only those set)."""
    if options is None:
        return {}
    out = {}
    if options.tools:
        out["tools"] = options.tools
        choice = options.tool_choice
        out["tool_choice"] = (
            choice if choice in TOOL_CHOICES else {"type": "function", "function": {"name": choice}}
        )
        if not options.parallel_tool_calls:
            out["parallel_tool_calls"] = False
    kwargs = options.kwargs()
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    if options.reasoning_budget is not None:
        out["reasoning_budget"] = options.reasoning_budget
    return out


class _Calls:
    """Tool calls streamed as OpenAI's deltas, joined as the SDK joins them (by index)."""

    def __init__(self):
        self.by_index: dict[int, dict] = {}

    def add(self, deltas: list[dict]) -> None:
        for d in deltas:
            call = self.by_index.setdefault(
                int(d.get("index", 0)), {"id": "", "name": "", "arguments": ""}
            )
            fn = d.get("function") or {}
            call["id"] = d.get("id") or call["id"]
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""

    def whole(self) -> list[ToolCall]:
        return [
            ToolCall(c["id"] or new_call_id(), c["name"], c["arguments"])
            for _, c in sorted(self.by_index.items())
        ]


def _inspector(observer):
    """The Inspector (or API recorder) behind an observer (its bound `observe`), if it takes
    a server's logprobs; None otherwise."""
    owner = getattr(observer, "__self__", None)
    return owner if hasattr(owner, "add_remote_step") else None


def _logprob_steps(logprobs) -> list[tuple[str, float | None, list]]:
    """(token, logprob, [(text, logprob)] alternatives) per token, from chat's
    {"content": [...]} or completions' {"tokens", "token_logprobs", "top_logprobs"}."""
    if not isinstance(logprobs, dict):
        return []
    if isinstance(logprobs.get("content"), list):
        return [
            (
                str(e.get("token", "")),
                _float(e.get("logprob")),
                [
                    (str(t.get("token", "")), _float(t.get("logprob"), -math.inf))
                    for t in e.get("top_logprobs") or []
                    if isinstance(t, dict)
                ],
            )
            for e in logprobs["content"]
            if isinstance(e, dict)
        ]
    tokens = logprobs.get("tokens")
    if not isinstance(tokens, list):
        return []
    values = logprobs.get("token_logprobs") or [None] * len(tokens)
    tops = logprobs.get("top_logprobs") or [{}] * len(tokens)
    return [
        (
            str(t),
            _float(v),
            sorted(
                ((str(k), _float(p, -math.inf)) for k, p in (top or {}).items()),
                key=lambda kv: -kv[1],
            ),
        )
        for t, v, top in zip(tokens, values, tops)
    ]


def stage_fields(params: SamplingParams, flavor: str, model: str) -> dict:
    """Every stage's settings as this kind of server names them. Sent when off too (llama.cpp's
    own defaults are not off), except to a server without the stage (OpenAI refuses fields it
    does not know); a stage that is on where the server lacks it is a ConfigError naming it,
    never a silent drop. The same for a stage order."""
    body = {}
    for stage in STAGES.values():
        if not stage.params:
            continue  # the logit bias and the grammar: their own fields
        if flavor not in stage.remote:
            if stage.is_on(params):
                raise ConfigError(
                    f"the server of model '{model}' ({flavor}) has no {stage.label} stage: "
                    f"switch it off ({', '.join(p.name for p in stage.params)}) for this model",
                    stage.params[0].name,
                )
            continue
        names = stage.remote_names.get(flavor, {})
        for p in stage.params:
            value = getattr(params, p.name)
            body[names.get(p.name, p.name)] = list(value) if isinstance(value, tuple) else value
    if params.samplers:
        if flavor not in ORDERS:
            raise ConfigError(
                f"the server of model '{model}' ({flavor}) takes no sampler order: leave "
                "'samplers' at the default for this model",
                "samplers",
            )
        body["samplers"] = list(params.samplers)
    return body


def _format_fields(params: SamplingParams, flavor: str) -> dict | None:
    """The output format as the server takes it: response_format for JSON, vLLM's
    structured_outputs for the others (llama.cpp: its GBNF `grammar`); None when this server
    has no way to hold a reply to it (it would ignore the field: never silently dropped)."""
    c = params.constraint
    if c is None:
        return {}
    if c.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if c.kind == "json_schema":
        return {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(c.value), "strict": True},
            }
        }
    if flavor in ("llama.cpp", "llama-cpp-python"):
        if c.kind == "choice":
            return {"grammar": "root ::= " + " | ".join(json.dumps(x) for x in json.loads(c.value))}
        if c.kind == "grammar" and "::=" in c.value:
            return {"grammar": c.value}
        return None
    if flavor == "ollama":
        return None
    key = {"regex": "regex", "choice": "choice", "grammar": "grammar"}[c.kind]
    return {"structured_outputs": {key: json.loads(c.value) if c.kind == "choice" else c.value}}


def _flavor(entry: dict) -> str:
    """Which server, from its /v1/models entry (confirmed by its own endpoints later)."""
    owner = str(entry.get("owned_by", "")).lower()
    if "max_model_len" in entry or owner == "vllm":
        return "vllm"
    if owner == "llamacpp":
        return "llama.cpp"
    if owner in ("library", "ollama"):
        return "ollama"
    if owner == "miniserve" or "context_length" in entry:
        return "miniserve"
    if owner == "me":  # llama-cpp-python's server
        return "llama-cpp-python"
    return "openai"


def _count_source(kind: str) -> str:
    return {
        "vllm": "the server's /tokenize (vLLM's, with the chat template)",
        "llama.cpp": "the server's /apply-template and /tokenize",
        "extras": "the server's /extras/tokenize (the chat template's tokens estimated)",
    }.get(
        kind, f"an estimate (~{BYTES_PER_TOKEN} bytes a token; the server has no tokenize endpoint)"
    )


def _too_long(n: int, params: SamplingParams, context: int) -> ChatError:
    room = max(context - params.max_new_tokens, 0)
    return ChatError(
        f"'prompt' is {n} tokens, but with max_new_tokens={params.max_new_tokens} "
        f"the context window of {context} tokens leaves room for {room}; shorten "
        "it or lower max new tokens",
        "prompt",
    )


def _json(r: httpx.Response):
    try:
        return r.json()
    except (ValueError, RuntimeError):  # not JSON; or the body could not be read
        return None


def _error_message(data) -> str | None:
    """The message of an error body: OpenAI's {"error": {"message"}}, {"error": "..."},
    vLLM's {"object": "error", "message"}, FastAPI's {"detail": ...}."""
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    if data.get("object") == "error" and data.get("message"):
        return str(data["message"])
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail:  # FastAPI's validation errors
        first = detail[0] if isinstance(detail[0], dict) else {}
        where = ".".join(str(x) for x in first.get("loc", [])[1:])
        return f"'{where}': {first.get('msg', detail[0])}" if where else str(first.get("msg"))
    return None


def _what(r: httpx.Response) -> str:
    """What a body that is not what was asked for looks like, in a few words."""
    kind = r.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    try:
        text = r.text
    except (ValueError, RuntimeError):
        text = ""
    if "html" in kind or text.lstrip()[:15].lower().startswith(("<!doctype", "<html")):
        return "an HTML page"
    return f"{kind}: {_snippet(text)}" if text.strip() else f"an empty {kind} body"


def _snippet(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


def _network_reason(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.ConnectTimeout):
        return f"no answer within {TIMEOUT.connect:.0f} s"
    if isinstance(e, httpx.ConnectError):
        return "connection refused or host unknown (is the server running?)"
    if isinstance(e, httpx.TimeoutException):
        return "it took too long to answer"
    if isinstance(e, httpx.UnsupportedProtocol):
        return "not an http:// or https:// address"
    return f"{type(e).__name__}: {str(e) or 'the connection broke'}"


def _int(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _float(value, default=None):
    return (
        float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
    )
