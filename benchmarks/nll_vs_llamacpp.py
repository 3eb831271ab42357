"""Quality of the weights as stored: the mean negative log-likelihood of a fixed text under our
engine and under llama.cpp, on the same GGUF file and the same token ids.

    .venv/bin/python benchmarks/nll_vs_llamacpp.py FILE.gguf [FILE.gguf ...] [--tokens 2048]

The text is docs/bench/nll_text.txt: CPython 3.11's LICENSE.txt (the history of the software
and the PSF, BeOpen, CNRI and CWI licenses; shipped with every CPython, redistributable under
those same terms), 2,020 words, first --tokens tokens of it (after a BOS where the model adds
one). Each engine runs in a process of its own, one after the other (never both at once on the
cores); ours through Engine.prompt_logprobs (the native runner over the weights as stored,
its default), llama.cpp through llama-cpp-python (logits of every position, its default
kernels, 2 threads). Prints one row a file: the two NLLs and their ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "docs" / "bench" / "nll_text.txt"


def token_ids(path: str, n: int) -> list[int]:
    from miniserve.runners.loader import load_model

    loaded = load_model(path, dtype="stored", progress=lambda m: None)
    ids = loaded.tokenizer(TEXT.read_text())["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def ours(path: str, ids: list[int]) -> float:
    from miniserve.engine.engine import Engine
    from miniserve.runners.loader import load_model

    engine = Engine(load_model(path, dtype="stored", progress=lambda m: None))
    try:
        logprobs = [lp for lp, _ in engine.prompt_logprobs(ids)]
    finally:
        engine.close()
    return -sum(logprobs) / len(logprobs)


def llamacpp(path: str, ids: list[int]) -> float:
    import numpy as np

    from miniserve.bench.synthetic import block_amx

    block_amx()  # llama.cpp's AMX kernels die on this CPU (synthetic.block_amx says why)
    from llama_cpp import Llama

    llm = Llama(
        model_path=path,
        n_ctx=len(ids) + 16,
        n_batch=512,
        logits_all=True,
        n_threads=2,
        verbose=False,
    )
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    top = scores.max(-1, keepdims=True)
    logp = scores - top - np.log(np.exp(scores - top).sum(-1, keepdims=True))
    return float(-np.mean([logp[i, ids[i + 1]] for i in range(len(ids) - 1)]))


def child(args) -> None:
    ids = json.loads(Path(args.ids).read_text())
    nll = ours(args.file, ids) if args.child == "ours" else llamacpp(args.file, ids)
    print(json.dumps({"nll": nll}))


def run(engine: str, path: str, ids_file: Path) -> float:
    done = subprocess.run(
        [sys.executable, __file__, "--child", engine, "--ids", str(ids_file), path],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"{engine} on {path} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["nll"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--child", choices=("ours", "llamacpp"), help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.file = args.files[0]
        return child(args)
    import tempfile

    print(
        "| file | tokens | NLL ours | NLL llama.cpp | ours / llama.cpp |\n|---|---:|---:|---:|---:|"
    )
    for path in args.files:
        ids = token_ids(path, args.tokens)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(ids, f)
        a, b = run("ours", path, Path(f.name)), run("llamacpp", path, Path(f.name))
        print(f"| {Path(path).name} | {len(ids)} | {a:.4f} | {b:.4f} | {a / b:.4f} |", flush=True)
        assert math.isfinite(a) and math.isfinite(b)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
