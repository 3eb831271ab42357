"""The command line's shared parts: one-line argument errors, the model, sampling and history
flags (their ranges from core/config.py), and opening the models and history they name. Used by
the subcommands (cli/main.py) and the web app's launcher (cli/app.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from miniserve.core.config import (
    CONTEXT,
    FIELDS,
    KV_BUDGET,
    MATHS,
    MAX_BATCH,
    MAX_CONVERSATIONS,
    MAX_LOADED_MODELS,
    MAX_QUEUE,
    ConfigError,
    Constraint,
    Field,
    SamplingParams,
    load_presets,
    parse_logit_bias,
)
from miniserve.core.errors import Unavailable, UserError
from miniserve.core.samplers import default_order
from miniserve.engine.grammar import GrammarError
from miniserve.models.registry import EngineOptions
from miniserve.models.registry import open_models as open_registry
from miniserve.store import store

if TYPE_CHECKING:
    from miniserve.store.store import Store

DEFAULT_PRESET = "balanced"


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


DEFAULT_SPECULATE = "ngram"  # where the runner is batch-invariant (Engine.speculation)


def port_number(value: str) -> int:
    """A TCP port flag's value (argparse's type): a whole number from 1 to 65535."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number from 1 to 65535, not {value!r}")
    return port


def reasoning_budget(value: str) -> int:
    """--reasoning-budget's value (argparse's type): -1 (no limit) or a count of tokens."""
    try:
        budget = int(value)
    except ValueError:
        budget = -2
    if budget < -1:
        raise argparse.ArgumentTypeError(
            f"a reasoning budget is -1 (no limit), 0 (no reasoning) or a number of tokens, "
            f"not {value!r}"
        )
    return budget


def fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    return code


def fail_with(e: UserError) -> int:
    """The command line's one mapping of an error meant for the user: its sentence on one
    line, exit code 1 when a model could not be loaded or reached, else 2 (a bad request)."""
    return fail(e.describe(), 1 if isinstance(e, Unavailable) else 2)


# Whole-number settings, by flag; their ranges and defaults are in config.py. add_model_args
# adds the engine's, add_history_args the store's; flag_error checks every one a parser has.
ENGINE_FLAGS: dict[str, Field] = {
    "--kv-budget": KV_BUDGET,
    "--max-batch": MAX_BATCH,
    "--max-queue": MAX_QUEUE,
    "--max-loaded-models": MAX_LOADED_MODELS,
}
HISTORY_FLAGS: dict[str, Field] = {"--history-max-conversations": MAX_CONVERSATIONS}
RANGED_FLAGS: dict[str, Field] = {**ENGINE_FLAGS, **HISTORY_FLAGS, "--context": CONTEXT}


def _add_ranged(p: argparse.ArgumentParser, flags: dict[str, Field]) -> None:
    for flag, spec in flags.items():  # argparse checks the number, flag_error the range
        p.add_argument(
            flag,
            type=int,
            default=spec.default,
            metavar="N",
            help=f"{spec.help}: {int(spec.low)} to {int(spec.high)} (default {int(spec.default)})",
        )


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="[NAME=]SOURCE",
        help="a .gguf file, a model folder, a Hugging Face id, gemma-3-270m "
        "(installed on request; Gemma terms apply), or the URL of an "
        "OpenAI-compatible server, http://HOST:PORT/v1[#served-name]; "
        "repeatable: the first is the default (default: $MINISERVE_MODEL, "
        "else the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--models-file",
        default=None,
        metavar="YAML",
        help="the models to serve as a file (a list of sources, or of mappings with "
        "source, name, context, api_key_env); after any --model",
    )
    p.add_argument(
        "--remote-api-key",
        default=os.environ.get("MINISERVE_REMOTE_API_KEY"),
        metavar="KEY",
        help="the key remote models' servers ask for (or set "
        "MINISERVE_REMOTE_API_KEY); not this server's --api-key",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help=f"the context of remote models whose server does not report it "
        f"({int(CONTEXT.low)} to {int(CONTEXT.high)}; default "
        f"{int(CONTEXT.default)})",
    )
    p.add_argument(
        "--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps"
    )
    p.add_argument(
        "--speculate",
        choices=("ngram", "off"),
        default=None,
        help="prompt-lookup speculation: drafts from the prompt and the reply so far, verified "
        "in one pass, the reply unchanged (native runner only; default ngram: 2-3x on replies "
        "that copy their input, within noise elsewhere, BENCHMARKS.md; bench: off unless "
        "asked, so that its rows time the same loop as the engines they are compared with)",
    )
    p.add_argument(
        "--reasoning-budget",
        type=reasoning_budget,
        default=-1,
        metavar="N",
        help="a thinking model's reasoning tokens at most, where a request sets none; then "
        "the reasoning is closed and the answer follows (0: no reasoning; default -1: no "
        "limit)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="weights: auto, stored, float32, bfloat16, float16. stored: a GGUF's "
        "weights as the file holds them (Q4_K, Q6_K, Q8_0, Q4_1, ... blocks, "
        "memory-mapped; the native runner on the CPU); the others: dequantized "
        "copies. auto: stored for a GGUF where the native runner runs, else "
        "bfloat16 on CUDA and on a CPU with the native runner, float16 on MPS, "
        "else float32",
    )
    p.add_argument(
        "--runner",
        default="auto",
        choices=("auto", "native", "lean", "transformers"),
        help="lean: the readable fused forward pass in PyTorch (Llama family); "
        "native: the same forward pass in compiled C++, every pass -- prompt "
        "chunks and the decode rows of many sequences together (CPU); "
        "transformers: the library model; auto: the fastest that applies",
    )
    p.add_argument(
        "--quant",
        default=None,
        choices=("q8_0", "q4_0", "int8"),
        help="quantize a float model's matrices at load: q8_0 / q4_0 (llama.cpp's "
        "blocks of 32 weights with a scale each, made by the gguf package, "
        "run by the native runner's integer kernels; for a GGUF, its own "
        "blocks run as stored without this); int8 (one scale a row, the "
        "PyTorch lean runner, bfloat16 activations, a bfloat16 copy kept for "
        "prompts: decodes slower than q8_0, prompts faster where PyTorch uses AMX)",
    )
    p.add_argument(
        "--math",
        default="auto",
        choices=MATHS,
        help="the arithmetic of the matrix products, apart from the weights' dtype: "
        "float32 (float32 products and sums); bfloat16 (activations rounded to "
        "bfloat16, products summed in float32); auto: bfloat16 where the CPU "
        "has bfloat16 dot products and the weights are bfloat16, else float32. "
        "With weights as stored, quantized matrices always take their "
        "activations as int8 blocks; --math is the arithmetic of attention "
        "(bfloat16: a bfloat16 KV cache) and of any float matrices (auto: "
        "bfloat16 where the CPU has bfloat16 dot products)",
    )
    _add_ranged(p, ENGINE_FLAGS)


def flag_error(args) -> str | None:
    """One line naming the first ranged flag out of its range, or None."""
    for flag, spec in RANGED_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None and not spec.low <= value <= spec.high:
            return f"{flag} must be from {int(spec.low)} to {int(spec.high)}, got {value}"
    return None


def add_history_args(p: argparse.ArgumentParser) -> None:
    """Where saved conversations go (miniserve/store/store.py)."""
    p.add_argument(
        "--history-db",
        default=os.environ.get("MINISERVE_HISTORY_DB"),
        metavar="PATH",
        help="the SQLite file of saved conversations (or set MINISERVE_HISTORY_DB; "
        "default: history.sqlite3 in the data folder, $MINISERVE_DATA_DIR "
        "if set)",
    )
    p.add_argument(
        "--no-history",
        action="store_true",
        help="keep nothing on disk: conversations live in memory until the app stops",
    )
    _add_ranged(p, HISTORY_FLAGS)


def open_history(args) -> Store:
    """The conversation store the flags of add_history_args name; its notice (history off,
    a file kept aside or not writable), if any, printed once to stderr. Range-check the flags
    first (flag_error; load_engine does)."""
    history = store.open_store(
        args.history_db,
        enabled=not args.no_history,
        max_conversations=args.history_max_conversations,
    )
    if history.notice:
        print(f"note: {history.notice}", file=sys.stderr)
    return history


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default=None,
        help=f"a preset from presets.yaml, or the built-in greedy (argmax, no "
        f"filters; a presets file may redefine it) (default: {DEFAULT_PRESET})",
    )
    p.add_argument("--presets-file", default=None, help="another presets.yaml")
    for name, spec in FIELDS.items():
        listed = spec.kind is tuple
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=str if listed else spec.kind,
            action="append" if listed else "store",
            default=None,
            metavar="TEXT" if listed else "N",
            help=f"{spec.help} ("
            + ("repeat the flag for each; --dry-sequence-breakers '' for none" if listed else "")
            + (spec.describe() if not listed else "")
            + ")",
        )
    p.add_argument(
        "--samplers",
        default=None,
        metavar="A;B;...",
        help="the stages' order, separated by ; (default: "
        + ";".join(default_order())
        + "); a stage left out is off",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for a reproducible run")
    p.add_argument(
        "--logit-bias",
        metavar="ID:BIAS,...",
        default=None,
        help="add BIAS (-100..100; -100 bans) to token ID's logit, e.g. 13:-100,42:2.5",
    )
    fmt = p.add_argument_group("output format (the reply is held to it, token by token)")
    one = fmt.add_mutually_exclusive_group()
    one.add_argument("--json-object", action="store_true", help="any JSON object")
    one.add_argument(
        "--json-schema", metavar="FILE", help="JSON valid against the JSON Schema in FILE"
    )
    one.add_argument("--regex", metavar="PATTERN", help="text matching PATTERN, whole")
    one.add_argument("--choice", metavar="A,B,C", help="exactly one of these strings")
    one.add_argument(
        "--grammar", metavar="FILE", help="a grammar in FILE: GBNF (llama.cpp's, with ::=) or Lark"
    )


# the flag each output format comes from, for errors
FORMAT_FLAGS = {
    "json_object": "--json-object",
    "json_schema": "--json-schema",
    "regex": "--regex",
    "choice": "--choice",
    "grammar": "--grammar",
}


def constraint_from_args(args):
    """The output-format flag as a Constraint (None without one); ConfigError naming the flag
    for a file that cannot be read or a schema that is not JSON."""
    if getattr(args, "json_object", False):
        return Constraint("json_object")
    if getattr(args, "regex", None) is not None:
        return Constraint("regex", args.regex)
    if getattr(args, "choice", None) is not None:
        choices = [c for c in args.choice.split(",") if c]
        if not choices:
            raise ConfigError(
                "--choice: give the strings separated by commas, like yes,no", "choice"
            )
        return Constraint("choice", json.dumps(choices))
    for kind, flag in (("json_schema", "--json-schema"), ("grammar", "--grammar")):
        path = getattr(args, kind, None)
        if path is None:
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as e:
            raise ConfigError(f"{flag}: cannot read {path} ({e.strerror})", kind) from None
        except UnicodeDecodeError:
            raise ConfigError(f"{flag}: {path} is not UTF-8 text", kind) from None
        if kind == "json_schema":
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{flag}: {path} is not JSON: {e.msg} at line {e.lineno}", kind
                ) from None
        return Constraint(kind, text)
    return None


def logit_bias_from(text: str | None) -> tuple:
    """ "13:-100,42:2.5" as checked (id, bias) pairs; ConfigError naming --logit-bias."""
    return parse_logit_bias(text, "--logit-bias")


def params_from_args(args) -> tuple[SamplingParams, dict[str, SamplingParams]]:
    presets = load_presets(args.presets_file)
    name = args.preset or DEFAULT_PRESET
    if name not in presets:
        raise ConfigError(f"unknown preset '{name}' (available: {', '.join(presets)})", "preset")
    changes = {k: getattr(args, k) for k in FIELDS if getattr(args, k) is not None}
    for k, v in list(changes.items()):
        if FIELDS[k].kind is tuple:  # the flag repeated; '' alone: none
            changes[k] = [t for t in v if t]
    if getattr(args, "samplers", None) is not None:
        changes["samplers"] = args.samplers
    return presets[name].replace(
        seed=args.seed,
        logit_bias=logit_bias_from(args.logit_bias),
        constraint=constraint_from_args(args),
        **changes,
    ), presets


def check_format(engine, params) -> str | None:
    """One line when the output format cannot be compiled or enforced, or a --logit-bias
    id is out of the vocabulary; else None."""
    try:
        engine.check(params)
    except GrammarError as e:
        return f"{FORMAT_FLAGS[params.constraint.kind]}: {e}"
    except ConfigError as e:
        return "--logit-bias: " + str(e).removeprefix("'logit_bias': ")
    return None


def open_models(args):
    """The models the flags name (nothing loaded yet); ModelSpecError for a bad entry."""
    env = os.environ.get("MINISERVE_MODEL")
    sources = args.model or ([env] if env and not args.models_file else [])
    options = EngineOptions(
        device=args.device,
        dtype=args.dtype,
        runner=args.runner,
        quant=args.quant,
        math=args.math,
        kv_budget=args.kv_budget,
        reasoning_budget=None
        if getattr(args, "reasoning_budget", -1) < 0
        else args.reasoning_budget,
        speculate=getattr(args, "speculate", None) or DEFAULT_SPECULATE,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
    )
    return open_registry(
        sources,
        args.models_file,
        options,
        args.max_loaded_models,
        args.context,
        args.remote_api_key,
    )


def checked_models(args):
    """(the models the flags name, None) -- nothing loaded yet -- or (None, exit code) after a
    one-line error (a bad flag or model entry: 2)."""
    if flag_error(args):
        return None, fail(flag_error(args))
    try:
        return open_models(args), None
    except UserError as e:  # ModelSpecError
        return None, fail_with(e)
    except ValueError as e:
        return None, fail(str(e))


def load_engine(args):
    """(engine of the default model, None), or (None, exit code) after a one-line error (a
    model that could not be loaded: 1). args.models is then the registry of every model the
    flags name."""
    args.models, code = checked_models(args)
    if args.models is None:
        return None, code
    try:
        return args.models.get(None), None
    except UserError as e:  # ModelLoadError: 1
        return None, fail_with(e)
    except ValueError as e:
        return None, fail(str(e))
