"""Start-up as the user sees it: one line per phase (load, memory plan, linear plan,
routing profile, ready) with its time, and a progress bar (tqdm) where a phase measures
for seconds. Everything goes to stderr."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Phases:
    """``with phases("memory plan"): ...`` prints ``<prog>: memory plan ...`` and, at the end,
    how long it took; `ready` prints the total. ``quiet``: print nothing (tests, library use)."""

    def __init__(self, prog: str, file=None, quiet: bool = False):
        self.prog, self.file, self.quiet = prog, file, quiet
        self.t0 = time.perf_counter()

    def say(self, line: str) -> None:
        if not self.quiet:
            print(f"{self.prog}: {line}", file=self.file or sys.stderr, flush=True)

    @contextmanager
    def __call__(self, name: str):
        self.say(f"{name} ...")
        t = time.perf_counter()
        yield
        self.say(f"{name}: done in {time.perf_counter() - t:.1f} s")

    @property
    def bars(self) -> bool:
        """Whether measuring phases should show a progress bar."""
        return not self.quiet

    def ready(self, what: str) -> None:
        self.say(f"ready in {time.perf_counter() - self.t0:.1f} s: {what}")


QUIET = Phases("", quiet=True)
