"""The report: the tables `miniserve bench` prints, the line under each (what ran, where, and
whether its tokens are right), and the results as JSON or CSV."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict

from miniserve.bench.options import CONSTRAINED_MODES, MODES
from miniserve.bench.remote import REMOTE_MODE
from miniserve.bench.results import BenchResult, ConcurrencyResult


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
