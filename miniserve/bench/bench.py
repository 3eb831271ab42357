"""Cache vs no-cache vs transformers' generate(), side by side in one run; and B streams at
once (`run_concurrency`): aggregate and per-stream speed, latency, and the share of what this
machine's memory and arithmetic allow.

Shared by `python -m miniserve bench` and the web app's Benchmark tab. Greedy decoding
throughout: a benchmark of wrong answers is worthless, so the tokens of every mode that runs
these weights are checked (`TokenCheck`) against a reference holding them, each token within
the error bound of its arithmetic of the reference's best (miniserve/runners/verify.py). For a
GGUF run as stored the reference is a float64 pass over the file's blocks, dequantized a tensor
at a time (miniserve/runners/float64.py): no copy of the model is written or held; for a
transformers model it is the float32 model itself. llama.cpp and int8 weights are other
weights, so not checked. The modes compute with different kernels, so their tokens may part at
a near-tie; the result shows where.
"""

from __future__ import annotations

import copy
import csv
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import torch

from miniserve.bench import peer
from miniserve.core.config import (
    BUILTIN_PRESETS,
    GREEDY,
    MAX_NEW_TOKENS,
    MAX_QUEUE,
    Constraint,
    SamplingParams,
    load_presets,
    with_builtins,
)
from miniserve.core.platform import cpu_model, rss_mb
from miniserve.engine.decode import GenerationStats, generate
from miniserve.engine.engine import Engine, common_prefix
from miniserve.runners import native
from miniserve.runners.float64 import Float64Reference
from miniserve.runners.hf import TransformersRunner
from miniserve.runners.lean import LeanRunner
from miniserve.runners.loader import resolve_source
from miniserve.runners.verify import (
    BOUND_STORED,
    GreedyCheck,
    bound_for,
    check_greedy,
    last_logits,
    runner_bound,
)

# The benchmarks' limits, checked by their configs and by the CLI (concurrency levels: the
# engine's queue, config.MAX_QUEUE).
MAX_PROMPT_TOKENS = 32768
REPEAT = range(1, 21)  # runs per row

MODES = ("no_cache", "cache", "cache+json_schema", "hf_generate", "transformers_loop", "lean")
DEFAULT_MODES = ("no_cache", "cache", "cache+json_schema", "hf_generate")
# cache+json_schema: the cached loop with the grammar stage on, under a schema that cannot end
# before the token budget (a string of at least this many characters): what each step's mask
# costs. Its tokens follow the schema, so they are not checked against the free reference.
CONSTRAINED_MODES = ("cache+json_schema",)
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 100000}},
    "required": ["text"],
}
FILLER = (
    "The history of science is the study of the development of science and scientific "
    "knowledge, including both the natural and social sciences. Science is a body of "
    "empirical, theoretical, and practical knowledge about the natural world, produced by "
    "scientists who emphasize the observation, explanation, and prediction of real-world "
    "phenomena. "
)

Progress = Callable[[float, str], None]
T = TypeVar("T")


def check_repeat(repeat) -> None:
    if repeat not in REPEAT:
        raise ValueError(f"repeat must be from {REPEAT.start} to {REPEAT.stop - 1}, got {repeat}")


@dataclass
class BenchConfig:
    prompt_tokens: list[int] = field(default_factory=lambda: [64, 256, 1024])
    new_tokens: int = 64
    repeat: int = 3
    modes: tuple[str, ...] = DEFAULT_MODES
    peer: bool = False  # also llama.cpp (f32, bf16, the file's own type) on its weights
    check: bool = True  # check our tokens against the reference (TokenCheck)

    def __post_init__(self):
        if not self.prompt_tokens or any(
            not 1 <= n <= MAX_PROMPT_TOKENS for n in self.prompt_tokens
        ):
            raise ValueError(f"prompt lengths must be whole numbers from 1 to {MAX_PROMPT_TOKENS}")
        if not 2 <= self.new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(
                f"new tokens must be from 2 to {MAX_NEW_TOKENS}, got {self.new_tokens}"
            )
        check_repeat(self.repeat)
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(
                f"unknown mode {', '.join(unknown) or '(none)'}; choose from {', '.join(MODES)}"
            )


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
    tokens_match: bool  # the same tokens as the first mode's
    agree_tokens: int  # how many leading tokens are the first mode's
    verified: bool | None  # follows the reference (None: other weights, or not checked)


@dataclass
class BenchResult:
    rows: list[Row]
    greedy_match: bool  # all our modes (not llama.cpp) gave the same tokens
    tokens_verified: bool  # every checked row follows the reference (llama.cpp and int8
    # weights are not checked: other weights)
    model: str
    device: str
    dtype: str
    prefix_reuse: dict | None = None
    note: str = ""
    runner: str = ""  # what ran our rows: native, lean or transformers
    native_isa: str = ""  # what the native kernels were compiled for, when they ran
    cpu: str = ""
    check: str = ""  # what the tokens were checked against; or the line saying why they were not
    check_rule: str = ""  # the check's rule, what it found and what it cost


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


def _peer_runners(engine: Engine, config: BenchConfig, progress: Progress):
    """llama.cpp rows, keyed by mode, with their dtype and weight bytes; and the peer
    processes, for the caller to close."""
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
        label = (peer.file_type(path) or "file") if precision == "file" else precision
        mode = f"llamacpp_{label}"
        runners[mode] = (lambda m: lambda ids: m.run(ids, config.new_tokens, engine.eos_ids))(model)
        dtypes[mode] = label if label != "file" else "as stored"
        nbytes[mode] = model.weight_bytes()  # the file: weights as stored, read once a token
    return runners, dtypes, nbytes, peers


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


def run_bench(engine: Engine, config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    progress = progress or (lambda f, m: None)
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
        "no_cache": lambda ids: _run_ours(engine, ids, params, False),
        "cache": lambda ids: _run_ours(engine, ids, params, True),
        "cache+json_schema": lambda ids: _run_ours(engine, ids, schema_params, True),
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


# -- a remote model (miniserve/models/remote.py) ----------------------------------------------
# Its weights are on its server: no-cache, generate(), the other runners and the token check
# cannot run here. What can: our streaming loop through the server, timed at this client.

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


def available_memory() -> int | None:
    """Bytes this machine can give a process now without swapping (MemAvailable; psutil's
    estimate where /proc is missing); None where neither says."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


class TokenCheck:
    """Do our greedy tokens follow a reference holding the engine's weights, within the error
    bound of the arithmetic that chose them?

    The rule (miniserve/runners/verify.py's check_greedy), teacher-forced: one reference pass
    over prompt + a reply's own tokens gives the logits each step should have seen. A step is
    decided where the reference's top two logits differ by more than 2 x the row's error bound
    (bounds 3.0 for weights as stored, 1e-3 for float32 arithmetic); there the reply must have
    chosen the reference's top token. Elsewhere (a near-tie) it may have chosen any token
    within 2 x the bound of the top, and the later steps are checked on the path it took. A
    reply that stopped early is checked for choosing an end token at its last step.

    The reference: for a GGUF run as stored, a float64 pass over the file's blocks dequantized
    a tensor at a time (Float64Reference), every reply of the run in one pass, so each layer is
    dequantized once; nothing is written, and what it holds at once is estimated first: where
    that is more than the memory available, the check is skipped and says so. For a
    transformers model, the model itself in float32 (a float32 copy in memory for bfloat16
    weights), one pass per reply.

    add() each reply, run() once, then verdict() per row; each distinct reply is computed
    once (the repeats of a mode, and the modes that agree, give the same tokens)."""

    def __init__(self, engine: Engine, new_tokens: int):
        self.engine, self.new_tokens = engine, new_tokens
        self.stored = engine.loaded.stored
        self.replies: dict[tuple, None] = {}  # (prompt ids, tokens), in order
        self.rows: dict[tuple, torch.Tensor] = {}  # their reference logits
        self.skipped = ""  # why the check did not run
        self.results: dict[tuple, GreedyCheck] = {}
        self.seconds = 0.0
        self.peak_bytes = 0

    def _ends(self, tokens) -> tuple:
        """A shorter reply stopped on an end token (which is not recorded)."""
        return () if len(tokens) >= self.new_tokens else tuple(self.engine.eos_ids)

    def add(self, prompt_ids, tokens) -> None:
        self.replies.setdefault((tuple(prompt_ids), tuple(tokens)), None)

    def run(self, progress: Progress | None = None) -> None:
        progress = progress or (lambda f, m: None)
        todo = [key for key in self.replies if key not in self.rows]
        todo = [key for key in todo if key[1] or self._ends(key[1])]  # nothing to check else
        if not todo:
            return
        start = time.perf_counter()
        if self.stored:
            reference = Float64Reference(self.engine.loaded.model)
            lengths = [len(p) + len(t) for p, t in todo]
            last = [len(t) + 1 for _, t in todo]  # row i chose t[i]; the last, an end token
            self.peak_bytes = reference.peak_bytes(lengths, last)
            free = available_memory()
            if free is not None and self.peak_bytes > free:
                self.skipped = (
                    "greedy tokens not checked: the float64 reference over the file's blocks "
                    f"would hold about {_gb(self.peak_bytes)} at once and "
                    f"{_gb(free)} is available"
                )
                progress(1.0, self.skipped)
                return
            progress(
                1.0,
                f"checking the tokens: a float64 pass over the file's blocks "
                f"({sum(lengths)} positions)",
            )
            rows = reference.logits_many([list(p) + list(t) for p, t in todo], last)
            for key, r in zip(todo, rows):
                self.rows[key] = torch.from_numpy(r)
        else:
            progress(1.0, "checking the tokens against the float32 reference")
            model = self.engine.loaded.reference()
            if model.dtype != torch.float32:
                model = copy.deepcopy(model).float()
            for p, t in todo:
                self.rows[(p, t)] = last_logits(model, list(p) + list(t), len(t) + 1)
        self.seconds += time.perf_counter() - start

    def result(self, prompt_ids, tokens, bound: float) -> GreedyCheck | None:
        """The check of one reply at this bound; None where it was not computed."""
        key = (tuple(prompt_ids), tuple(tokens))
        ends = self._ends(tokens)
        if not tokens and not ends:
            return GreedyCheck()
        if key not in self.rows:
            return None
        if (key, bound) not in self.results:
            self.results[(key, bound)] = check_greedy(self.rows[key], list(tokens), bound, ends)
        return self.results[(key, bound)]

    def verdict(self, replies, bound: float) -> bool | None:
        """Do all these replies follow the reference? None: not checked (skipped)."""
        checks = [self.result(p, t, bound) for p, t in replies]
        if any(c is None for c in checks):
            return None
        return all(c.ok for c in checks)

    @property
    def name(self) -> str:
        """What the tokens are checked against; or, not checked, the line that says why."""
        if self.skipped:
            return self.skipped
        return "float64 reference over the file's blocks" if self.stored else "float32 reference"

    def rule(self) -> str:
        """The rule, and what this run's check found and cost."""
        if self.skipped:
            return ""
        counts: dict[float, list[int]] = {}  # bound -> [decided, steps] over the checks
        for (_, bound), c in self.results.items():
            n = counts.setdefault(bound, [0, 0])
            n[0], n[1] = n[0] + c.decided, n[1] + c.steps
        found = ", ".join(
            f"{d} of {n} at bound {b:g}" + (" (as stored)" if b == BOUND_STORED else "")
            for b, (d, n) in sorted(counts.items(), reverse=True)
        )
        top = [  # the distinct replies' tokens that are the reference's top token
            (int((rows[: len(t)].argmax(-1) == torch.tensor(t)).sum()), len(t))
            for (_, t), rows in self.rows.items()
        ]
        if top:
            found += (
                f"; the reference's top token at {sum(a for a, _ in top)} of "
                f"{sum(n for _, n in top)} steps"
            )
        cost = f"{self.seconds:.1f} s" + (
            f", about {_gb(self.peak_bytes)} held, nothing written" if self.stored else ""
        )
        return (
            "teacher-forced; a step is decided where the reference's top two logits differ by "
            "more than 2 x the row's error bound, and elsewhere any token that close to the "
            f"top counts; steps decided: {found or 'none checked'}; {cost}"
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


def format_table(result: BenchResult) -> str:
    head = (
        "prompt_tokens",
        "mode",
        "dtype",
        "new_tokens",
        "ttft_s",
        "decode_tok/s",
        "total_s",
        "speedup",
        "GB/s",
        "tokens",
    )
    lines = [" ".join(f"{h:>13}" for h in head)]
    for r in result.rows:
        cells = (
            r.prompt_tokens,
            r.mode,
            r.dtype,
            r.new_tokens,
            f"{r.ttft_s:.3f}",
            f"{r.decode_tokens_per_s:.1f}",
            f"{r.total_s:.2f}",
            f"{r.speedup_vs_no_cache:.2f}x" if r.speedup_vs_no_cache else "-",
            f"{r.effective_gb_s:.1f}" if r.mode != REMOTE_MODE else "-",
            {True: "checked", False: "WRONG", None: "-"}[r.verified],
        )
        lines.append(" ".join(f"{c:>13}" for c in cells))
    lines.append(describe_run(result))
    return "\n".join(lines)


def describe_run(result: BenchResult) -> str:
    """What ran, where, and whether its tokens are right: the line under every table."""
    if result.runner == "remote":
        return f"{result.model}: {result.note}"
    return (
        f"{result.model} on {result.device} ({result.dtype}, {result.runner} runner"
        + (f", {result.native_isa} kernels" if result.native_isa else "")
        + (f"; {result.cpu}" if result.cpu else "")
        + f"); {verdict(result)}"
    )


def verdict(result: BenchResult) -> str:
    """One sentence on the tokens: checked against the reference, and alike across modes."""
    reference = result.check or "float32 reference"
    rule = f" ({result.check_rule})" if result.check_rule else ""
    if reference.startswith("greedy tokens not checked"):
        checked = reference
    elif result.tokens_verified:
        checked = f"the checked rows' greedy tokens follow the {reference}: yes{rule}"
    else:
        checked = f"greedy tokens follow the {reference}: NO -- a mode computes wrong logits{rule}"
    if "int8" in result.dtype:
        alike = (
            "the int8 rows run rounded weights, so their tokens differ from the float "
            "reference as expected and are not checked (BENCHMARKS.md has the agreement)"
        )
    elif result.greedy_match:
        alike = "identical across modes" + (
            " (the json_schema rows follow their schema)"
            if any(r.mode in CONSTRAINED_MODES for r in result.rows)
            else ""
        )
    else:
        parted = min(
            r.agree_tokens
            for r in result.rows
            if r.mode in MODES and r.mode not in CONSTRAINED_MODES
        )
        alike = (
            f"the modes part at a near-tie after {parted} token{'s' if parted != 1 else ''} "
            "(other kernels, other rounding)"
        )
    note = f"; {result.note}" if result.note else ""
    return f"{checked}; {alike}{note}"


def to_dict(result: BenchResult | ConcurrencyResult) -> dict:
    if isinstance(result, ConcurrencyResult):
        return {
            "model": result.model,
            "device": result.device,
            "dtype": result.dtype,
            "runner": result.runner,
            "math": result.math,
            "native_isa": result.native_isa,
            "cpu": result.cpu,
            "prompt_tokens": result.prompt_tokens,
            "new_tokens": result.new_tokens,
            "ceiling": result.ceiling,
            "note": result.note,
            "rows": [asdict(r) for r in result.rows],
        }
    return {
        "model": result.model,
        "device": result.device,
        "dtype": result.dtype,
        "runner": result.runner,
        "native_isa": result.native_isa,
        "cpu": result.cpu,
        "greedy_match": result.greedy_match,
        "tokens_verified": result.tokens_verified,
        "check": result.check,
        "check_rule": result.check_rule,
        "note": result.note,
        "rows": [asdict(r) for r in result.rows],
        "prefix_reuse": result.prefix_reuse,
    }


def write_json(result: BenchResult | ConcurrencyResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_dict(result), f, indent=2)


def write_csv(result: BenchResult | ConcurrencyResult, path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(result.rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in result.rows)


# -- concurrency: B streams at once ------------------------------------------------------------
# B callers submit at the same moment (a barrier), each with its own prompt of the same length
# and its own seed, and read their replies as chunks arrive. From the arrival times: aggregate
# tokens/s (every stream's new tokens over the wall time from the first submit to the last
# finish), each stream's decode rate, time to first token and the gaps between tokens. The
# ceiling -- what B rows a step could reach at most on this machine -- is measured in the same
# run, so the share of it is the engine's, not the machine's.


@dataclass
class ConcurrencyConfig:
    levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    prompt_tokens: int = 64
    new_tokens: int = 128
    presets: tuple[str, ...] = (GREEDY, "balanced")
    repeat: int = 1
    peer: bool = False  # also llama.cpp decoding the same B greedy streams batched
    presets_file: str | None = None  # where `presets` are defined, when no table is given

    def __post_init__(self):
        low, high = int(MAX_QUEUE.low), int(MAX_QUEUE.high)
        if not self.levels or any(
            not isinstance(b, int) or not low <= b <= high for b in self.levels
        ):
            raise ValueError(f"concurrency levels must be whole numbers from {low} to {high}")
        if not 2 <= self.prompt_tokens <= MAX_PROMPT_TOKENS:
            raise ValueError(
                f"prompt tokens must be from 2 to {MAX_PROMPT_TOKENS}, got {self.prompt_tokens}"
            )
        if not 2 <= self.new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(
                f"new tokens must be from 2 to {MAX_NEW_TOKENS}, got {self.new_tokens}"
            )
        check_repeat(self.repeat)
        if not self.presets:
            raise ValueError("name at least one preset")


@dataclass
class ConcurrencyRow:
    engine: str  # "miniserve", or "llama.cpp" (its own process, batched)
    preset: str
    concurrency: int  # B: streams submitted at once
    dtype: str  # weights (+ arithmetic where it differs)
    prompt_tokens: int  # each stream's prompt
    new_tokens: int  # asked of each stream
    produced_tokens: int  # what all streams of all repeats produced (an end token stops one)
    asked_tokens: int  # concurrency x new_tokens x repeats
    min_stream_tokens: int  # the fewest one stream produced
    wall_s: float  # first submit -> last finish (median over repeats)
    aggregate_tokens_per_s: float  # all streams' new tokens / wall_s (median over repeats)
    stream_decode_tokens_per_s: float  # one stream's tokens after its first / their time (median)
    ttft_p50_s: float  # submit -> first token arrived, over the streams
    ttft_p95_s: float
    itl_p95_s: float  # gaps between a stream's chunks, per token they carry
    ceiling_tokens_per_s: float | None  # min(B x bandwidth / weight bytes, GFLOPS / flops a token)
    ceiling_share: float | None  # aggregate / ceiling
    cpu: str
    native_isa: str
    kv_peak: int | None = None  # the most KV positions reserved at once (ours; budget apart)


@dataclass
class ConcurrencyResult:
    rows: list[ConcurrencyRow]
    model: str
    device: str
    dtype: str
    runner: str
    math: str  # the arithmetic of the matrix products
    cpu: str
    native_isa: str
    prompt_tokens: int
    new_tokens: int
    ceiling: dict = field(default_factory=dict)  # measured bandwidth, GFLOPS and how
    note: str = ""
    kv_budget: int | None = None  # the engine's, in positions
    rss_mb_before: float = 0.0  # this process's resident memory around the run
    rss_mb_after: float = 0.0


@dataclass
class StreamTimeline:
    """One stream's timeline: when it was submitted, (arrival, tokens it carries) per chunk,
    the end, and the CPU time of the thread that read it."""

    submit: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    end: float = 0.0
    cpu_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(k for _, k in self.arrivals)

    def first(self) -> tuple[float, int] | None:
        return next(((t, k) for t, k in self.arrivals if k), None)

    def ttft(self) -> float | None:
        first = self.first()
        return first[0] - self.submit if first else None

    def decode_rate(self) -> float | None:
        """Tokens after the first chunk's over the time from it to the last token's chunk."""
        first = self.first()
        if first is None:
            return None
        last = max(t for t, k in self.arrivals if k)
        later = self.tokens - first[1]
        return later / (last - first[0]) if later and last > first[0] else None

    def token_gaps(self) -> list[float]:
        """Each token after the first chunk: its chunk's gap from the previous one / the tokens
        the chunk carries (a chunk holds several ids while their text is incomplete). The
        inter-token latency of every report is a percentile of these."""
        gaps, previous = [], None
        for t, k in self.arrivals:
            if not k:
                continue
            if previous is not None:
                gaps += [(t - previous) / k] * k
            previous = t
        return gaps


def percentile(values, q: float, empty: float | None = 0.0) -> float | None:
    """The q-th percentile (0-100), interpolated linearly between the sorted values; `empty`
    when there are none."""
    xs = sorted(values)
    if not xs:
        return empty
    pos = (len(xs) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (pos - low)


def stream_prompt(tokenizer, n: int, index: int) -> list[int]:
    """Stream `index`'s prompt: exactly n tokens, "<index + 1>. " then the filler, so no two
    streams share a prompt (nor a cached prefix)."""
    lead = tokenizer(f"{index + 1}. ", add_special_tokens=False)["input_ids"]
    return (lead + prompt_of_length(tokenizer, n))[:n]


def concurrency_params(
    config: ConcurrencyConfig, presets: dict[str, SamplingParams] | None = None
) -> dict[str, SamplingParams]:
    """The presets to run, by name, asking for new_tokens with no stop strings: from `presets`
    (the table a caller has loaded, the web app's), else from config.presets_file (None: the
    default presets.yaml). `greedy` is built in unless the table defines it."""
    if presets is None:
        presets = load_presets(config.presets_file)
    presets = with_builtins(presets)
    unknown = [p for p in config.presets if p not in presets]
    if unknown:
        raise ValueError(f"unknown preset {', '.join(unknown)} (available: {', '.join(presets)})")
    return {
        name: presets[name].replace(max_new_tokens=config.new_tokens, stop=())
        for name in config.presets
    }


def at_once(
    count: int, one: Callable[[int, Callable[[], None]], T], name: str = "bench-stream"
) -> list[T]:
    """one(i, start) for i in range(count), each on a thread of its own: each calls start()
    when it is ready, and all go on from there together (a barrier). Their results in order;
    the first failure is re-raised -- the real one, not the broken barrier it left the others."""
    results: list = [None] * count
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            results[i] = one(i, barrier.wait)
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            errors.append(e)
            barrier.abort()

    threads = [
        threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True)
        for i in range(count)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return results


def run_streams(
    engine: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    reuse_prefix: bool = False,
) -> list[StreamTimeline]:
    """Submit every prompt at once from a thread each; time what comes back."""

    def one(i: int, start: Callable[[], None]) -> StreamTimeline:
        start()
        cpu = time.thread_time()
        stream = StreamTimeline(time.perf_counter())
        for chunk in engine.complete(prompts[i], params[i], reuse_prefix=reuse_prefix):
            stream.arrivals.append((time.perf_counter(), len(chunk.token_ids)))
        stream.end = time.perf_counter()
        stream.cpu_s = time.thread_time() - cpu
        return stream

    return at_once(len(prompts), one)


def _row(
    engine_name: str,
    preset: str,
    level: int,
    dtype: str,
    config: ConcurrencyConfig,
    runs: list[list[StreamTimeline]],
    ceiling: float | None,
    cpu: str,
    isa: str,
) -> ConcurrencyRow:
    streams = [s for run in runs for s in run]
    walls = [max(s.end for s in run) - min(s.submit for s in run) for run in runs]
    aggregates = [
        sum(s.tokens for s in run) / wall if wall > 0 else 0.0 for run, wall in zip(runs, walls)
    ]
    ttfts = [t for s in streams if (t := s.ttft()) is not None]
    rates = [r for s in streams if (r := s.decode_rate()) is not None]
    gaps = [g for s in streams for g in s.token_gaps()]
    aggregate = statistics.median(aggregates)
    return ConcurrencyRow(
        engine_name,
        preset,
        level,
        dtype,
        config.prompt_tokens,
        config.new_tokens,
        sum(s.tokens for s in streams),
        level * config.new_tokens * len(runs),
        min(s.tokens for s in streams),
        round(statistics.median(walls), 4),
        round(aggregate, 2),
        round(statistics.median(rates), 2) if rates else 0.0,
        round(percentile(ttfts, 50), 4),
        round(percentile(ttfts, 95), 4),
        round(percentile(gaps, 95), 5),
        round(ceiling, 1) if ceiling else None,
        round(aggregate / ceiling, 3) if ceiling else None,
        cpu,
        isa,
    )


def run_concurrency(
    engine: Engine,
    config: ConcurrencyConfig,
    progress: Progress | None = None,
    presets: dict[str, SamplingParams] | None = None,
) -> ConcurrencyResult:
    """Every preset at every concurrency level (and llama.cpp's greedy streams with `peer`),
    with the ceiling measured first; the presets from `presets` or config.presets_file (see
    concurrency_params). Raises ValueError for a level the engine's queue cannot hold or a
    preset that does not exist."""
    progress = progress or (lambda f, m: None)
    if not engine.capabilities.local_tokens:
        raise ValueError(
            f"bench --concurrency measures this machine's scheduler; model "
            f"'{engine.name}' runs on a remote server (bench without "
            "--concurrency times our streaming loop through it)"
        )
    params = concurrency_params(config, presets)
    too_many = [b for b in config.levels if b > engine.max_queue]
    if too_many:
        raise ValueError(
            f"concurrency {max(too_many)} is more than the engine admits at once "
            f"(--max-queue {engine.max_queue})"
        )
    if config.prompt_tokens + config.new_tokens > engine.context_length:
        raise ValueError(
            f"prompt tokens + new tokens ({config.prompt_tokens} + "
            f"{config.new_tokens}) exceed the context ({engine.context_length})"
        )
    cpu = cpu_model()
    isa = (native.kernels_label() or "") if engine.runner_name == "native" else ""
    info = engine.info()
    math = info.get("compute_dtype", "")
    weights = weights_label(engine)
    shown = weights if math in ("", weights) else f"{weights} ({math} math)"
    prompts = [
        stream_prompt(engine.tokenizer, config.prompt_tokens, i) for i in range(max(config.levels))
    ]

    scheduler = engine.scheduler
    rss_before = rss_mb()
    progress(0.0, "measuring bandwidth and GFLOPS on the largest weight matrix")
    ceiling = measure_ceiling(engine, math)
    peer_model, peer_dtype, peer_bytes = None, "", 0
    if config.peer:
        peer_model, peer_dtype, peer_bytes = _concurrency_peer(engine, config, progress)
    try:
        progress(0.0, "warming up")  # first passes at each width pay one-off costs
        warm = params[config.presets[0]].replace(max_new_tokens=4, seed=0)
        for level in sorted(set(config.levels)):
            run_streams(engine, prompts[:level], [warm] * level)
        if peer_model is not None:
            peer_model.run_batch(prompts[:1], 4, engine.eos_ids)
        rows = []
        jobs = [(p, b) for p in config.presets for b in config.levels]
        total = len(jobs) * config.repeat + (
            len(config.levels) * config.repeat if peer_model else 0
        )
        done = 0
        for preset, level in jobs:
            runs = []
            scheduler.peak_kv = 0
            for r in range(config.repeat):
                progress(done / total, f"{preset}, {level} at once, run {r + 1}/{config.repeat}")
                seeded = [params[preset].replace(seed=1000 + i) for i in range(level)]
                runs.append(run_streams(engine, prompts[:level], seeded))
                done += 1
            rows.append(
                _row(
                    "miniserve",
                    preset,
                    level,
                    shown,
                    config,
                    runs,
                    ceiling_tokens_per_s(ceiling, level),
                    cpu,
                    isa,
                )
            )
            rows[-1].kv_peak = scheduler.peak_kv
        if peer_model is not None:
            peer_ceiling = dict(ceiling, weight_bytes=peer_bytes) if ceiling else {}
            for level in config.levels:
                runs = []
                for r in range(config.repeat):
                    progress(
                        done / total, f"llama.cpp, {level} at once, run {r + 1}/{config.repeat}"
                    )
                    runs.append(
                        _peer_streams(
                            peer_model.run_batch(prompts[:level], config.new_tokens, engine.eos_ids)
                        )
                    )
                    done += 1
                rows.append(
                    _row(
                        "llama.cpp",
                        GREEDY,
                        level,
                        peer_dtype,
                        config,
                        runs,
                        ceiling_tokens_per_s(peer_ceiling, level),
                        cpu,
                        "",
                    )
                )
    finally:
        if peer_model is not None:
            peer_model.close()
    progress(1.0, "done")
    short = [r for r in rows if r.produced_tokens < r.asked_tokens]
    note = ""
    if short:
        note = "some streams ended on an end token before their new tokens: " + ", ".join(
            f"{r.engine} {r.preset} x{r.concurrency} produced "
            f"{r.produced_tokens} of {r.asked_tokens}"
            for r in short
        )
    return ConcurrencyResult(
        rows,
        engine.name,
        engine.loaded.device.type,
        weights,
        engine.runner_name,
        math,
        cpu,
        isa,
        config.prompt_tokens,
        config.new_tokens,
        ceiling,
        note,
        scheduler.kv_budget,
        round(rss_before, 1),
        round(rss_mb(), 1),
    )


def _peer_streams(reply: dict) -> list[StreamTimeline]:
    """llama.cpp's batch reply (seconds from its start) as stream timelines: every stream
    was submitted at 0, and each token arrives when the step that chose it ends."""
    return [StreamTimeline(0.0, [(t, 1) for t in s["times"]], s["end"]) for s in reply["streams"]]


def _concurrency_peer(engine: Engine, config: ConcurrencyConfig, progress: Progress):
    """llama.cpp in its own process on the engine's weights as a GGUF copy (bfloat16, or
    float32 when the engine runs float32 weights); (peer, dtype, weight bytes)."""
    if not peer.available():
        raise ValueError("--peer needs llama-cpp-python (`make bench-peer` installs it)")
    kind, path, _ = resolve_source(engine.loaded.source)
    if kind != "gguf":
        raise ValueError("--peer needs a .gguf model source")
    precision = "float32" if engine.loaded.dtype == torch.float32 else "bfloat16"
    progress(0.0, f"preparing llama.cpp {precision}")
    model = peer.LlamaCppPeer(peer.gguf_copy(path, precision), 0, torch.get_num_threads())
    return model, precision, model.weight_bytes()


# -- the ceiling ------------------------------------------------------------------------------

CEILING_BATCH = 64  # rows for the GFLOPS measurement: enough that arithmetic, not memory, limits


def largest_weight(runner) -> tuple[str, torch.Tensor] | None:
    """(name, tensor) of the runner's largest 2-D float weight matrix; None if it has none
    (int8 weights)."""
    if hasattr(runner, "layers") and hasattr(runner, "lm_head"):
        named = [("lm_head", runner.lm_head)] + [
            (f"layers[0].{k}", t) for k, t in (runner.layers[0].items() if runner.layers else ())
        ]
    else:
        named = list(getattr(runner, "model", runner).named_parameters())
    named = [
        (n, t)
        for n, t in named
        if isinstance(t, native.StoredMatrix)
        or (
            isinstance(t, torch.Tensor)
            and t.dim() == 2
            and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        )
    ]
    return max(named, key=lambda nt: nt[1].numel(), default=None)


def weight_elements(runner) -> int:
    """Weight elements read per decoded token: the tensors runner.weight_bytes() counts."""
    if hasattr(runner, "layers") and hasattr(runner, "lm_head"):
        tensors = [
            *(x for layer in runner.layers for x in layer.values()),
            runner.lm_head,
            getattr(runner, "final_norm", None),
        ]
        return sum((w.q if hasattr(w, "q") else w).numel() for w in tensors if w is not None)
    m = runner.model
    total = sum(p.numel() for p in m.parameters())
    embed = m.get_input_embeddings().weight
    out = m.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == embed.data_ptr()
    return total if tied else total - embed.numel()


def _bytes(w) -> int:
    return w.nbytes if isinstance(w, native.StoredMatrix) else w.numel() * w.element_size()


def _type_name(type_id: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(type_id).name


def product_kernel(
    w: torch.Tensor, math: str, use_native: bool
) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """(x (B, C) float32 -> w @ x.T as (B, R) float32, what computes it): the native matmul
    (the native runner's kernel) with `use_native`, else torch.matmul in the math dtype."""
    if use_native:
        if native.load() is None:
            raise RuntimeError(
                f"the native kernels are not available: {native.unavailable_reason()}"
            )
        return (lambda x: native.matmul(w, x, math)), "native.matmul"
    dtype = w.dtype if math != "float32" else torch.float32
    wt = w.to(dtype)
    label = f"torch.matmul ({str(dtype).removeprefix('torch.')})"
    return (lambda x: torch.matmul(x.to(dtype), wt.t()).float()), label


def _best_time(fn, budget_s: float = 0.4, min_reps: int = 3, max_reps: int = 200) -> float:
    fn()  # first call: page faults, thread pool start
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or (spent < budget_s and reps < max_reps):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, reps = min(best, took), spent + took, reps + 1
    return best


def measure_ceiling(engine: Engine, math: str = "") -> dict:
    """Memory bandwidth (one row through the largest weight matrix) and GFLOPS (CEILING_BATCH
    rows through it), measured on the engine thread with the kernel that would run them; the
    best of several runs. Empty when the runner has no float weight matrix."""
    runner = engine.runner
    found = largest_weight(runner)
    if found is None:
        return {}
    name, w = found
    math = math or engine.info().get("compute_dtype", "float32")

    def measure():
        product, label = product_kernel(w, math, engine.runner_name == "native")
        rows, cols = w.shape
        x1 = torch.randn(1, cols, dtype=torch.float32)
        xb = torch.randn(CEILING_BATCH, cols, dtype=torch.float32)
        with torch.inference_mode():
            t1 = _best_time(lambda: product(x1))
            tb = _best_time(lambda: product(xb))
        kind = (
            _type_name(w.type)
            if isinstance(w, native.StoredMatrix)
            else str(w.dtype).removeprefix("torch.")
        )
        return {
            "matrix": f"{name} ({rows}x{cols}, {kind})",
            "bandwidth_gb_s": round(_bytes(w) / t1 / 1e9, 2),
            "gflops": round(2 * rows * cols * CEILING_BATCH / tb / 1e9, 2),
            "gflops_rows": CEILING_BATCH,
            "method": f"{label} for the bandwidth and GFLOPS",
            "weight_bytes": runner.weight_bytes(),
            "weight_elements": weight_elements(runner),
            "math": math,
        }

    run = getattr(engine, "run_on_worker", None)
    return run(measure) if run else measure()


def ceiling_tokens_per_s(ceiling: dict, level: int) -> float | None:
    """min(B x bandwidth / weight bytes, GFLOPS / (2 x weight elements)): a step of B rows
    reads every weight once and does two flops per weight element and row."""
    if not ceiling:
        return None
    memory = level * ceiling["bandwidth_gb_s"] * 1e9 / ceiling["weight_bytes"]
    compute = ceiling["gflops"] * 1e9 / (2 * ceiling["weight_elements"])
    return min(memory, compute)


def format_concurrency_table(result: ConcurrencyResult) -> str:
    head = (
        "engine",
        "preset",
        "B",
        "tokens",
        "tok/s",
        "stream_tok/s",
        "ttft_p50",
        "ttft_p95",
        "itl_p95_ms",
        "ceiling",
        "share",
        "kv_peak",
    )
    widths = (10, 9, 4, 11, 9, 13, 9, 9, 11, 9, 7, 8)
    lines = [" ".join(f"{h:>{w}}" for h, w in zip(head, widths))]
    for r in result.rows:
        cells = (
            r.engine,
            r.preset,
            r.concurrency,
            f"{r.produced_tokens}/{r.asked_tokens}",
            f"{r.aggregate_tokens_per_s:.1f}",
            f"{r.stream_decode_tokens_per_s:.1f}",
            f"{r.ttft_p50_s:.3f}",
            f"{r.ttft_p95_s:.3f}",
            f"{r.itl_p95_s * 1000:.1f}",
            f"{r.ceiling_tokens_per_s:.0f}" if r.ceiling_tokens_per_s else "-",
            f"{r.ceiling_share:.0%}" if r.ceiling_share is not None else "-",
            r.kv_peak if r.kv_peak is not None else "-",
        )
        lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    lines.append(describe_concurrency(result))
    return "\n".join(lines)


def describe_concurrency(result: ConcurrencyResult) -> str:
    """The line under the concurrency table: what ran, on which CPU, and the ceiling."""
    c = result.ceiling
    ceiling = (
        f"ceiling from {c['bandwidth_gb_s']:g} GB/s and {c['gflops']:g} GFLOPS measured "
        f"on {c['matrix']} with {c['method']}"
        if c
        else "no ceiling (no float weight matrix to measure)"
    )
    math = f", {result.math} math" if result.math else ""
    return (
        f"{result.model} on {result.device} ({result.dtype} weights{math}, {result.runner} "
        f"runner"
        + (f", {result.native_isa} kernels" if result.native_isa else "")
        + f"; CPU: {result.cpu}); {result.prompt_tokens}-token prompts, "
        f"{result.new_tokens} new tokens a stream; {ceiling}"
        + (f"; KV budget {result.kv_budget} positions" if result.kv_budget else "")
        + f"; memory {result.rss_mb_before:.0f} -> {result.rss_mb_after:.0f} MB resident"
        + (f"; {result.note}" if result.note else "")
    )
