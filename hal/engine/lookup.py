"""Prompt lookup on the host, for the router's forecast: will a lookup drafter find a match
this step, and which token would it draft first?

`LookupIndex` answers exactly as `hal.ops.Ops.ngram_propose` does (vLLM's n-gram proposer:
the longest suffix n-gram, ``min_n <= n <= max_n``, that also occurs ending before the last
token; of those the earliest), from a dictionary per n of each n-gram's earliest end, kept
up to date as tokens are committed: O(max_n) dictionary operations per token, where the
backend op scans the whole history on every call. The router asks it before anything is
drafted, so a request whose lookup finds nothing costs nothing to route (no draft, no
score, no probe), and one whose lookup matches is routed on the lookup's own acceptance
(`hal.engine.router.Router`). It reads committed tokens only: non-anticipating.
tests/engine/test_lookup.py checks it against the backend op on random histories.
"""

from __future__ import annotations

from hal.errors import arg_error


class LookupIndex:
    """One request's n-grams, each with its earliest end, for ``min_n <= n <= max_n``."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise arg_error("min_n, max_n", "1 <= min_n <= max_n", (min_n, max_n))
        self.min_n, self.max_n = min_n, max_n
        self.first: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.ends = 0   # n-grams ending before this index are in ``first``
        self.seen, self.last = 0, None   # tokens indexed, and the last of them (a shorter or changed history rebuilds)

    def update(self, tokens: list[int]) -> None:
        """Index every n-gram of ``tokens`` that ends before its last token."""
        if len(tokens) < self.seen or (self.seen and tokens[self.seen - 1] != self.last):
            self.__init__(self.min_n, self.max_n)   # not an extension of what was indexed: start again
        if tokens:
            self.seen, self.last = len(tokens), tokens[-1]
        for e in range(self.ends, len(tokens) - 1):
            for n, first in self.first.items():
                if e + 1 >= n:
                    first.setdefault(tuple(tokens[e + 1 - n:e + 1]), e)
        self.ends = max(self.ends, len(tokens) - 1)

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """``(n, end)``: the longest suffix n-gram of ``tokens`` (which must have been passed to
        `update`) that occurs earlier, and the end of its earliest occurrence; None when the
        lookup finds nothing."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) >= n:
                e = self.first[n].get(tuple(tokens[len(tokens) - n:]))
                if e is not None:
                    return n, e
        return None
