"""Which host thread runs torch's parallel CPU work.

GNU OpenMP (the CPU build's intra-op threads) keeps a thread team for each thread that has
started a parallel region, until that thread ends. Once it manages more threads than there are
CPUs it stops letting idle workers spin, so every parallel region then waits for a sleeping
worker. A process whose main thread loaded a model (a team) and whose engine thread then runs
the forwards (a second team) pays that on every op: the engine's thread decoded at 0.44x
the loading thread's rate (`benchmarks/serve_decode.py`). Work that must leave no team behind
(loading, warm-ups) runs in `in_a_thread_that_ends`."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def in_a_thread_that_ends(fn: Callable[[], T], name: str = "hal-load") -> T:
    """``fn()`` run in a thread of its own, which ends when it returns (and its OpenMP team
    with it): its value, or its exception raised again here."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:   # raised again in the caller's thread
            box["error"] = e
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
