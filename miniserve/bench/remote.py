"""The benchmark of a remote model (miniserve/models/remote.py). Its weights are on its server:
no-cache, generate(), the other runners and the token check cannot run here. What can: our
streaming loop through the server, timed at this client."""

from __future__ import annotations

import statistics

from miniserve.bench.options import BenchConfig, Progress
from miniserve.bench.prompts import FILLER
from miniserve.bench.results import BenchResult, Row
from miniserve.core.config import BUILTIN_PRESETS, GREEDY, SamplingParams

REMOTE_MODE = "remote"


def remote_note(engine) -> str:
    info = engine.info()
    return (
        f"a remote model ({info.get('server', 'server')} at {info.get('url', '?')}): only our "
        "streaming loop through its server ran -- time to first token and tokens/s as "
        "this client sees them, network included; the other modes need the weights on "
        "this machine, and its tokens are not checked (its weights are not here); prompt "
        "tokens as the server counted them"
        + (
            ""
            if info.get("token_counts", "").startswith("the server's")
            else " (where it sent no count, as estimated here)"
        )
    )


def remote_prompt(engine, n: int, lead: str = "", count=None) -> str:
    """A completion prompt of about n of the server's tokens: `lead`, then the filler, the
    most words whose count(text) is at most n (a bisection; count: the engine's)."""
    count = count or engine.count_text
    words = (lead + " " + FILLER * (n // 40 + 2)).split()
    low, high = 1, len(words)
    while low < high:
        mid = (low + high + 1) // 2
        if count(" ".join(words[:mid])) <= n:
            low = mid
        else:
            high = mid - 1
    return " ".join(words[:low])


def _filler_counter(engine, params: SamplingParams):
    """count(text) for the filler: the server's tokenize endpoint where it has one; else
    tokens a word as the server counted them in one prompt of filler (its usage), which the
    estimate of bytes would miss by a third or more."""
    if engine.info().get("token_counts", "").startswith("the server's"):
        return engine.count_text
    text = FILLER * 3
    *_, last = engine.complete_text(text, params.replace(max_new_tokens=2))
    per_word = last.stats.prompt_tokens / len(text.split()) if last.stats.prompt_tokens else 0
    if not per_word:  # the server sent no usage: the estimate it is
        return engine.count_text
    return lambda t: round(len(t.split()) * per_word)


def _run_remote(engine, prompt: str, params: SamplingParams):
    """(text, prompt tokens the server counted (0: it did not say), new tokens, ttft, total)."""
    chunks = list(engine.complete_text(prompt, params))
    stats = chunks[-1].stats
    return (
        "".join(c.text for c in chunks),
        stats.prompt_tokens,
        stats.new_tokens,
        stats.ttft_s,
        stats.total_s,
    )


def run_remote_bench(engine, config: BenchConfig, progress: Progress) -> BenchResult:
    """The rows a remote model can have: one per prompt length, our loop through its server.
    Each run's prompt starts differently, so the server's prefix cache cannot answer it."""
    if config.peer:
        raise ValueError(
            "--peer needs a local .gguf model: a remote model's weights are on its server"
        )
    params = BUILTIN_PRESETS[GREEDY].replace(max_new_tokens=config.new_tokens)
    progress(0.0, "warming up the remote, counting its tokens")
    count = _filler_counter(engine, params)  # also the warm-up
    rows, total, done = [], len(config.prompt_tokens) * config.repeat, 0
    for n in config.prompt_tokens:
        n = min(n, engine.context_length - config.new_tokens)
        runs = []
        for r in range(config.repeat):
            progress(done / total, f"{n} prompt tokens, remote, run {r + 1}/{config.repeat}")
            prompt = remote_prompt(engine, n, f"Run {n}-{r + 1}.", count)
            text, counted, *timing = _run_remote(engine, prompt, params)
            # the server's usage, or (a server that sends none) the count that cut the prompt
            runs.append((text, counted or count(prompt), *timing))
            done += 1
        ttft = statistics.median(r[3] for r in runs)
        total_s = statistics.median(r[4] for r in runs)
        decode = statistics.median(
            (r[2] - 1) / (r[4] - r[3]) if r[2] > 1 and r[4] > r[3] else 0.0 for r in runs
        )
        counted = statistics.median(r[1] for r in runs)
        rows.append(
            Row(
                int(counted),
                REMOTE_MODE,
                "remote",
                runs[0][2],
                round(ttft, 4),
                round(decode, 2),
                round(total_s, 4),
                None,
                0.0,
                True,
                runs[0][2],
                None,
            )
        )
    progress(1.0, "done")
    return BenchResult(
        rows, True, True, engine.name, "remote", "remote", note=remote_note(engine), runner="remote"
    )
