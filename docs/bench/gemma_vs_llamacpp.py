"""Gemma 3 270M: ours (the engine: native, bf16) vs llama.cpp bf16 on the same weights,
the two interleaved run by run, as bench's cache mode runs them (BENCHMARKS.md, "Models").

    python docs/bench/gemma_vs_llamacpp.py [REPEATS] [PROMPT,TOKENS]   (needs make models and
    llama-cpp-python: make bench-peer)
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from miniserve.bench import peer  # noqa: E402
from miniserve.bench.prompts import prompt_of_length  # noqa: E402
from miniserve.bench.runs import _run_ours  # noqa: E402
from miniserve.core.config import SamplingParams  # noqa: E402
from miniserve.engine.engine import start_engine  # noqa: E402
from miniserve.runners.loader import known_model_path  # noqa: E402

G = str(known_model_path("gemma-3-270m"))
engine = start_engine(G, progress=lambda *a: None)
print(engine.runner, engine.loaded.dtype, flush=True)
params = SamplingParams(temperature=0, top_k=0, top_p=1.0, repetition_penalty=1.0, max_new_tokens=64)
lc = peer.LlamaCppPeer(peer.gguf_copy(Path(G), "bfloat16"), 1100, torch.get_num_threads())
warm = prompt_of_length(engine.tokenizer, 8)
_run_ours(engine, warm, params, True); lc.run(warm, 64, engine.eos_ids)
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for n in [int(x) for x in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["50", "1000"])]:
    ids = prompt_of_length(engine.tokenizer, n)
    res = {"ours": [], "llama.cpp": []}
    for r in range(reps):
        for name, fn in (("ours", lambda: _run_ours(engine, ids, params, True)), ("llama.cpp", lambda: lc.run(ids, 64, engine.eos_ids))):
            tokens, ttft, total = fn()
            res[name].append((ttft, (len(tokens) - 1) / (total - ttft), len(tokens)))
    for name, runs in res.items():
        print(n, "%-9s" % name, "ttft med %.3f (%s)" % (statistics.median(r[0] for r in runs), " ".join("%.3f" % r[0] for r in runs)),
              "decode med %.1f (%s)" % (statistics.median(r[1] for r in runs), " ".join("%.1f" % r[1] for r in runs)), "tokens", runs[0][2], flush=True)
lc.close()
