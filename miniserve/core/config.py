"""Sampling settings, their limits, and the presets file.

Every surface (web UI sliders, CLI flags, API fields) reads its ranges from
`FIELDS`, so a value the UI offers is a value the engine accepts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from miniserve.core.errors import UserError

PRESETS_FILE = Path(__file__).resolve().parent / "presets.yaml"


class ConfigError(UserError, ValueError):
    """A setting is wrong. `field` names it; the message says what is allowed."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Field:
    kind: type  # int or float
    low: float
    high: float
    default: float
    label: str
    help: str
    low_open: bool = False  # True: `low` itself is not allowed

    def describe(self) -> str:
        left = "(" if self.low_open else "["
        return f"{left}{self.low:g}, {self.high:g}]"


# The one table of defaults and limits.
FIELDS: dict[str, Field] = {
    "temperature": Field(
        float,
        0.0,
        2.0,
        0.7,
        "Temperature",
        "divides the logits; 0 means greedy (always the most likely token)",
    ),
    "top_k": Field(
        int,
        0,
        1_000_000,
        50,
        "Top-k",
        "keep only the k most likely tokens; 0 = off (k above the vocabulary = off)",
    ),
    "top_p": Field(
        float,
        0.0,
        1.0,
        0.95,
        "Top-p",
        "keep the smallest set of tokens whose probability reaches p; 1 = off",
        low_open=True,
    ),
    "min_p": Field(
        float,
        0.0,
        1.0,
        0.0,
        "Min-p",
        "drop tokens less likely than min_p x the top token's probability; 0 = off",
    ),
    "repetition_penalty": Field(
        float,
        0.5,
        2.0,
        1.0,
        "Repetition penalty",
        "divide the scores of tokens already seen; 1 = off",
    ),
    "max_new_tokens": Field(
        int, 1, 4096, 256, "Max new tokens", "stop after this many generated tokens"
    ),
}

SEED_MAX = 2**63 - 1
RANDOM_SEEDS = 2**32  # a seed drawn for "random" (shown and saved with a reply) is below this
MAX_NEW_TOKENS = FIELDS["max_new_tokens"].high  # also the API's and the benchmark's ceiling
# How many requests may be running or waiting at once; past it, "busy" / HTTP 429.
MAX_QUEUE = Field(
    int,
    1,
    1000,
    16,
    "Max queue",
    "requests running or waiting before new ones get 'busy' (HTTP 429)",
)
MAX_CHOICES = 8  # the API's largest n; each choice takes one place in the queue
MAX_PROMPTS = 16  # prompts in one /v1/completions request (each with its n choices)
# The scheduler (miniserve/engine/scheduler.py): how many sequences advance in one forward pass, how
# many tokens one pass may take (decode rows + a chunk of a waiting prompt), and how many
# positions of keys and values all sequences together may hold (prompt + max_new_tokens is
# reserved when a request starts; it waits while that does not fit).
MAX_BATCH = Field(int, 1, 64, 8, "Max batch", "sequences that advance together in one forward pass")
STEP_TOKENS = Field(
    int,
    16,
    8192,
    512,
    "Step tokens",
    "rows one forward pass may take: a decode row per sequence plus a chunk of a waiting prompt",
)
KV_BUDGET = Field(
    int,
    256,
    10_000_000,
    65536,
    "KV budget",
    "positions of keys and values all running sequences may hold together",
)
# The arithmetic of the matrix products, apart from the weights' dtype (--dtype):
# float32 sums of float32 products; bfloat16: activations rounded to bfloat16, products summed
# in float32 (AVX512_BF16's vdpbf16ps where the CPU has it); auto: bfloat16 where the CPU has
# bfloat16 dot products and the weights are bfloat16, else float32.
MATHS = ("auto", "float32", "bfloat16")
# The conversation store (miniserve/store/store.py): how many conversations each user keeps (the
# least recently used go first; 0 keeps all), and the largest file Import reads.
MAX_CONVERSATIONS = Field(
    int,
    0,
    10_000_000,
    0,
    "Max conversations",
    "conversations kept per user, the least recently updated removed first; 0 = keep all",
)
MAX_IMPORT_BYTES = 5_000_000
# Several models in one app (miniserve/models/registry.py): how many stay loaded at once (the least
# recently used idle one is unloaded to make room), and the context of a remote model whose
# server does not say.
MAX_LOADED_MODELS = Field(
    int,
    1,
    64,
    2,
    "Max loaded models",
    "local models kept loaded at once; the least recently used idle one is unloaded to make room",
)
CONTEXT = Field(
    int,
    16,
    10_000_000,
    4096,
    "Context",
    "the context window in tokens of a remote model whose server does not report it",
)


def check_value(name: str, value, where: str = "") -> float | int:
    """Validate one sampling field; return it converted to its kind."""
    spec = FIELDS.get(name)
    if spec is None:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}unknown setting '{name}' (allowed: {', '.join(FIELDS)})", name)
    return check_number(name, value, spec, where)


def check_number(name: str, value, spec: Field, where: str = "") -> float | int:
    """The one check of a number against its Field (kind and range), for sampling settings
    and any other numeric field (the API's n, max_tokens, ...); return it as its kind.
    Raises ConfigError naming the field and what is allowed."""
    prefix = f"{where}: " if where else ""
    whole = "a whole number" if spec.kind is int else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            f"{prefix}'{name}' must be {whole} {spec.describe()}, got {value!r}", name
        )
    if spec.kind is int and (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(
            f"{prefix}'{name}' must be a whole number {spec.describe()}, got {value!r}", name
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"{prefix}'{name}' must be a finite number {spec.describe()}, got {value!r}", name
        )
    too_low = value <= spec.low if spec.low_open else value < spec.low
    if too_low or value > spec.high:
        raise ConfigError(f"{prefix}'{name}' must be in {spec.describe()}, got {value!r}", name)
    return spec.kind(value)


def check_seed(seed, where: str = "") -> int | None:
    if seed is None:
        return None
    prefix = f"{where}: " if where else ""
    if (
        isinstance(seed, bool)
        or not isinstance(seed, (int, float))
        or (isinstance(seed, float) and not seed.is_integer())
    ):
        raise ConfigError(
            f"{prefix}'seed' must be a whole number in [0, {SEED_MAX}], got {seed!r}", "seed"
        )
    seed = int(seed)
    if not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"{prefix}'seed' must be in [0, {SEED_MAX}], got {seed}", "seed")
    return seed


LOGIT_BIAS = Field(
    float,
    -100.0,
    100.0,
    0.0,
    "Logit bias",
    "added to a token's logit before the other stages; -100 bans the token",
)
MAX_LOGIT_BIAS_TOKENS = 300  # as OpenAI: at most this many tokens in one logit_bias
# The kinds of output a constraint (miniserve/engine/grammar.py) can hold the reply to: any JSON
# object, JSON that validates against a JSON Schema, a regular expression, one string of a
# list, or a grammar (EBNF).
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What the reply must match. `value`: the schema as JSON text (json_schema), the pattern
    (regex), the grammar's text (grammar), the choices as a JSON list (choice), "" for
    json_object. Compiled, checked and enforced by miniserve/engine/grammar.py."""

    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ConfigError(
                f"the output format must be one of {', '.join(CONSTRAINT_KINDS)}, "
                f"got {self.kind!r}",
                "constraint",
            )
        if not isinstance(self.value, str):
            raise ConfigError("the constraint's value must be text", "constraint")

    def as_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value}


def check_logit_bias(bias, where: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or digit strings, as JSON sends them) or (id, bias) pairs,
    each bias in [-100, 100]; returned as sorted (id, bias) pairs."""
    if not bias:
        return ()
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        items = list(items)
    except TypeError:
        raise ConfigError(f"'{where}' must map token ids to numbers", where) from None
    if len(items) > MAX_LOGIT_BIAS_TOKENS:
        raise ConfigError(
            f"'{where}' may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(items)}", where
        )
    out = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ConfigError(f"'{where}' must map token ids to numbers", where)
        key, value = item
        token = key
        if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(
                f"'{where}': keys must be token ids (whole numbers >= 0), got {key!r}", where
            )
        out[token] = float(check_number(f"{where}[{key}]", value, LOGIT_BIAS))
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each token. Validated on construction."""

    temperature: float = FIELDS["temperature"].default
    top_k: int = FIELDS["top_k"].default
    top_p: float = FIELDS["top_p"].default
    min_p: float = FIELDS["min_p"].default
    repetition_penalty: float = FIELDS["repetition_penalty"].default
    max_new_tokens: int = FIELDS["max_new_tokens"].default
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; see check_logit_bias
    constraint: Constraint | None = None  # what the reply must match; None: free text

    def __post_init__(self):
        for name in FIELDS:
            object.__setattr__(self, name, check_value(name, getattr(self, name)))
        object.__setattr__(self, "seed", check_seed(self.seed))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ConfigError("'stop' must be a list of non-empty strings", "stop")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ConfigError("'constraint' must be a Constraint", "constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The settings as plain values (saved with a reply, printed by the CLI); the logit
        bias and the constraint only when they are set."""
        out = {name: getattr(self, name) for name in (*FIELDS, "seed")}
        if self.logit_bias:
            out["logit_bias"] = {str(i): b for i, b in self.logit_bias}
        if self.constraint is not None:
            out["constraint"] = self.constraint.as_dict()
        return out


# The presets every surface has without a presets file naming them (CLI --preset, the web
# app's preset lists, the benchmarks): `greedy` takes the most likely token at each step, no
# filter on. A presets file that defines a preset of the same name overrides it.
GREEDY = "greedy"
BUILTIN_PRESETS: dict[str, SamplingParams] = {
    GREEDY: SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0),
}


def with_builtins(presets: dict[str, SamplingParams]) -> dict[str, SamplingParams]:
    """`presets` and, after them, each built-in preset they do not define."""
    return {**presets, **{n: p for n, p in BUILTIN_PRESETS.items() if n not in presets}}


def load_presets(path: str | Path | None = None) -> dict[str, SamplingParams]:
    """Read presets.yaml, plus the built-in presets it does not define (`greedy`). Errors name
    the file, the preset and the field."""
    path = Path(path) if path is not None else PRESETS_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: presets file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read presets file ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty; expected a 'presets:' mapping")
    if not isinstance(data, dict) or set(data) != {"presets"}:
        raise ConfigError(f"{path}: expected exactly one top-level key 'presets'")
    presets = data["presets"]
    if not isinstance(presets, dict) or not presets:
        raise ConfigError(f"{path}: 'presets' must map preset names to settings")
    out = {}
    for name, values in presets.items():
        where = f"{path}: preset '{name}'"
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: expected a mapping of settings, got {values!r}")
        for key in values:
            if key not in FIELDS:
                raise ConfigError(
                    f"{where}: unknown field '{key}' (allowed: {', '.join(FIELDS)})", key
                )
        checked = {key: check_value(key, value, where) for key, value in values.items()}
        out[str(name)] = SamplingParams(**checked)
    return with_builtins(out)
