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

The benchmark's entry: its names, from the modules that do each job --

    options.py      the modes, limits and configs, and their checks
    results.py      the rows and results the runs produce
    prompts.py      the filler prompts, cut to a number of tokens
    runs.py         running the engine's modes and timing them (run_bench, prefix_reuse)
    check.py        the token check against the reference (TokenCheck)
    remote.py       the benchmark of a remote model
    streams.py      streams at once and their timelines
    concurrency.py  B streams at once per preset and level (run_concurrency)
    machine.py      memory available, and the bandwidth and GFLOPS ceiling
    peer_rows.py    llama.cpp's rows (peer.py runs it in its own process)
    report.py       the tables, the line under each, JSON and CSV
"""

from __future__ import annotations

from miniserve.bench.check import TokenCheck
from miniserve.bench.concurrency import run_concurrency
from miniserve.bench.machine import (
    CEILING_BATCH,
    available_memory,
    ceiling_tokens_per_s,
    largest_weight,
    measure_ceiling,
    product_kernel,
    weight_elements,
)
from miniserve.bench.options import (
    BENCH_SCHEMA,
    CONSTRAINED_MODES,
    DEFAULT_MODES,
    MAX_PROMPT_TOKENS,
    MODES,
    REPEAT,
    BenchConfig,
    BenchStopped,
    ConcurrencyConfig,
    Progress,
    check_repeat,
    concurrency_params,
)
from miniserve.bench.prompts import FILLER, prompt_of_length, stream_prompt
from miniserve.bench.remote import REMOTE_MODE, remote_note, remote_prompt, run_remote_bench
from miniserve.bench.report import (
    describe_concurrency,
    describe_run,
    format_concurrency_table,
    format_table,
    to_dict,
    verdict,
    write_csv,
    write_json,
)
from miniserve.bench.results import BenchResult, ConcurrencyResult, ConcurrencyRow, Row
from miniserve.bench.runs import (
    clear_prefix_cache,
    mixed_precision,
    prefix_reuse,
    run_bench,
    weights_label,
)
from miniserve.bench.streams import StreamTimeline, at_once, percentile, run_streams
from miniserve.core.config import GREEDY  # the Benchmark tab's default preset, by this name

__all__ = [
    "BENCH_SCHEMA",
    "CEILING_BATCH",
    "CONSTRAINED_MODES",
    "DEFAULT_MODES",
    "FILLER",
    "GREEDY",
    "MAX_PROMPT_TOKENS",
    "MODES",
    "REMOTE_MODE",
    "REPEAT",
    "BenchConfig",
    "BenchResult",
    "BenchStopped",
    "ConcurrencyConfig",
    "ConcurrencyResult",
    "ConcurrencyRow",
    "Progress",
    "Row",
    "StreamTimeline",
    "TokenCheck",
    "at_once",
    "available_memory",
    "ceiling_tokens_per_s",
    "check_repeat",
    "clear_prefix_cache",
    "concurrency_params",
    "describe_concurrency",
    "describe_run",
    "format_concurrency_table",
    "format_table",
    "largest_weight",
    "measure_ceiling",
    "mixed_precision",
    "percentile",
    "prefix_reuse",
    "product_kernel",
    "prompt_of_length",
    "remote_note",
    "remote_prompt",
    "run_bench",
    "run_concurrency",
    "run_remote_bench",
    "run_streams",
    "stream_prompt",
    "to_dict",
    "verdict",
    "weight_elements",
    "weights_label",
    "write_csv",
    "write_json",
]
