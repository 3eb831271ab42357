"""Streams at once and their timelines: submit every prompt from a thread each at the same
moment (a barrier), note when each chunk arrives, and read time to first token, decode rate and
the gaps between tokens from those times (also benchmarks/http_bench.py's, through HTTP)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from miniserve.core.config import SamplingParams
from miniserve.engine.engine import Engine

T = TypeVar("T")


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
    speculate: bool = False,
) -> list[StreamTimeline]:
    """Submit every prompt at once from a thread each; time what comes back (prompt-lookup
    drafts only with `speculate`)."""

    def one(i: int, start: Callable[[], None]) -> StreamTimeline:
        start()
        cpu = time.thread_time()
        stream = StreamTimeline(time.perf_counter())
        for chunk in engine.complete(
            prompts[i], params[i], reuse_prefix=reuse_prefix, speculate=speculate
        ):
            stream.arrivals.append((time.perf_counter(), len(chunk.token_ids)))
        stream.end = time.perf_counter()
        stream.cpu_s = time.thread_time() - cpu
        return stream

    return at_once(len(prompts), one)
