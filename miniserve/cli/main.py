"""`python -m miniserve generate | chat | step | bench | serve | app` (also the `miniserve`
command)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from miniserve import __version__
from miniserve.bench.bench import (
    MAX_PROMPT_TOKENS,
    BenchConfig,
    ConcurrencyConfig,
    concurrency_params,
    format_concurrency_table,
    format_table,
    prefix_reuse,
    run_bench,
    run_concurrency,
    write_csv,
    write_json,
)
from miniserve.cli import app
from miniserve.cli.args import (
    DEFAULT_PRESET,
    Parser,
    add_history_args,
    add_model_args,
    add_sampling_args,
    check_format,
    fail,
    fail_with,
    load_engine,
    open_history,
    params_from_args,
    port_number,
)
from miniserve.cli.repl import ChatSession
from miniserve.cli.step import StepLoop
from miniserve.core.config import (
    MAX_QUEUE,
    ConfigError,
)
from miniserve.core.deferred import import_cut_off
from miniserve.core.errors import UserError
from miniserve.engine.chat import NoChatTemplate
from miniserve.engine.inspector import Inspector
from miniserve.engine.step import StepError, StepSession
from miniserve.runners.native import summary


def prompt_from_stdin(dash: bool) -> tuple[str, str | None]:
    """The prompt piped in (`--prompt -`, or no --prompt with stdin not a terminal): UTF-8 (a
    byte-order mark dropped), one final line break dropped (the one `echo` adds).
    Returns (prompt, None), or ("", why not)."""
    stdin = sys.stdin
    if stdin is None or (not dash and stdin.isatty()):
        return "", "give the text to answer: --prompt TEXT, or the text on stdin"
    if stdin.isatty():
        print("Reading the prompt from stdin (end it with Ctrl-D) ...", file=sys.stderr)
    raw = getattr(stdin, "buffer", None)  # bytes, where stdin is a file
    try:
        text = raw.read().decode("utf-8-sig") if raw is not None else stdin.read()
    except UnicodeDecodeError as e:
        return "", f"the prompt on stdin is not valid UTF-8 (byte {e.start})"
    text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text.strip():
        return "", "the prompt on stdin is empty; pipe the text to answer, or give --prompt TEXT"
    return text, None


def cmd_generate(args) -> int:
    try:
        params, _ = params_from_args(args)
        if args.stop:
            params = params.replace(stop=tuple(args.stop))
    except ConfigError as e:
        return fail(str(e))
    if args.prompt is None or args.prompt == "-":
        args.prompt, why = prompt_from_stdin(dash=args.prompt == "-")
        if why:
            return fail(why)
    if not args.prompt.strip():
        return fail("--prompt is empty; give the text to answer")
    if args.raw and args.system:
        return fail("--system needs a chat template; --raw continues the prompt as it is")
    engine, code = load_engine(args)
    if engine is None:
        return code
    if check_format(engine, params):
        return fail(check_format(engine, params))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    inspector = None
    if args.show_probs:
        inspector = Inspector(engine.tokenizer, params)
    parts, ids, last = [], [], None
    observer = inspector.observe if inspector else None
    try:
        stream = (
            engine.complete_text(
                args.prompt, params, use_cache=not args.no_cache, observer=observer
            )
            if args.raw
            else engine.chat(messages, params, use_cache=not args.no_cache, observer=observer)
        )
        thought = []  # a thinking model's reasoning: on stderr (stdout is the answer alone)
        for last in stream:
            parts.append(last.text)
            ids.extend(last.token_ids)
            if last.reasoning:
                thought.append(last.reasoning)
                if not args.json:
                    sys.stderr.write(("" if len(thought) > 1 else "Thinking: ") + last.reasoning)
                    sys.stderr.flush()
            if not args.json and last.text:
                if thought and not "".join(parts[:-1]):  # the answer starts on a line of its own
                    sys.stderr.write("\n")
                    sys.stderr.flush()
                sys.stdout.write(last.text)
                sys.stdout.flush()
    except UserError as e:  # ChatError, RequestTooLarge, busy, a remote refusal
        return fail_with(e)
    except ValueError as e:
        return fail(str(e))
    except RuntimeError as e:  # a remote server that failed (RemoteError), the engine closed
        return fail(f"{engine.name}: {e}", 1)
    stats = last.stats
    if args.json:
        out = {
            "text": "".join(parts),
            "reasoning": "".join(thought),
            "reasoning_tokens": stats.reasoning_tokens,
            "token_ids": ids,
            "prompt_tokens": stats.prompt_tokens,
            "new_tokens": stats.new_tokens,
            "ttft_s": round(stats.ttft_s, 4),
            "tokens_per_s": round(stats.tokens_per_s, 2),
            "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
            "total_s": round(stats.total_s, 4),
            "finish_reason": stats.finish_reason,
            "cache": not args.no_cache,
            "model": engine.name,
            "raw": args.raw,
            "params": params.as_dict(),
        }
        if inspector:
            out["steps"] = inspector.as_json()
        print(json.dumps(out, ensure_ascii=False))
    else:
        print()
        if thought and not "".join(parts):  # all reasoning: end its line
            print(file=sys.stderr)
        if inspector:
            print(inspector.as_text(), file=sys.stderr)
        print(f"[{stats.summary()}, cache {'off' if args.no_cache else 'on'}]", file=sys.stderr)
        if params.constraint is not None and stats.finish_reason == "length":
            print(
                "[incomplete: --max-new-tokens ended the reply before its format was complete]",
                file=sys.stderr,
            )
    return 0


def cmd_chat(args) -> int:
    try:
        params, presets = params_from_args(args)
    except ConfigError as e:
        return fail(str(e))
    if args.raw and args.system:  # as generate: raw mode has no turns to put it in
        return fail("--system needs a chat template; --raw continues the text as it is")
    engine, code = load_engine(args)
    if engine is None:
        return code
    if check_format(engine, params):
        return fail(check_format(engine, params))
    if not engine.has_chat_template and not args.raw:
        return fail(str(NoChatTemplate(engine.name)))
    history = open_history(args)
    try:
        session = ChatSession(
            args.models,
            params,
            presets,
            system=args.system,
            preset_name=args.preset or DEFAULT_PRESET,
            store=history,
            raw=args.raw,
        )
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
        raise ValueError(f"{flag} must be comma-separated whole numbers {allowed}, got '{text}'")
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


def _check_outputs(args) -> None:
    """--json / --csv: a file that can be written, checked before the run (not after it, when
    the measurements would be lost with the traceback)."""
    for flag, name in (("--json", args.json), ("--csv", args.csv)):
        if name is None:
            continue
        path = Path(name)
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise ValueError(f"{flag} {name}: that is a folder; give a file name")
        if not folder.is_dir():
            raise ValueError(f"{flag} {name}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ValueError(f"{flag} {name}: not writable")


def cmd_bench(args) -> int:
    # the rows time one token a step, as the engines they are compared with (--speculate
    # ngram: with drafts)
    args.speculate = args.speculate or "off"
    if args.concurrency is not None:
        return cmd_bench_concurrency(args)
    try:
        _check_outputs(args)
        if args.prefix_reuse and not 64 <= args.prefix_reuse <= MAX_PROMPT_TOKENS:
            raise ValueError(
                f"--prefix-reuse must be 0 (off) or from 64 to {MAX_PROMPT_TOKENS} tokens of "
                f"history, got {args.prefix_reuse}"
            )
        lengths = _whole_numbers(
            args.prompt_tokens or "64,256,1024", "--prompt-tokens", 1, MAX_PROMPT_TOKENS
        )
        config = BenchConfig(
            prompt_tokens=lengths,
            new_tokens=_given(args.new_tokens, 64),
            repeat=_given(args.repeat, 3),
            modes=tuple(args.modes.split(",")),
            peer=args.peer,
            check=not args.no_check,
            speculate=args.speculate == "ngram",
        )
    except ValueError as e:
        return fail(str(e))

    def measure(engine, bar):
        if args.prefix_reuse and not engine.capabilities.local_tokens:  # before anything runs
            raise ValueError(
                "--prefix-reuse times this engine's own prefix cache: it needs a "
                "local model, not a remote one"
            )
        # the history, two more turns and their replies (prefix_reuse: ~200 tokens at most)
        if args.prefix_reuse and args.prefix_reuse + 256 > engine.context_length:
            raise ValueError(
                f"--prefix-reuse {args.prefix_reuse}: the history and two more turns do not "
                f"fit the model's context of {engine.context_length} tokens; at most "
                f"{max(engine.context_length - 256, 0)}"
            )
        return run_bench(engine, config, progress=bar)

    engine, result = _bench_and_print(args, measure, format_table)
    if engine is None:
        return result
    if args.prefix_reuse:
        reuse = result.prefix_reuse = prefix_reuse(engine, args.prefix_reuse)
        print(
            f"follow-up turn after {reuse['prompt_tokens']} tokens of conversation: first "
            f"token in {reuse['ttft_warm_s']:.3f} s with {reuse['reused_tokens']} tokens "
            f"reused from the prefix cache vs {reuse['ttft_cold_s']:.3f} s cold "
            f"({reuse['speedup']}x)"
        )
    _write_files(result, args)
    return 0 if result.tokens_verified else 3


def cmd_bench_concurrency(args) -> int:
    """bench --concurrency 1,2,4,8: B streams at once per level and preset."""
    try:
        _check_outputs(args)
        levels = _whole_numbers(
            args.concurrency, "--concurrency", int(MAX_QUEUE.low), int(MAX_QUEUE.high)
        )
        lengths = _whole_numbers(
            args.prompt_tokens or "64", "--prompt-tokens", 1, MAX_PROMPT_TOKENS
        )
        if len(lengths) != 1:
            raise ValueError(
                f"--prompt-tokens takes one length with --concurrency, got '{args.prompt_tokens}'"
            )
        presets = tuple(p.strip() for p in args.presets.split(",") if p.strip())
        config = ConcurrencyConfig(
            levels=levels,
            prompt_tokens=lengths[0],
            new_tokens=_given(args.new_tokens, 128),
            presets=presets,
            repeat=_given(args.repeat, 1),
            peer=args.peer,
            presets_file=args.presets_file,
            ignore_eos=not args.stop_at_eos,
            speculate=args.speculate == "ngram",
        )
        concurrency_params(config)  # an unknown preset is reported before the model loads
    except (ValueError, ConfigError) as e:
        return fail(str(e))
    # a level past --max-queue: run_concurrency's ValueError, one line
    engine, result = _bench_and_print(
        args,
        lambda engine, bar: run_concurrency(engine, config, progress=bar),
        format_concurrency_table,
    )
    if engine is None:
        return result
    _write_files(result, args)
    return 0


def _write_files(result, args) -> None:
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(result, args.csv)
        print(f"wrote {args.csv}")


def _bar(fraction: float, message: str) -> None:
    width = 30
    filled = int(width * fraction)
    sys.stderr.write(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%} {message[:60]:<60}"
    )
    sys.stderr.flush()


def cmd_serve(args) -> int:
    engine, code = load_engine(args)  # the default model loads now; the others on first use
    if engine is None:
        return code
    from miniserve.serve.routes import serve  # FastAPI and uvicorn: only for this command

    serve(args.models, host=args.host, port=args.port, api_key=args.api_key)
    return 0


def cmd_app(args) -> int:
    return app.main(args.app_args, prog="miniserve app")


class VersionAction(argparse.Action):
    """--version: worked out when asked for (it may compile the native kernels)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(0, f"MiniServeLM {__version__}\n{summary()}\n")


def cmd_step(args) -> int:
    """One token at a time, the per-stage table after each (miniserve/cli/step.py)."""
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
        return StepLoop(session, presets, args.top, prompt if args.raw else "", sys.stdout).run(
            sys.stdin
        )
    finally:
        session.release()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m miniserve",
        description="MiniServeLM: a hand-written LLM decode loop you can see and tune.",
    )
    parser.add_argument(
        "--version",
        action=VersionAction,
        help="the version, this CPU and the kernels that run on it",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="answer one prompt, streaming to stdout")
    g.add_argument(
        "--prompt",
        default=None,
        help="the text to answer; - (or no --prompt with text piped in) reads it from stdin",
    )
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument(
        "--show-probs",
        action="store_true",
        help="show each token's probability and the top-5 alternatives",
    )
    g.add_argument(
        "--raw",
        action="store_true",
        help="completion mode: continue the prompt as it is, no chat template (what "
        "a base model needs)",
    )
    add_sampling_args(g)
    add_model_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="a terminal chat (reads one message a line from a pipe)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument(
        "--raw",
        action="store_true",
        help="completion mode: each line is added to one running text, which the "
        "model continues (no chat template; for base models)",
    )
    add_sampling_args(c)
    add_model_args(c)
    add_history_args(c)
    c.set_defaults(func=cmd_chat)

    st = sub.add_parser(
        "step",
        help="decode one token at a time: the per-stage table of the "
        "top candidates; Enter steps, N takes candidate N, b "
        "goes back, /set as in chat, q quits",
    )
    st.add_argument(
        "--prompt",
        default=None,
        help="the message (or, with --raw, the text to continue); asked for when not given",
    )
    st.add_argument(
        "--raw",
        action="store_true",
        help="completion mode: continue the prompt as it is, no chat template",
    )
    st.add_argument("--top", type=int, default=10, help="candidates in the table (default 10)")
    add_sampling_args(st)
    add_model_args(st)
    st.set_defaults(func=cmd_step)

    b = sub.add_parser(
        "bench",
        help="no-cache vs KV-cache vs generate() over prompt lengths; "
        "or, with --concurrency, B streams at once",
    )
    b.add_argument(
        "--prompt-tokens",
        default=None,
        help="comma-separated prompt lengths (default 64,256,1024; with "
        "--concurrency one length, default 64)",
    )
    b.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="new tokens a run (default 64; with --concurrency 128 a stream)",
    )
    b.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs per row; the median is reported (default 3; with --concurrency 1)",
    )
    b.add_argument(
        "--concurrency",
        default=None,
        metavar="B,B,...",
        help="comma-separated numbers of streams submitted at once (e.g. 1,2,4,8; "
        "at most --max-queue): "
        "aggregate and per-stream tokens/s, time to first token, inter-token "
        "latency and the share of the measured ceiling, per preset",
    )
    b.add_argument(
        "--presets",
        default="greedy,balanced",
        help="with --concurrency: comma-separated presets (greedy is built in; the "
        "others come from presets.yaml)",
    )
    b.add_argument("--presets-file", default=None, help="another presets.yaml")
    b.add_argument(
        "--modes",
        default="no_cache,cache,hf_generate",
        help="comma-separated: no_cache, cache, hf_generate, transformers_loop "
        "(our cached loop on the transformers model), lean (our cached loop on "
        "the PyTorch lean pass, to set beside the native runner)",
    )
    b.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="with --concurrency: a stream ends on its end token (default: end tokens are "
        "banned, so every stream writes its new tokens and presets compare at the same batch)",
    )
    b.add_argument(
        "--peer",
        action="store_true",
        help="also llama.cpp on the same GGUF weights at f32, bf16 and as stored "
        "(q4_1 for the embedded model); with "
        "--concurrency, its batched decoding of the same greedy streams "
        "(needs llama-cpp-python: make bench-peer)",
    )
    b.add_argument(
        "--no-check",
        action="store_true",
        help="do not check our greedy tokens against the reference (a GGUF run as "
        "stored: a float64 pass over the file's blocks, layer by layer, no copy "
        "written; a transformers model: a float32 copy)",
    )
    b.add_argument(
        "--prefix-reuse",
        type=int,
        default=0,
        metavar="TOKENS",
        help="also time a follow-up chat turn after this much history, with and "
        "without prefix-cache reuse (0 = skip)",
    )
    b.add_argument("--json", default=None, metavar="FILE")
    b.add_argument("--csv", default=None, metavar="FILE")
    add_model_args(b)
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP API, without the web UI")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port_number, default=8000)
    s.add_argument(
        "--api-key",
        default=os.environ.get("MINISERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (or set MINISERVE_API_KEY)",
    )
    add_model_args(s)
    s.set_defaults(func=cmd_serve)

    a = sub.add_parser(
        "app",
        add_help=False,
        help="the web app: chat, notebook, compare, benchmark and the API on one "
        "port (as python app.py; `miniserve app --help` for its flags)",
    )
    a.add_argument("app_args", nargs=argparse.REMAINDER)
    a.set_defaults(func=cmd_app)
    return parser


# The flags whose text reaches the tokenizer or the sampler (file paths are left alone: on
# Linux a name that is not UTF-8 is a valid path, and Python carries its bytes through)
TEXT_FLAGS = ("prompt", "system", "stop", "regex", "choice", "dry_sequence_breakers")


def not_utf8(args) -> str | None:
    """Which text flag is not UTF-8, said in a line; None where all are. (Python hands such
    bytes on as lone surrogates, which the tokenizer would turn into other characters.)"""
    for name in TEXT_FLAGS:
        value = getattr(args, name, None)
        for text in value if isinstance(value, list) else [value]:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                point = ord(text[e.start])
                what = (
                    f"byte 0x{point - 0xDC00:02x}"
                    if 0xDC80 <= point <= 0xDCFF
                    else f"a lone surrogate U+{point:04X}"
                )
                return (
                    f"--{name.replace('_', '-')} is not valid UTF-8 ({what} at character "
                    f"{e.start}); write the text in UTF-8"
                )
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["app"]:  # every flag after it is the web app's own (cli/app.py)
        return app.main(argv[1:], prog="miniserve app")
    args = build_parser().parse_args(argv)
    bad = not_utf8(args)
    if bad:
        return fail(bad)
    code = None
    try:
        code = args.func(args)
        return code
    except UserError as e:  # what a command did not catch itself: one line, never a traceback
        return fail_with(e)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        code = 130
        return code
    except BrokenPipeError:
        return 0
    finally:  # engine threads end before the interpreter does (no pass cut off mid-way)
        if getattr(args, "models", None) is not None:
            args.models.close()
        if code == 130 and import_cut_off():  # see import_cut_off: no shutdown to run
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
