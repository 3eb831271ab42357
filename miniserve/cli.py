"""`python -m miniserve generate | chat | step | bench | serve`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from miniserve.config import (CONTEXT, FIELDS, KV_BUDGET, MATHS, MAX_BATCH, MAX_CONVERSATIONS,
                              MAX_LOADED_MODELS, MAX_QUEUE, ConfigError, Field, SamplingParams,
                              load_presets)

if TYPE_CHECKING:
    from miniserve.store import Store

DEFAULT_PRESET = "balanced"


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    return code


# Whole-number settings, by flag; their ranges and defaults are in config.py. add_model_args
# adds the engine's, add_history_args the store's; flag_error checks every one a parser has.
ENGINE_FLAGS: dict[str, Field] = {"--kv-budget": KV_BUDGET, "--max-batch": MAX_BATCH,
                                  "--max-queue": MAX_QUEUE, "--max-loaded-models": MAX_LOADED_MODELS}
HISTORY_FLAGS: dict[str, Field] = {"--history-max-conversations": MAX_CONVERSATIONS}
RANGED_FLAGS: dict[str, Field] = {**ENGINE_FLAGS, **HISTORY_FLAGS, "--context": CONTEXT}


def _add_ranged(p: argparse.ArgumentParser, flags: dict[str, Field]) -> None:
    for flag, spec in flags.items():  # argparse checks the number, flag_error the range
        p.add_argument(flag, type=int, default=spec.default, metavar="N",
                       help=f"{spec.help}: {int(spec.low)} to {int(spec.high)} "
                            f"(default {int(spec.default)})")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]SOURCE",
                   help="a .gguf file, a model folder, a Hugging Face id, gemma-3-270m "
                        "(installed on request; Gemma terms apply), or the URL of an "
                        "OpenAI-compatible server, http://HOST:PORT/v1[#served-name]; "
                        "repeatable: the first is the default (default: $MINISERVE_MODEL, "
                        "else the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--models-file", default=None, metavar="YAML",
                   help="the models to serve as a file (a list of sources, or of mappings with "
                        "source, name, context, api_key_env); after any --model")
    p.add_argument("--remote-api-key", default=os.environ.get("MINISERVE_REMOTE_API_KEY"),
                   metavar="KEY", help="the key remote models' servers ask for (or set "
                                       "MINISERVE_REMOTE_API_KEY); not this server's --api-key")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help=f"the context of remote models whose server does not report it "
                        f"({int(CONTEXT.low)} to {int(CONTEXT.high)}; default "
                        f"{int(CONTEXT.default)})")
    p.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps")
    p.add_argument("--dtype", default="auto",
                   help="weights: auto, stored, float32, bfloat16, float16. stored: a GGUF's "
                        "weights as the file holds them (Q4_K, Q6_K, Q8_0, Q4_1, ... blocks, "
                        "memory-mapped; the native runner on the CPU); the others: dequantized "
                        "copies. auto: stored for a GGUF where the native runner runs, else "
                        "bfloat16 on CUDA and on a CPU with the native runner, float16 on MPS, "
                        "else float32")
    p.add_argument("--runner", default="auto", choices=("auto", "native", "lean", "transformers"),
                   help="lean: the readable fused forward pass in PyTorch (Llama family); "
                        "native: the same forward pass in compiled C++, every pass -- prompt "
                        "chunks and the decode rows of many sequences together (CPU); "
                        "transformers: the library model; auto: the fastest that applies")
    p.add_argument("--quant", default=None, choices=("q8_0", "q4_0", "int8"),
                   help="quantize a float model's matrices at load: q8_0 / q4_0 (llama.cpp's "
                        "blocks of 32 weights with a scale each, made by the gguf package, "
                        "run by the native runner's integer kernels; for a GGUF, its own "
                        "blocks run as stored without this); int8 (one scale a row, the "
                        "PyTorch lean runner, bfloat16 activations)")
    p.add_argument("--math", default="auto", choices=MATHS,
                   help="the arithmetic of the matrix products, apart from the weights' dtype: "
                        "float32 (float32 products and sums); bfloat16 (activations rounded to "
                        "bfloat16, products summed in float32); auto: bfloat16 where the CPU "
                        "has bfloat16 dot products and the weights are bfloat16, else float32. "
                        "With weights as stored, quantized matrices always take their "
                        "activations as int8 blocks; --math is the arithmetic of attention "
                        "(bfloat16: a bfloat16 KV cache) and of any float matrices (auto: "
                        "bfloat16 where the CPU has bfloat16 dot products)")
    _add_ranged(p, ENGINE_FLAGS)


def flag_error(args) -> str | None:
    """One line naming the first ranged flag out of its range, or None."""
    for flag, spec in RANGED_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None and not spec.low <= value <= spec.high:
            return f"{flag} must be from {int(spec.low)} to {int(spec.high)}, got {value}"
    return None


def add_history_args(p: argparse.ArgumentParser) -> None:
    """Where saved conversations go (miniserve/store.py)."""
    p.add_argument("--history-db", default=os.environ.get("MINISERVE_HISTORY_DB"),
                   metavar="PATH",
                   help="the SQLite file of saved conversations (or set MINISERVE_HISTORY_DB; "
                        "default: history.sqlite3 in the data folder, $MINISERVE_DATA_DIR "
                        "if set)")
    p.add_argument("--no-history", action="store_true",
                   help="keep nothing on disk: conversations live in memory until the app stops")
    _add_ranged(p, HISTORY_FLAGS)


def open_history(args) -> Store:
    """The conversation store the flags of add_history_args name; its notice (history off,
    a file kept aside or not writable), if any, printed once to stderr. Range-check the flags
    first (flag_error; load_engine does)."""
    from miniserve import store
    history = store.open_store(args.history_db, enabled=not args.no_history,
                               max_conversations=args.history_max_conversations)
    if history.notice:
        print(f"note: {history.notice}", file=sys.stderr)
    return history


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None,
                   help=f"a preset from presets.yaml (default: {DEFAULT_PRESET})")
    p.add_argument("--presets-file", default=None, help="another presets.yaml")
    for name, spec in FIELDS.items():
        p.add_argument("--" + name.replace("_", "-"), type=spec.kind, default=None,
                       metavar="N", help=f"{spec.help} {spec.describe()}")
    p.add_argument("--seed", type=int, default=None, help="random seed for a reproducible run")
    p.add_argument("--logit-bias", metavar="ID:BIAS,...", default=None,
                   help="add BIAS (-100..100; -100 bans) to token ID's logit, e.g. 13:-100,42:2.5")
    fmt = p.add_argument_group("output format (the reply is held to it, token by token)")
    one = fmt.add_mutually_exclusive_group()
    one.add_argument("--json-object", action="store_true", help="any JSON object")
    one.add_argument("--json-schema", metavar="FILE",
                     help="JSON valid against the JSON Schema in FILE")
    one.add_argument("--regex", metavar="PATTERN", help="text matching PATTERN, whole")
    one.add_argument("--choice", metavar="A,B,C", help="exactly one of these strings")
    one.add_argument("--grammar", metavar="FILE",
                     help="a grammar in FILE: GBNF (llama.cpp's, with ::=) or Lark")


# the flag each output format comes from, for errors
FORMAT_FLAGS = {"json_object": "--json-object", "json_schema": "--json-schema",
                "regex": "--regex", "choice": "--choice", "grammar": "--grammar"}


def constraint_from_args(args):
    """The output-format flag as a Constraint (None without one); ConfigError naming the flag
    for a file that cannot be read or a schema that is not JSON."""
    from miniserve.config import Constraint
    if getattr(args, "json_object", False):
        return Constraint("json_object")
    if getattr(args, "regex", None) is not None:
        return Constraint("regex", args.regex)
    if getattr(args, "choice", None) is not None:
        choices = [c for c in args.choice.split(",") if c]
        if not choices:
            raise ConfigError("--choice: give the strings separated by commas, like yes,no",
                              "choice")
        return Constraint("choice", json.dumps(choices))
    for kind, flag in (("json_schema", "--json-schema"), ("grammar", "--grammar")):
        path = getattr(args, kind, None)
        if path is None:
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as e:
            raise ConfigError(f"{flag}: cannot read {path} ({e.strerror})", kind) from None
        if kind == "json_schema":
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag}: {path} is not JSON: {e.msg} at line {e.lineno}",
                                  kind) from None
        return Constraint(kind, text)
    return None


def logit_bias_from(text: str | None) -> dict:
    """"13:-100,42:2.5" as {13: -100.0, 42: 2.5}; ConfigError naming --logit-bias."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, _, value = part.partition(":")
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise ConfigError(f"--logit-bias: write ID:BIAS pairs separated by commas, like "
                              f"13:-100,42:2.5 (got {part!r})", "logit_bias") from None
    return out


def params_from_args(args) -> tuple[SamplingParams, dict[str, SamplingParams]]:
    presets = load_presets(args.presets_file)
    name = args.preset or DEFAULT_PRESET
    if name not in presets:
        raise ConfigError(f"unknown preset '{name}' (available: {', '.join(presets)})", "preset")
    changes = {k: getattr(args, k) for k in FIELDS if getattr(args, k) is not None}
    return presets[name].replace(seed=args.seed, logit_bias=logit_bias_from(args.logit_bias),
                                 constraint=constraint_from_args(args), **changes), presets


def check_format(engine, params) -> str | None:
    """One line when the output format cannot be compiled or enforced, or a --logit-bias
    id is out of the vocabulary; else None."""
    from miniserve.grammar import GrammarError
    try:
        engine.check(params)
    except GrammarError as e:
        return f"{FORMAT_FLAGS[params.constraint.kind]}: {e}"
    except ConfigError as e:
        return "--logit-bias: " + str(e).removeprefix("'logit_bias': ")
    return None


def open_models(args):
    """The models the flags name (nothing loaded yet); ModelSpecError for a bad entry."""
    from miniserve.models import EngineOptions, open_models as open_registry
    env = os.environ.get("MINISERVE_MODEL")
    sources = args.model or ([env] if env and not args.models_file else [])
    options = EngineOptions(device=args.device, dtype=args.dtype, runner=args.runner,
                            quant=args.quant, math=args.math, kv_budget=args.kv_budget,
                            max_queue=args.max_queue, max_batch=args.max_batch)
    return open_registry(sources, args.models_file, options, args.max_loaded_models,
                         args.context, args.remote_api_key)


def load_engine(args):
    """(engine of the default model, None), or (None, exit code) after a one-line error.
    args.models is then the registry of every model the flags name."""
    from miniserve.loader import ModelLoadError
    from miniserve.models import ModelSpecError
    if flag_error(args):
        return None, fail(flag_error(args))
    try:
        args.models = open_models(args)
        return args.models.get(None), None
    except ModelSpecError as e:
        return None, fail(str(e), 2)
    except ModelLoadError as e:
        return None, fail(str(e), 1)
    except ValueError as e:
        return None, fail(str(e), 2)


def cmd_generate(args) -> int:
    from miniserve.engine import EngineBusy
    try:
        params, _ = params_from_args(args)
        if args.stop:
            params = params.replace(stop=tuple(args.stop))
    except ConfigError as e:
        return fail(str(e))
    if not args.prompt.strip():
        return fail("--prompt is empty; give the text to answer")
    if args.raw and args.system:
        return fail("--system needs a chat template; --raw continues the prompt as it is")
    engine, code = load_engine(args)
    if engine is None:
        return code
    if check_format(engine, params):
        return fail(check_format(engine, params))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    inspector = None
    if args.show_probs:
        from miniserve.inspector import Inspector
        inspector = Inspector(engine.tokenizer, params)
    parts, ids, last = [], [], None
    observer = inspector.observe if inspector else None
    try:
        stream = (engine.complete_text(args.prompt, params, use_cache=not args.no_cache,
                                       observer=observer) if args.raw else
                  engine.chat(messages, params, use_cache=not args.no_cache, observer=observer))
        for last in stream:
            parts.append(last.text)
            ids.extend(last.token_ids)
            if not args.json and last.text:
                sys.stdout.write(last.text)
                sys.stdout.flush()
    except (ValueError, EngineBusy) as e:  # ChatError, RequestTooLarge, a remote refusal
        return fail(str(e))
    except RuntimeError as e:  # a remote server that failed (RemoteError), the engine closed
        return fail(f"{engine.name}: {e}", 1)
    stats = last.stats
    if args.json:
        out = {"text": "".join(parts), "token_ids": ids, "prompt_tokens": stats.prompt_tokens,
               "new_tokens": stats.new_tokens, "ttft_s": round(stats.ttft_s, 4),
               "tokens_per_s": round(stats.tokens_per_s, 2),
               "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
               "total_s": round(stats.total_s, 4), "finish_reason": stats.finish_reason,
               "cache": not args.no_cache, "model": engine.name, "raw": args.raw,
               "params": params.as_dict()}
        if inspector:
            out["steps"] = inspector.as_json()
        print(json.dumps(out, ensure_ascii=False))
    else:
        print()
        if inspector:
            print(inspector.as_text(), file=sys.stderr)
        print(f"[{stats.summary()}, cache {'off' if args.no_cache else 'on'}]", file=sys.stderr)
        if params.constraint is not None and stats.finish_reason == "length":
            print("[incomplete: --max-new-tokens ended the reply before its format was complete]",
                  file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from miniserve.repl import ChatSession
    try:
        params, presets = params_from_args(args)
    except ConfigError as e:
        return fail(str(e))
    engine, code = load_engine(args)
    if engine is None:
        return code
    if check_format(engine, params):
        return fail(check_format(engine, params))
    if not engine.has_chat_template and not args.raw:
        from miniserve.chat import NoChatTemplate
        return fail(str(NoChatTemplate(engine.name)))
    history = open_history(args)
    try:
        session = ChatSession(args.models, params, presets, system=args.system,
                              preset_name=args.preset or DEFAULT_PRESET, store=history,
                              raw=args.raw)
        return session.run(sys.stdin, sys.stdout)
    finally:
        history.close()


def _whole_numbers(text: str, flag: str, low: int = 1, high: int | None = None) -> list[int]:
    """Comma-separated whole numbers in [low, high], or ValueError naming the flag."""
    allowed = f"from {low} to {high}" if high is not None else f"of at least {low}"
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < low or (high is not None and v > high) for v in values):
        raise ValueError(f"{flag} must be comma-separated whole numbers {allowed}, "
                         f"got '{text}'")
    return values


def _given(value, default):
    return default if value is None else value


def _bench_and_print(args, measure, table):
    """What both bench commands do: load the engine, measure with a progress bar, print the
    table. (engine, result), or (None, exit code) after a one-line error."""
    engine, code = load_engine(args)
    if engine is None:
        return None, code
    try:
        result = measure(engine, _bar)
    except ValueError as e:
        return None, fail(str(e))
    print(file=sys.stderr)
    print(table(result))
    return engine, result


def cmd_bench(args) -> int:
    if args.concurrency is not None:
        return cmd_bench_concurrency(args)
    from miniserve.bench import MAX_PROMPT_TOKENS, BenchConfig, format_table, run_bench
    try:
        lengths = _whole_numbers(args.prompt_tokens or "64,256,1024", "--prompt-tokens", 1,
                                 MAX_PROMPT_TOKENS)
        config = BenchConfig(prompt_tokens=lengths, new_tokens=_given(args.new_tokens, 64),
                             repeat=_given(args.repeat, 3), modes=tuple(args.modes.split(",")),
                             peer=args.peer, check=not args.no_check)
    except ValueError as e:
        return fail(str(e))
    def measure(engine, bar):
        if args.prefix_reuse and engine.remote:  # before anything runs
            raise ValueError("--prefix-reuse times this engine's own prefix cache: it needs a "
                             "local model, not a remote one")
        return run_bench(engine, config, progress=bar)

    engine, result = _bench_and_print(args, measure, format_table)
    if engine is None:
        return result
    if args.prefix_reuse:
        from miniserve.bench import prefix_reuse
        reuse = result.prefix_reuse = prefix_reuse(engine, args.prefix_reuse)
        print(f"follow-up turn after {reuse['prompt_tokens']} tokens of conversation: first "
              f"token in {reuse['ttft_warm_s']:.3f} s with {reuse['reused_tokens']} tokens "
              f"reused from the prefix cache vs {reuse['ttft_cold_s']:.3f} s cold "
              f"({reuse['speedup']}x)")
    _write_files(result, args)
    return 0 if result.tokens_verified else 3


def cmd_bench_concurrency(args) -> int:
    """bench --concurrency 1,2,4,8: B streams at once per level and preset."""
    from miniserve.bench import (MAX_PROMPT_TOKENS, ConcurrencyConfig, concurrency_params,
                                 format_concurrency_table, run_concurrency)
    try:
        levels = _whole_numbers(args.concurrency, "--concurrency", int(MAX_QUEUE.low),
                                int(MAX_QUEUE.high))
        lengths = _whole_numbers(args.prompt_tokens or "64", "--prompt-tokens", 1,
                                 MAX_PROMPT_TOKENS)
        if len(lengths) != 1:
            raise ValueError("--prompt-tokens takes one length with --concurrency, "
                             f"got '{args.prompt_tokens}'")
        presets = tuple(p.strip() for p in args.presets.split(",") if p.strip())
        config = ConcurrencyConfig(levels=levels, prompt_tokens=lengths[0],
                                   new_tokens=_given(args.new_tokens, 128), presets=presets,
                                   repeat=_given(args.repeat, 1), peer=args.peer,
                                   presets_file=args.presets_file)
        concurrency_params(config)  # an unknown preset is reported before the model loads
    except (ValueError, ConfigError) as e:
        return fail(str(e))
    # a level past --max-queue: run_concurrency's ValueError, one line
    engine, result = _bench_and_print(
        args, lambda engine, bar: run_concurrency(engine, config, progress=bar),
        format_concurrency_table)
    if engine is None:
        return result
    _write_files(result, args)
    return 0


def _write_files(result, args) -> None:
    from miniserve.bench import write_csv, write_json
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(result, args.csv)
        print(f"wrote {args.csv}")


def _bar(fraction: float, message: str) -> None:
    width = 30
    filled = int(width * fraction)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%} {message[:60]:<60}")
    sys.stderr.flush()


def cmd_serve(args) -> int:
    engine, code = load_engine(args)  # the default model loads now; the others on first use
    if engine is None:
        return code
    from miniserve.api import serve
    serve(args.models, host=args.host, port=args.port, api_key=args.api_key)
    return 0


class VersionAction(argparse.Action):
    """--version: worked out when asked for (it may compile the native kernels)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from miniserve import __version__
        from miniserve.platform_info import summary
        parser.exit(0, f"MiniServeLM {__version__}\n{summary()}\n")


def cmd_step(args) -> int:
    """One token at a time, the per-stage table after each (miniserve/step_cli.py)."""
    from miniserve.step import StepError, StepSession
    from miniserve.step_cli import StepLoop
    try:
        params, presets = params_from_args(args)
    except ConfigError as e:
        return fail(str(e))
    if not 1 <= args.top <= 200:
        return fail(f"--top must be from 1 to 200, got {args.top}")
    engine, code = load_engine(args)
    if engine is None:
        return code
    if check_format(engine, params):
        return fail(check_format(engine, params))
    prompt = args.prompt
    if prompt is None:
        sys.stdout.write("prompt> ")
        sys.stdout.flush()
        prompt = sys.stdin.readline().rstrip("\n")
    if not prompt.strip():
        return fail("the prompt is empty; give --prompt TEXT or type it first")
    try:
        if args.raw:
            ids = engine.prompt_ids(prompt, params)
        else:
            ids = engine.chat_prompt([{"role": "user", "content": prompt}], params)
        session = StepSession(engine, ids, params)
    except (StepError, ValueError) as e:  # a remote model, no chat template, the KV budget
        return fail(str(e))
    try:
        return StepLoop(session, presets, args.top, prompt if args.raw else "",
                        sys.stdout).run(sys.stdin)
    finally:
        session.release()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m miniserve",
                    description="MiniServeLM: a hand-written LLM decode loop you can see and tune.")
    parser.add_argument("--version", action=VersionAction,
                        help="the version, this CPU and the kernels that run on it")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="answer one prompt, streaming to stdout")
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--show-probs", action="store_true",
                   help="show each token's probability and the top-5 alternatives")
    g.add_argument("--raw", action="store_true",
                   help="completion mode: continue the prompt as it is, no chat template (what "
                        "a base model needs)")
    add_sampling_args(g)
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="a terminal chat (reads one message a line from a pipe)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--raw", action="store_true",
                   help="completion mode: each line is added to one running text, which the "
                        "model continues (no chat template; for base models)")
    add_sampling_args(c)
    add_model_args(c)
    add_history_args(c)
    c.set_defaults(func=cmd_chat)

    st = sub.add_parser("step", help="decode one token at a time: the per-stage table of the "
                                     "top candidates; Enter steps, N takes candidate N, b "
                                     "goes back, /set as in chat, q quits")
    st.add_argument("--prompt", default=None, help="the message (or, with --raw, the text to "
                                                   "continue); asked for when not given")
    st.add_argument("--raw", action="store_true",
                    help="completion mode: continue the prompt as it is, no chat template")
    st.add_argument("--top", type=int, default=10, help="candidates in the table (default 10)")
    add_sampling_args(st)
    add_model_args(st)
    st.set_defaults(func=cmd_step)

    b = sub.add_parser("bench", help="no-cache vs KV-cache vs generate() over prompt lengths; "
                                     "or, with --concurrency, B streams at once")
    b.add_argument("--prompt-tokens", default=None,
                   help="comma-separated prompt lengths (default 64,256,1024; with "
                        "--concurrency one length, default 64)")
    b.add_argument("--new-tokens", type=int, default=None,
                   help="new tokens a run (default 64; with --concurrency 128 a stream)")
    b.add_argument("--repeat", type=int, default=None,
                   help="runs per row; the median is reported (default 3; with --concurrency 1)")
    b.add_argument("--concurrency", default=None, metavar="B,B,...",
                   help="comma-separated numbers of streams submitted at once (e.g. 1,2,4,8; "
                        "at most --max-queue): "
                        "aggregate and per-stream tokens/s, time to first token, inter-token "
                        "latency and the share of the measured ceiling, per preset")
    b.add_argument("--presets", default="greedy,balanced",
                   help="with --concurrency: comma-separated presets (greedy is built in; the "
                        "others come from presets.yaml)")
    b.add_argument("--presets-file", default=None, help="another presets.yaml")
    b.add_argument("--modes", default="no_cache,cache,hf_generate",
                   help="comma-separated: no_cache, cache, hf_generate, transformers_loop "
                        "(our cached loop on the transformers model), lean (our cached loop on "
                        "the PyTorch lean pass, to set beside the native runner)")
    b.add_argument("--peer", action="store_true",
                   help="also llama.cpp on the same GGUF weights at f32, bf16 and as stored "
                        "(q4_1 for the embedded model); with "
                        "--concurrency, its batched decoding of the same greedy streams "
                        "(needs llama-cpp-python: make bench-peer)")
    b.add_argument("--no-check", action="store_true",
                   help="do not check our greedy tokens against the float32 reference (which "
                        "loads a float32 copy of the weights: for a large GGUF run as stored, "
                        "gigabytes and a minute)")
    b.add_argument("--prefix-reuse", type=int, default=0, metavar="TOKENS",
                   help="also time a follow-up chat turn after this much history, with and "
                        "without prefix-cache reuse (0 = skip)")
    b.add_argument("--json", default=None, metavar="FILE")
    b.add_argument("--csv", default=None, metavar="FILE")
    add_model_args(b)
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP API, without the web UI")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("MINISERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or set MINISERVE_API_KEY)")
    add_model_args(s)
    s.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:  # engine threads end before the interpreter does (no pass cut off mid-way)
        if getattr(args, "models", None) is not None:
            args.models.close()

