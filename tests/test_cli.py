"""The command line, run as users run it: generate, chat through a pipe, bench."""

import csv
import json
import os
import re
import subprocess
import sys
import time

import pytest

from miniserve.runners.verify import BOUND_FLOAT32, check_tokens

from command import ROOT, process, run
from conftest import chat_ids, expected_runner


def generate_json(*args, **kwargs) -> dict:
    """`generate --json` with `args`: the reply as the command wrote it, having succeeded."""
    r = run("generate", *args, "--json", **kwargs)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_generate_json_matches_the_engine(engine, ref32):
    question = "What is the capital of France?"
    args = ("--prompt", question, "--preset", "factual", "--max-new-tokens", "12")
    out = generate_json(*args, "--dtype", "float32")
    assert {"text", "token_ids", "prompt_tokens", "ttft_s", "tokens_per_s", "cache"} <= set(out)
    assert out["cache"] is True and 0 < len(out["token_ids"]) <= 12
    assert out["text"] == engine.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    # Exact by construction: the same runner computing the same prompt from scratch, here
    # and in the command (the same CPU, the same number of threads).
    from miniserve.core.config import SamplingParams

    text, _ = engine.chat_text(
        [{"role": "user", "content": question}],
        SamplingParams(temperature=0, max_new_tokens=12),
        reuse_prefix=False,
    )
    assert out["text"] == text
    nocache = generate_json(*args, "--dtype", "float32", "--no-cache")
    assert nocache["cache"] is False
    # Without the cache the sums are others (many rows through MKL): held to the reference.
    prompt = chat_ids(engine.tokenizer, question)
    for reply in (out, nocache):  # a shorter reply ended on one of the end tokens
        ends = () if len(reply["token_ids"]) == 12 else engine.eos_ids
        assert check_tokens(ref32, prompt, reply["token_ids"], BOUND_FLOAT32, ends).ok


def test_generate_streams_text_and_show_probs():
    r = run(
        "generate", "--prompt", "Say hello.", "--max-new-tokens", "6", "--seed", "1", "--show-probs"
    )
    assert r.returncode == 0 and r.stdout.strip()
    assert "p=" in r.stderr and "tokens/s" in r.stderr


def test_bad_arguments_exit_nonzero_with_one_line():
    for args in (
        ["--top-p", "0"],
        ["--temperature", "9"],
        ["--top-k", "abc"],
        ["--preset", "nope"],
        ["--model", "/no/such/dir"],
        ["--max-new-tokens", "0"],
    ):
        # the model's path in a real process too: stderr then holds whatever native code,
        # logging or an import would write there
        command = process if args[0] == "--model" else run
        r = command("generate", "--prompt", "hi", *args)
        assert r.returncode != 0, args
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in r.stderr, args


def test_chat_through_a_pipe():
    script = (
        "\n".join(
            [
                "Hello!",
                "/preset factual",
                "/settings",
                "/set temperature hot",
                "/set top_p 7",
                "/set max_new_tokens 8",
                "What is 2+2?",
                "/preset",
                "/model",
                "/exit",
                "never read",
            ]
        )
        + "\n"
    )
    r = process("chat", "--max-new-tokens", "8", stdin=script)  # a real pipe, a real process
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.split("[factual]")[1].splitlines()[0].startswith(" greedy ")
    assert "error: 'temperature' must be a number" in out
    assert "error: 'top_p' must be in (0, 1]" in out
    assert out.count("tokens/s") == 2  # both messages got a reply
    assert "presets: factual, conservative, balanced, creative" in out
    assert "SmolLM2-135M-Instruct on cpu" in out or "SmolLM2-135M-Instruct on" in out


def test_chat_on_a_terminal_says_how_far_a_long_prompt_is_read():
    """On a terminal, while a message longer than a pass (512 rows) is read, the reply's line
    says how far ("(reading the prompt: 512 of N tokens…)", faint), then is cleared back to
    "bot> " for the reply; in a pipe (above) no such line."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "miniserve", "chat", *CHEAP],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
    )
    os.close(slave)
    out, deadline = b"", time.monotonic() + 180

    def read_until(marker: bytes, count: int) -> None:
        nonlocal out
        while out.count(marker) < count and time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:  # the process ended
                    return

    try:
        read_until(b"you> ", 1)
        os.write(master, ("The river runs past the old mill. " * 120 + "\n").encode())
        read_until(b"tokens/s", 1)
        os.write(master, b"\x04")  # Ctrl-D: leave
        proc.wait(timeout=30)
    finally:
        proc.kill()
        os.close(master)
    text = out.decode(errors="replace")
    reading = re.findall(r"\(reading the prompt: ([\d,]+) of ([\d,]+) tokens…\)", text)
    assert len(reading) >= 2, text[-2000:]
    counts = [int(a.replace(",", "")) for a, _ in reading]
    assert counts == sorted(counts) and counts[0] == 0 and 512 in counts
    assert len({total for _, total in reading}) == 1 and int(reading[0][1].replace(",", "")) > 512
    after = text[text.rindex("tokens…)") :]
    assert "\r\x1b[Kbot> " in after and "tokens/s" in after


CHEAP = ("--max-new-tokens", "4", "--temperature", "0")


def _lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def test_chat_saves_lists_loads_exports_and_imports(tmp_path):
    from miniserve.cli.repl import CLI_OWNER
    from miniserve.store.store import open_store

    db, js, md, bad = (tmp_path / n for n in ("h.sqlite3", "x.json", "x.md", "bad.txt"))
    bad.write_text("not json at all")
    script = [
        "/export " + str(js),
        "Hello!",
        "/save Greeting",
        "What is 2+2?",
        "/list",
        f"/export {js}",
        f"/export {md}",
        f"/import {js}",
        f"/import {bad}",
        "/load 99",
        "/load two",
        f"/export {tmp_path / 'no' / 'such' / 'x.json'}",
    ]
    r = run("chat", *CHEAP, "--seed", "7", "--history-db", str(db), stdin="\n".join(script) + "\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    out = r.stdout
    assert out.count("tokens/s") == 2
    assert _lines(out, "error: ") == [
        "error: this conversation is not saved; /save it first",
        f"error: cannot import {bad}: the file is not JSON: Expecting value at line 1, column 1",
        "error: no conversation 99; /list shows 2",
        "error: /load takes the number of a conversation in /list, got 'two'",
        f"error: cannot write {tmp_path / 'no' / 'such' / 'x.json'}: No such file or directory",
    ]
    assert "saved as 1: Greeting" in out and "  1. Greeting  (" in out
    assert re.search(r"^imported 1 conversation as [12]: Greeting$", out, re.M)
    # What the store holds: the turns, each reply's settings (seed included) and stats
    store = open_store(db)
    convs = store.conversations(CLI_OWNER)
    assert [c.title for c in convs] == ["Greeting", "Greeting"] and store.conversations("web") == []
    exports = [store.export(CLI_OWNER, c.id) for c in convs]
    assert exports[0] == exports[1] == json.loads(js.read_text())  # the import round-trips
    path = store.path(CLI_OWNER, convs[0].id)
    assert [(m.role, m.status) for m in path] == [
        ("user", "complete"),
        ("assistant", "complete"),
    ] * 2
    assert [m.content for m in path[::2]] == ["Hello!", "What is 2+2?"]
    for reply in path[1::2]:
        assert reply.content and reply.content in out
        assert reply.settings["seed"] == 7 and reply.settings["temperature"] == 0
        assert reply.settings["max_new_tokens"] == 4 and reply.settings["preset"] == "balanced"
        assert reply.stats["new_tokens"] == 4 and reply.stats["finish_reason"] == "length"
        assert reply.stats["prompt_tokens"] > 0
    assert md.read_text(encoding="utf-8").startswith("# Greeting\n")
    assert f"**User:**\n\nWhat is 2+2?\n\n**Assistant:**\n\n{path[3].content}" in md.read_text()
    store.close()

    # A second run (the file named by MINISERVE_HISTORY_DB) lists, loads and goes on
    r = run(
        "chat",
        *CHEAP,
        stdin="/list\n/load 1\nAnd 3+3?\n/exit\n",
        env={"MINISERVE_HISTORY_DB": str(db)},
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert len(_lines(r.stdout, "  ")) == 2 and "4 messages)" in r.stdout
    assert _lines(r.stdout, "you> ") == ["you> Hello!", "you> What is 2+2?"]
    assert _lines(r.stdout, "bot> ") == [f"bot> {path[1].content}", f"bot> {path[3].content}"]
    store = open_store(db)
    counts = sorted(c.messages for c in store.conversations(CLI_OWNER))
    assert counts == [4, 6]  # the third turn went to the loaded conversation
    longer = max(store.conversations(CLI_OWNER), key=lambda c: c.messages)
    assert [m.content for m in store.path(CLI_OWNER, longer.id)][:5:2] == [
        "Hello!",
        "What is 2+2?",
        "And 3+3?",
    ]
    store.close()


def test_chat_history_flags(tmp_path):
    r = run("chat", "--history-max-conversations", "-1")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--history-max-conversations" in lines[0]
    db, data = tmp_path / "h.sqlite3", tmp_path / "data"
    r = run(
        "chat",
        *CHEAP,
        "--no-history",
        "--history-db",
        str(db),
        stdin="Hi\n/save\n/list\n",
        env={"MINISERVE_DATA_DIR": str(data)},
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "note: history is off" in r.stderr
    assert "saved as 1: Hi (in memory only: history is not kept on disk)" in r.stdout
    assert "  1. Hi  (" in r.stdout
    assert not db.exists() and not data.exists() and list(tmp_path.iterdir()) == []


def test_bench_writes_json_and_csv(tmp_path):
    j, c = tmp_path / "b.json", tmp_path / "b.csv"
    r = run(
        "bench",
        "--prompt-tokens",
        "8,24",
        "--new-tokens",
        "4",
        "--repeat",
        "1",
        "--dtype",
        "float32",
        "--json",
        str(j),
        "--csv",
        str(c),
    )
    assert r.returncode == 0, r.stderr
    assert "follow the float32 reference: yes" in r.stdout and "checked" in r.stdout
    data = json.loads(j.read_text())
    assert data["tokens_verified"] is True and data["dtype"] == "float32"
    assert data["runner"] == expected_runner()
    assert data["cpu"] and (data["native_isa"] or data["runner"] != "native")
    rows = data["rows"]
    assert {(row["prompt_tokens"], row["mode"]) for row in rows} == {
        (n, m) for n in (8, 24) for m in ("no_cache", "cache", "hf_generate")
    }
    for row in rows:
        assert row["ttft_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["verified"]
    with open(c) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 6 and {
        "prompt_tokens",
        "mode",
        "new_tokens",
        "ttft_s",
        "decode_tokens_per_s",
        "total_s",
        "speedup_vs_no_cache",
    } <= set(table[0])


def test_bench_bad_arguments(tmp_path):
    """Each a line and exit 2 before anything runs: a bad length, a --prefix-reuse past its
    range (it hung, growing a history forever), a --json or --csv that cannot be written (a
    traceback after the whole run, its results lost)."""
    for args, said in (
        (["--prompt-tokens", "8,x"], "prompt-tokens"),
        (["--prefix-reuse", "999999"], "--prefix-reuse"),
        (["--prefix-reuse", "-5"], "--prefix-reuse"),
        (["--json", str(tmp_path / "no" / "x.json")], "does not exist"),
        (["--csv", str(tmp_path)], "folder"),
    ):
        r = run("bench", "--prompt-tokens", "8", "--new-tokens", "2", "--repeat", "1", *args)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_port_out_of_range_and_a_raw_chat_with_a_system_prompt_are_one_line():
    for args, said in (
        (["serve", "--port", "70000"], "from 1 to 65535"),  # a traceback from uvicorn's bind
        (["app", "--port", "-1"], "from 1 to 65535"),
        (["app", "--preset", "nosuch"], "unknown preset 'nosuch'"),  # it started with another
        (["chat", "--raw", "--system", "be a pirate"], "--system needs a chat template"),
    ):
        r = run(*args)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generate_reads_a_piped_prompt_and_refuses_text_that_is_not_utf8(tmp_path):
    greedy = ("--temperature", "0", "--max-new-tokens", "6")
    question = "What is the capital of France?"
    given = generate_json("--prompt", question, *greedy)
    # no --prompt: stdin, its final line break dropped (as `echo` writes it); --prompt -: the same
    for args, piped in (([], question + "\n"), (["--prompt", "-"], question + "\r\n")):
        r = run("generate", *args, *greedy, "--json", stdin=piped)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert (out["token_ids"], out["prompt_tokens"]) == (
            given["token_ids"],
            given["prompt_tokens"],
        )
    # the bytes path of a real process: a byte-order mark dropped, bytes that are not UTF-8 refused
    r = process("generate", *greedy, "--json", stdin=b"\xef\xbb\xbf" + question.encode())
    assert r.returncode == 0 and json.loads(r.stdout)["token_ids"] == given["token_ids"], r.stderr
    r = process("generate", stdin=b"Say \xff")
    assert r.returncode == 2 and "the prompt on stdin is not valid UTF-8 (byte 4)" in r.stderr
    for args, said in (
        # bytes that are not UTF-8 reach Python as lone surrogates: they became "\ufffd"
        (["generate", "--prompt", "Hi \udcff"], "--prompt is not valid UTF-8 (byte 0xff"),
        (["chat", "--system", "\udce9t\udce9"], "--system is not valid UTF-8 (byte 0xe9"),
        (["generate", "--prompt", "Hi", "--stop", "\udc80"], "--stop is not valid UTF-8"),
        (["generate", "--prompt", "Hi", "--reasoning-budget", "-5"], "-1 (no limit)"),
        # a path that is not UTF-8 is a valid path: not refused as text
        (["generate", "--prompt", "Hi", "--model", str(tmp_path / "m\udcff.gguf")], "m\udcff"),
        (["generate"], "the prompt on stdin is empty"),
    ):
        r = run(*args)
        assert r.returncode in (1, 2) and said in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert "--model is not valid" not in r.stderr


def test_a_device_that_is_not_there_is_said_alone():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nothing to refuse")
    r = run("generate", "--prompt", "Hi", "--device", "cuda")
    # before: a line about dequantizing the GGUF for that device came first
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: Device 'cuda' was requested but no CUDA GPU is available; use --device cpu."
    ]


def test_thinking_models_reasoning_is_shown_apart(tmp_path):
    """generate with a thinking model: the reasoning on stderr after "Thinking:" and in --json
    (it printed nothing at all: the reply was all reasoning); stdout is the answer alone."""
    from thinking_models import r1_tiny

    model = ("--model", str(r1_tiny()), "--max-new-tokens", "12", "--seed", "1")
    out = generate_json("--prompt", "hi", *model)
    assert out["reasoning"] and out["reasoning_tokens"] == len(out["token_ids"]) == 12
    r = run("generate", "--prompt", "hi", *model)
    assert r.returncode == 0 and "Thinking: " + out["reasoning"] in r.stderr
    assert r.stdout.strip() == out["text"].strip()


def test_output_format_flags(tmp_path):
    """--regex holds the reply to the pattern; a schema the grammar library cannot enforce, a
    bad pattern, an unreadable file, a logit-bias id beyond the vocabulary: one line each
    naming the flag, exit 2, no traceback."""
    date = r"\d{4}-\d{2}-\d{2}"
    greedy = ("--temperature", "0", "--max-new-tokens", "20")
    out = generate_json("--prompt", "What is today's date?", "--regex", date, *greedy)
    assert re.fullmatch(date, out["text"]) and out["finish_reason"] == "stop"
    assert out["params"]["constraint"] == {"kind": "regex", "value": date}
    unique = tmp_path / "unique.json"
    unique.write_text('{"type": "array", "uniqueItems": true}')
    for args, words in [
        (["--json-schema", str(unique)], "--json-schema: Unimplemented keys"),
        (["--regex", "a("], "--regex: "),
        (["--grammar", str(tmp_path / "missing.gbnf")], "--grammar: cannot read"),
        (["--logit-bias", "99999:-100"], "--logit-bias: token id 99999"),
        (["--logit-bias", "7:-101"], "must be in [-100, 100]"),
    ]:
        r = run("generate", "--prompt", "Hi", "--max-new-tokens", "2", *args)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert "Traceback" not in r.stderr and len(errors) == 1 and words in errors[0]


def test_preset_greedy_is_built_in_and_gives_the_argmax(engine):
    """`--preset greedy` with no presets file naming it: the most likely token at every step,
    the same tokens as a temperature-0 reply of the engine on the same runner."""
    from miniserve.core.config import SamplingParams

    question = "Name a large animal."
    flags = ("--preset", "greedy", "--max-new-tokens", "10", "--show-probs", "--dtype", "float32")
    out = generate_json("--prompt", question, *flags)
    assert out["params"]["temperature"] == 0 and out["params"]["top_k"] == 0
    assert out["params"]["repetition_penalty"] == 1.0 and out["token_ids"]
    # each token the command chose was the top of the raw softmax at its step
    assert [s["token_id"] for s in out["steps"]][: len(out["token_ids"])] == out["token_ids"]
    assert all(s["top"][0]["token_id"] == s["token_id"] for s in out["steps"])
    text, last = engine.chat_text(
        [{"role": "user", "content": question}],
        SamplingParams(temperature=0, max_new_tokens=10),
        reuse_prefix=False,
    )
    assert out["text"] == text and out["new_tokens"] == last.stats.new_tokens


def test_presets_file_defining_greedy_overrides_the_built_in(tmp_path):
    f = tmp_path / "presets.yaml"
    f.write_text("presets:\n  greedy:\n    temperature: 0.9\n    top_k: 5\n    max_new_tokens: 3\n")
    out = generate_json(
        "--prompt", "Hi", "--preset", "greedy", "--presets-file", str(f), "--seed", "1"
    )
    assert (
        out["params"]["temperature"],
        out["params"]["top_k"],
        out["params"]["max_new_tokens"],
    ) == (0.9, 5, 3)
    assert out["new_tokens"] <= 3
