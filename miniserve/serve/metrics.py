"""/metrics: the server's state and what its requests added up to, in Prometheus' text format
(prometheus_client), as llama-server and vLLM expose theirs; the names follow vLLM's with our
prefix. Every served model is a `model_name` label; a model not loaded yet, or served by
another server, appears as `miniserve:model_loaded` (0, or `remote="1"`) and in nothing that
only a local engine knows.

Read at each scrape from the engines (no thread samples them in between):
  model_loaded{model_name, remote}    1 when its engine is up, else 0
  queue_depth, queue_limit            requests holding a place in the queue (running or
                                      waiting), and --max-queue: past it, 429
  num_requests_running, _waiting      the scheduler's running and waiting sequences
  kv_cache_used_positions             KV positions held: running sequences' reserves, Step
                                      sessions' caches, the prefix cache's kept caches
  kv_cache_prefix_positions           of those, the prefix cache's (given up first when a
                                      request needs room): at rest, used == prefix
  kv_cache_budget_positions           --kv-budget; kv_cache_usage_perc: used / budget (a
                                      fraction, as vLLM's)
  spec_draft_tokens_total,            draft tokens speculation proposed and accepted (the
  spec_accepted_tokens_total          scheduler's counters; vLLM's spec_decode_num_*)
Counted when a request finishes (the scheduler's `on_finish`, on the engine thread):
  prompt_tokens_total                 prompt tokens of finished requests, as usage counts them;
  prompt_tokens_cached_total          of those, the ones whose KV came from the prefix cache
  generation_tokens_total             tokens generated (cancelled replies' too)
  request_success_total               by finished_reason: eos | stop | length | tool_calls |
                                      cancelled | no_token_allowed | error
  time_to_first_token_seconds         histogram: submitted -> first token chosen (queueing and
                                      prefill), over the replies that got a token
  e2e_request_latency_seconds         histogram: submitted -> finished
Every name has the prefix `miniserve:`.

What the engine runs are choices: a request with n = 3 is counted as 3 requests (running,
waiting, finished, their latencies), each with the prompt's tokens. A choice is counted just
after its last chunk is handed to its client, so a scrape racing
that reply's last byte may not count it yet. The counts live with the engine: a model that is
unloaded and loaded again starts them from 0 (a counter reset, which Prometheus' rate() reads
as one). A remote model's tokens and times are its own server's to report.

Open without `--api-key`, as vLLM leaves its /metrics: it says how busy the server is, never
what anyone asked. Bind to a public address with that in mind.
"""

from __future__ import annotations

import math
import threading
import weakref
from bisect import bisect_left
from collections import Counter

from fastapi import APIRouter
from fastapi.responses import Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from miniserve.engine.engine import Engine
from miniserve.engine.scheduler import Scheduler, Sequence
from miniserve.models.registry import Models

PREFIX = "miniserve:"
# seconds; first tokens from a few ms (a cached prompt) to tens of seconds (a long prompt
# queued behind others on 2 cores)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
RECENT = 0.2  # the weight of the newest request in the recent average of seconds a place is held
MAX_RETRY_AFTER_S = 60


class Histogram:
    """Counts per bucket and the sum, as Prometheus' histogram writes them."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: a bound holds its own value
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) for each bound, then +Inf."""
        out, total = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class Tally:
    """What one engine's finished requests add up to; `add` is its scheduler's on_finish."""

    def __init__(self):
        self.lock = threading.Lock()  # the engine thread adds, a scrape reads
        self.prompt_tokens = self.cached_tokens = self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.held_s: float | None = None  # seconds a request held its place, lately (Retry-After)

    def add(self, seq: Sequence, error: BaseException | None) -> None:  # the engine thread
        stats = seq.stats
        with self.lock:
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += stats.reused_tokens
            self.generation_tokens += stats.new_tokens
            self.finished["error" if error is not None else stats.finish_reason or "length"] += 1
            if stats.new_tokens:
                self.ttft.observe(stats.ttft_s)
            self.e2e.observe(stats.total_s)
            held = self.held_s
            self.held_s = stats.total_s if held is None else held + RECENT * (stats.total_s - held)


_tallies: weakref.WeakKeyDictionary[Scheduler, Tally] = weakref.WeakKeyDictionary()
_tallies_lock = threading.Lock()


def tally_of(engine: Engine) -> Tally:
    """The engine's Tally, its scheduler counting into it from now on (once per engine,
    however many apps serve it)."""
    with _tallies_lock:
        tally = _tallies.get(engine.scheduler)
        if tally is None:
            tally = _tallies[engine.scheduler] = Tally()
            engine.scheduler.on_finish.append(tally.add)
        return tally


def watch(models: Models) -> None:
    """Count every local engine of `models`: those loaded now, and each one loaded later (its
    factory wrapped), whoever asks for it (the API, the web app's tabs, the CLI)."""
    for name in models.loaded():
        engine = models.loaded_engine(name)
        if isinstance(engine, Engine):
            tally_of(engine)
    make = models.factory
    if make is None:  # Models.single: its one engine is loaded
        return

    def factory(spec, progress=None):
        engine = make(spec, progress)
        if isinstance(engine, Engine):
            tally_of(engine)
        return engine

    models.factory = factory


def wait_estimate(held_s: float | None, depth: int, places: int = 1) -> int | None:
    """Seconds until `places` places in a queue are likely free, when `depth` requests hold
    places for `held_s` seconds each on average: one leaves every held_s / depth seconds
    (Little's law). At least 1, at most MAX_RETRY_AFTER_S; None when nothing is known yet."""
    if held_s is None or depth <= 0:
        return None
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(places * held_s / depth)))


def retry_after(engine, places: int = 1) -> int | None:
    """wait_estimate for a local engine's queue, from its requests' recent times; None for a
    remote one or an engine nothing has finished on."""
    if not isinstance(engine, Engine):
        return None
    tally = _tallies.get(engine.scheduler)
    return wait_estimate(tally.held_s if tally else None, engine.queue_depth, places)


def _read(count) -> int | None:
    """count() from another thread than the engine's, which may change a dict it sums (Step
    sessions', the prefix cache's) meanwhile: then read again; None if it never settles."""
    for _ in range(5):
        try:
            return count()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return None


class ServerCollector:
    """Every metric above, built from the engines at each scrape."""

    def __init__(self, models: Models):
        self.models = models

    def collect(self):
        label = ["model_name"]

        def gauge(name: str, doc: str, labels=label):
            return GaugeMetricFamily(PREFIX + name, doc, labels=labels)

        def counter(name: str, doc: str, labels=label):
            return CounterMetricFamily(PREFIX + name, doc, labels=labels)

        loaded = gauge("model_loaded", "1 when the model's engine is up", ["model_name", "remote"])
        depth = gauge("queue_depth", "requests holding a place in the queue (running or waiting)")
        limit = gauge("queue_limit", "places in the queue (--max-queue); past it, HTTP 429")
        running = gauge("num_requests_running", "requests the scheduler is advancing")
        waiting = gauge("num_requests_waiting", "requests waiting for a slot or KV room")
        kv_used = gauge("kv_cache_used_positions", "KV positions held, the prefix cache's included")
        kv_prefix = gauge("kv_cache_prefix_positions", "KV positions the prefix cache holds")
        kv_budget = gauge("kv_cache_budget_positions", "KV positions all sequences may hold")
        kv_usage = gauge("kv_cache_usage_perc", "KV positions held / the budget (a fraction)")
        drafted = counter("spec_draft_tokens", "draft tokens speculation proposed")
        accepted = counter("spec_accepted_tokens", "draft tokens speculation accepted")
        prompt = counter("prompt_tokens", "prompt tokens of finished requests")
        cached = counter("prompt_tokens_cached", "of those, tokens reused from the prefix cache")
        generated = counter("generation_tokens", "tokens generated")
        finished = counter(
            "request_success", "requests finished, by reason", ["model_name", "finished_reason"]
        )
        ttft = HistogramMetricFamily(
            PREFIX + "time_to_first_token_seconds",
            "seconds from submission to the first token",
            labels=label,
        )
        e2e = HistogramMetricFamily(
            PREFIX + "e2e_request_latency_seconds",
            "seconds from submission to the end of the reply",
            labels=label,
        )
        for name, spec in self.models.specs.items():
            engine = self.models.loaded_engine(name)
            loaded.add_metric([name, "1" if spec.remote else "0"], float(engine is not None))
            if engine is None:
                continue
            depth.add_metric([name], engine.queue_depth)
            limit.add_metric([name], engine.max_queue)
            if not isinstance(engine, Engine):  # remote: its server knows the rest
                continue
            s = engine.scheduler
            running.add_metric([name], len(s.running))
            waiting.add_metric([name], len(s.waiting))
            used, held = _read(s.kv_used), _read(engine.prefix_cache.held_positions)
            if used is not None:
                kv_used.add_metric([name], used)
                kv_usage.add_metric([name], used / s.kv_budget)
            if held is not None:
                kv_prefix.add_metric([name], held)
            kv_budget.add_metric([name], s.kv_budget)
            drafted.add_metric([name], s.spec_drafted)
            accepted.add_metric([name], s.spec_accepted)
            tally = tally_of(engine)
            with tally.lock:
                prompt.add_metric([name], tally.prompt_tokens)
                cached.add_metric([name], tally.cached_tokens)
                generated.add_metric([name], tally.generation_tokens)
                for reason, n in sorted(tally.finished.items()):
                    finished.add_metric([name, reason], n)
                ttft.add_metric([name], tally.ttft.buckets(), tally.ttft.sum)
                e2e.add_metric([name], tally.e2e.buckets(), tally.e2e.sum)
        yield from (loaded, depth, limit, running, waiting, kv_used, kv_prefix, kv_budget)
        yield from (kv_usage, drafted, accepted, prompt, cached, generated, finished, ttft, e2e)


def add_metrics_route(router: APIRouter, models: Models) -> None:
    """GET /metrics on `router`, over `models` (counted from now on). A route of FastAPI's own
    class: no API key asked (see above)."""
    watch(models)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(models))

    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    router.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        include_in_schema=False,
        route_class_override=APIRoute,
    )
