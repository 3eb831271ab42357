"""What the benchmarks produce: a row per measurement and the result around them, the
single-stream benchmark's (Row, BenchResult) and the concurrency benchmark's (ConcurrencyRow,
ConcurrencyResult). The report reads them; `bench --json`, `--csv` and the web app's tables
are their fields."""

from __future__ import annotations

from dataclasses import dataclass, field


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
