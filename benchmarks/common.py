"""Small helpers the benchmark scripts share."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_threads(count: int, one: Callable[[int], T]) -> list[T | None]:
    """one(i) for i in range(count), each on a thread of its own, all started before any is
    joined. Their results in order (None where one raised: its thread prints the traceback)."""
    results: list[T | None] = [None] * count

    def run(i: int) -> None:
        results[i] = one(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
