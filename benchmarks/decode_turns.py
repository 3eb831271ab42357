"""One stream's decode against llama.cpp, the two engines taking turns every second or so.

    .venv/bin/python benchmarks/decode_turns.py FILE.gguf [FILE.gguf ...] [--turns 40]
        [--new-tokens 32] [--prompt-tokens 64] [--threads 2] [--json OUT.json]

vs_llamacpp.py starts a fresh process for every measurement, and its rounds are minutes apart;
on a shared VM whose memory gives 30 GB/s one minute and 45 the next, the rounds' ratios then
move more than the engines differ (0.91-1.23x for the Llama 1B shape in one afternoon). Here
each engine loads the file once, in its own process, and the two take turns: one reply of
--new-tokens greedy tokens after a --prompt-tokens prompt (the same filler prompt as vs_llamacpp.py,
tokenized by each engine), then the other's, A B then B A. The waiting process is blocked on its
pipe, so each engine runs alone while it runs. A reply's decode rate is vs_llamacpp.py's: the
tokens after the first over their time (ours: the engine's own stats, through the scheduler, as
`miniserve bench` measures it; llama.cpp: llama-cpp-python's generate loop, its repacked buffers
on, AMX refused as there). Each pair of turns, seconds apart, gives one ratio; the table shows
the pairs' median and quartiles and the engines' median rates.

Before each pair, a memory probe (the faster of two sums over 512 MB on --threads threads, while
neither engine runs) reads what the machine's memory gives that moment; the last column is the
pairs' median ratio apart for the pairs after a probe above and at or below --split-gb-s (45
GB/s: this VM's memory reads ~30 GB/s most minutes and 45-57 in some).

Both processes hold their weights at once (llama.cpp's RSS plus ours: vs_llamacpp.py's table has
each alone), and either may find the other's pages in the caches it shares: the same for both,
turn by turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_llamacpp import cpu_description, filler_ids, llamacpp_greedy  # noqa: E402

ENGINES = ("llamacpp", "ours")


# -- the children: load once, then one reply a line read ---------------------------------------


def _llamacpp_reply(path: str, threads: int, prompt_tokens: int, context: int):
    from miniserve.bench.synthetic import block_amx

    block_amx()  # as vs_llamacpp.py runs it: AMX's kernels die on this llama-cpp-python
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=path, n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    ids = filler_ids(
        lambda t: llm.tokenize(t.encode(), add_bos=False, special=False), prompt_tokens
    )

    def reply(n: int) -> dict:
        tokens, first, total = llamacpp_greedy(llm, ids, n)
        return {"tokens": len(tokens), "ttft_s": first, "decode_s": total - first}

    return reply


def _ours_reply(path: str, threads: int, prompt_tokens: int, context: int):
    import torch

    from miniserve.core.config import BUILTIN_PRESETS, GREEDY
    from miniserve.engine.engine import start_engine

    torch.set_num_threads(threads)  # the native pass's threads
    engine = start_engine(path, speculate="off")
    engine.warm_up()
    tok = engine.tokenizer
    ids = filler_ids(lambda t: tok.encode(t, add_special_tokens=False), prompt_tokens)

    def reply(n: int) -> dict:
        params = BUILTIN_PRESETS[GREEDY].replace(max_new_tokens=n)
        chunks = list(engine.complete(ids, params, reuse_prefix=False, speculate=False))
        stats = chunks[-1].stats
        new = sum(len(c.token_ids) for c in chunks)
        return {"tokens": new, "ttft_s": stats.ttft_s, "decode_s": stats.total_s - stats.ttft_s}

    return reply


def child(args) -> int:
    context = max(1024, args.prompt_tokens + args.new_tokens + 16)
    make = _llamacpp_reply if args.child == "llamacpp" else _ours_reply
    reply = make(args.model, args.threads, args.prompt_tokens, context)
    reply(4)  # one-off costs out of the turns
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps(reply(args.new_tokens)), flush=True)
    return 0


# -- the turns ---------------------------------------------------------------------------------


def start(engine: str, path: Path, args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, str(path), "--child", engine]
    cmd += ["--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens)]
    cmd += ["--new-tokens", str(args.new_tokens)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, bufsize=1
    )
    for line in proc.stdout:
        if line.strip() == "READY":
            return proc
    raise SystemExit(f"{engine} ended before it was ready (exit {proc.wait()})")


def turn(proc: subprocess.Popen) -> dict:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"an engine's process ended mid-turn (exit {proc.wait()})")
    out = json.loads(line)
    out["decode_tok_s"] = (out["tokens"] - 1) / out["decode_s"] if out["tokens"] > 1 else 0.0
    return out


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


class MemoryProbe:
    """What the machine's memory gives this moment: the faster of two 2-thread sums over 512 MB
    (torch), in GB/s, taken while neither engine runs."""

    def __init__(self, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.block = torch.ones(128 * 2**20)  # float32: 512 MB

    def __call__(self) -> float:
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            self.block.sum()
            best = min(best, time.perf_counter() - started)
        return self.block.numel() * 4 / best / 1e9


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_file(path: Path, args, probe: MemoryProbe) -> dict:
    procs = {e: start(e, path, args) for e in ENGINES}
    turns = {e: [] for e in ENGINES}
    memory = []  # GB/s before each pair of turns
    try:
        for n in range(args.turns):
            memory.append(probe())
            for e in ENGINES if n % 2 == 0 else reversed(ENGINES):
                turns[e].append(turn(procs[e]))
    finally:
        for p in procs.values():  # every child told to end before any is waited for
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    rates = {e: [t["decode_tok_s"] for t in turns[e]] for e in ENGINES}
    ratios = [o / c for o, c in zip(rates["ours"], rates["llamacpp"], strict=True)]
    # the pairs split by what the memory probe read before them
    cut = args.split_gb_s
    fast = [r for r, m in zip(ratios, memory, strict=True) if m > cut]
    slow = [r for r, m in zip(ratios, memory, strict=True) if m <= cut]
    return {
        "file": path.name,
        "size_mib": round(path.stat().st_size / 2**20),
        "turns": turns,
        "median_tok_s": {e: statistics.median(rates[e]) for e in ENGINES},
        "ratio_quartiles": quartiles(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "memory_gb_s": memory,
        "memory_split": {
            "cut_gb_s": cut,
            "above": {"pairs": len(fast), "median_ratio": median_or_none(fast)},
            "below": {"pairs": len(slow), "median_ratio": median_or_none(slow)},
        },
    }


def split(r: dict) -> str:
    m = r["memory_split"]

    def part(side: str) -> str:
        n, ratio = m[side]["pairs"], m[side]["median_ratio"]
        return f"{ratio:.2f}x ({n})" if n else "- (0)"

    return (
        f"{part('above')} / {part('below')} (probe {min(r['memory_gb_s']):.0f}-"
        f"{max(r['memory_gb_s']):.0f} GB/s)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--turns", type=int, default=40, help="turns of each engine")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--split-gb-s",
        type=float,
        default=45.0,
        help="the pairs' ratio shown apart for a memory probe above and below this (GB/s)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.model = args.models[0]
        return child(args)
    if args.turns < 1 or args.new_tokens < 2 or args.prompt_tokens < 1:
        ap.error("--turns >= 1, --new-tokens >= 2 and --prompt-tokens >= 1")
    cpu = cpu_description()
    print(f"{cpu['model']}, {args.threads} threads, {args.turns} turns each")
    probe = MemoryProbe(args.threads)
    results = []
    print("| file | decode tok/s llama.cpp → ours (medians) | ours / llama.cpp a pair: ", end="")
    cut = f"{args.split_gb_s:.0f} GB/s"
    print(f"p25, median, p75 (range) | median (pairs) with the probe > / <= {cut} |")
    print("|---|---|---|---|")
    for m in args.models:
        r = run_file(Path(m), args, probe)
        results.append(r)
        lo, mid, hi = r["ratio_quartiles"]
        a, b = r["ratio_range"]
        t = r["median_tok_s"]
        print(
            f"| {r['file']} ({r['size_mib']} MiB) | {t['llamacpp']:.1f} → {t['ours']:.1f} | "
            f"{lo:.2f}, **{mid:.2f}x**, {hi:.2f} ({a:.2f}-{b:.2f}) | {split(r)} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"cpu": cpu, "args": vars(args), "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
