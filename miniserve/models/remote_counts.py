"""Token counts of a remote model (miniserve/models/remote.py), which has no tokenizer here:
the server's own, where it has a tokenize endpoint (vLLM's /tokenize with the chat template,
llama.cpp's /apply-template + /tokenize, llama-cpp-python's /extras/tokenize), else an
estimate; and what they decide: the history trimmed to the context, a completion prompt that
fits it."""

from __future__ import annotations

import json

from miniserve.core.config import SamplingParams
from miniserve.engine.chat import (
    ChatError,
    ChatOptions,
    NoChatTemplate,
    Trimmed,
    check_messages,
    clean_text,
    trim_history,
)

# Token counts without the server's tokenizer: bytes a token (English runs 4-5 with BPE
# tokenizers, so this errs toward too many and drops a turn early rather than overflowing),
# and a chat template's own tokens.
BYTES_PER_TOKEN = 3
TEMPLATE_TOKENS, MESSAGE_TOKENS = 32, 8


class TokenCounts:
    """RemoteEngine's token counts (a mixin: it reads the engine's `facts`, `name` and
    `context_length`, and asks the server with its `_post_json`)."""

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

    def _counter(self, prompt):
        """prompt_tokens() of a completion prompt for _start: ids are their own count, text
        the server's (None with only an estimate)."""
        if not isinstance(prompt, str):
            return lambda: len(prompt)
        return (lambda: self.count_text(prompt)) if self.facts.tokenize else None


class _ServerCounts:
    """What chat.trim_history asks of a tokenizer, answered with the server's counts: the
    "rendered" prompt is the messages themselves, its "ids" as many as the server counts."""

    chat_template = "the server's"

    def __init__(self, engine: TokenCounts):
        self.engine = engine

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        return messages

    def __call__(self, messages, add_special_tokens=False):
        return {"input_ids": range(self.engine.count_chat(messages))}


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
