"""Sampling settings, their limits, and the presets file.

Every surface (web UI sliders, CLI flags, API fields) reads its ranges from
`FIELDS`, so a value the UI offers is a value the engine accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from miniserve.core.fields import ConfigError, Field, check_number
from miniserve.core.samplers import (
    FIELDS,
    PARAMS,
    STAGES,
    check_order,
    check_setting,
    default_order,
)

__all__ = ["FIELDS", "STAGES", "ConfigError", "Field", "SamplingParams", "check_number"]

PRESETS_FILE = Path(__file__).resolve().parent / "presets.yaml"


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


def check_value(name: str, value, where: str = ""):
    """Validate one sampling setting; return it converted to its kind."""
    return check_setting(name, value, where)


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


def parse_logit_bias(text, where: str = "logit bias") -> tuple[tuple[int, float], ...]:
    """ "13:-100, 42:2.5" (commas or lines between pairs) as checked (id, bias) pairs: the text
    form of the CLI's --logit-bias and the Step view's box. ConfigError says how to write it."""
    pairs = []
    for part in str(text or "").replace("\n", ",").split(","):
        if not part.strip():
            continue
        key, _, value = part.partition(":")
        try:
            pairs.append((int(key), float(value)))
        except ValueError:
            raise ConfigError(
                f"{where}: write token ID:BIAS pairs separated by commas, like "
                f"13:-100, 42:2.5 (got {part.strip()!r})",
                "logit_bias",
            ) from None
    return check_logit_bias(pairs, where)


class SamplingParams:
    """How to choose each token. Validated on construction; immutable.

    Every declared stage's settings (miniserve/core/samplers.py) are attributes: those not
    given take the stage's default (the UI's), so a stage declared later has its settings
    here with no edit. The rest: max_new_tokens, seed, stop strings, the logit bias, the
    output format, and the stage order (`samplers`; None: the default order)."""

    _OWN = ("max_new_tokens", "seed", "stop", "logit_bias", "constraint", "samplers")
    __slots__ = ("_values", *_OWN)

    def __init__(
        self,
        *,
        max_new_tokens: int = FIELDS["max_new_tokens"].default,
        seed: int | None = None,
        stop=(),
        logit_bias=(),
        constraint: Constraint | None = None,
        samplers=None,
        **settings,
    ):
        values = {}
        for name, (_, param) in PARAMS.items():
            value = settings.pop(name, param.field.default)
            values[name] = check_value(name, value)
        if settings:
            name = next(iter(settings))
            raise ConfigError(
                f"unknown setting '{name}' (allowed: {', '.join(FIELDS)}, seed, stop, "
                "logit_bias, samplers)",
                name,
            )
        own = object.__setattr__
        own(self, "_values", values)
        own(self, "max_new_tokens", check_value("max_new_tokens", max_new_tokens))
        own(self, "seed", check_seed(seed))
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ConfigError("'stop' must be a list of non-empty strings", "stop")
        own(self, "stop", stop)
        own(self, "logit_bias", check_logit_bias(logit_bias))
        if constraint is not None and not isinstance(constraint, Constraint):
            raise ConfigError("'constraint' must be a Constraint", "constraint")
        own(self, "constraint", constraint)
        own(self, "samplers", check_order(samplers))

    def __getattr__(self, name):
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("SamplingParams are immutable: use replace()")

    def _key(self) -> tuple:
        return (tuple(sorted(self._values.items())), *(getattr(self, n) for n in self._OWN))

    def __eq__(self, other):
        return isinstance(other, SamplingParams) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"SamplingParams({fields})"

    def __reduce__(self):
        return (_rebuild, (self.as_dict(),))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def order(self) -> tuple[str, ...]:
        """The stages' order: the request's, else the default."""
        return self.samplers or default_order()

    def replace(self, **changes) -> SamplingParams:
        kept = {**self._values, **{n: getattr(self, n) for n in self._OWN}}
        kept = {k: v for k, v in kept.items() if k in PARAMS or k in self._OWN}
        return SamplingParams(**{**kept, **changes})

    def as_dict(self) -> dict:
        """The settings as plain values (saved with a reply, printed by the CLI): every stage's
        settings, max_new_tokens and seed; the logit bias, the constraint and the order only
        when they are set."""
        out = {name: list(v) if isinstance(v, tuple) else v for name, v in self._values.items()}
        out["max_new_tokens"] = self.max_new_tokens
        out["seed"] = self.seed
        if self.logit_bias:
            out["logit_bias"] = {str(i): b for i, b in self.logit_bias}
        if self.constraint is not None:
            out["constraint"] = self.constraint.as_dict()
        if self.samplers:
            out["samplers"] = list(self.samplers)
        return out


def _rebuild(values: dict) -> SamplingParams:
    constraint = values.pop("constraint", None)
    if constraint is not None:
        constraint = Constraint(**constraint)
    return SamplingParams(constraint=constraint, **values)


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
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: the presets file is not UTF-8 text") from None
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
            if key not in FIELDS and key != "samplers":
                raise ConfigError(
                    f"{where}: unknown field '{key}' (allowed: {', '.join(FIELDS)}, samplers)",
                    key,
                )
        checked = {
            key: check_order(value, f"{where}: samplers")
            if key == "samplers"
            else check_value(key, value, where)
            for key, value in values.items()
        }
        out[str(name)] = SamplingParams(**checked)
    return with_builtins(out)
