"""Prompt-lookup speculation against decoding one token a step, on the same engine's model, in
one run: input-grounded tasks (rename in a code file, correct the typos of a passage), free
prose, and 8 streams at once. Greedy; the replies must be identical both ways (checked).
With --llamacpp, llama.cpp (llama-cpp-python) decodes the same prompt ids from the same file
with and without its own prompt lookup (`LlamaPromptLookupDecoding`), each run in a process of
its own while ours waits.

    .venv/bin/python benchmarks/speculation.py [--model default] [--tokens 256] [--repeat 3]
        [--llamacpp] [--threads 2]

A model with a chat template gets the tasks as chat messages; a base model (Gemma 3 270M, a
random-weight file) as completion prompts that frame the same texts. Tasks' texts:
benchmarks/speculation_tasks/ (SOURCES.md says where each comes from). Prints decode tokens/s
off and on, the ratio (median of the repeats, alternating), and what the drafts did:
"accepted X of Y a step"; with --llamacpp, llama.cpp's off / lookup rates and our "on" over its
"lookup", and how many leading tokens its replies share with ours (the two engines' arithmetic
differs, so a greedy reply can part where two tokens nearly tie).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TASKS = ROOT / "benchmarks" / "speculation_tasks"
RENAME = "Rename `ids` to `token_ids` in this code and give all of it back, nothing else:\n\n"
TYPOS = "Correct the spelling mistakes in this passage and give all of it back:\n\n"
PROSE = "Write a short story about a lighthouse keeper."


def chat_tasks() -> dict[str, str]:
    code = (TASKS / "detokenizer.txt").read_text("utf-8")
    typos = (TASKS / "typos.txt").read_text("utf-8")
    return {"rename": RENAME + code, "typos": TYPOS + typos, "prose": PROSE}


def completion_tasks() -> dict[str, str]:
    """The same tasks for a model without a chat template: the text, then the start of the
    answer for the model to continue."""
    code = (TASKS / "detokenizer.txt").read_text("utf-8")
    typos = (TASKS / "typos.txt").read_text("utf-8")
    return {
        "rename": "A Python file:\n\n```python\n" + code + "```\n\nThe same file with `ids` "
        "renamed to `token_ids`:\n\n```python\n",
        "typos": "A passage with spelling mistakes:\n\n" + typos + "\n\nThe same passage with "
        "the mistakes corrected:\n\n",
        "prose": "The lighthouse keeper",
    }


def cpu_name() -> str:
    return next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )


# -- llama.cpp, in a child process ------------------------------------------------------------


def child_llamacpp(path: str, prompts_file: str, tokens: int, threads: int, lookup: bool) -> dict:
    """Greedy replies to each task's prompt ids (end tokens stop it, as ours), decode tokens/s
    after the first token; with `lookup`, LlamaPromptLookupDecoding (its defaults)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    prompts = json.loads(Path(prompts_file).read_text())
    n_ctx = max(len(ids) for ids in prompts.values()) + tokens + 16
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=max(n_ctx, 1024),
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=LlamaPromptLookupDecoding() if lookup else None,
        logits_all=lookup,  # its score array is sized by this flag, not by the draft model's
        verbose=False,
    )
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)

    def run(ids: list[int]) -> dict:
        llm.reset()
        out, first = [], None
        for token in llm.generate(
            ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        ):
            if first is None:
                first = time.perf_counter()
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            out.append(token)
            if len(out) >= tokens:
                break
        end = time.perf_counter()
        rate = (len(out) - 1) / (end - first) if len(out) > 1 else 0.0
        return {"tokens": out, "decode_tok_s": rate}

    run(next(iter(prompts.values()))[:8])  # one-off costs out of the numbers
    return {name: run(ids) for name, ids in prompts.items()}


def llamacpp_rates(path: str, prompts: dict, tokens: int, threads: int, lookup: bool) -> dict:
    """child_llamacpp in a process of its own (AMX refused there, as vs_llamacpp.py does)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [sys.executable, __file__, "--child", path, f.name, str(tokens), str(threads)]
    done = subprocess.run(cmd + (["lookup"] if lookup else []), capture_output=True, text=True)
    Path(f.name).unlink()
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        from miniserve.bench.synthetic import block_amx

        block_amx()
        path, prompts_file, tokens, threads, *rest = sys.argv[2:]
        result = child_llamacpp(path, prompts_file, int(tokens), int(threads), rest == ["lookup"])
        print(json.dumps(result))
        return 0

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp's prompt lookup beside")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    args = ap.parse_args()

    from miniserve.core.config import SamplingParams
    from miniserve.engine.engine import Engine
    from miniserve.runners.loader import load_model

    from benchmarks.common import on_threads

    loaded = load_model(args.model, dtype="stored")
    engines = {name: Engine(loaded, speculate=name, max_batch=8) for name in ("off", "ngram")}
    params = SamplingParams(temperature=0, max_new_tokens=args.tokens)
    off_engine = engines["off"]
    chat = off_engine.has_chat_template
    texts = chat_tasks() if chat else completion_tasks()
    prompts = {
        name: (
            off_engine.trim([{"role": "user", "content": text}], params).prompt_ids
            if chat
            else off_engine.prompt_ids(text, params)
        )
        for name, text in texts.items()
    }

    def run(engine, ids):
        out, stats = [], None
        for chunk in engine.complete(ids, params, reuse_prefix=False):
            out += chunk.token_ids
            stats = chunk.stats
        return out, stats

    def many(engine, batch):
        start = time.perf_counter()
        out = on_threads(len(batch), lambda i: run(engine, batch[i]))
        seconds = time.perf_counter() - start
        return [o[0] for o in out], sum(o[1].new_tokens for o in out) / seconds

    for e in engines.values():
        e.warm_up()
    form = "chat messages" if chat else "completion prompts (no chat template)"
    print(
        f"CPU: {cpu_name()}; model {loaded.name}; greedy, {args.tokens} new tokens at most; "
        f"tasks as {form}"
    )
    ours = {}
    for name, ids in prompts.items():
        speeds = {"off": [], "ngram": []}
        replies = {}
        last = None
        for _ in range(args.repeat):
            for mode, engine in engines.items():
                out, stats = run(engine, ids)
                speeds[mode].append(stats.decode_tokens_per_s)
                replies.setdefault(mode, out)
                assert out == replies[mode]
                if mode == "ngram":
                    last = stats
        assert replies["off"] == replies["ngram"], f"{name}: speculation changed the reply"
        off, on = statistics.median(speeds["off"]), statistics.median(speeds["ngram"])
        ours[name] = {"off": off, "on": on, "reply": replies["off"]}
        drafts = (
            f"accepted {last.accepted / last.draft_steps:.1f} of "
            f"{last.drafted / last.draft_steps:.1f} a step, {last.draft_steps} drafting steps"
            if last.draft_steps
            else "no drafts"
        )
        print(
            f"  {name:7s} {last.new_tokens:4d} tokens ({len(ids)} in): off {off:6.1f} tok/s, "
            f"on {on:6.1f} tok/s, {on / off:.2f}x ({drafts})"
        )
    batch = (list(prompts.values()) * 3)[:8]
    off_ids, off_rate = many(engines["off"], batch)
    on_ids, on_rate = many(engines["ngram"], batch)
    assert off_ids == on_ids, "8 streams: speculation changed a reply"
    print(
        f"  8 streams (the three tasks mixed): off {off_rate:.1f} tok/s in all, on "
        f"{on_rate:.1f}, {on_rate / off_rate:.2f}x"
    )
    if args.llamacpp:
        path = str(loaded.source)
        rounds = {"off": [], "lookup": []}
        for _ in range(args.repeat):
            for mode in rounds:
                rounds[mode].append(
                    llamacpp_rates(path, prompts, args.tokens, args.threads, mode == "lookup")
                )
        print(f"  llama.cpp (llama-cpp-python, {args.threads} threads), the same prompt ids:")
        for name in prompts:
            off = statistics.median(r[name]["decode_tok_s"] for r in rounds["off"])
            on = statistics.median(r[name]["decode_tok_s"] for r in rounds["lookup"])
            theirs = rounds["lookup"][0][name]["tokens"]
            same = shared_prefix(theirs, ours[name]["reply"])
            print(
                f"  {name:7s} {len(theirs):4d} tokens: off {off:6.1f} tok/s, lookup {on:6.1f} "
                f"tok/s, {on / off:.2f}x; ours on / its lookup {ours[name]['on'] / on:.2f}x "
                f"(first {same} tokens the same as ours)"
            )
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
