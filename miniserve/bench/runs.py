"""Running the engine's modes and timing them: cache vs no-cache vs transformers' generate()
(and the other modes of options.MODES), each over every prompt length, warmed up first, the
median of the repeats a row (`run_bench`); and the follow-up turn with the prefix cache warm vs
cold (`prefix_reuse`). The token check is check.py's, llama.cpp's rows peer_rows.py's."""

from __future__ import annotations

import json
import statistics
import threading
import time

import torch

from miniserve.bench import peer_rows
from miniserve.bench.check import TokenCheck
from miniserve.bench.options import BENCH_SCHEMA, BenchConfig, BenchStopped, Progress, stoppable
from miniserve.bench.prompts import FILLER, prompt_of_length
from miniserve.bench.remote import run_remote_bench
from miniserve.bench.results import BenchResult, Row
from miniserve.core.config import BUILTIN_PRESETS, GREEDY, Constraint, SamplingParams
from miniserve.core.platform import cpu_model
from miniserve.engine.decode import GenerationStats, generate
from miniserve.engine.engine import Engine, common_prefix
from miniserve.runners import native
from miniserve.runners.hf import TransformersRunner
from miniserve.runners.lean import LeanRunner
from miniserve.runners.verify import bound_for, runner_bound


class _FirstTokenTimer:
    """A transformers streamer that notes when generate() produces its first new token."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


class _Linked(threading.Event):
    """One run's cancel event (the engine sets it when the run's stream closes), which also
    reads as set once the benchmark's own is."""

    def __init__(self, parent: threading.Event):
        super().__init__()
        self.parent = parent

    def is_set(self) -> bool:
        return super().is_set() or self.parent.is_set()


def _run_ours(engine: Engine, ids, params, use_cache: bool, cancel=None, speculate=False):
    run_cancel = _Linked(cancel) if cancel is not None else None
    chunks = list(
        engine.complete(
            ids,
            params,
            use_cache=use_cache,
            reuse_prefix=False,
            cancel=run_cancel,
            speculate=speculate,
        )
    )
    if cancel is not None and cancel.is_set():
        raise BenchStopped()
    stats = chunks[-1].stats
    tokens = [i for c in chunks for i in c.token_ids]
    return tokens, stats.ttft_s, stats.total_s


def _run_hf(engine: Engine, ids, params):
    return engine.run_on_worker(_hf_generate, engine, ids, params)  # same thread as ours


def _hf_generate(engine: Engine, ids, params):
    model = engine.loaded.reference()  # the transformers reference, whatever the engine runs
    input_ids = torch.tensor([ids], device=model.device)
    timer = _FirstTokenTimer()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=params.max_new_tokens,
            top_k=None,
            top_p=None,
            temperature=None,
            streamer=timer,
            eos_token_id=sorted(engine.eos_ids),
        )
        total = time.perf_counter() - start
    tokens = [t for t in out[0, len(ids) :].tolist() if t not in engine.eos_ids]
    return tokens, (timer.first or start + total) - start, total


def _run_transformers_loop(engine: Engine, ids, params):
    """Our cached loop driving the transformers model (not the lean runner): what the lean
    forward pass gains, on the same loop."""

    def run():
        stats = GenerationStats()
        tokens = list(
            generate(engine.loaded.reference(), ids, params, eos_ids=engine.eos_ids, stats=stats)
        )
        return tokens, stats.ttft_s, stats.total_s

    return engine.run_on_worker(run)


def _run_lean(engine: Engine, ids, params, box: dict):
    """Our cached loop on the PyTorch lean forward pass (miniserve/runners/lean.py), prompt and
    decode steps alike, next to the engine's own runner: what the native forward pass gains.
    Built at first use (its own fused copy of the weights, activations in the model's dtype)."""

    def run():
        if "model" not in box:
            box["model"] = LeanRunner(engine.loaded.reference())
        stats = GenerationStats()
        tokens = list(generate(box["model"], ids, params, eos_ids=engine.eos_ids, stats=stats))
        return tokens, stats.ttft_s, stats.total_s

    return engine.run_on_worker(run)


def _measure(
    engine: Engine, config: BenchConfig, modes: list[str], runners: dict, progress: Progress
) -> list[tuple[list[int], dict]]:
    """[(prompt ids, {mode: [(tokens, ttft_s, total_s) per repeat]}) per prompt length]."""
    warm = prompt_of_length(engine.tokenizer, 8)
    for mode in modes:  # first calls pay one-off costs; keep them out of the numbers
        progress(0.0, f"warming up {mode}")
        runners[mode](warm)
    measured = []
    total_runs = len(config.prompt_tokens) * len(modes) * config.repeat
    done = 0
    for n in config.prompt_tokens:
        ids = prompt_of_length(engine.tokenizer, min(n, engine.context_length - config.new_tokens))
        results = {}
        for mode in modes:
            runs = []
            for r in range(config.repeat):
                progress(
                    done / total_runs, f"{n} prompt tokens, {mode}, run {r + 1}/{config.repeat}"
                )
                runs.append(runners[mode](ids))
                done += 1
            results[mode] = runs
        measured.append((ids, results))
    return measured


def weights_label(engine: Engine) -> str:
    """What the engine's matrices are: a GGUF's types as stored ("q4_k_m as stored"), the blocks
    a float model was quantized to at load ("q8_0 from bfloat16"), "bfloat16+int8" (activations
    + weights, the lean runner), or the float dtype."""
    dtype = str(engine.loaded.dtype).removeprefix("torch.")
    if engine.quant == "int8":
        return f"{dtype}+int8"
    if engine.loaded.stored:
        return engine.info()["dtype"]
    return f"{engine.quant} from {dtype}" if engine.quant else dtype


def run_bench(
    engine: Engine,
    config: BenchConfig,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> BenchResult:
    """Every mode at every prompt length. `cancel`, once set, ends it with BenchStopped: our
    own runs at their next step, the others (transformers, llama.cpp) at their end."""
    progress = stoppable(progress or (lambda f, m: None), cancel)
    if not engine.capabilities.local_tokens:
        return run_remote_bench(engine, config, progress)
    params = BUILTIN_PRESETS[GREEDY].replace(max_new_tokens=config.new_tokens)
    dtype = str(engine.loaded.dtype).removeprefix("torch.")  # the reference modes' weights
    ours = weights_label(engine)
    dtypes = {
        "no_cache": ours,
        "cache": ours,
        "cache+json_schema": ours,
        "hf_generate": dtype,
        "transformers_loop": dtype,
        "lean": dtype,
    }
    schema_params = params.replace(constraint=Constraint("json_schema", json.dumps(BENCH_SCHEMA)))
    lean_box: dict = {}  # the PyTorch lean model of the `lean` mode, built at its first run
    runners = {
        "no_cache": lambda ids: _run_ours(engine, ids, params, False, cancel),
        "cache": lambda ids: _run_ours(engine, ids, params, True, cancel, config.speculate),
        "cache+json_schema": lambda ids: _run_ours(
            engine, ids, schema_params, True, cancel, config.speculate
        ),
        "hf_generate": lambda ids: _run_hf(engine, ids, params),
        "transformers_loop": lambda ids: _run_transformers_loop(engine, ids, params),
        "lean": lambda ids: _run_lean(engine, ids, params, lean_box),
    }
    nbytes = {
        m: (
            engine.runner
            if m in ("no_cache", "cache", "cache+json_schema")
            else TransformersRunner(engine.loaded.reference())
        ).weight_bytes()
        for m in config.modes
    }
    modes = list(config.modes)
    # the error bound of each mode's logits: the engine's runner's own (bfloat16 products on
    # the native runner), else the arithmetic of the model's dtype
    ours_bound, reference_bound = runner_bound(engine.runner), bound_for(engine.loaded.dtype)
    bounds = {
        "no_cache": ours_bound,
        "cache": ours_bound,
        "hf_generate": reference_bound,
        "transformers_loop": reference_bound,
        "lean": reference_bound,
    }
    peers = []
    if config.peer:  # llama.cpp: its own weights (a copy per precision), so not checked
        peer_runners, peer_dtypes, peer_bytes, peers = peer_rows.peer_runners(
            engine, config, progress
        )
        runners.update(peer_runners)
        dtypes.update(peer_dtypes)
        nbytes.update(peer_bytes)
        modes += list(peer_runners)
    try:
        measured = _measure(engine, config, modes, runners, progress)
    finally:
        for p in peers:  # the llama.cpp processes end with the measurements
            p.close()
    checked = {  # the rows whose tokens are checked, with their bounds
        mode: bounds[mode]
        for mode in modes
        if mode in bounds and not (engine.quant and mode in ("cache", "no_cache"))
    }
    check = TokenCheck(engine, config.new_tokens) if config.check else None
    if check:
        for prompt_ids, results in measured:
            for mode in checked:
                for r in results[mode]:
                    check.add(prompt_ids, r[0])
        check.run(progress)
    rows = []
    for prompt_ids, results in measured:
        first = results[modes[0]][0][0]
        base_total = None
        for mode in modes:
            runs = results[mode]
            tokens = runs[0][0]
            agree = common_prefix(tokens, first)
            verified = None  # llama.cpp (its own weights) and int8 weights: not checked
            if check and mode in checked:
                verified = check.verdict([(prompt_ids, r[0]) for r in runs], checked[mode])
            ttft = statistics.median(r[1] for r in runs)
            total = statistics.median(r[2] for r in runs)
            decode_tps = statistics.median(
                (len(r[0]) - 1) / (r[2] - r[1]) if len(r[0]) > 1 and r[2] > r[1] else 0.0
                for r in runs
            )
            if mode == "no_cache":
                base_total = total
            rows.append(
                Row(
                    len(prompt_ids),
                    mode,
                    dtypes[mode],
                    len(tokens),
                    round(ttft, 4),
                    round(decode_tps, 2),
                    round(total, 4),
                    round(base_total / total, 2) if base_total else None,
                    round(nbytes[mode] * decode_tps / 1e9, 2),
                    all(r[0] == first for r in runs),
                    agree,
                    verified,
                )
            )
    progress(1.0, "done")
    note = (
        "ours computes in float32 over the bfloat16 weights, generate() in bfloat16"
        if mixed_precision(engine)
        else ""
    )
    ours_rows = [r for r in rows if r.mode in bounds]  # not llama.cpp's
    return BenchResult(
        rows,
        all(r.tokens_match for r in ours_rows),
        all(r.verified is not False for r in rows),
        engine.name,
        engine.loaded.device.type,
        ours,
        note=note,
        runner=engine.runner_name,
        native_isa=(native.kernels_label() or "") if engine.runner_name == "native" else "",
        cpu=cpu_model(),
        check=check.name if check else "greedy tokens not checked (--no-check)",
        check_rule=check.rule() if check else "",
    )


def mixed_precision(engine: Engine) -> bool:
    return engine.runner.act_dtype != engine.loaded.dtype


def clear_prefix_cache(engine) -> None:
    """Empty the engine's prefix cache, on the engine thread (which reads it between steps),
    so that the next run finds nothing of an earlier one's prompts."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is not None:
        engine.run_on_worker(cache.clear)


def prefix_reuse(engine: Engine, history_tokens: int = 1500, repeat: int = 3) -> dict:
    """Time to first token of a follow-up turn after ~`history_tokens` of conversation, with
    the KV cache of the shared prefix reused (warm) vs computed from scratch (cold)."""
    params = SamplingParams(temperature=0, max_new_tokens=8)
    filler = FILLER * (history_tokens // 50 + 1)
    words = filler.split()
    history = []
    while (
        len(engine.chat_prompt(history + [{"role": "user", "content": "x"}], params))
        < history_tokens
    ):
        history += [
            {"role": "user", "content": " ".join(words[:60])},
            {"role": "assistant", "content": " ".join(words[60:120])},
        ]
    question = {"role": "user", "content": "Summarise our talk in one line."}
    warm, cold = [], []
    for _ in range(repeat):
        clear_prefix_cache(engine)
        first = history + [{"role": "user", "content": "What did I say first?"}]
        reply, _ = engine.chat_text(first, params)  # this turn fills the cache
        follow = first + [{"role": "assistant", "content": reply}, question]
        _, hit = engine.chat_text(follow, params)
        _, miss = engine.chat_text(follow, params, reuse_prefix=False)
        warm.append(hit.stats)
        cold.append(miss.stats)
    warm_ttft = statistics.median(s.ttft_s for s in warm)
    cold_ttft = statistics.median(s.ttft_s for s in cold)
    return {
        "prompt_tokens": warm[0].prompt_tokens,
        "reused_tokens": warm[0].reused_tokens,
        "ttft_warm_s": round(warm_ttft, 4),
        "ttft_cold_s": round(cold_ttft, 4),
        "speedup": round(cold_ttft / warm_ttft, 1),
    }
