"""The grammar stage of the sampler: which tokens may come next so that the reply stays inside
an output format (a JSON Schema, any JSON object, a regular expression, one of a list of
strings, or a grammar).

    logit bias -> repetition penalty -> [grammar mask] -> temperature -> top-k -> top-p -> min-p

The masks come from llguidance (Microsoft's guidance engine, Rust): compiling a schema takes
about a millisecond, a mask for this model's 49,152 tokens about 70 microseconds, and a JSON
Schema keyword it cannot enforce is an error naming the keyword — never silently relaxed.
(xgrammar and outlines-core were measured beside it: BENCHMARKS.md, "Structured output".)

`Grammars` belongs to one tokenizer (grammars and token ids are per tokenizer): it compiles a
`Constraint` once (kept in a small LRU) and hands out a `GrammarMatcher` per reply: the state
of one sequence, which the decode loop and the scheduler ask for its mask each step, then
tell the token chosen. A reply ends when its grammar is complete (`done`).

JSON is generated compactly (", " and ": " separators, no newlines or indentation): with
free whitespace small models tend to fill the token budget with spaces and newlines. And an
object schema that lists its properties but says nothing of others gets only those
(`closed_objects`): JSON Schema allows extra keys there, so the output is valid either way,
but a small model given the freedom keeps inventing keys until the budget runs out.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import torch

from miniserve.core.config import Constraint
from miniserve.core.errors import UserError

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_ENTRIES = 64


class GrammarError(UserError, ValueError):
    """A schema, pattern or grammar that cannot be compiled or enforced. `field` names the
    part of the constraint (set by the caller, e.g. the API's field); the message is the
    library's reason."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def describe(self) -> str:
        return f"the output format cannot be used: {self}"


@dataclass(frozen=True)
class Lark:
    """A grammar written here in llguidance's Lark format (a tool call's), compiled and cached
    as a Constraint is."""

    text: str


def grammar_text(constraint: Constraint | Lark) -> str:
    """The constraint in llguidance's grammar format (checked only for shape here)."""
    if isinstance(constraint, Lark):
        return llguidance.grammar_from("lark", constraint.text)
    kind, value = constraint.kind, constraint.value
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', overrides=COMPACT_JSON
        )
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarError(
                f"the JSON Schema is not JSON: {e.msg} (line {e.lineno}, column {e.colno})"
            ) from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON Schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(closed_objects(schema)), overrides=COMPACT_JSON
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        try:
            choices = json.loads(value)
        except json.JSONDecodeError:
            choices = None
        if (
            not isinstance(choices, list)
            or not choices
            or any(not isinstance(c, str) or not c for c in choices)
        ):
            raise GrammarError("the choices must be a list of non-empty strings")
        return llguidance.grammar_from("choice", json.dumps(choices))
    if kind == "grammar":
        # a Lark grammar (llguidance's own format) or GBNF, as llama.cpp writes it ("::=")
        return llguidance.grammar_from("gbnf" if "::=" in value else "lark", value)
    raise GrammarError(f"unknown output format {kind!r}")


# the keywords whose values are schemas, or maps or lists of them
_SUBSCHEMA = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # not allOf: its parts add up
# beside these, other keys may be declared elsewhere: such an object is left open
_COMBINED = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "dependentSchemas",
    "if",
    "then",
    "else",
)


def closed_objects(schema):
    """The schema with `"additionalProperties": false` added to every object schema that has
    `properties` and no word on other keys (no additionalProperties, patternProperties,
    unevaluatedProperties, and no allOf, anyOf, oneOf, $ref or conditional beside them that
    could declare more): what is generated is then exactly the declared keys, which the
    original schema accepts too. allOf's parts are left as they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _COMBINED):
        out["additionalProperties"] = False
    return out


class GrammarMatcher:
    """One reply's place in its grammar (the decode loop's `Matcher`)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
        self._m = matcher
        # one bit a token, 32 to an int32 (llguidance's layout); its torch helpers are not
        # imported: they compile a kernel at import (2 s) that this path does not need
        self._bits = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self, width: int) -> torch.Tensor:
        """The tokens that may come next: bool, shape (1, width); ids past the tokenizer's
        vocabulary (padding rows of the model's output) are never allowed."""
        self._m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        bits = ((self._bits.unsqueeze(-1) >> self._shifts) & 1).bool().flatten()
        if bits.numel() >= width:
            return bits[:width].unsqueeze(0)
        out = torch.zeros(1, width, dtype=torch.bool)
        out[0, : bits.numel()] = bits
        return out

    def accept(self, token_id: int) -> None:
        if not self._m.consume_token(token_id):
            raise GrammarError(
                f"token {token_id} does not fit the grammar: {self._m.get_error() or 'rejected'}"
            )

    def rollback(self, n: int) -> None:
        """Take back the last `n` accepted tokens (the Step view's Back)."""
        if n > 0 and not self._m.rollback(n):
            raise GrammarError(f"cannot take back {n} tokens: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing may follow (the reply ends here)."""
        return self._m.is_stopped()


class Grammars:
    """Compiled constraints of one tokenizer."""

    def __init__(self, tokenizer, eos_ids, vocab: int | None = None):
        self.vocab = max(vocab or 0, len(tokenizer))
        import llguidance.hf  # imports transformers: at first use, not with this module

        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab, eos_token=sorted(eos_ids) or None
        )
        self._lock = threading.Lock()  # the API's threads and the engine thread share it
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()

    def check(self, constraint: Constraint) -> None:
        """Compile (or find) the constraint; GrammarError with the library's reason if it
        cannot be used."""
        self._template(constraint)

    def _template(self, constraint: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        try:
            text = grammar_text(constraint)
        except ValueError as e:  # llguidance's own checks of a schema or pattern
            raise GrammarError(_reason(e)) from None
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(_reason(matcher.get_error()))
        with self._lock:
            self._compiled[constraint] = matcher
            while len(self._compiled) > CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh state at the start of the constraint, for one reply."""
        template = self._template(constraint)
        with self._lock:
            copy = template.deep_copy()
        return GrammarMatcher(copy, self.vocab)


def _reason(error) -> str:
    """The library's message, without its grammar listing: the first lines that say why."""
    text = str(error).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    reason = " ".join(ln.strip() for ln in lines[:4] if not ln.lstrip().startswith(("|", "^")))
    return reason or text
