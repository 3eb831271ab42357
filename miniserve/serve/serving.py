"""Serving the API's requests: which model answers (loaded on first use, held while it
answers), starting a request's choices on the engine (all or none), and writing the reply
whole or streamed. The routes (routes.py) call this; the checks are in protocol.py and
parse.py, the reply objects in shapes.py, the handing-over from the engine's thread in
bridge.py.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from miniserve.core.config import SEED_MAX
from miniserve.core.errors import Busy
from miniserve.engine.chat import render
from miniserve.models.registry import Models, UnknownModel
from miniserve.serve.bridge import Choices, read_remote, until_disconnect
from miniserve.serve.errors import APIError, as_user_error, error_event
from miniserve.serve.metrics import retry_after
from miniserve.serve.parse import APIRequest, no_chat_template
from miniserve.serve.protocol import TokenizeRequest
from miniserve.serve.shapes import LogprobRecorder, TextShape, events, shape_of


class Lease:
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


class OpenAIServing:
    """The API over a Models registry (or one engine), with its key when it has one."""

    def __init__(self, models, api_key: str | None = None):
        self.models = Models.of(models)
        self.api_key = api_key

    def authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(
                "missing or wrong API key: send 'Authorization: Bearer KEY'",
                status=401,
                kind="authentication_error",
                code="invalid_api_key",
            )

    def resolve(self, model: str | None) -> str:
        """The served name `model` means. Unknown: 404 naming the request's field, with
        OpenAI's code for it."""
        try:
            return self.models.resolve(model)
        except UnknownModel as e:
            raise APIError(str(e), "model", status=404, code="model_not_found") from None

    async def open(self, model: str | None) -> Lease:
        """The lease on the model the request names, loaded (whatever loading raised: 502,
        said with the name; the other models keep answering)."""
        lease = Lease(self.models, self.resolve(model))
        try:
            await lease.acquire()
        except Exception as e:  # noqa: BLE001
            raise APIError(
                f"model '{lease.name}' could not be loaded: {e}",
                "model",
                status=502,
                kind="server_error",
                code="model_unavailable",
            ) from None
        return lease

    @staticmethod
    def tokenize(body: TokenizeRequest, engine) -> dict:
        """vLLM's /tokenize: `prompt` (text, as completions tokenizes it) or `messages` (with
        the chat template, the assistant's turn opened). Only a model whose tokenizer is here."""
        if not engine.capabilities.local_tokens:
            raise APIError(f"'model': {engine.name} is a remote model; ask its server", "model")
        if body.messages is not None:
            if not engine.has_chat_template:
                raise no_chat_template(engine.name)
            ids = render(engine.tokenizer, body.messages)  # checked: role and content
        elif body.prompt is not None:
            ids = engine.tokenizer(body.prompt)["input_ids"]
        else:
            raise APIError("give 'prompt' (a string) or 'messages'", "prompt")
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}

    # -- responses --------------------------------------------------------------------------
    async def start(self, req: APIRequest) -> Choices:
        """Admit the request's choices as engine requests, all or none (429 when they do not
        all fit). The engine hands their chunks to the event loop: no thread waits on them
        (a remote engine's reply is read on a thread of its own: it waits on the network)."""
        engine, n, total = req.engine, req.settings.n, req.choices
        over_network = engine.capabilities.over_network
        free = engine.max_queue - engine.queue_depth
        need = f"n={n}" if len(req.prompts) == 1 else f"{len(req.prompts)} prompts x n={n}"
        if total > engine.max_queue:  # never fits: waiting would not help
            raise APIError(
                f"{need} asks for {total} choices at once and this server's queue holds "
                f"{engine.max_queue} (--max-queue): ask for fewer",
                "n" if len(req.prompts) == 1 else "prompt",
            )
        if total > free:
            busy = Busy(
                "the server is busy; try again in a moment"
                if total == 1
                else f"the server is busy: {need} needs {total} places in the queue and "
                f"{max(free, 0)} are free; try again in a moment"
            )
            raise APIError.busy(busy, retry_after(engine, total - max(free, 0)))
        choices = Choices(asyncio.get_running_loop())
        try:
            for i in range(total):
                if over_network:  # sent now: a refusal or a failure is this reply's status
                    await self._start_remote_choice(req, i, choices)
                else:
                    self._start_choice(req, i, choices)
        except BaseException as e:  # start none: cancel those already queued
            choices.stop()
            if isinstance(e, Exception):  # the engine's own admission checks, a remote refusal
                error = as_user_error(e, req.model, over_network)
                if isinstance(error, Busy):  # another request took the last places first
                    error = APIError.busy(error, retry_after(engine, total))
                raise error from None
            raise
        return choices

    @staticmethod
    def _choice(req: APIRequest, index: int):
        """(prompt, params, logprob recorder) of choice `index`: choice j of a prompt."""
        prompt, j = divmod(index, req.settings.n)
        params = req.settings.params
        if params.seed is not None and j:
            params = params.replace(seed=(params.seed + j) % (SEED_MAX + 1))
        recorder = None
        if req.logprobs:
            engine = req.engine
            remote = engine.capabilities.over_network
            # a remote reply's chunks carry no token ids: where stop strings may cut it, the
            # recorder places each token in the answer's text
            recorder = LogprobRecorder(
                engine.tokenizer,
                req.top_logprobs,
                getattr(engine, "eos_ids", frozenset()),
                local=not remote,
                places=remote and bool(params.stop),
            )
        return req.prompts[prompt], params, recorder

    def _start_choice(self, req: APIRequest, index: int, choices: Choices) -> None:
        prompt, params, recorder = self._choice(req, index)
        req.engine.submit(
            prompt,
            params,
            choices.sink(index),
            cancel=choices.cancel,
            observer=recorder.observe if recorder else None,
            plan=req.plan,
            speculate=req.speculate,
        )
        choices.started(recorder)  # after submit: a choice that did not start is not waited for

    async def _start_remote_choice(self, req: APIRequest, index: int, choices: Choices) -> None:
        """Send one choice to a remote engine (off the event loop: it waits on the network),
        then read its reply on a thread of its own, which hands each item to the sink as the
        local engine thread does. Its own cancel event: a finished stream may set the event it
        was given, which must not end the other choices; the request's Stop closes it."""
        prompt, params, recorder = self._choice(req, index)
        own = threading.Event()
        observer = recorder.observe if recorder else None
        if req.kind == "chat":
            stream = await asyncio.to_thread(
                req.engine.chat, prompt, params, req.options, cancel=own, observer=observer
            )
        else:
            stream = await asyncio.to_thread(
                req.engine.complete_text, prompt, params, cancel=own, observer=observer
            )
        choices.on_stop(lambda: (own.set(), stream.close()))
        read_remote(stream, choices.sink(index))
        choices.started(recorder)

    @staticmethod
    def _usage(req: APIRequest, last: list) -> dict:
        # each prompt counted once, whatever its number of choices
        prompt = sum(last[p * req.settings.n].stats.prompt_tokens for p in range(len(req.prompts)))
        completion = sum(c.stats.new_tokens for c in last)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if req.kind == "chat":
            reasoning = sum(c.stats.reasoning_tokens for c in last)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    @staticmethod
    def _finish(stats) -> str:
        """OpenAI's finish reasons, and one of ours: "no_token_allowed" when the output
        format (its grammar) and logit_bias left no token that could come next."""
        if stats.finish_reason in ("length", "no_token_allowed", "tool_calls"):
            return stats.finish_reason
        return "stop"

    async def complete(self, req: APIRequest, choices: Choices) -> dict:
        parts: list[list[str]] = [[] for _ in range(req.choices)]
        thought: list[list[str]] = [[] for _ in range(req.choices)]
        last: list = [None] * req.choices
        try:
            while choices.running:
                for i, chunk, error in await choices.next_batch():
                    if error is not None:
                        raise as_user_error(
                            error, req.model, req.engine.capabilities.over_network
                        ) from None
                    if chunk is not None:
                        took(choices, i, chunk)
                        parts[i].append(chunk.text)
                        thought[i].append(chunk.reasoning)
                        if chunk.done:
                            last[i] = chunk
                    elif last[i] is None:
                        raise RuntimeError(f"choice {i} ended without its final chunk")
        finally:
            choices.stop()
        shape = shape_of(req, choices)
        return {
            "id": f"{shape.prefix}-{uuid.uuid4().hex[:24]}",
            "object": shape.object,
            "created": int(time.time()),
            "model": req.model,
            "choices": [
                shape.whole(
                    i,
                    "".join(parts[i]),
                    self._finish(last[i].stats),
                    reasoning="".join(thought[i]),
                    calls=last[i].calls,
                )
                for i in range(req.choices)
            ],
            "usage": self._usage(req, last),
            "system_fingerprint": "miniserve",
        }

    def prompt_only(self, req: APIRequest):
        """`max_tokens: 0` on /v1/completions: nothing generated, the prompt (with echo) and
        its log-probabilities (with logprobs) -- how evaluation harnesses score a text's
        likelihood. Every choice alike, finish_reason "length"."""
        shape = TextShape(req, None)
        choices = [shape.prompt_only(i) for i in range(req.choices)]
        prompt_tokens = sum(len(p) for p in req.prompts)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": prompt_tokens,
        }
        if not req.settings.stream:
            return {
                "id": f"{shape.prefix}-{uuid.uuid4().hex[:24]}",
                "object": shape.object,
                "created": int(time.time()),
                "model": req.model,
                "choices": choices,
                "usage": usage,
                "system_fingerprint": "miniserve",
            }
        event = events(req, shape)
        body = (
            "".join(event(c) for c in choices)
            + (event(None, usage) if req.settings.include_usage else "")
            + "data: [DONE]\n\n"
        )
        return StreamingResponse(
            iter([body]), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def stream(self, req: APIRequest, choices: Choices, lease: Lease):
        shape = shape_of(req, choices)
        event = events(req, shape)

        last: list = [None] * req.choices
        try:
            opening = "".join(
                event(c) for i in range(req.choices) if (c := shape.opening(i)) is not None
            )
            if opening:
                yield opening
            while choices.running:
                # every chunk that arrived since the last write goes out in one write
                out = []
                for i, chunk, error in await choices.next_batch():
                    if error is not None or (chunk is None and last[i] is None):
                        out.append(error_event(error))
                        yield "".join(out)
                        return
                    if chunk is None:
                        continue
                    took(choices, i, chunk)
                    if chunk.text or chunk.reasoning or chunk.tool_calls:
                        out.append(
                            event(
                                shape.piece(i, chunk.text, None, chunk.reasoning, chunk.tool_calls)
                            )
                        )
                    if chunk.done:
                        last[i] = chunk
                        out.append(event(shape.piece(i, "", self._finish(chunk.stats))))
                if out:
                    yield "".join(out)
            tail = [event(None, usage=self._usage(req, last))] if req.settings.include_usage else []
            yield "".join(tail) + "data: [DONE]\n\n"
        finally:
            end(choices, lease)  # the client went away (this generator was cancelled) or done


def took(choices: Choices, i: int, chunk) -> None:
    """Choice i's logprobs may show the tokens of its chunk, now that it is written."""
    recorder = choices.choices[i].recorder
    if recorder is not None:
        recorder.took(chunk)


def end(choices: Choices, lease: Lease) -> None:
    choices.stop()
    lease.release()


async def whole_reply(request: Request, reply, choices: Choices):
    """The reply once it is complete, unless the client goes away first (then its choices
    are cancelled)."""
    reply = asyncio.ensure_future(reply)
    gone = asyncio.ensure_future(until_disconnect(request.receive))
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
