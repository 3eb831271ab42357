"""The command line, run as users run it: generate, chat through a pipe, bench."""

import csv
import json
import subprocess
import sys
from pathlib import Path

from conftest import chat_ids, expected_runner
from miniserve.verify import BOUND_FLOAT32, check_tokens

ROOT = Path(__file__).resolve().parent.parent


def run(*args, stdin=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "miniserve", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_json_matches_the_engine(engine, ref32):
    r = run("generate", "--prompt", "What is the capital of France?", "--preset", "factual",
            "--max-new-tokens", "12", "--json", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"text", "token_ids", "prompt_tokens", "ttft_s", "tokens_per_s", "cache"} <= set(out)
    assert out["cache"] is True and 0 < len(out["token_ids"]) <= 12
    assert out["text"] == engine.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    # Exact by construction: the same runner computing the same prompt from scratch, here
    # and in the command's own process (the same CPU, the same number of threads).
    from miniserve.config import SamplingParams
    text, _ = engine.chat_text([{"role": "user", "content": "What is the capital of France?"}],
                               SamplingParams(temperature=0, max_new_tokens=12),
                               reuse_prefix=False)
    assert out["text"] == text
    nocache = json.loads(run("generate", "--prompt", "What is the capital of France?",
                             "--preset", "factual", "--max-new-tokens", "12", "--json",
                             "--dtype", "float32", "--no-cache").stdout)
    assert nocache["cache"] is False
    # Without the cache the sums are others (many rows through MKL): held to the reference.
    prompt = chat_ids(engine.tokenizer, "What is the capital of France?")
    for reply in (out, nocache):  # a shorter reply ended on one of the end tokens
        ends = () if len(reply["token_ids"]) == 12 else engine.eos_ids
        assert check_tokens(ref32, prompt, reply["token_ids"], BOUND_FLOAT32, ends).ok


def test_generate_streams_text_and_show_probs():
    r = run("generate", "--prompt", "Say hello.", "--max-new-tokens", "6", "--seed", "1",
            "--show-probs")
    assert r.returncode == 0 and r.stdout.strip()
    assert "p=" in r.stderr and "tokens/s" in r.stderr


def test_bad_arguments_exit_nonzero_with_one_line():
    for args in (["--top-p", "0"], ["--temperature", "9"], ["--top-k", "abc"],
                 ["--preset", "nope"], ["--model", "/no/such/dir"], ["--max-new-tokens", "0"]):
        r = run("generate", "--prompt", "hi", *args)
        assert r.returncode != 0, args
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in r.stderr, args


def test_chat_through_a_pipe():
    script = "\n".join(["Hello!", "/preset factual", "/settings", "/set temperature hot",
                        "/set top_p 7", "/set max_new_tokens 8", "What is 2+2?", "/preset",
                        "/model", "/exit", "never read"]) + "\n"
    r = run("chat", "--max-new-tokens", "8", stdin=script)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "T=0 " in out.split("[factual]")[1].splitlines()[0]
    assert "error: 'temperature' must be a number" in out
    assert "error: 'top_p' must be in (0, 1]" in out
    assert out.count("tokens/s") == 2  # both messages got a reply
    assert "presets: factual, conservative, balanced, creative" in out
    assert "SmolLM2-135M-Instruct on cpu" in out or "SmolLM2-135M-Instruct on" in out


def test_bench_writes_json_and_csv(tmp_path):
    j, c = tmp_path / "b.json", tmp_path / "b.csv"
    r = run("bench", "--prompt-tokens", "8,24", "--new-tokens", "4", "--repeat", "1",
            "--dtype", "float32", "--json", str(j), "--csv", str(c))
    assert r.returncode == 0, r.stderr
    assert "follow the float32 reference: yes" in r.stdout and "checked" in r.stdout
    data = json.loads(j.read_text())
    assert data["tokens_verified"] is True and data["dtype"] == "float32"
    assert data["runner"] == expected_runner()
    assert data["cpu"] and (data["native_isa"] or data["runner"] != "native")
    rows = data["rows"]
    assert {(row["prompt_tokens"], row["mode"]) for row in rows} == {
        (n, m) for n in (8, 24) for m in ("no_cache", "cache", "hf_generate")}
    for row in rows:
        assert row["ttft_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["verified"]
    with open(c) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 6 and {"prompt_tokens", "mode", "new_tokens", "ttft_s",
                                "decode_tokens_per_s", "total_s",
                                "speedup_vs_no_cache"} <= set(table[0])


def test_bench_bad_arguments():
    r = run("bench", "--prompt-tokens", "8,x")
    assert r.returncode == 2 and "prompt-tokens" in r.stderr
