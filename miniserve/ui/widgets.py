"""The controls the tabs share: the number boxes' values and sampling settings from them, the
Output format control, the preset and sampling sliders, a thinking model's Think switch and
reasoning budget, and the keys (Enter, Ctrl+Enter)."""

from __future__ import annotations

import functools
import inspect
import json
from types import SimpleNamespace
from typing import NamedTuple

import gradio as gr

from miniserve.core.config import FIELDS, ConfigError, Constraint, SamplingParams, check_seed
from miniserve.core.samplers import PARAMS, check_setting, orderable
from miniserve.engine.chat import ChatOptions


def unchanged(n: int) -> tuple:
    """n outputs that leave their components as they are."""
    return tuple(gr.update() for _ in range(n))


def whole(value):
    """A number box's value: an int when it is a whole number, else as given (so that the
    settings' checks name a fraction instead of it being cut off silently)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def seed_from(value) -> int | None:
    """The Seed box: empty or negative means a random seed; else a whole number."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass  # check_seed names it
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        return None
    return check_seed(value)


ORDER = "samplers"  # the Sampler order control: after the sliders, among the settings


def setting_names() -> list[str]:
    """The settings the panel passes, in the order the handlers take them: every declared
    stage's (FIELDS order, max_new_tokens last), then the stage order."""
    return [*FIELDS, ORDER]


def text_list(value, name: str) -> tuple[str, ...]:
    """A text box holding a list of strings, written as JSON (["\\n", ":"]); empty: none."""
    if isinstance(value, (list, tuple)):
        return tuple(value)
    text = str(value or "").strip()
    if not text:
        return ()
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(
            f"'{FIELDS[name].label}' must be a JSON list of strings, like "
            f"{json.dumps(list(FIELDS[name].default))}",
            name,
        ) from None
    return check_setting(name, items)


def params_from(settings, seed, output_format=None, format_text="") -> SamplingParams:
    """The settings panel (setting_names order), the Seed box and the Output format control as
    checked sampling settings."""
    names = setting_names()
    if len(settings) != len(names):
        raise ValueError(
            f"expected {len(names)} settings ({', '.join(names)}), got {len(settings)}"
        )
    fields = {}
    for name, value in zip(names, settings):
        if name == ORDER:
            fields[name] = list(value) if value is not None else None
        elif FIELDS[name].kind is tuple:
            fields[name] = text_list(value, name)
        else:
            fields[name] = whole(value)
    return SamplingParams(
        seed=seed_from(seed), constraint=constraint_from(output_format, format_text), **fields
    )


SETTINGS = "settings"  # in a panel's fields (takes_panel): the settings panel, control by control


def takes_panel(*fields):
    """A handler taking its controls' values as one parameter `panel` (a SimpleNamespace, the
    settings panel's values as `panel.settings`, setting_names order), declared once per tab:
    `fields` are names, or (name, default) pairs, with SETTINGS where the settings panel
    goes. The wrapper takes them one by one in `panel`'s place, so that Gradio passes each
    control and still injects the request and event data (it does so only for functions
    without *args, at their parameters' places)."""
    names = setting_names()

    def wrap(fn):
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        at = [p.name for p in params].index("panel")
        kind, empty = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty
        spread = []
        for f in fields:
            name, default = (f, empty) if isinstance(f, str) else f
            if name == SETTINGS:
                spread += [inspect.Parameter(f"setting_{n}", kind) for n in names]
            else:
                spread.append(inspect.Parameter(name, kind, default=default))
        new = sig.replace(parameters=[*params[:at], *spread, *params[at + 1 :]])
        own = {p.name for p in spread}

        def call(args, kwargs):
            bound = new.bind(*args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            panel = SimpleNamespace(**{k: values.pop(k) for k in list(values) if k in own})
            panel.settings = [getattr(panel, f"setting_{n}") for n in names]
            before = [values.pop(p.name) for p in params[:at]]
            return fn(*before, panel, **values)

        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                return (yield from call(args, kwargs))

        else:

            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                return call(args, kwargs)

        wrapper.__signature__ = new
        return wrapper

    return wrap


# -- Output format ----------------------------------------------------------------------------
# The dropdown's choices: the constraint kind each holds the reply to (config.Constraint), and
# for those that need text, the text box's label and a placeholder example.
FREE_TEXT = "Free text"

# The controls every generating tab passes after its own (widgets.takes_panel's fields): the
# settings panel, the seed, the inspector, the output format and its text, the model.
GENERATING = (
    SETTINGS,
    "seed",
    "inspect_on",
    ("output_format", FREE_TEXT),
    ("format_text", ""),
    ("model", None),
)


class Format(NamedTuple):
    kind: str | None
    box: str = ""  # the text box's label ("": no box)
    example: str = ""


FORMATS = {
    FREE_TEXT: Format(None),
    "JSON": Format("json_object"),
    "JSON schema": Format(
        "json_schema",
        "Schema (a JSON Schema the reply must follow)",
        '{"type": "object", "properties": {"name": {"type": "string"}, '
        '"age": {"type": "integer"}}, "required": ["name", "age"]}',
    ),
    "Regex": Format(
        "regex", "Pattern (the whole reply must match it)", r"(yes|no)\. [A-Z][a-z ]{10,60}\."
    ),
    "Choice": Format(
        "choice", "Choices (one per line, or separated by commas)", "red\ngreen\nblue"
    ),
    "Grammar": Format(
        "grammar",
        "Grammar (GBNF with ::=, or Lark)",
        'root ::= "The answer is " ("yes" | "no") "."',
    ),
}
JSON_KINDS = ("json_object", "json_schema")


def format_label(constraint: Constraint | None) -> str:
    """The dropdown's name for a constraint's kind ("Free text" for None)."""
    kind = constraint.kind if constraint is not None else None
    return next(label for label, f in FORMATS.items() if f.kind == kind)


def constraint_from(output_format, text) -> Constraint | None:
    """The Output format control's values as a Constraint (None: free text). Raises
    ConfigError for an unknown format and for text the format cannot start from: an empty or
    non-JSON schema, an empty pattern or grammar, no choices. Whether the grammar library can
    enforce it is checked when the reply starts (GrammarError)."""
    fmt = FORMATS.get(output_format or FREE_TEXT)
    if fmt is None:
        raise ConfigError(
            f"unknown output format {output_format!r} (choose one of {', '.join(FORMATS)})",
            "constraint",
        )
    text = str(text if text is not None else "")
    if fmt.kind in (None, "json_object"):
        return Constraint(fmt.kind) if fmt.kind else None
    if fmt.kind == "choice":
        lines = text.splitlines() if "\n" in text.strip() else text.split(",")
        choices = [c.strip() for c in lines if c.strip()]
        if not choices:
            raise ConfigError(
                "no choices given: write them one per line or separated by commas", "constraint"
            )
        return Constraint("choice", json.dumps(choices))
    if not text.strip():
        what = {
            "json_schema": "the JSON schema is empty: paste a JSON Schema",
            "regex": "the regex pattern is empty: write the pattern the reply must match",
            "grammar": "the grammar is empty: write one in GBNF (root ::= ...) or Lark",
        }
        raise ConfigError(f"{what[fmt.kind]}, like {fmt.example}", "constraint")
    if fmt.kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"the JSON schema is not JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                "constraint",
            ) from None
        return Constraint("json_schema", json.dumps(schema))
    # a pattern as typed, less the line breaks a text box adds around it
    return Constraint(fmt.kind, text.strip("\r\n") if fmt.kind == "regex" else text)


def format_note(constraint: Constraint | None, finish_reason: str) -> str:
    """What a finished reply's end means for its output format ("" when nothing to say)."""
    if constraint is None:
        return ""
    if finish_reason == "length":
        return (
            "incomplete JSON (cut by max new tokens)"
            if constraint.kind in JSON_KINDS
            else "incomplete: cut by max new tokens before the format was complete"
        )
    if finish_reason == "no_token_allowed":
        return (
            "ended early: the output format allowed no next token, so the reply may be incomplete"
        )
    return ""


def format_box(output_format) -> dict:
    """The text box under the dropdown: shown with its label and example when the format
    needs text."""
    fmt = FORMATS.get(output_format, FORMATS[FREE_TEXT])
    return gr.update(visible=bool(fmt.box), label=fmt.box or "Format", placeholder=fmt.example)


class OutputFormat(NamedTuple):
    """The control's components; `inputs` in the order constraint_from takes them."""

    format: gr.Dropdown
    text: gr.Textbox

    @property
    def inputs(self) -> list:
        return [self.format, self.text]


def build_output_format() -> OutputFormat:
    """The Output format dropdown and its text box (call inside a layout block)."""
    fmt = gr.Dropdown(
        list(FORMATS),
        value=FREE_TEXT,
        label="Output format",
        info="hold the reply to a format: at each step the sampler masks every "
        "token that would break it",
    )
    text = gr.Textbox(visible=False, lines=3, max_lines=12, label="Format")
    fmt.change(format_box, fmt, text, queue=False)
    return OutputFormat(fmt, text)


# -- Presets and sampling controls -----------------------------------------------------------


def preset_values(presets: dict[str, SamplingParams], name) -> list:
    """The settings panel's values (setting_names order) of a preset."""
    preset = presets[name]
    out = []
    for k in FIELDS:
        value = getattr(preset, k)
        out.append(json.dumps(list(value)) if FIELDS[k].kind is tuple else value)
    return [*out, list(preset.order)]


class SamplingControls(NamedTuple):
    """The Preset dropdown, the settings panel (a control per setting_names entry) and the
    Seed box."""

    preset: gr.Dropdown
    sliders: list  # setting_names order
    seed: gr.Number

    @property
    def inputs(self) -> list:
        """In the order the handlers take them: preset, the settings, seed."""
        return [self.preset, *self.sliders, self.seed]

    def named(self, name: str):
        return self.sliders[setting_names().index(name)]

    @property
    def shaping(self) -> list:
        """The controls that change the distribution (all but max new tokens)."""
        return [c for n, c in zip(setting_names(), self.sliders) if n != "max_new_tokens"]


def _control(name: str, value):
    stage, param = PARAMS[name]
    spec = param.field
    if spec.kind is tuple:
        return gr.Textbox(
            value=json.dumps(list(value)),
            label=spec.label,
            info=spec.help + " (a JSON list)",
            elem_id=f"setting-{name}",
        )
    return gr.Slider(
        minimum=spec.low,
        maximum=param.slider_max if param.slider_max is not None else spec.high,
        value=value,
        step=param.step,
        label=spec.label,
        info=spec.help,
        elem_id=f"setting-{name}",
    )


def build_sampling(
    presets: dict[str, SamplingParams], default_preset: str, apply, seed_info: str
) -> SamplingControls:
    """The Preset dropdown, a control per sampling setting (the classic stages' sliders, then
    "More samplers": the other stages' and the stage order) and the Seed box (call inside a
    layout block); choosing a preset moves them all (`apply(name)` -> their values)."""
    start = presets[default_preset]
    preset = gr.Dropdown(choices=list(presets), value=default_preset, label="Preset")
    made = {}
    for name, (stage, _) in PARAMS.items():
        if not stage.advanced:
            made[name] = _control(name, getattr(start, name))
    mnt = FIELDS["max_new_tokens"]
    made["max_new_tokens"] = gr.Slider(
        minimum=mnt.low,
        maximum=mnt.high,
        value=start.max_new_tokens,
        step=1,
        label=mnt.label,
        info=mnt.help,
        elem_id="setting-max_new_tokens",
    )
    with gr.Accordion("More samplers", open=False, elem_id="more-samplers"):
        for name, (stage, _) in PARAMS.items():
            if stage.advanced:
                made[name] = _control(name, getattr(start, name))
        made[ORDER] = gr.Dropdown(
            choices=[(s.label, s.key) for s in orderable()],
            value=list(start.order),
            multiselect=True,
            label="Sampler order",
            info="the stages run in this order, after the logit bias and the output format; "
            "one left out is off; remove one and add it again to move it to the end",
            elem_id="sampler-order",
        )
    sliders = [made[n] for n in setting_names()]
    seed = gr.Number(label="Seed", value=-1, precision=0, info=seed_info)
    preset.change(apply, preset, sliders)
    return SamplingControls(preset, sliders, seed)


# -- Thinking ---------------------------------------------------------------------------------
# A thinking model's controls: Think on/off and the reasoning budget, as llama.cpp's
# --reasoning-budget counts it (-1: no limit, 0: no reasoning, N: at most N reasoning tokens,
# then the reasoning is closed and the answer follows). Shown only for a model that thinks.
BUDGET_MAX = 4096  # the slider's range; the API takes more
NO_LIMIT = -1


def budget_from(value) -> int | None:
    """The budget slider's value: None for no limit (negative or empty), else a whole number
    of tokens."""
    value = whole(value)
    if value is None or value == "" or (isinstance(value, (int, float)) and value < 0):
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"the reasoning budget must be a whole number of tokens (-1: no limit), got {value!r}",
            "reasoning_budget",
        )
    return value


def thinking_options(think, budget) -> ChatOptions:
    """The Think switch and the budget slider as the chat's options."""
    return ChatOptions(thinking=bool(think), reasoning_budget=budget_from(budget))


class ThinkingControls(NamedTuple):
    """The group (shown for a model that thinks), the Think switch and the budget slider."""

    group: gr.Column
    think: gr.Checkbox
    budget: gr.Slider

    @property
    def inputs(self) -> list:
        return [self.think, self.budget]


def build_thinking(visible: bool) -> ThinkingControls:
    """The Think switch and the reasoning budget (call inside a layout block); the budget is
    greyed out while Think is off."""
    with gr.Column(visible=visible, elem_id="thinking", variant="panel") as group:
        think = gr.Checkbox(
            label="Think",
            value=True,
            info="the model reasons before it answers (shown folded above the reply); "
            "off: it answers at once",
            elem_id="think",
        )
        budget = gr.Slider(
            minimum=NO_LIMIT,
            maximum=BUDGET_MAX,
            value=NO_LIMIT,
            step=1,
            label="Reasoning budget",
            info="reasoning tokens at most, then the answer starts: -1 = no limit (or the "
            "app's --reasoning-budget), 0 = none",
            elem_id="reasoning-budget",
        )
    think.change(lambda on: gr.update(interactive=bool(on)), think, budget, queue=False)
    return ThinkingControls(group, think, budget)


# -- Keyboard ---------------------------------------------------------------------------------
# What the keys do, as in chat apps and editors. Chat's message box is a one-line Textbox that
# grows (lines=1, max_lines>1): Gradio sends it on Enter, and Shift+Enter is left to the
# browser, which adds a line. Gradio sends on the Enter's `keypress` even while an input method
# is composing (a Japanese or Chinese IME commits its text with Enter), so that Enter is held
# back here, for every text box. Ctrl+Enter (Cmd+Enter) in a box of class CTRL_ENTER clicks
# the nearest button of class CTRL_ENTER_TARGET (the Notebook's Generate). Installed once per
# page, on load; <html data-ms-keys="on"> says it is.
CTRL_ENTER = "ms-ctrl-enter"
CTRL_ENTER_TARGET = "ms-ctrl-enter-target"
KEYS_JS = """
() => {
  if (window.msKeys) return;
  window.msKeys = true;
  let composing = false;  // the last Enter's keydown came from an input method
  window.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" && e.keyCode !== 229) return;
    composing = e.isComposing || e.keyCode === 229;
    if (composing || e.key !== "Enter" || !(e.ctrlKey || e.metaKey)) return;
    const box = e.target.closest && e.target.closest(".%(box)s");
    if (!box) return;
    let around = box.parentElement;
    while (around && !around.querySelector(".%(target)s")) around = around.parentElement;
    const button = around && around.querySelector(".%(target)s");
    if (!button) return;
    e.preventDefault();
    button.click();
  }, true);
  window.addEventListener("keypress", (e) => {
    if (e.key === "Enter" && (e.isComposing || composing)) e.stopPropagation();
  }, true);
  document.documentElement.dataset.msKeys = "on";
}
""" % {"box": CTRL_ENTER, "target": CTRL_ENTER_TARGET}  # noqa: UP031 -- JS braces stay plain


def install_keys(demo: gr.Blocks) -> None:
    """The page's keys (KEYS_JS), set up when the page loads; call inside `demo`."""
    demo.load(None, None, None, js=KEYS_JS)
