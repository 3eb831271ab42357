"""Conversations: message checks, the chat template, and trimming history to fit.

Trimming is a pure function of token counts: the system prompt and the newest user
message always stay, room is reserved for the reply (max_new_tokens), and the oldest
turns go first. The caller is told how many messages were dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from miniserve.core.errors import UserError
from miniserve.core.text import clean_text

ROLES = ("system", "user", "assistant")


class ChatError(UserError, ValueError):
    """A conversation that cannot be sent; `field` names the part that is wrong."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


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


def check_messages(messages, field: str = "messages") -> list[dict]:
    """Validate and normalise [{'role', 'content'}, ...]; the last must be from the user."""
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"'{field}' must be a non-empty list of {{role, content}} objects", field)
    out = []
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"'{where}' must be an object with 'role' and 'content'", where)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatError(
                f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role"
            )
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        if not isinstance(content, str):
            raise ChatError(f"'{where}.content' must be a string", f"{where}.content")
        out.append({"role": role, "content": clean_text(content)})
    if out[-1]["role"] != "user":
        raise ChatError(f"the last of '{field}' must be a user message", field)
    if not out[-1]["content"].strip():
        raise ChatError(
            "the message is empty; type something to send", f"{field}[{len(out) - 1}].content"
        )
    return out


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The model's chat template, ending with the assistant's turn opened."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
        raise ChatError(
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


def trim_history(
    tokenizer, messages: list[dict], context_length: int, max_new_tokens: int
) -> Trimmed:
    """Drop the oldest turns until prompt + max_new_tokens fits in the context window."""
    limit = context_length - max_new_tokens
    system = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(system) :]

    def attempt(drop: int) -> list[int]:
        return render(tokenizer, system + turns[drop:])

    ids = attempt(0)
    if len(ids) <= limit:
        return Trimmed(messages, ids, 0)
    newest_only = len(turns) - 1
    ids = attempt(newest_only)
    if len(ids) > limit:
        raise ChatError(
            f"the message is too long: {len(ids)} prompt tokens with the system prompt, but with "
            f"max_new_tokens={max_new_tokens} the context window of {context_length} tokens leaves "
            f"room for {max(limit, 0)}; shorten the message or lower max new tokens",
            "messages",
        )
    # fewest dropped messages that fit (more dropped -> shorter prompt, so bisect)
    lo, hi = 1, newest_only  # attempt(hi) fits
    while lo < hi:
        mid = (lo + hi) // 2
        if len(attempt(mid)) <= limit:
            hi = mid
        else:
            lo = mid + 1
    # never start the kept history with an assistant reply cut from its question
    drop = hi + (1 if hi < newest_only and turns[hi]["role"] == "assistant" else 0)
    kept = system + turns[drop:]
    return Trimmed(kept, render(tokenizer, kept), drop)
