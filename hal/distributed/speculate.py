"""Drafting one round ahead (`hal.distributed.worker`): while the target verifies round r, the
worker drafts round r+1 for the likeliest outcomes of round r into a speculation cache, and the
COMMIT that ends round r is answered from it at once when its outcome was among them.

Glossary:
  outcome (a, b): the target accepted the first a of the n drafts it verifies and then emitted
      b: at a < n its correction at slot a (never the draft there), at a = n its bonus token.
  branch: that outcome's history, committed + d[:a] + [b], and the drafts built on it.
  extension: the branch a = n with the drafter's own guess of b, drafted on committed + d with
      one slot more (its first draft is the guess, the rest are the branch's drafts); its
      first slot's alternatives become the other a = n branches.
  key: (length, history hash) of a branch's history. This is the issue's (request, epoch,
      accepted length, bonus token): the cache lives in one epoch's request state, the length
      gives a, and the hash pins b and the drafts before it.
  alpha: the request's measured acceptance per draft position (accepted / tried, with a
      (1, 1) prior); P(a) = alpha^a (1 - alpha) for a < n, alpha^n for a = n.
  fan-out: the branches drafted for one request in one round, in descending P(a) P(b | a),
      at most ``budget`` of them, one wave (one branch per request, one drafter call) at a
      time while no COMMIT has arrived and the next wave fits the measured verify window.
  own features: a drafter that reads the target's features (an EAGLE head) has none yet for a
      branch's uncommitted tail; it is fed the drafter's own instead, the states it drew round
      r's slots from (`Drafted.own`: slot j's state stands for the target's feature at the
      position before slot j), one per tail token. They change which drafts a branch holds, never
      how they verify.

Exactness: a branch's drafts depend only on its history and the drafter's own draws, and
round r+1's drafts draw at the same Philox offsets on every path (cache hit or fresh): round
r's drafts take offsets o..o+k-1, the extension's guess o+k, round r+1's drafts o+k+1 on.
So which branch is used (chosen by the committed outcome, from the target's draws) never
correlates with the draws of the drafts it uses."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hal.distributed.protocol import history_hash

TOP = 3   # F: bonus-token guesses per accept length


@dataclass
class Drafted:
    """One drafter call's result for one request (host lists; ``q`` rows stay tensors)."""

    drafts: list[int]
    q: Tensor | None = None                    # [n, V] the rows the drafts were drawn from
    alts: list[list[tuple[int, float]]] | None = None   # per slot: (token, probability), likeliest first
    parents: list[int] | None = None           # a draft tree (never fanned out)
    own: Tensor | None = None                  # [n, F] a feature drafter's own features (`Proposal.own_features`)


@dataclass(order=True)
class Branch:
    neg_score: float
    order: int
    rid: int = field(compare=False)
    base: list[int] = field(compare=False)     # the history the outcome makes
    extend: bool = field(compare=False, default=False)   # the extension (see the glossary)
    a: int = field(compare=False, default=0)
    own: Tensor | None = field(compare=False, default=None)  # a feature drafter's features for base's uncommitted tail


@dataclass
class _Spec:
    """One request's speculation: the round in flight, the branches still to draft, the cache."""

    sent: list[int] = field(default_factory=list)        # round r's drafts (what the target verifies)
    todo: list[Branch] = field(default_factory=list)     # a heap
    cache: dict[tuple[int, int], Drafted] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    bigram: dict[int, Counter] = field(default_factory=dict)   # next-token counts of the committed history

    @property
    def alpha(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)


class FanOut:
    """The worker's speculation state for one epoch: per request its `_Spec`; `plan` after a
    reply, `wave` while the target verifies, `lookup` at the next COMMIT. ``budget``: branches
    per request and round (0: none). ``bounded`` False: every branch within the budget is
    drafted before the next message is read (deterministic hits, for tests)."""

    def __init__(self, budget: int, bounded: bool = True, own_features: bool = False):
        self.budget, self.bounded, self.specs, self._order = budget, bounded, {}, itertools.count()
        self.own_features = own_features   # the drafter reads features: a branch's tail is fed its own (`Drafted.own`)
        self.window = 0.0     # measured: seconds from a reply to the next COMMIT (verification and link)
        self.wave_s = 0.0     # measured: seconds per wave
        self.replied = time.perf_counter()
        self.branches = 0     # branches drafted since the last reply
        self.ahead_s = 0.0    # seconds drafting them
        self.waves = 0        # waves drafted since the last reply

    def observe(self, rid: int, before: list[int], delta: list[int]) -> None:
        """COMMIT: ``delta`` was committed for ``rid`` after ``before``: its acceptance of the
        drafts in flight and its next-token counts."""
        s = self.specs.setdefault(rid, _Spec())
        if s.sent:
            a = next((i for i, (x, y) in enumerate(zip(s.sent, delta)) if x != y), min(len(s.sent), len(delta)))
            s.accepted += a
            s.rejected += a < len(s.sent)
        seq = before[-1:] + delta
        for x, y in zip(seq, seq[1:]):
            s.bigram.setdefault(x, Counter())[y] += 1
        s.sent = []

    def lookup(self, rid: int, length: int, h: int, k: int) -> tuple[Drafted | None, bool]:
        """The cached drafts for request ``rid``'s committed history (``length``, hash ``h``),
        cut to ``k``; and whether it had a fan-out this round (a miss counts only then). The
        rest of its cache is dropped: every other branch is now stale."""
        s = self.specs.get(rid)
        if s is None:
            return None, False
        planned = bool(s.cache) or bool(s.todo)
        got = s.cache.get((length, h))
        s.cache, s.todo = {}, []
        if got is None or len(got.drafts) < k or k == 0:
            return None, planned
        return cut(got, k), planned

    def plan(self, rid: int, base: list[int], got: Drafted) -> None:
        """Round r's drafts for ``rid`` were sent, built on its committed history ``base``: rank
        the outcomes to draft ahead."""
        s = self.specs.setdefault(rid, _Spec())
        s.sent, s.todo, s.cache, s.drafted = list(got.drafts), [], {}, 0
        if not self.budget or not got.drafts or got.parents is not None or (self.own_features and got.own is None):
            return
        d, alpha = got.drafts, s.alpha
        own = (lambda n: got.own[:n]) if self.own_features else (lambda n: None)  # noqa: E731  (the tail's features)
        for a in range(len(d)):
            alts = got.alts[a] if got.alts else self._bigram(s, (base + d[:a])[-1])
            other = [(b, p) for b, p in alts if b != d[a]]
            rest = sum(p for _, p in other) or 1.0
            for b, p in other[:TOP]:
                self._push(s, rid, alpha ** a * (1 - alpha) * p / rest, base + d[:a] + [b], a=a, own=own(a + 1))
        self._push(s, rid, alpha ** len(d), base + d, extend=True, a=len(d), own=own(len(d)))

    def _push(self, s: _Spec, rid: int, score: float, base: list[int], extend: bool = False, a: int = 0,
              own: Tensor | None = None) -> None:
        heapq.heappush(s.todo, Branch(-score, next(self._order), rid, base, extend, a, own))

    @staticmethod
    def _bigram(s: _Spec, prev: int) -> list[tuple[int, float]]:
        """The fallback distribution for a drafter without one (n-gram lookup): what followed
        ``prev`` in the committed history."""
        c = s.bigram.get(prev)
        if not c:
            return []
        n = sum(c.values())
        return [(t, m / n) for t, m in c.most_common(TOP + 1)]

    def next_wave(self) -> list[Branch]:
        """One branch per request: each one's likeliest not yet drafted, within its budget."""
        out = []
        for s in self.specs.values():
            if s.todo and s.drafted < self.budget:
                out.append(heapq.heappop(s.todo))
                s.drafted += 1
        return out

    def fits(self, waiting: bool) -> bool:
        """Whether to draft another wave now: the round's first always (its likeliest
        branches); later ones while no message is ``waiting`` and the wave fits before the
        COMMIT is due (the measured window)."""
        if not self.bounded or not self.waves:
            return True
        return not waiting and time.perf_counter() - self.replied + self.wave_s <= self.window

    def store(self, branches: list[Branch], got: list[Drafted], seconds: float) -> list[tuple[int, int, int, Drafted]]:
        """A wave's results: each branch's drafts under its key (an extension's guess becomes
        its key's last token, and its first slot's alternatives new branches). Returns what
        was stored: (request, length, hash, drafts) per branch (what the worker may offer)."""
        stored = []
        self.wave_s = _ema(self.wave_s, seconds)
        self.waves += 1
        self.ahead_s += seconds
        for br, g in zip(branches, got):
            s = self.specs.get(br.rid)
            if s is None or not g.drafts:
                continue
            self.branches += 1
            if br.extend:   # its first slot is the guess; its alternatives are the other a = n branches
                first = g.alts[0] if g.alts else self._bigram(s, br.base[-1])
                own = None if br.own is None or g.own is None else torch.cat([br.own, g.own[:1]])
                guess, g = g.drafts[0], cut(g, len(g.drafts), start=1)
                for b, p in first[:TOP + 1]:
                    if b != guess:
                        self._push(s, br.rid, -br.neg_score * p, br.base + [b], a=br.a, own=own)
                hist = br.base + [guess]
            else:
                hist = br.base
            if g.drafts:
                key = (len(hist), history_hash(hist))
                s.cache[key] = g
                stored.append((br.rid, *key, g))
        return stored

    def replied_now(self, committed_at: float | None) -> None:
        """A reply was sent: the window from the last reply to this COMMIT is measured."""
        now = time.perf_counter()
        if committed_at is not None:
            self.window = _ema(self.window, committed_at - self.replied)
        self.replied, self.branches, self.ahead_s, self.waves = now, 0, 0.0, 0

    def drop(self, rid: int) -> None:
        self.specs.pop(rid, None)


def _ema(old: float, new: float) -> float:
    """A moving average of a measured time (0: none measured yet)."""
    return new if not old else 0.7 * old + 0.3 * new


def cut(g: Drafted, k: int, start: int = 0) -> Drafted:
    """Slots ``start`` .. ``k - 1`` of ``g``."""
    return Drafted(g.drafts[start:k], None if g.q is None else g.q[start:k],
                   None if g.alts is None else g.alts[start:k], None, None if g.own is None else g.own[start:k])
