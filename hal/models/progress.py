"""A progress bar for what measures for seconds (the linear plan, the routing profile):
tqdm on stderr when asked for, else one that shows nothing."""

from __future__ import annotations

import sys


class NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def bar(enabled: bool, total: int, desc: str, unit: str = "it"):
    """A tqdm bar of ``total`` steps (``enabled``), else a `NoBar`."""
    if not enabled:
        return NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, mininterval=0.5)
