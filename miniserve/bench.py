"""Cache vs no-cache vs transformers' generate(), side by side in one run.

Shared by `python -m miniserve bench` and the web app's Benchmark tab. Greedy decoding
throughout: a benchmark of wrong answers is worthless, so the tokens of every mode that runs
these weights are checked against a float32 transformers model holding them
(miniserve/verify.py: each token within the error bound of its arithmetic of the reference's
best; llama.cpp and int8 weights are other weights, so not checked). The modes compute with
different kernels, so their tokens may part at a near-tie; the result shows where.
"""

from __future__ import annotations

import copy
import csv
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from miniserve import native
from miniserve.config import MAX_NEW_TOKENS, SamplingParams
from miniserve.engine import Engine, common_prefix
from miniserve.platform_info import cpu_model
from miniserve.runner import TransformersRunner
from miniserve.verify import bound_for, check_tokens

MODES = ("no_cache", "cache", "hf_generate", "transformers_loop", "lean")
DEFAULT_MODES = ("no_cache", "cache", "hf_generate")
FILLER = ("The history of science is the study of the development of science and scientific "
          "knowledge, including both the natural and social sciences. Science is a body of "
          "empirical, theoretical, and practical knowledge about the natural world, produced by "
          "scientists who emphasize the observation, explanation, and prediction of real-world "
          "phenomena. ")

Progress = Callable[[float, str], None]


@dataclass
class BenchConfig:
    prompt_tokens: list[int] = field(default_factory=lambda: [64, 256, 1024])
    new_tokens: int = 64
    repeat: int = 3
    modes: tuple[str, ...] = DEFAULT_MODES
    peer: bool = False  # also llama.cpp (f32, bf16, q4_1) on the same GGUF weights

    def __post_init__(self):
        if not self.prompt_tokens or any(n < 1 or n > 32768 for n in self.prompt_tokens):
            raise ValueError("prompt lengths must be whole numbers from 1 to 32768")
        if not 2 <= self.new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"new tokens must be from 2 to {MAX_NEW_TOKENS}, "
                             f"got {self.new_tokens}")
        if not 1 <= self.repeat <= 20:
            raise ValueError(f"repeat must be from 1 to 20, got {self.repeat}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"unknown mode {', '.join(unknown) or '(none)'}; "
                             f"choose from {', '.join(MODES)}")


@dataclass
class Row:
    prompt_tokens: int
    mode: str
    dtype: str
    new_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float
    speedup_vs_no_cache: float | None
    effective_gb_s: float  # weight bytes read per second while decoding
    tokens_match: bool     # the same tokens as the first mode's
    agree_tokens: int      # how many leading tokens are the first mode's
    verified: bool | None  # follows the float32 reference (None: other weights, not checked)


@dataclass
class BenchResult:
    rows: list[Row]
    greedy_match: bool     # all our modes (not llama.cpp) gave the same tokens
    tokens_verified: bool  # every checked row follows the float32 reference (llama.cpp
                           # and int8 weights are not checked: other weights)
    model: str
    device: str
    dtype: str
    prefix_reuse: dict | None = None
    note: str = ""
    runner: str = ""  # what ran our rows: native, lean or transformers
    native_isa: str = ""  # what the native step was compiled for, when it ran
    cpu: str = ""


def prompt_of_length(tokenizer, n: int) -> list[int]:
    ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]


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


def _run_ours(engine: Engine, ids, params, use_cache: bool):
    chunks = list(engine.complete(ids, params, use_cache=use_cache, reuse_prefix=False))
    stats = chunks[-1].stats
    tokens = [i for c in chunks for i in c.token_ids]
    return tokens, stats.ttft_s, stats.total_s


def _run_hf(engine: Engine, ids, params):
    return engine.run_on_worker(_hf_generate, engine, ids, params)  # same thread as ours


def _hf_generate(engine: Engine, ids, params):
    model = engine.loaded.model  # the transformers reference, whatever the engine runs
    input_ids = torch.tensor([ids], device=model.device)
    timer = _FirstTokenTimer()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             do_sample=False, max_new_tokens=params.max_new_tokens, top_k=None,
                             top_p=None, temperature=None, streamer=timer,
                             eos_token_id=sorted(engine.eos_ids))
        total = time.perf_counter() - start
    tokens = [t for t in out[0, len(ids):].tolist() if t not in engine.eos_ids]
    return tokens, (timer.first or start + total) - start, total


def _run_transformers_loop(engine: Engine, ids, params):
    """Our cached loop driving the transformers model (not the lean runner): what the lean
    forward pass gains, on the same loop."""
    from miniserve.decode import GenerationStats, generate

    def run():
        stats = GenerationStats()
        tokens = list(generate(engine.loaded.model, ids, params, eos_ids=engine.eos_ids,
                               stats=stats))
        return tokens, stats.ttft_s, stats.total_s

    return engine.run_on_worker(run)


def _run_lean(engine: Engine, ids, params, box: dict):
    """Our cached loop on the PyTorch lean forward pass (miniserve/lean.py), one-token steps
    included, next to the engine's own runner: what the native step gains. Built at first use
    (its own fused copy of the weights, activations in the model's dtype)."""
    from miniserve.decode import GenerationStats, generate
    from miniserve.lean import LeanModel

    def run():
        if "model" not in box:
            box["model"] = LeanModel(engine.loaded.model)
        stats = GenerationStats()
        tokens = list(generate(box["model"], ids, params, eos_ids=engine.eos_ids, stats=stats))
        return tokens, stats.ttft_s, stats.total_s

    return engine.run_on_worker(run)


def _peer_runners(engine: Engine, config: BenchConfig, progress: Progress):
    """llama.cpp rows, keyed by mode, with their dtype and weight bytes; and the peer
    processes, for the caller to close."""
    from miniserve import peer
    from miniserve.loader import resolve_source
    kind, path, _ = resolve_source(engine.loaded.source)
    if not peer.available():
        raise ValueError("--peer needs llama-cpp-python (`make bench-peer` installs it)")
    if kind != "gguf":
        raise ValueError("--peer needs a .gguf model source")
    n_ctx = max(config.prompt_tokens) + config.new_tokens + 16
    runners, dtypes, nbytes, peers = {}, {}, {}, []
    for precision in peer.PRECISIONS:
        progress(0.0, f"preparing llama.cpp {precision}")
        model = peer.LlamaCppPeer(peer.gguf_copy(path, precision), n_ctx, torch.get_num_threads())
        peers.append(model)
        mode = f"llamacpp_{precision}"
        runners[mode] = (lambda m: lambda ids: m.run(ids, config.new_tokens, engine.eos_ids))(model)
        dtypes[mode] = precision
        nbytes[mode] = model.weight_bytes()  # the file: weights as stored, read once a token
    return runners, dtypes, nbytes, peers


def _measure(engine: Engine, config: BenchConfig, modes: list[str], runners: dict,
             progress: Progress) -> list[tuple[list[int], dict]]:
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
                progress(done / total_runs, f"{n} prompt tokens, {mode}, run {r + 1}/{config.repeat}")
                runs.append(runners[mode](ids))
                done += 1
            results[mode] = runs
        measured.append((ids, results))
    return measured


def run_bench(engine: Engine, config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    progress = progress or (lambda f, m: None)
    params = SamplingParams(temperature=0, top_k=0, top_p=1.0, repetition_penalty=1.0,
                            max_new_tokens=config.new_tokens)
    dtype = str(engine.loaded.dtype).removeprefix("torch.")
    ours = f"{dtype}+int8" if engine.quant == "int8" else dtype  # activations+weights
    dtypes = {"no_cache": ours, "cache": ours, "hf_generate": dtype, "transformers_loop": dtype,
              "lean": dtype}
    lean_box: dict = {}  # the PyTorch lean model of the `lean` mode, built at its first run
    runners = {"no_cache": lambda ids: _run_ours(engine, ids, params, False),
               "cache": lambda ids: _run_ours(engine, ids, params, True),
               "hf_generate": lambda ids: _run_hf(engine, ids, params),
               "transformers_loop": lambda ids: _run_transformers_loop(engine, ids, params),
               "lean": lambda ids: _run_lean(engine, ids, params, lean_box)}
    nbytes = {m: (engine.model if m in ("no_cache", "cache") else
                  TransformersRunner(engine.loaded.model)).weight_bytes() for m in config.modes}
    modes = list(config.modes)
    arithmetic = {"no_cache": engine.model.act_dtype, "cache": engine.model.act_dtype,
                  "hf_generate": engine.loaded.dtype, "transformers_loop": engine.loaded.dtype,
                  "lean": engine.loaded.dtype}
    peers = []
    if config.peer:  # llama.cpp: its own weights (a copy per precision), so not checked
        peer_runners, peer_dtypes, peer_bytes, peers = _peer_runners(engine, config, progress)
        runners.update(peer_runners)
        dtypes.update(peer_dtypes)
        nbytes.update(peer_bytes)
        modes += list(peer_runners)
    try:
        measured = _measure(engine, config, modes, runners, progress)
    finally:
        for p in peers:  # the llama.cpp processes end with the measurements
            p.close()
    progress(1.0, "checking the tokens against the float32 reference")
    check = _token_checker(engine, config.new_tokens)
    rows = []
    for prompt_ids, results in measured:
        first = results[modes[0]][0][0]
        base_total = None
        for mode in modes:
            runs = results[mode]
            tokens = runs[0][0]
            agree = common_prefix(tokens, first)
            verified = None  # llama.cpp (its own weights) and int8 weights: not checked
            if mode in arithmetic and not (engine.quant and mode in ("cache", "no_cache")):
                verified = all(check(prompt_ids, r[0], arithmetic[mode]) for r in runs)
            ttft = statistics.median(r[1] for r in runs)
            total = statistics.median(r[2] for r in runs)
            decode_tps = statistics.median(
                (len(r[0]) - 1) / (r[2] - r[1]) if len(r[0]) > 1 and r[2] > r[1] else 0.0
                for r in runs)
            if mode == "no_cache":
                base_total = total
            rows.append(Row(len(prompt_ids), mode, dtypes[mode], len(tokens), round(ttft, 4),
                            round(decode_tps, 2), round(total, 4),
                            round(base_total / total, 2) if base_total else None,
                            round(nbytes[mode] * decode_tps / 1e9, 2),
                            all(r[0] == first for r in runs), agree, verified))
    progress(1.0, "done")
    note = ("ours computes in float32 over the bfloat16 weights, generate() in bfloat16"
            if mixed_precision(engine) else "")
    ours_rows = [r for r in rows if r.mode in arithmetic]  # not llama.cpp's
    return BenchResult(rows, all(r.tokens_match for r in ours_rows),
                       all(r.verified is not False for r in rows), engine.name,
                       engine.loaded.device.type, ours, note=note, runner=engine.runner,
                       native_isa=(native.isa() or "") if engine.runner == "native" else "",
                       cpu=cpu_model())


def _token_checker(engine: Engine, new_tokens: int):
    """check(prompt ids, greedy tokens, arithmetic dtype) -> do they follow a float32
    transformers model holding the engine's weights (a float32 copy for bfloat16 weights)?
    Each distinct reply is checked once (the repeats of a mode give the same tokens)."""
    model = engine.loaded.model
    if model.dtype != torch.float32:
        model = copy.deepcopy(model).float()
    seen = {}

    def check(prompt_ids, tokens, arithmetic) -> bool:
        key = (tuple(prompt_ids), tuple(tokens), arithmetic)
        if key not in seen:  # a shorter reply stopped on an end token (which is not recorded)
            ends = () if len(tokens) >= new_tokens else engine.eos_ids
            seen[key] = check_tokens(model, prompt_ids, tokens, bound_for(arithmetic), ends).ok
        return seen[key]

    return check


def mixed_precision(engine: Engine) -> bool:
    return engine.model.act_dtype != engine.loaded.dtype


def prefix_reuse(engine: Engine, history_tokens: int = 1500, repeat: int = 3) -> dict:
    """Time to first token of a follow-up turn after ~`history_tokens` of conversation, with
    the KV cache of the shared prefix reused (warm) vs computed from scratch (cold)."""
    params = SamplingParams(temperature=0, max_new_tokens=8)
    filler = FILLER * (history_tokens // 50 + 1)
    words = filler.split()
    history = []
    while len(engine.chat_prompt(history + [{"role": "user", "content": "x"}], params)) \
            < history_tokens:
        history += [{"role": "user", "content": " ".join(words[:60])},
                    {"role": "assistant", "content": " ".join(words[60:120])}]
    question = {"role": "user", "content": "Summarise our talk in one line."}
    warm, cold = [], []
    for _ in range(repeat):
        engine.prefix_cache.clear()
        first = history + [{"role": "user", "content": "What did I say first?"}]
        reply, _ = engine.chat_text(first, params)  # this turn fills the cache
        follow = first + [{"role": "assistant", "content": reply}, question]
        _, hit = engine.chat_text(follow, params)
        _, miss = engine.chat_text(follow, params, reuse_prefix=False)
        warm.append(hit.stats)
        cold.append(miss.stats)
    warm_ttft = statistics.median(s.ttft_s for s in warm)
    cold_ttft = statistics.median(s.ttft_s for s in cold)
    return {"prompt_tokens": warm[0].prompt_tokens, "reused_tokens": warm[0].reused_tokens,
            "ttft_warm_s": round(warm_ttft, 4), "ttft_cold_s": round(cold_ttft, 4),
            "speedup": round(cold_ttft / warm_ttft, 1)}


def format_table(result: BenchResult) -> str:
    head = ("prompt_tokens", "mode", "dtype", "new_tokens", "ttft_s", "decode_tok/s", "total_s",
            "speedup", "GB/s", "tokens")
    lines = [" ".join(f"{h:>13}" for h in head)]
    for r in result.rows:
        cells = (r.prompt_tokens, r.mode, r.dtype, r.new_tokens, f"{r.ttft_s:.3f}",
                 f"{r.decode_tokens_per_s:.1f}", f"{r.total_s:.2f}",
                 f"{r.speedup_vs_no_cache:.2f}x" if r.speedup_vs_no_cache else "-",
                 f"{r.effective_gb_s:.1f}",
                 {True: "checked", False: "WRONG", None: "-"}[r.verified])
        lines.append(" ".join(f"{c:>13}" for c in cells))
    lines.append(describe_run(result))
    return "\n".join(lines)


def describe_run(result: BenchResult) -> str:
    """What ran, where, and whether its tokens are right: the line under every table."""
    return (f"{result.model} on {result.device} ({result.dtype}, {result.runner} runner"
            + (f", {result.native_isa} kernels" if result.native_isa else "")
            + (f"; {result.cpu}" if result.cpu else "") + f"); {verdict(result)}")


def verdict(result: BenchResult) -> str:
    """One sentence on the tokens: checked against the reference, and alike across modes."""
    checked = ("the checked rows' greedy tokens follow the float32 reference: yes"
               if result.tokens_verified else
               "greedy tokens follow the float32 reference: NO -- a mode computes wrong logits")
    if "int8" in result.dtype:
        alike = ("the int8 rows run rounded weights, so their tokens differ from the float "
                 "reference as expected and are not checked (BENCHMARKS.md has the agreement)")
    elif result.greedy_match:
        alike = "identical across modes"
    else:
        parted = min(r.agree_tokens for r in result.rows if r.mode in MODES)
        alike = (f"the modes part at a near-tie after {parted} tokens (other kernels, other "
                 "rounding)")
    note = f"; {result.note}" if result.note else ""
    return f"{checked}; {alike}{note}"


def to_dict(result: BenchResult) -> dict:
    return {"model": result.model, "device": result.device, "dtype": result.dtype,
            "runner": result.runner, "native_isa": result.native_isa, "cpu": result.cpu,
            "greedy_match": result.greedy_match, "tokens_verified": result.tokens_verified,
            "note": result.note,
            "rows": [asdict(r) for r in result.rows], "prefix_reuse": result.prefix_reuse}


def write_json(result: BenchResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(result), f, indent=2)


def write_csv(result: BenchResult, path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(result.rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in result.rows)
