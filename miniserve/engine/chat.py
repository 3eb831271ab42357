"""Conversations: message checks, the chat template, and trimming history to fit.

Trimming is a pure function of token counts: the system prompt and the newest user
message always stay, room is reserved for the reply (max_new_tokens), and the oldest
turns go first. The caller is told how many messages were dropped.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from miniserve.core.errors import UserError
from miniserve.core.text import clean_text

ROLES = ("system", "user", "assistant", "tool")
TOOL_CHOICES = ("auto", "none", "required")


@dataclass
class ChatOptions:
    """What a chat request asks of the template and the reply besides its messages: tools
    (OpenAI's [{type: "function", function: {name, description, parameters}}]), how they may
    be called (`tool_choice`: auto, none, required, or a function's name), the template's own
    switches (`template_kwargs`, e.g. enable_thinking), thinking on/off (None: the template's
    default) and the reasoning budget in tokens (None: no limit)."""

    tools: list = field(default_factory=list)
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    template_kwargs: dict = field(default_factory=dict)
    thinking: bool | None = None
    reasoning_budget: int | None = None

    def kwargs(self) -> dict:
        """The template's keyword arguments: thinking off is `enable_thinking: false`."""
        out = dict(self.template_kwargs)
        if self.thinking is not None:
            out.setdefault("enable_thinking", self.thinking)
        return out


NO_OPTIONS = ChatOptions()


class ChatError(UserError, ValueError):
    """A conversation that cannot be sent; `field` names the part that is wrong."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class ContextTooLong(ChatError):
    """A prompt that, with the tokens asked for, does not fit the context window."""

    code = "context_length_exceeded"


class NoChatTemplate(ChatError):
    """A chat request to a model without a chat template (a base model)."""

    def __init__(self, model: str):
        super().__init__(
            f"model '{model}' has no chat template (it is a base model, which continues text "
            "rather than answering messages): use completion mode -- the Notebook tab, "
            "`generate --raw` / `chat --raw`, or POST /v1/completions",
            "messages",
        )
        self.model = model


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _text(content, where: str, allow_none: bool = False) -> str | None:
    if content is None and allow_none:
        return None
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    if not isinstance(content, str):
        raise ChatError(f"'{where}.content' must be a string", f"{where}.content")
    return clean_text(content)


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as OpenAI sends them: [{id, type: "function",
    function: {name, arguments: JSON text}}] (arguments given as an object are kept as one)."""
    if not isinstance(calls, list):
        raise ChatError(f"'{where}.tool_calls' must be a list of calls", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(f"'{at}.function.name' must be a non-empty string", f"{at}.function")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise ChatError(f"'{at}.function.arguments' must be JSON text", f"{at}.function")
        out.append(
            {
                "id": str(call.get("id") or f"call_{j}"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def check_messages(messages, field: str = "messages") -> list[dict]:
    """Validate and normalise [{'role', 'content', ...}, ...] as OpenAI sends them: system,
    user, assistant (content may be null beside tool_calls; reasoning_content kept for the
    template to keep or drop) and tool messages (with tool_call_id). The conversation ends
    with a user message, tool results, or an assistant message to continue (prefill)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"'{field}' must be a non-empty list of {{role, content}} objects", field)
    out = []
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"'{where}' must be an object with 'role' and 'content'", where)
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name of the system role
            role = "system"
        if role not in ROLES:
            raise ChatError(
                f"'{where}.role' must be one of {', '.join(ROLES)} (or developer, the system "
                f"role's newer name), got {role!r}",
                f"{where}.role",
            )
        calls = _tool_calls(m["tool_calls"], where) if m.get("tool_calls") else []
        if calls and role != "assistant":
            raise ChatError(f"'{where}': only an assistant message has tool_calls", where)
        content = _text(m.get("content"), where, allow_none=role == "assistant")
        if content is None and not calls:
            content = ""
        msg = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        if role == "assistant" and m.get("reasoning_content") is not None:
            msg["reasoning_content"] = _text(m["reasoning_content"], f"{where}.reasoning_content")
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    last = out[-1]
    if last["role"] == "system":
        raise ChatError(
            f"the last of '{field}' must be a user message, tool results, or an assistant "
            "message to continue",
            field,
        )
    if last["role"] == "user" and not last["content"].strip():
        raise ChatError(
            "the message is empty; type something to send", f"{field}[{len(out) - 1}].content"
        )
    return out


def calls_as_text(messages: list[dict]) -> list[dict]:
    """For a template that cannot show tool calls: each assistant message's tool_calls written
    into its content as JSON, {"tool_calls": [{"name", "arguments", "id"}], "content"}, as
    llama.cpp's templates fill them in, so that the model still reads what it called before
    the tool messages that answer it (a template that drops them leaves an empty turn)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = c["function"]["arguments"]
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:  # not JSON: the text as it came
                        pass
                calls.append({"name": c["function"]["name"], "arguments": args, "id": c["id"]})
            body: dict = {"tool_calls": calls}
            if m.get("content"):
                body["content"] = m["content"]
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = json.dumps(body, ensure_ascii=False, indent=2)
        out.append(m)
    return out


def continues(messages: list[dict]) -> bool:
    """Whether the reply continues the last message (an assistant's: prefill)."""
    return bool(messages) and messages[-1]["role"] == "assistant"


def _for_template(m: dict) -> dict:
    """A message as templates read it: text content ("" where it is null: Qwen's template
    searches the content of every assistant message)."""
    return {**m, "content": m.get("content") or ""}


def template_text(
    tokenizer, messages: list[dict], options: ChatOptions = NO_OPTIONS, generation: bool = True
) -> str:
    """The model's chat template over the messages, with the tools and the template's switches
    passed to every render; ending with the assistant's turn opened (or, when the last message
    is an assistant's, inside it: the reply continues it). A template that refuses what it
    was given (its own raise_exception) is a ChatError with its words."""
    prefill = continues(messages)
    try:
        return tokenizer.apply_chat_template(
            [_for_template(m) for m in messages],
            tools=list(options.tools) or None,
            tokenize=False,
            add_generation_prompt=generation and not prefill,
            **({"continue_final_message": True} if prefill and generation else {}),
            **options.kwargs(),
        )
    except ChatError:
        raise
    except Exception as e:  # noqa: BLE001 -- jinja's TemplateError and what templates raise
        raise ChatError(
            f"the model's chat template refused the conversation: {e}", "messages"
        ) from None


def render(tokenizer, messages: list[dict], options: ChatOptions = NO_OPTIONS) -> list[int]:
    """The model's chat template as token ids, ending with the assistant's turn opened."""
    text = template_text(tokenizer, messages, options)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def takes_tools(tokenizer) -> bool:
    """Whether the chat template shows the model its tools: a probe tool with a random name
    appears in the rendered prompt."""
    name = "probe_" + secrets.token_hex(6)
    probe = [{"type": "function", "function": {"name": name, "description": "", "parameters": {}}}]
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}],
            tools=probe,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # noqa: BLE001 -- a template that refuses tools does not take them
        return False
    return isinstance(text, str) and name in text


def completion_ids(
    tokenizer,
    prompt,
    context_length: int,
    max_new_tokens: int,
    field: str = "prompt",
    trim: bool = False,
) -> list[int]:
    """A completion's prompt as ids: text is tokenized as the model's tokenizer does for plain
    text (with its BOS, if it adds one); a list of ids is taken as is. Too long for the context
    with max_new_tokens: ChatError -- or, with `trim`, the oldest tokens dropped (what a
    notebook that grows past the context does)."""
    if isinstance(prompt, str):
        text = clean_text(prompt)
        if not text:
            raise ChatError(f"'{field}' is empty; give the text to continue", field)
        ids = tokenizer(text)["input_ids"]
    else:
        ids = list(prompt)
        if not ids:
            raise ChatError(f"'{field}' is empty; give at least one token", field)
    limit = context_length - max_new_tokens
    if len(ids) > limit:
        if trim and limit > 1:  # the newest tokens, behind the BOS the model always saw
            bos = getattr(tokenizer, "bos_token_id", None)
            keep = [ids[0]] if bos is not None and ids[0] == bos else []
            return keep + ids[len(ids) - limit + len(keep) :]
        raise ContextTooLong(
            f"'{field}' is {len(ids)} tokens, but with max_new_tokens={max_new_tokens} the "
            f"context window of {context_length} tokens leaves room for {max(limit, 0)}; shorten "
            "it or lower max new tokens",
            field,
        )
    return ids


@dataclass
class Trimmed:
    messages: list[dict]  # what is sent
    prompt_ids: list[int]
    dropped: int  # how many older messages were left out
    plan: object = None  # how the reply starts and what steers it (engine.reply_plan)


def trim_history(
    tokenizer,
    messages: list[dict],
    context_length: int,
    max_new_tokens: int,
    options: ChatOptions = NO_OPTIONS,
) -> Trimmed:
    """Drop the oldest turns until prompt + max_new_tokens fits in the context window. The
    kept history starts at a user message: never with an assistant reply cut from its question,
    nor a tool result cut from the call that asked for it. The newest exchange (from the last
    user message on: its calls and their results) is never cut."""
    limit = context_length - max_new_tokens
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system) :]

    def attempt(drop: int) -> list[int]:
        return render(tokenizer, system + turns[drop:], options)

    ids = attempt(0)
    if len(ids) <= limit:
        return Trimmed(messages, ids, 0)
    # where the kept history may start: at a user message, after the first
    starts = [i for i, m in enumerate(turns) if m["role"] == "user" and i > 0]
    if not starts or len(ids := attempt(starts[-1])) > limit:
        raise ContextTooLong(
            f"the message is too long: {len(ids)} prompt tokens with the system prompt, but with "
            f"max_new_tokens={max_new_tokens} the context window of {context_length} tokens leaves "
            f"room for {max(limit, 0)}; shorten the message or lower max new tokens",
            "messages",
        )
    # fewest dropped messages that fit (more dropped -> shorter prompt, so bisect)
    lo, hi = 0, len(starts) - 1  # attempt(starts[hi]) fits
    while lo < hi:
        mid = (lo + hi) // 2
        if len(attempt(starts[mid])) <= limit:
            hi = mid
        else:
            lo = mid + 1
    drop = starts[hi]
    kept = system + turns[drop:]
    return Trimmed(kept, render(tokenizer, kept, options), drop)
