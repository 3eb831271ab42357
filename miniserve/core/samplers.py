"""The sampling stages as declarations: one entry per stage, and every surface reads them.

A `Stage` says what it is (its key in a `samplers` order, the label the charts show, its
help), its parameters (each a `Param`: kind, range, the UI's default, the value that is
"off" and the API's default), its place in the default order, whether it runs when the
reply is greedy, whether it can remove every token, and whether Mirostat replaces it. The
function over the logits attaches in `miniserve.engine.sampling` (`@applies(key)`), so this
file needs no torch: the page is built from it before torch is imported.

Read from here: the presets' fields, the sliders, the API's fields and their documented
limits, the remote engines' fields, the CLI's flags and `/set`, the Step view's chart, the
inspector's "removed by" marks and the Compare columns. `declare(stage)` adds one (a test
declares its own and finds it on every surface).

The default order is today's and never moves a seeded reply: the logit bias and the
grammar's mask first (fixed), then repetition penalty -> presence/frequency penalty -> DRY ->
temperature -> top-nσ -> top-k -> typical-p -> top-p -> min-p -> XTC, with Mirostat (when on)
in place of the truncation stages, as llama.cpp does. A request may give its own order
(`samplers`, as llama-server names the stages); a stage left out of it is off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from miniserve.core.fields import ConfigError, Field, check_number


@dataclass(frozen=True)
class Param:
    """One setting of a stage. `field`: kind, range, the UI's default, label and help;
    `off`: the value that switches the stage off (what the API assumes when a request is
    silent); `step` and `slider_max`: the slider. kind `tuple` is a list of strings."""

    name: str
    field: Field
    off: object
    step: float = 0.01
    slider_max: float | None = None


def _on_if_changed(params, stage: Stage) -> bool:
    return any(getattr(params, p.name) != p.off for p in stage.params)


@dataclass(frozen=True)
class Stage:
    key: str  # its name in a `samplers` order (llama-server's)
    label: str  # what the charts, the inspector and the Step view call it
    help: str
    params: tuple[Param, ...] = ()
    place: float = 0.0  # its place in the default order
    fixed: bool = False  # always first, in its place, and never left out (bias, grammar)
    greedy: bool = False  # runs when the reply is greedy too (it moves logits, not a draw)
    truncation: bool = False  # Mirostat, when on, replaces it
    removes_all: bool = False  # may leave no token at all (then: no token allowed)
    # on for these settings (default: any parameter not at its off value)
    on: Callable[[object], bool] | None = None
    shown_off: bool = False  # listed in the charts even when it changes nothing (the classics)
    aliases: tuple[str, ...] = ()  # other names a `samplers` order may use
    # remote servers: flavors that have this stage, and the field names they use where not ours
    remote: tuple[str, ...] = ("llama.cpp", "miniserve")
    remote_names: dict[str, dict[str, str]] = field(default_factory=dict)
    advanced: bool = True  # its sliders sit in the "More samplers" block
    panel: float | None = None  # its place among the sliders (default: `place`)
    short: str = ""  # a column title of 7 characters at most (default: the label)
    # a stage an order that names this one brings in right after it, when the order does not
    # name it itself (llama.cpp's `penalties` is repetition, presence and frequency at once)
    joins: str | None = None

    def __post_init__(self):
        if not self.short:
            object.__setattr__(self, "short", self.label[:7])

    def is_on(self, params) -> bool:
        return self.on(params) if self.on is not None else _on_if_changed(params, self)


def _f(kind, low, high, default, label, help, **kw) -> Field:
    return Field(kind, low, high, default, label, help, **kw)


ALL_SERVERS = ("llama.cpp", "miniserve", "vllm", "ollama", "llama-cpp-python", "openai")
EXTENDED = ("llama.cpp", "miniserve", "vllm", "ollama", "llama-cpp-python")
LLAMA = {"llama.cpp": "repeat_penalty", "llama-cpp-python": "repeat_penalty"}
DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's default sequence breakers
MAX_BREAKERS, MAX_BREAKER_CHARS = 32, 64

STAGES: dict[str, Stage] = {}


def declare(stage: Stage) -> Stage:
    """Add a stage (or replace one of the same key); every surface reads it from here on."""
    STAGES[stage.key] = stage
    ordered = sorted(STAGES.values(), key=lambda s: s.place)
    STAGES.clear()
    STAGES.update({s.key: s for s in ordered})
    _sync_fields()
    return stage


def withdraw(key: str) -> None:
    """Remove a declared stage (a test's own, when it is done)."""
    STAGES.pop(key, None)
    _sync_fields()


for _stage in (
    Stage(
        "logit_bias",
        "logit bias",
        "added to chosen tokens' logits (the request's logit_bias); -100 bans a token",
        place=0,
        fixed=True,
        greedy=True,
        removes_all=True,
        on=lambda p: bool(p.logit_bias),
        advanced=False,
        short="bias",
    ),
    Stage(
        "grammar",
        "grammar",
        "the output format's mask: only tokens that can continue text it accepts",
        place=1,
        fixed=True,
        greedy=True,
        removes_all=True,
        on=lambda p: False,  # on when a mask is given (the engine's, not a setting)
        advanced=False,
    ),
    Stage(
        "penalties",
        "repetition penalty",
        "tokens already seen (prompt and reply) score lower: a positive logit is divided "
        "by the penalty, a negative one multiplied",
        (
            Param(
                "repetition_penalty",
                _f(
                    float,
                    0.5,
                    2.0,
                    1.0,
                    "Repetition penalty",
                    "divide the scores of tokens already seen; 1 = off",
                ),
                1.0,
            ),
        ),
        place=10,
        greedy=True,
        aliases=("repetition_penalty", "penalty"),
        panel=55,  # the sliders: after min-p, as they always were
        short="rep.pen",
        remote=EXTENDED,
        remote_names={k: {"repetition_penalty": v} for k, v in LLAMA.items()},
        advanced=False,
    ),
    Stage(
        "presence",
        "presence/frequency penalty",
        "OpenAI's penalties, over the reply's own tokens: a token the reply already has loses "
        "the presence penalty once and the frequency penalty for each time it is there",
        (
            Param(
                "presence_penalty",
                _f(
                    float,
                    -2.0,
                    2.0,
                    0.0,
                    "Presence penalty",
                    "subtracted from the score of a token the reply already has; 0 = off",
                ),
                0.0,
            ),
            Param(
                "frequency_penalty",
                _f(
                    float,
                    -2.0,
                    2.0,
                    0.0,
                    "Frequency penalty",
                    "subtracted once for each time the reply has the token; 0 = off",
                ),
                0.0,
            ),
        ),
        place=12,
        greedy=True,
        aliases=("presence_penalty", "frequency_penalty"),
        short="pres/fr",
        remote=ALL_SERVERS,
        joins="penalties",
    ),
    Stage(
        "dry",
        "DRY",
        "Don't Repeat Yourself: a token that would extend a sequence already in the text "
        "(at least the allowed length) loses multiplier x base^(length - allowed) from its "
        "logit; sequence breakers end a match",
        (
            Param(
                "dry_multiplier",
                _f(float, 0.0, 5.0, 0.0, "DRY multiplier", "the penalty's size; 0 = off"),
                0.0,
            ),
            Param(
                "dry_base",
                _f(float, 1.0, 4.0, 1.75, "DRY base", "how fast the penalty grows per token"),
                1.75,
            ),
            Param(
                "dry_allowed_length",
                _f(int, 1, 20, 2, "DRY allowed length", "repeats this long go unpenalised"),
                2,
                step=1,
            ),
            Param(
                "dry_penalty_last_n",
                _f(
                    int,
                    -1,
                    1_000_000,
                    -1,
                    "DRY range",
                    "tokens looked back over; -1 = the whole text, 0 = off",
                ),
                -1,
                step=1,
                slider_max=4096,
            ),
            Param(
                "dry_sequence_breakers",
                _f(
                    tuple,
                    0,
                    MAX_BREAKERS,
                    DRY_BREAKERS,
                    "DRY sequence breakers",
                    "a token whose text holds one of these ends a repeat",
                ),
                DRY_BREAKERS,
            ),
        ),
        place=15,
        greedy=True,
        on=lambda p: p.dry_multiplier > 0 and p.dry_penalty_last_n != 0,
    ),
    Stage(
        "temperature",
        "temperature",
        "divides the logits: below 1 sharpens the distribution, above 1 flattens it",
        (
            Param(
                "temperature",
                _f(
                    float,
                    0.0,
                    2.0,
                    0.7,
                    "Temperature",
                    "divides the logits; 0 means greedy (always the most likely token)",
                ),
                1.0,
                step=0.05,
            ),
        ),
        place=20,
        shown_off=True,
        aliases=("temp",),
        short="temp",
        remote=ALL_SERVERS,
        advanced=False,
    ),
    Stage(
        "top_n_sigma",
        "top-nσ",
        "keep the tokens whose logit is within n standard deviations of the best",
        (
            Param(
                "top_n_sigma",
                _f(float, -1.0, 10.0, -1.0, "Top-nσ", "n standard deviations; <= 0 = off"),
                -1.0,
                step=0.05,
            ),
        ),
        place=25,
        truncation=True,
        on=lambda p: p.top_n_sigma > 0,
    ),
    Stage(
        "top_k",
        "top-k",
        "keep only the k most likely tokens",
        (
            Param(
                "top_k",
                _f(
                    int,
                    0,
                    1_000_000,
                    50,
                    "Top-k",
                    "keep only the k most likely tokens; 0 = off (k above the vocabulary = off)",
                ),
                0,
                step=1,
                slider_max=200,
            ),
        ),
        place=30,
        truncation=True,
        shown_off=True,
        remote=EXTENDED,
        advanced=False,
    ),
    Stage(
        "typ_p",
        "typical-p",
        "keep the tokens whose surprise is closest to the distribution's entropy, until "
        "their mass reaches p",
        (
            Param(
                "typical_p",
                _f(float, 0.0, 1.0, 1.0, "Typical-p", "the mass kept; 1 = off", low_open=True),
                1.0,
            ),
        ),
        place=35,
        truncation=True,
        aliases=("typical_p", "typical"),
        remote=("llama.cpp", "miniserve", "llama-cpp-python"),
    ),
    Stage(
        "top_p",
        "top-p",
        "keep the smallest set of most likely tokens whose probability reaches p",
        (
            Param(
                "top_p",
                _f(
                    float,
                    0.0,
                    1.0,
                    0.95,
                    "Top-p",
                    "keep the smallest set of tokens whose probability reaches p; 1 = off",
                    low_open=True,
                ),
                1.0,
            ),
        ),
        place=40,
        truncation=True,
        shown_off=True,
        remote=ALL_SERVERS,
        advanced=False,
    ),
    Stage(
        "min_p",
        "min-p",
        "drop tokens less likely than min_p x the top token's probability",
        (
            Param(
                "min_p",
                _f(
                    float,
                    0.0,
                    1.0,
                    0.0,
                    "Min-p",
                    "drop tokens less likely than min_p x the top token's probability; 0 = off",
                ),
                0.0,
            ),
        ),
        place=50,
        truncation=True,
        shown_off=True,
        remote=EXTENDED,
        advanced=False,
    ),
    Stage(
        "xtc",
        "XTC",
        "Exclude Top Choices: with the given probability, every token at least as likely as "
        "the threshold is removed except the least likely of them",
        (
            Param(
                "xtc_probability",
                _f(float, 0.0, 1.0, 0.0, "XTC probability", "how often it acts; 0 = off"),
                0.0,
            ),
            Param(
                "xtc_threshold",
                _f(
                    float,
                    0.0,
                    1.0,
                    0.1,
                    "XTC threshold",
                    "tokens at least this likely are the top choices; above 0.5 = off",
                ),
                0.1,
            ),
        ),
        place=60,
        truncation=True,
        on=lambda p: p.xtc_probability > 0 and p.xtc_threshold <= 0.5,
    ),
    Stage(
        "mirostat",
        "Mirostat",
        "Mirostat v2: keeps the reply's surprise near tau, in place of the truncation "
        "stages (top-nσ, top-k, typical-p, top-p, min-p, XTC); its state is per reply",
        (
            Param(
                "mirostat",
                _f(int, 0, 2, 0, "Mirostat", "0 = off, 2 = Mirostat v2", choices=(0, 2)),
                0,
                step=2,
            ),
            Param(
                "mirostat_tau",
                _f(float, 0.0, 20.0, 5.0, "Mirostat tau", "the target surprise, in bits"),
                5.0,
                step=0.1,
            ),
            Param(
                "mirostat_eta",
                _f(float, 0.0, 1.0, 0.1, "Mirostat eta", "how fast it follows the target"),
                0.1,
            ),
        ),
        place=1000,  # after every stage a user may order
        fixed=True,
        on=lambda p: p.mirostat == 2 and not p.greedy,
        remote=("llama.cpp", "miniserve", "llama-cpp-python"),
        remote_names={"llama-cpp-python": {"mirostat": "mirostat_mode"}},
    ),
):
    STAGES[_stage.key] = _stage

# The settings that are not a stage's: how long the reply may be.
MAX_NEW_TOKENS_FIELD = Field(
    int, 1, 4096, 256, "Max new tokens", "stop after this many generated tokens"
)
# every stage's settings in the panel's order, then max_new_tokens (kept in step with STAGES)
FIELDS: dict[str, Field] = {}
PARAMS: dict[str, tuple[Stage, Param]] = {}


def _sync_fields() -> None:
    PARAMS.clear()
    panel = sorted(STAGES.values(), key=lambda s: (s.advanced, s.panel or s.place))
    PARAMS.update({p.name: (s, p) for s in panel for p in s.params})
    FIELDS.clear()
    FIELDS.update({name: p.field for name, (_, p) in PARAMS.items()})
    FIELDS["max_new_tokens"] = MAX_NEW_TOKENS_FIELD


_sync_fields()


def orderable() -> list[Stage]:
    """The stages a `samplers` order may place, in the default order."""
    return [s for s in STAGES.values() if not s.fixed]


def default_order() -> tuple[str, ...]:
    return tuple(s.key for s in orderable())


def stage_of(name: str) -> Stage | None:
    """The orderable stage a `samplers` entry names (its key or an alias), or None."""
    name = name.strip().lower().replace("-", "_")
    for s in orderable():
        if name == s.key or name in s.aliases:
            return s
    return None


def check_order(order, where: str = "samplers") -> tuple[str, ...] | None:
    """A `samplers` list (or a ';'/','-separated string, as llama.cpp's CLI takes it) as stage
    keys; None: the default order."""
    if order is None:
        return None
    if isinstance(order, str):
        order = [n for n in order.replace(";", ",").split(",") if n.strip()]
    if not isinstance(order, (list, tuple)) or not all(isinstance(n, str) for n in order):
        raise ConfigError(f"'{where}' must be a list of stage names", where)
    keys = []
    for name in order:
        stage = stage_of(name)
        if stage is None:
            raise ConfigError(
                f"'{where}': unknown stage {name!r} (stages: {', '.join(default_order())}; "
                "the logit bias and the grammar always come first, Mirostat is switched by "
                "'mirostat')",
                where,
            )
        if stage.key in keys:
            raise ConfigError(f"'{where}': {stage.key!r} is listed twice", where)
        keys.append(stage.key)
    for s in orderable():  # what an order's stage brings in with it (Stage.joins)
        if s.joins in keys and s.key not in keys:
            keys.insert(keys.index(s.joins) + 1, s.key)
    keys = tuple(keys)
    return None if keys == default_order() else keys


def check_breakers(value, name: str = "dry_sequence_breakers", where: str = "") -> tuple:
    """DRY's sequence breakers: a list of non-empty strings (a JSON string of a list is read,
    as llama-server's CLI takes it)."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, str) and 0 < len(v) <= MAX_BREAKER_CHARS for v in value
    ):
        raise ConfigError(
            f"{prefix}'{name}' must be a list of strings of 1 to {MAX_BREAKER_CHARS} characters",
            name,
        )
    if len(value) > MAX_BREAKERS:
        raise ConfigError(
            f"{prefix}'{name}' may hold at most {MAX_BREAKERS} strings, got {len(value)}", name
        )
    return tuple(value)


def check_setting(name: str, value, where: str = ""):
    """One stage setting (or max_new_tokens), checked and converted to its kind."""
    spec = FIELDS.get(name)
    if spec is None:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}unknown setting '{name}' (allowed: {', '.join(FIELDS)})", name)
    if spec.kind is tuple:
        return check_breakers(value, name, where)
    return check_number(name, value, spec, where)


def running(params, order: tuple[str, ...] | None = None) -> list[Stage]:
    """The stages that run for these settings, in order (the grammar's mask is added by the
    engine where there is one): the fixed ones first, then the order's stages that are on;
    Mirostat, when on, in place of the truncation stages; greedy keeps only those that move
    logits."""
    order = order if order is not None else (params.samplers or default_order())
    mirostat = "mirostat" in STAGES and STAGES["mirostat"].is_on(params)
    out = [s for s in STAGES.values() if s.fixed and s.key != "mirostat"]
    for key in order:
        s = STAGES.get(key)
        if s is None or (mirostat and s.truncation):
            continue
        out.append(s)
    if mirostat:
        out.append(STAGES["mirostat"])
    if params.greedy:
        out = [s for s in out if s.greedy]
    return [s for s in out if s.is_on(params) or s.shown_off or s.key == "grammar"]


def describe(params) -> str:
    """The settings in one line, the stages on in their order (the REPL, Compare, the CLI)."""
    parts = []
    if params.greedy:
        parts.append("greedy")
    for s in running(params):
        for p in s.params:
            value = getattr(params, p.name)
            if p.field.kind is tuple:
                value = "[" + ",".join(repr(v) for v in value) + "]"
            elif isinstance(value, float):
                value = f"{value:g}"
            parts.append(f"{p.name}={value}")
    if params.samplers:
        parts.append("samplers=" + ";".join(params.samplers))
    return " ".join(parts)
