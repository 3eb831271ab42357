"""What splitting a reply into reasoning and answer costs a token: the same reply (same prompt,
seed and tokens) decoded with and without its parts (engine/reply.py's ReplyParts deciding each
token's part and steering the next, two detokenizers), alternating, in one run.

    .venv/bin/python benchmarks/reasoning_split.py [--hidden 1024 --layers 8] [--tokens 256]
        [--repeat 5]

The model: a qwen2 GGUF with Qwen3's tokenizer and an R1-style template (the reply starts
inside its reasoning, so every token passes the reasoning path), random weights, written once
into the cache folder; `--hidden 64 --layers 2` is the tests' tiny model, where the fixed cost
a token weighs most. Prints decode tokens/s both ways and the ratio (median of the repeats).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    from thinking_models import r1_template

    from miniserve.bench.tokenizer_files import write_qwen3_tokenizer_gguf
    from miniserve.core.config import SamplingParams
    from miniserve.core.paths import cache_root
    from miniserve.engine.chat import ChatOptions
    from miniserve.engine.engine import start_engine

    path = cache_root() / "synthetic" / f"r1-qwen2-h{args.hidden}-l{args.layers}.gguf"
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        write_qwen3_tokenizer_gguf(
            path,
            arch="qwen2",
            hidden=args.hidden,
            layers=args.layers,
            heads=max(args.hidden // 64, 1),
            kv_heads=max(args.hidden // 256, 1),
            ffn=args.hidden * 3,
            chat_template=r1_template(),
        )
    engine = start_engine(str(path))
    messages = [{"role": "user", "content": "Think about the weather, then answer."}]
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, seed=7, max_new_tokens=args.tokens)
    trimmed = engine.trim(messages, params, ChatOptions())
    assert trimmed.plan.in_reasoning, "the template should open the reasoning"

    def run(plan) -> tuple[float, list[int], int]:
        ids, reasoning = [], 0
        for chunk in engine.complete(trimmed.prompt_ids, params, reuse_prefix=False, plan=plan):
            ids += chunk.token_ids
            if chunk.done:
                stats = chunk.stats
        reasoning = stats.reasoning_tokens
        return stats.decode_tokens_per_s, ids, reasoning

    engine.warm_up()
    run(None)
    off, on = [], []
    for _ in range(args.repeat):
        speed, ids_off, _ = run(None)
        off.append(speed)
        speed, ids_on, reasoning = run(trimmed.plan)
        on.append(speed)
        assert ids_on == ids_off, "the split must not change the tokens"
        assert reasoning == len(ids_on), "every token should be the reasoning's"
    # the split's own cost a token, without the model: the parts deciding and steering, and
    # the reply's two detokenizers, over the reply's own ids (reasoning, then answer)
    import time

    from miniserve.engine.decode import GenerationStats
    from miniserve.engine.engine import _Reply

    ids = ids_on
    half = dict(trimmed.plan.__dict__)
    half["budget"] = len(ids) // 2
    plan = type(trimmed.plan)(**half)
    vocab = engine.runner.config.vocab_size
    rounds, spent = 20, 0.0
    for _ in range(rounds):
        parts = engine.reply_matcher(params, plan)
        reply = _Reply(engine.tokenizer, params, GenerationStats(), lambda chunk: None, 0, parts)
        start = time.perf_counter()
        for i in ids:
            mask = parts.allowed(vocab)
            if mask is not None:  # forced closing tokens: the sampler's masked argmax
                i = int(mask[0].nonzero()[0])
            parts.accept(i)
            reply.token(i)
        reply.finish()
        spent += time.perf_counter() - start
    split_us = spent / (rounds * len(ids)) * 1e6
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    a, b = statistics.median(off), statistics.median(on)
    print(f"CPU: {cpu}; model hidden {args.hidden}, {args.layers} layers, vocab 151,936")
    print(f"{args.tokens} tokens, {args.repeat} alternating runs each (median)")
    print(f"  without the split: {a:8.1f} tok/s   {[round(x, 1) for x in off]}")
    print(f"  with the split:    {b:8.1f} tok/s   {[round(x, 1) for x in on]}")
    print(f"  time per token with / without: {a / b:.4f} (the machine's noise included)")
    print(
        f"  the split alone (parts, masks, two detokenizers; half reasoning, half answer): "
        f"{split_us:.1f} us a token = {split_us * 1e-6 * a * 100:.2f}% of a token's "
        f"{1000 / a:.1f} ms here"
    )
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
