"""What the API writes: OpenAI's reply objects and stream chunks for chat (messages, deltas)
and completions (text, the legacy logprobs), the models list's entries, and the logprob
recorder that collects what a reply's logprobs show.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid

import torch

from miniserve.engine.stream import text_bytes, token_text
from miniserve.models.registry import Models
from miniserve.serve.bridge import Choices
from miniserve.serve.parse import APIRequest


class LogprobRecorder:
    """Observer for the decode loop: log-probabilities of each chosen token (before filters).
    A remote engine hands it what its server sent instead (add_remote_step).

    Which entries go out (`shown`): from a local engine, those of the ids the reply's chunks
    carried (`took`): every token of the text returned, whichever part it went to --
    reasoning, the tags, the answer, tool calls (vLLM's logprobs cover every token too) --
    and none of the text a stop string removed, or holds back in case it becomes one. A remote
    engine's chunks carry no ids: with `places` (a reply that stop strings may cut), where each
    token stands in the answer's text, so that the same go out: an answer token once its text
    starts being written, any other (reasoning, a call) once the answer before it is."""

    def __init__(
        self, tokenizer, top: int, ends: frozenset = frozenset(), local=True, places=False
    ):
        self.tokenizer, self.top, self.entries = tokenizer, top, []
        self.ends = ends  # end tokens: they end the reply and are not in its text or usage
        self.kept = 0 if local else None  # from a local engine: the ids its chunks carried
        # with places: each entry's (first character in the answer, whether it is the answer's)
        self.places: list[tuple[int, bool]] | None = [] if places else None
        self.chars = 0  # the answer's characters placed so far
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # of the answer's tokens
        self.placed = 0  # entries shown so far (the answer written only grows)

    def took(self, chunk) -> None:
        if self.kept is not None:
            self.kept += len(chunk.token_ids)

    def shown(self, chars: int) -> int:
        """How many entries go out once the first `chars` characters of the answer are
        written (a remote token whose text starts in them counts, though a stop string may cut
        it): from a local engine, those of the ids its chunks carried."""
        if self.kept is not None:
            return self.kept
        if self.places is None:
            return len(self.entries)
        while self.placed < len(self.places):
            at, answer = self.places[self.placed]
            if at > chars or (answer and at == chars):
                break
            self.placed += 1
        return self.placed

    def _place(self, text: str, answer: bool) -> None:
        if self.places is not None:
            self.places.append((self.chars, answer))
            if answer:  # a piece of a character adds none; the piece that ends it, one
                self.chars += len(self.utf8.decode(text_bytes(text)))

    def observe(self, logits, previous_ids, token_id, allowed=None, state=None):
        if token_id in self.ends:
            return
        logp = torch.log_softmax(logits[0].float(), -1)
        entry = self._item(*token_text(self.tokenizer, token_id), float(logp[token_id]))
        if self.top:
            values, indices = torch.topk(logp, self.top)
            entry["top_logprobs"] = [
                self._item(*token_text(self.tokenizer, i), v)
                for v, i in zip(values.tolist(), indices.tolist())
            ]
        else:
            entry["top_logprobs"] = []
        self.entries.append(entry)

    def add_remote_step(self, text: str, logprob: float, top=(), answer: bool = True) -> None:
        """A remote server's step: its token's text, logprob and top alternatives; `answer`:
        the token is the answer's (not its reasoning's or a tool call's)."""
        self._place(text, answer)
        entry = self._item(text, text.encode("utf-8"), logprob)
        entry["top_logprobs"] = [
            self._item(t, t.encode("utf-8"), lp) for t, lp in list(top)[: self.top]
        ]
        self.entries.append(entry)

    @staticmethod
    def _item(text: str, raw: bytes, logprob: float) -> dict:
        """OpenAI's entry: the token's text ("bytes:\\x.." for a piece of a character) and its
        own bytes (a client joins them into the characters a byte-level token splits)."""
        return {"token": text, "logprob": logprob, "bytes": list(raw)}


class ChatShape:
    """How a chat reply is written: messages, and streamed deltas."""

    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, req: APIRequest, choices: Choices):
        self.choices = choices
        self.sent = [0] * req.choices  # logprob entries already streamed, per choice
        self.written = [0] * req.choices  # characters of content streamed, per choice

    def _recorder(self, i: int):
        return self.choices.choices[i].recorder

    def whole(self, i: int, text: str, finish: str, reasoning: str = "", calls: list = ()) -> dict:
        recorder = self._recorder(i)
        message = {"role": "assistant", "content": text or (None if calls else text)}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return {
            "index": i,
            "message": message,
            "finish_reason": finish,
            "logprobs": (
                {"content": recorder.entries[: recorder.shown(len(text or ""))]}
                if recorder
                else None
            ),
        }

    def opening(self, i: int) -> dict:
        return {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }

    def piece(
        self, i: int, text: str, finish: str | None = None, reasoning: str = "", tool_calls=()
    ) -> dict:
        delta = {"content": text} if text else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = list(tool_calls)
        choice = {
            "index": i,
            "delta": delta,
            "finish_reason": finish,
            "logprobs": None,
        }
        recorder = self._recorder(i)
        self.written[i] += len(text or "")
        upto = recorder.shown(self.written[i]) if recorder else 0
        if upto > self.sent[i]:
            choice["logprobs"] = {"content": recorder.entries[self.sent[i] : upto]}
            self.sent[i] = upto
        return choice


class TextShape:
    """How a completion is written: text (the prompt in front with echo) and OpenAI's legacy
    logprobs, streamed as pieces of text."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, req: APIRequest, choices: Choices):
        self.req, self.choices = req, choices
        self.sent = [0] * req.choices  # recorder entries already written, per choice
        self.written = [0] * req.choices  # characters of generated text written, per choice
        self.offset = [0] * req.choices  # text_offset of the next token, per choice
        # the characters the tokens' bytes make so far, per choice (a character split over
        # tokens counts once, where it is complete)
        self.chars = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(req.choices)]

    def _echo(self, i: int) -> tuple[str, list]:
        return self.req.echo[i // self.req.settings.n] if self.req.echo else ("", [])

    def _logprobs(self, i: int, entries: list, generated: bool = True) -> dict | None:
        """The legacy logprobs of `entries` (the echoed prompt's), then of choice i's
        generated tokens not written yet."""
        if not self.req.logprobs:
            return None
        if generated:
            recorder = self.choices.choices[i].recorder
            upto = recorder.shown(self.written[i])
            for e in recorder.entries[self.sent[i] : upto]:
                best = {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                best[e["token"]] = e["logprob"]  # the chosen token is always there, as chosen
                entries = entries + [(e["token"], e["logprob"], best, bytes(e["bytes"]))]
            self.sent[i] = max(self.sent[i], upto)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, best, raw in entries:
            out["tokens"].append(token)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(best)
            out["text_offset"].append(self.offset[i])
            self.offset[i] += len(self.chars[i].decode(raw))
        return out

    def whole(self, i: int, text: str, finish: str, **_chat_parts) -> dict:
        echo, entries = self._echo(i)
        self.written[i] = len(text)
        return {
            "index": i,
            "text": echo + text,
            "logprobs": self._logprobs(i, entries),
            "finish_reason": finish,
        }

    def prompt_only(self, i: int) -> dict:
        """Choice i of a request that generates nothing (max_tokens 0)."""
        echo, entries = self._echo(i)
        return {
            "index": i,
            "text": echo,
            "logprobs": self._logprobs(i, entries, False),
            "finish_reason": "length",
        }

    def opening(self, i: int) -> dict | None:
        if not self.req.echo:
            return None
        echo, entries = self._echo(i)
        return {
            "index": i,
            "text": echo,
            "logprobs": self._logprobs(i, entries, False),
            "finish_reason": None,
        }

    def piece(self, i: int, text: str, finish: str | None = None, *_chat_parts) -> dict:
        self.written[i] += len(text)
        logprobs = self._logprobs(i, [])
        return {
            "index": i,
            "text": text,
            "logprobs": logprobs if logprobs and logprobs["tokens"] else None,
            "finish_reason": finish,
        }


def _shape(req: APIRequest, choices: Choices):
    return (ChatShape if req.kind == "chat" else TextShape)(req, choices)


def shape_of(req: APIRequest, choices: Choices):
    """How `req`'s reply is written."""
    return (ChatShape if req.kind == "chat" else TextShape)(req, choices)


def events(req: APIRequest, shape):
    """A function writing one server-sent event of this reply: a choice's chunk, or (choice
    None) the usage chunk."""
    ident, created = f"{shape.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())

    def event(choice: dict | None, usage=None) -> str:
        chunk = {
            "id": ident,
            "object": shape.chunk_object,
            "created": created,
            "model": req.model,
            "system_fingerprint": "miniserve",
            "choices": [choice] if choice is not None else [],
        }
        if usage is not None or req.settings.include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    return event


def model_entry(models: Models, described: dict) -> dict:
    engine = models.loaded_engine(described["name"])
    return {
        "id": described["name"],
        "object": "model",
        "created": 0,
        "owned_by": "miniserve",
        "default": described["default"],
        "loaded": described["loaded"],
        "remote": described["remote"],
        "context_length": described["context_length"],
        "chat": engine.has_chat_template if engine is not None else None,
        # what a chat may ask of it (None: not loaded, or a remote model's server decides)
        "thinks": getattr(engine, "thinks", None) if engine is not None else None,
        "tools": getattr(engine, "takes_tools", None) if engine is not None else None,
        "speculation": getattr(engine, "speculation", None) if engine is not None else None,
    }
