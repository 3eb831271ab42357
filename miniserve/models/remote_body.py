"""The body of a request to a remote server (miniserve/models/remote.py), field by field: the
sampler stages' settings as each kind of server names them, the output format as it takes it,
and a chat's tools and template switches as the OpenAI API names them."""

from __future__ import annotations

import json

from miniserve.core.config import ConfigError, SamplingParams
from miniserve.core.samplers import STAGES
from miniserve.engine.chat import TOOL_CHOICES, ChatOptions

TOP_LOGPROBS = 5  # alternatives asked for when the token inspector is on
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (an API client may ask for more than the inspector)
# Which stages each kind of server has, and its names for their settings: the stages'
# declarations (miniserve/core/samplers.py, Stage.remote and Stage.remote_names).
ORDERS = ("llama.cpp", "miniserve")  # servers that take a `samplers` order


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
