"""The parts of a chat reply -- reasoning, answer, tool calls -- told apart on token ids, and
steered.

Thinking models write `<think> ... </think>` before their answer; some templates open the tag
in the prompt (the DeepSeek-R1 distills), others leave it to the model (Qwen3, which the
template's `enable_thinking: false` turns off by writing an empty block into the prompt).
Tool-calling models open a call with their family's opener token (`<tool_call>` for Qwen and
Hermes; miniserve/core/toolcalls.py has the families).

`ReplyParts` is one reply's place among those parts. It is the decode loop's `Matcher` (the
grammar stage of the sampler), so the same object that sorts each token steers the next:

    start ──<think>──▶ reasoning ──</think>──▶ answer ──opener──▶ call ──closer──▶ answer
      │                    │ (budget spent: "\\n</think>\\n\\n" forced, not counted)
      └──any other token───┴──────────────────────▶ answer

- Reasoning is free text; at the budget the closing tokens are forced one a step.
- The answer's output format (a grammar) starts only after the reasoning and the forced
  closing tokens: until then it is inert, so JSON mode and thinking go together. With a format
  (or a required tool call) on a model that thinks, `<think>` is forced first, as the model's
  own template would have it.
- Tools: `auto` lets the model choose; its opener switches the call's grammar on (a lazy
  trigger) until the call is complete. `required` and a named function: the answer is the
  calls' grammar from its first token. `none` bans the opener. One call only unless parallel
  calls are allowed.
- `allowed()` returns None when nothing is constrained (the sampler then skips the mask).
- Every accepted token can be taken back (`rollback`, the Step view's Back).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from miniserve.core.toolcalls import CallStream, ToolCall
from miniserve.engine.grammar import closed_objects
from miniserve.engine.stream import Detokenizer

START, OPEN, REASONING, CLOSE, ANSWER, CALL = (
    "start",
    "open",
    "reasoning",
    "close",
    "answer",
    "call",
)
MAX_CALLS = 8  # calls a reply may make at most when parallel calls are allowed (a grammar bound)
THINK, END_THINK = "<think>", "</think>"
CLOSING = "\n</think>\n\n"  # what the budget forces (llama.cpp's and vLLM's closing)


def token_id(tokenizer, token: str) -> int | None:
    """The id of one whole token of the vocabulary (added tokens included), or None: asked of
    the fast tokenizer's table, not through get_vocab(), which builds the whole vocabulary as a
    dict (151,936 entries for Qwen3: ~30 MiB and ~30 ms each time)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "token_to_id"):
        return backend.token_to_id(token)
    return tokenizer.get_vocab().get(token)


@dataclass(frozen=True)
class Markers:
    """A tokenizer's reasoning tags as single token ids (None where it has none) and the
    ids of CLOSING."""

    think: int | None = None
    end_think: int | None = None
    closing: tuple[int, ...] = ()

    @property
    def thinking(self) -> bool:
        return self.think is not None and self.end_think is not None

    @classmethod
    def of(cls, tokenizer) -> Markers:
        think, end = token_id(tokenizer, THINK), token_id(tokenizer, END_THINK)
        if think is None or end is None:
            return cls()
        closing = tuple(tokenizer(CLOSING, add_special_tokens=False)["input_ids"])
        if end not in closing:  # a tokenizer that splits the tag: no forced closing
            closing = (end,)
        return cls(think, end, closing)


@dataclass(frozen=True)
class ToolPlan:
    """The calls a reply may make: the family's opener and closer ids, `choice` ("auto",
    "none", "required" or a function's name), whether more than one call is allowed, and the
    grammar (llguidance's Lark) of one call and of the required calls."""

    format: str
    opener: int | None
    closer: int | None
    choice: str = "auto"
    parallel: bool = True
    one_call: str = ""  # grammar text
    calls: str = ""  # grammar text (required / named)


@dataclass(frozen=True)
class ReplyPlan:
    """How a reply starts and what steers it, decided when its prompt is rendered."""

    markers: Markers = field(default_factory=Markers)
    in_reasoning: bool = False  # the prompt opened <think> (its generation prompt did)
    think_first: bool = False  # thinking is on: a constrained answer forces <think> first
    think_off: bool = False  # thinking is off (the prompt closed it, or it was switched off)
    budget: int | None = None  # reasoning tokens at most (None: no limit)
    tools: ToolPlan | None = None

    @property
    def split(self) -> bool:
        """Whether the reply has parts to tell apart (else it is all answer)."""
        return self.markers.thinking or self.tools is not None


class _Counted:
    """A grammar matcher and how many tokens it has taken (so that Back can restore it)."""

    def __init__(self, matcher):
        self.m, self.taken = matcher, 0

    def accept(self, token_id: int) -> None:
        self.m.accept(token_id)
        self.taken += 1

    def back_to(self, taken: int) -> None:
        if self.taken > taken:
            self.m.rollback(self.taken - taken)
            self.taken = taken


class ReplyParts:
    """One reply's parts (`kinds`: the part of each accepted token) and the mask that steers
    the next token. `answer()` makes the output format's matcher (None: free text); `call()`
    a matcher of one tool call, `calls()` of the required calls."""

    def __init__(
        self,
        plan: ReplyPlan,
        eos_ids=frozenset(),
        answer: Callable[[], object] | None = None,
        call: Callable[[], object] | None = None,
        calls: Callable[[], object] | None = None,
    ):
        self.plan, self.eos_ids = plan, frozenset(eos_ids)
        self._answer, self._call, self._calls = answer, call, calls
        self.kinds: list[str] = []
        self.phase = REASONING if plan.in_reasoning else START
        self.thought = 0  # reasoning tokens chosen (not forced)
        self.forcing = -1  # index into the closing tokens being forced, or -1
        self.made = 0  # tool calls completed
        self.in_call = False
        self.inner: _Counted | None = None  # the grammar steering now, if any
        self.inner_lazy = False  # the inner grammar is one auto call (the answer resumes after)
        self._history: list[tuple] = []

    # -- what may come next ------------------------------------------------------------------
    @property
    def tools(self) -> ToolPlan | None:
        return self.plan.tools

    def _constrained_answer(self) -> bool:
        t = self.tools
        return self._answer is not None or (t is not None and t.choice not in ("auto", "none"))

    def allowed(self, width: int) -> torch.Tensor | None:
        m = self.plan.markers
        if self.forcing >= 0:
            return _only(width, m.closing[self.forcing])
        if self.phase == START and self.plan.think_first and self._constrained_answer():
            return _only(width, m.think)
        if self.phase == REASONING:
            budget = self.plan.budget
            if budget is not None and self.thought >= budget:
                return _only(width, m.closing[0])
            return None
        bans = [m.think] if self.phase == START and self.plan.think_off else []
        if self.phase != START or self._constrained_answer():  # else <think> may still come
            self._open_answer()
        if self.inner is not None:
            return self.inner.m.allowed(width)
        t = self.tools
        if t is not None and t.opener is not None:
            if t.choice == "none":
                bans.append(t.opener)
            elif self.made and not t.parallel:  # one call made: the reply ends
                return _only(width, *sorted(self.eos_ids))
        # thinking off means no reasoning, whatever the model chooses
        return _without(width, *bans) if bans else None

    def _open_answer(self) -> None:
        """At the answer's first token: its grammar (the output format, or the required calls)
        starts here."""
        if self.phase == START and self.plan.think_first and self._constrained_answer():
            return
        if self.phase in (START, CLOSE):
            self.phase = ANSWER
            make = self._calls if self.tools and self.tools.choice not in ("auto", "none") else None
            make = make or self._answer
            if make is not None:
                self.inner, self.inner_lazy = _Counted(make()), False

    # -- the token that came -----------------------------------------------------------------
    def accept(self, token_id: int) -> None:
        self._history.append(self._state())
        self.kinds.append(self._take(token_id))

    def _take(self, token_id: int) -> str:
        m, t = self.plan.markers, self.tools
        if self.forcing >= 0:  # a forced closing token
            self.forcing += 1
            if self.forcing == len(m.closing):
                self.forcing = -1
            if token_id == m.end_think:
                self.phase = CLOSE
                return CLOSE
            return REASONING if self.phase == REASONING else ANSWER
        if self.phase == START and m.thinking and token_id == m.think and not self.plan.think_off:
            self.phase = REASONING
            return OPEN
        if self.phase == REASONING:
            if token_id == m.end_think:
                self.phase = CLOSE
                return CLOSE
            budget = self.plan.budget
            if budget is not None and self.thought >= budget:  # the first forced token
                self.forcing = 1 if len(m.closing) > 1 else -1
                return REASONING
            self.thought += 1
            return REASONING
        self._open_answer()
        if token_id in self.eos_ids:
            if self.inner is not None:
                self.inner.accept(token_id)
            return ANSWER
        kind = ANSWER
        if t is not None and t.opener is not None and t.choice != "none":
            if token_id == t.opener:
                self.in_call = True
                if self.inner is None and self._call is not None:  # auto: the lazy trigger
                    self.inner, self.inner_lazy = _Counted(self._call()), True
            if self.in_call or t.choice != "auto":  # required: the whole answer is calls
                kind = CALL
            if token_id == t.closer and self.in_call:
                self.in_call = False
                self.made += 1
        if self.inner is not None:
            self.inner.accept(token_id)
            if self.inner_lazy and self.inner.m.done:
                self.inner, self.inner_lazy = None, False
        return kind

    @property
    def done(self) -> bool:
        """The answer's grammar is complete (an auto call's grammar ending is not)."""
        return self.inner is not None and not self.inner_lazy and self.inner.m.done

    # -- Back ---------------------------------------------------------------------------------
    def _state(self) -> tuple:
        inner = self.inner
        return (
            self.phase,
            self.thought,
            self.forcing,
            self.made,
            self.in_call,
            inner,
            inner.taken if inner is not None else 0,
            self.inner_lazy,
        )

    def rollback(self, n: int) -> None:
        """Take back the last `n` accepted tokens."""
        if n <= 0:
            return
        if n > len(self._history):
            raise ValueError(f"cannot take back {n} tokens: {len(self._history)} were taken")
        state = self._history[-n]
        del self._history[-n:]
        del self.kinds[-n:]
        current = self.inner
        (
            self.phase,
            self.thought,
            self.forcing,
            self.made,
            self.in_call,
            self.inner,
            taken,
            self.inner_lazy,
        ) = state
        if self.inner is not None:
            self.inner.back_to(taken)
        if current is not None and current is not self.inner:
            current.back_to(0)  # a grammar started after the restored point: left behind

    # -- what the reply holds -----------------------------------------------------------------
    @property
    def reasoning_tokens(self) -> int:
        """Reasoning tokens chosen by the model (the tags and forced tokens not counted)."""
        return self.thought


def _only(width: int, *ids: int) -> torch.Tensor:
    mask = torch.zeros(1, width, dtype=torch.bool)
    mask[0, [i for i in ids if i is not None and i < width]] = True
    return mask


def _without(width: int, *ids: int) -> torch.Tensor:
    mask = torch.ones(1, width, dtype=torch.bool)
    mask[0, [i for i in ids if i is not None and i < width]] = False
    return mask


# -- the grammar of a tool call -------------------------------------------------------------

# the JSON object each family writes for one call: (the key of the name, the key of the
# arguments)
CALL_KEYS = {"hermes": ("name", "arguments"), "llama3": ("name", "parameters")}


def call_schema(tools: list[dict], keys: tuple[str, str], only: str | None = None) -> dict:
    """The JSON Schema of one call to one of `tools` (OpenAI's [{type, function: {name,
    parameters}}]), or to the function named `only`."""
    name_key, args_key = keys
    options = []
    for tool in tools:
        fn = tool["function"]
        if only is not None and fn["name"] != only:
            continue
        # the declared arguments only, as the output formats are generated (grammar.py)
        params = closed_objects(fn.get("parameters") or {"type": "object", "properties": {}})
        options.append(
            {
                "type": "object",
                "properties": {name_key: {"const": fn["name"]}, args_key: params},
                "required": [name_key, args_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # compact JSON, as the output formats are generated (engine/grammar.py's COMPACT_JSON)
    schema["x-guidance"] = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }
    return schema


def call_grammars(
    format: str,
    tools: list[dict],
    opener: int,
    closer: int | None,
    only: str | None,
    parallel: bool,
) -> tuple[str, str]:
    """(one call, the required calls) as llguidance Lark grammars: the opener token, a newline,
    the call's JSON, a newline, the closer token -- as Qwen's and Hermes' templates write it."""
    keys = CALL_KEYS.get(format, CALL_KEYS["hermes"])
    body = json.dumps(call_schema(tools, keys, only))
    end = f' "\\n" <[{closer}]>' if closer is not None else ""
    one = f'call: <[{opener}]> "\\n" body{end}\nbody: %json {body}\n'
    many = f'start: call ("\\n" call){{0,{MAX_CALLS - 1}}}\n' if parallel else "start: call\n"
    return "start: call\n" + one, many + one


class CallParts:
    """A reply's call tokens (its ReplyParts' CALL kind: opener to closer) as OpenAI's
    streaming deltas and, at the end, whole calls. They are decoded with special tokens kept
    (the openers are special tokens) and parsed by the family's rules (core/toolcalls.py).

    A call that does not parse (max_tokens cut it) after calls went out as deltas: the calls as
    their deltas built them, the cut one with its arguments so far (OpenAI's answer to a call
    max_tokens cut), so that a streamed reply and a whole one say the same. A reply whose call
    region gave out no delta at all gives its text back as the answer's, and no calls."""

    def __init__(self, tokenizer, fmt):
        self.stream = CallStream(fmt)
        self.detok = Detokenizer(tokenizer, skip_special_tokens=False)
        self.raw = ""
        self.sent: dict[int, dict] = {}  # index -> the call as its deltas built it

    def _keep(self, deltas: list[dict]) -> list[dict]:
        for d in deltas:
            call = self.sent.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
            fn = d.get("function") or {}
            call["id"] = d.get("id") or call["id"]
            call["name"] = fn.get("name") or call["name"]
            call["arguments"] += fn.get("arguments") or ""
        return deltas

    def push(self, token_id: int) -> list[dict]:
        piece = self.detok.push(token_id)
        self.raw += piece
        return self._keep(self.stream.feed(piece)[1])

    def finish(self) -> tuple[list[dict], list, str]:
        """(the last deltas, the calls, text to give back as the answer's)."""
        piece = self.detok.flush()
        self.raw += piece
        deltas = self._keep(self.stream.feed(piece)[1] + self.stream.finish()[1])
        result = self.stream.result()
        if not result.errors:
            return deltas, result.calls, ""
        if not self.sent:
            return deltas, [], self.raw
        calls = [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(self.sent.items())]
        return deltas, calls, ""
