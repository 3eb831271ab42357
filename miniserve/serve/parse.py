"""From a validated request (protocol.py) to what the engine starts: the checks only the model
can make, which no schema can state -- max_tokens within its context window, token ids and
logit-bias ids within its vocabulary, the output format compiled by its grammar library, its
chat template, the conversation or prompt fitting its context -- and the prompts as it takes
them (token ids for a model here; messages or text for one served over the network).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from miniserve.core.config import MAX_NEW_TOKENS, ConfigError, SamplingParams, check_number
from miniserve.core.config import Field as Limit
from miniserve.engine.chat import NoChatTemplate
from miniserve.engine.grammar import GrammarError
from miniserve.engine.stream import token_text
from miniserve.serve.errors import APIError, as_user_error
from miniserve.serve.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    api_defaults,
)


@dataclass
class Settings:
    """What both routes take alike, checked."""

    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int  # as asked: 0 (completions only) scores the prompt, generating nothing


@dataclass
class APIRequest:
    """A checked request, ready to start: `prompts` are token ids for a local engine, what
    the remote engine takes (messages, a prompt) for a remote one."""

    model: str  # the served name
    engine: object
    kind: str  # "chat" or "text"
    prompts: list
    settings: Settings
    logprobs: bool = False
    top_logprobs: int = 0
    echo: list | None = None  # text: per prompt, (its text, its tokens' logprob entries)
    options: object = None  # chat: the ChatOptions (tools, template switches, thinking)
    plan: object = None  # chat, a model here: how the reply starts and what steers it
    speculate: bool | None = None  # the request's switch (None: the server's)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.settings.n


def no_chat_template(model: str) -> APIError:
    return APIError(str(NoChatTemplate(model)), "messages", code="model_has_no_chat_template")


def settings(
    body: SamplingRequest,
    engine,
    default_max_tokens: int,
    max_tokens_fields: tuple[str, ...],
    least_tokens: int = 1,
) -> Settings:
    """The settings both routes share, with what only the model can check: the token limit
    (each of `max_tokens_fields` given in [least_tokens, its context]; the first one given
    counts), the logit-bias ids in its vocabulary, the output format compiled once."""
    # the tokens one reply may generate (MAX_NEW_TOKENS), within the model's context where it
    # is known: past it, a 400 naming the limit (as OpenAI answers past a model's output
    # limit), not a reply silently cut there
    ceiling = min(engine.context_length or MAX_NEW_TOKENS, MAX_NEW_TOKENS)
    given = [
        check_number(
            name,
            getattr(body, name),
            Limit(int, least_tokens, ceiling, default_max_tokens, name, ""),
        )
        for name in max_tokens_fields
        if getattr(body, name) is not None
    ]
    max_tokens = given[0] if given else default_max_tokens
    constraint, constraint_field = body.constraint()
    sampling = {
        name: default if getattr(body, name) is None else getattr(body, name)
        for name, default in api_defaults().items()
    }
    params = SamplingParams(
        **sampling,
        samplers=body.samplers,
        max_new_tokens=max(max_tokens, 1),
        seed=body.seed,
        stop=tuple(body.stop or ()),
        logit_bias=body.logit_bias,
        constraint=constraint,
    )
    try:
        engine.check(params)  # ids in the vocabulary; the format compiled once
    except GrammarError as e:
        raise APIError(f"'{constraint_field}': {e}", constraint_field) from None
    return Settings(params, body.n or 1, bool(body.stream), body.include_usage, max_tokens)


async def chat_request(body: ChatCompletionRequest, model: str, engine) -> APIRequest:
    """A chat request for `engine`: its template applied, the conversation fitting its context
    with max_tokens (never cut: 400)."""
    if not engine.has_chat_template:
        raise no_chat_template(model)
    checked = settings(body, engine, DEFAULT_MAX_TOKENS, ("max_completion_tokens", "max_tokens"))
    params = checked.params
    messages = body.messages  # checked: [{"role", "content": text}, ...]
    options = body.options()
    if engine.capabilities.over_network:  # counted by its server (a request): off the loop
        try:
            trimmed = await asyncio.to_thread(engine.trim, messages, params, options)
        except Exception as e:  # noqa: BLE001 -- a refusal as it is; a failure: the server's
            raise as_user_error(e, model, over_network=True) from None
    else:
        trimmed = engine.trim(messages, params, options)
    if trimmed.dropped:  # sent on purpose: never cut it
        raise APIError(
            f"the conversation is longer than the context window of "
            f"{engine.context_length} tokens allows with "
            f"max_tokens={params.max_new_tokens}; shorten it",
            "messages",
            code="context_length_exceeded",
        )
    prompt = trimmed.prompt_ids if engine.capabilities.local_tokens else trimmed.messages
    return APIRequest(
        model,
        engine,
        "chat",
        [prompt],
        checked,
        bool(body.logprobs),
        (body.top_logprobs or 0) if body.logprobs else 0,
        options=options,
        plan=trimmed.plan,
        speculate=None if body.speculate is None else body.speculate == "ngram",
    )


async def text_request(body: CompletionRequest, model: str, engine) -> APIRequest:
    """A completion request for `engine`: each prompt as token ids fitting its context (for a
    model here), and the echoed prompts scored when logprobs are asked."""
    checked = settings(body, engine, DEFAULT_COMPLETION_TOKENS, ("max_tokens",), least_tokens=0)
    top, echo = body.logprobs, bool(body.echo)
    prompts = body.prompts()
    fields = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
    req = APIRequest(model, engine, "text", prompts, checked, top is not None, top or 0)
    req.speculate = None if body.speculate is None else body.speculate == "ngram"
    if not engine.capabilities.local_tokens:  # the prompt's tokens are its server's
        if checked.max_tokens == 0:
            raise APIError(
                f"'max_tokens': 0 (the prompt scored, nothing generated) is not "
                f"available for the remote model '{model}': its prompt's "
                "log-probabilities are its server's",
                "max_tokens",
                code="unsupported_parameter",
            )
        if echo and (top is not None or any(isinstance(p, list) for p in prompts)):
            raise APIError(
                f"'echo' with {'logprobs' if top is not None else 'token ids'} is "
                f"not available for the remote model '{model}': its prompt tokens "
                "and their log-probabilities are its server's",
                "echo",
                code="unsupported_parameter",
            )
        req.echo = [(p, []) for p in prompts] if echo else None
        return req
    req.prompts = [_prompt_ids(engine, p, checked, f) for p, f in zip(prompts, fields)]
    if echo:
        req.echo = [await _echo(engine, p, ids, top) for p, ids in zip(prompts, req.prompts)]
    return req


def _prompt_ids(engine, prompt, checked: Settings, field: str) -> list[int]:
    vocab = engine.runner.config.vocab_size
    if isinstance(prompt, list):
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ConfigError(
                f"'{field}': token id {bad} is out of range: the vocabulary has ids 0..{vocab - 1}",
                field,
            )
    # too long for the context with max_tokens: a ChatError naming the field
    return engine.prompt_ids(prompt, checked.params, field=field, new_tokens=checked.max_tokens)


async def _echo(engine, prompt, ids: list[int], top: int | None) -> tuple[str, list]:
    """The echoed prompt: its text, and with logprobs its tokens' entries (the first without
    a logprob: nothing comes before it to predict it)."""
    text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)
    if top is None:
        return text, []
    token = [token_text(engine.tokenizer, i) for i in ids]  # (text, bytes)
    # the model runs on its engine thread; this waits for it off the event loop
    scored = await asyncio.to_thread(engine.prompt_logprobs, ids, top)
    entries = [(token[0][0], None, None, token[0][1])]
    for pos, (logprob, alts) in enumerate(scored, 1):
        best = {token_text(engine.tokenizer, i)[0]: lp for i, lp in alts}
        best[token[pos][0]] = logprob
        entries.append((token[pos][0], logprob, best, token[pos][1]))
    return text, entries
