"""Concurrency: B streams at once (`run_concurrency`).

B callers submit at the same moment (a barrier), each with its own prompt of the same length
and its own seed, and read their replies as chunks arrive. From the arrival times: aggregate
tokens/s (every stream's new tokens over the wall time from the first submit to the last
finish), each stream's decode rate, time to first token and the gaps between tokens. The
ceiling -- what B rows a step could reach at most on this machine -- is measured in the same
run, so the share of it is the engine's, not the machine's."""

from __future__ import annotations

import statistics
import threading

from miniserve.bench.machine import ceiling_tokens_per_s, measure_ceiling
from miniserve.bench.options import ConcurrencyConfig, Progress, concurrency_params, stoppable
from miniserve.bench.peer_rows import concurrency_peer, peer_streams
from miniserve.bench.prompts import stream_prompt
from miniserve.bench.results import ConcurrencyResult, ConcurrencyRow
from miniserve.bench.runs import weights_label
from miniserve.bench.streams import StreamTimeline, percentile, run_streams
from miniserve.core.config import GREEDY, SamplingParams
from miniserve.core.platform import cpu_model, rss_mb
from miniserve.engine.engine import Engine
from miniserve.runners import native


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
    cancel: threading.Event | None = None,
) -> ConcurrencyResult:
    """Every preset at every concurrency level (and llama.cpp's greedy streams with `peer`),
    with the ceiling measured first; the presets from `presets` or config.presets_file (see
    concurrency_params). Raises ValueError for a level the engine's queue cannot hold or a
    preset that does not exist. `cancel`, once set, ends it with BenchStopped (at the end of
    the run in progress)."""
    progress = stoppable(progress or (lambda f, m: None), cancel)
    if not engine.capabilities.local_tokens:
        raise ValueError(
            f"bench --concurrency measures this machine's scheduler; model "
            f"'{engine.name}' runs on a remote server (bench without "
            "--concurrency times our streaming loop through it)"
        )
    params = concurrency_params(config, presets)
    if config.ignore_eos:
        banned = tuple((t, -100.0) for t in sorted(engine.eos_ids))
        params = {n: p.replace(logit_bias=p.logit_bias + banned) for n, p in params.items()}
    peer_eos = () if config.ignore_eos else engine.eos_ids
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
        peer_model, peer_dtype, peer_bytes = concurrency_peer(engine, config, progress)
    try:
        progress(0.0, "warming up")  # first passes at each width pay one-off costs
        warm = params[config.presets[0]].replace(max_new_tokens=4, seed=0)
        for level in sorted(set(config.levels)):
            run_streams(engine, prompts[:level], [warm] * level, speculate=config.speculate)
        if peer_model is not None:
            peer_model.run_batch(prompts[:1], 4, peer_eos)
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
                runs.append(
                    run_streams(engine, prompts[:level], seeded, speculate=config.speculate)
                )
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
                        peer_streams(
                            peer_model.run_batch(prompts[:level], config.new_tokens, peer_eos)
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
