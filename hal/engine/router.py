"""Routing and adaptive k: per request, speculate or not, and how many drafts.

Leviathan et al.: with per-token acceptance a, k drafts yield E(k) = (1 - a^(k+1)) / (1 - a)
tokens per verify step, and the (k+1)-th draft adds a^(k+1). A step's cost is the
target forward over all fed tokens (profiled at start-up) plus the draft chain. The
router adds drafts one at a time, to the request with the largest marginal gain, while
batch tokens per second ``sum E / cost`` still rises; so k shrinks smoothly as the
batch grows (no threshold cliff). A drafter that often has nothing to offer (n-gram lookup
on open-ended text finds no match on most steps) gains only at its measured offer rate r:
draft j is worth r * a^j, so a lookup that rarely matches is not asked, except by a probe.
A probe of a free deterministic (``shadow``) drafter verifies nothing: the decoder scores its
first draft against the step's own target row, as the emitted token (greedy) or as its
acceptance probability p(draft) (sampled), so measuring a request at k = 0 costs no verify.
So a shadow drafter's request is drafted for only once its own first drafts have been
measured (``evidence`` of them, scored or verified): the prior is never spent on a verify.
Scoring is free for n-gram lookup but not for an EAGLE head (its feed and first draft: see
docs/benchmarks.md, "Scoring a head's first drafts"), so its cost is measured (steps with scores only
against steps with neither scores nor drafts) and a greedy request's first draft is scored
every `Router.score_every` steps, all at once (the head then feeds the steps between in one
ragged forward), as often as keeps that cost within ``LEARN_SHARE`` of the time.

Non-anticipating: `Router.choose` runs before anything is drafted and reads only
finished steps (EWMA acceptance), prompt and context lengths and the batch size, so
the choice of k never depends on this step's draws and the output distribution is
unchanged (tests/engine/test_router.py, with the DSpark counterexample).
"""

from __future__ import annotations

import heapq
import math
import time
from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from hal.engine.drafting import capabilities
from hal.engine.requests import draft_room
from hal.errors import arg_error
from hal.models.progress import NoBar, bar as progress_bar


LEARN_SHARE = 0.03   # keeping requests at k = 0 measured (scores, probes) may cost this share of the time
QUIET = 8            # while scoring every step, every QUIET-th step scores nothing: a plain step to compare


@dataclass
class CostModel:
    """Step cost in seconds: ``verify[T]`` for a target forward over T fed tokens (piecewise
    linear between profiled points), plus ``per_context`` seconds per (fed token x
    context token) for attention, plus ``draft[k]`` for a draft chain of k tokens."""

    verify: dict[int, float]
    draft: dict[int, float] = field(default_factory=dict)
    per_context: float = 0.0

    def __post_init__(self):  # measured tables are noisy: make them non-decreasing
        for table in (self.verify, self.draft):
            run = 0.0
            for x in sorted(table):
                run = table[x] = max(run, table[x])

    def cost(self, fed: int, fed_x_context: int, chain: int) -> float:
        """A step feeding ``fed`` tokens with ``fed_x_context`` (fed token x context) pairs
        and a draft chain of ``chain`` tokens."""
        draft = interpolate(self.draft, chain) if self.draft and chain else 0.0
        return interpolate(self.verify, fed) + self.per_context * fed_x_context + draft

    def step(self, ks: list[int], contexts: list[int]) -> float:
        return self.cost(sum(1 + k for k in ks), sum((1 + k) * c for k, c in zip(ks, contexts)), max(ks, default=0))


def interpolate(table: dict[int, float], x: int) -> float:
    """``table`` at ``x``: piecewise linear, proportional below the first point, the last
    segment's slope beyond the last."""
    points = sorted(table)
    if x <= points[0]:
        return table[points[0]] * x / points[0] if points[0] else table[points[0]]
    if x >= points[-1]:  # extrapolate with the last segment's slope
        a, b = (points[-2], points[-1]) if len(points) > 1 else (0, points[-1])
        slope = (table[b] - table.get(a, 0.0)) / (b - a)
        return table[b] + slope * (x - b)
    i = bisect_left(points, x)
    a, b = points[i - 1], points[i]
    return table[a] + (table[b] - table[a]) * (x - a) / (b - a)


def profile(fn, points: list[int], reps: int = 3, synchronize=lambda: None, bar=NoBar()) -> dict[int, float]:
    """Least seconds of ``fn(x)`` over ``reps`` for each x (after one warm-up call each: a
    compute cost is fixed, and a busy machine only adds to it); ``synchronize``
    (a backend's) runs before the clock starts and before it stops: device launches are
    asynchronous, so an unsynchronised timing measures only the launch. ``bar``: advanced
    once per point."""
    out = {}
    for x in points:
        bar.update()
        fn(x)
        ts = []
        for _ in range(reps):
            synchronize()
            t = time.perf_counter()
            fn(x)
            synchronize()
            ts.append(time.perf_counter() - t)
        out[x] = min(ts)
    return out


@dataclass
class Ewma:
    """Acceptance as decayed counts: accepted drafts over (accepted + first rejections)."""

    decay: float
    accepted: float = 0.0
    trials: float = 0.0

    def add(self, drafted: int, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + (accepted < drafted)

    def score(self, p: float) -> None:
        """One first draft scored, not verified: accepted with probability ``p`` (its expectation)."""
        self.accepted = self.decay * self.accepted + p
        self.trials = self.decay * self.trials + 1.0

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.trials + weight)


class Router:
    """Chooses k per request (0 = plain decoding) to maximise expected tokens per second."""

    def __init__(self, costs: CostModel, max_k: int = 8, prior: float = 0.6, request_decay: float = 0.7,
                 global_decay: float = 0.95, prior_weight: float = 2.0, probe_every: int = 16, margin: float = 0.1,
                 shadow: bool = False, evidence: int = 2):
        if max_k < 0:
            raise arg_error("max_k", "an int >= 0", max_k)
        if not 0 <= margin < 10:
            raise arg_error("margin", "a number in [0, 10)", margin)
        if not 0 <= evidence <= 1000:
            raise arg_error("evidence", "an int in [0, 1000]", evidence)
        self.costs, self.max_k, self.prior, self.prior_weight = costs, max_k, prior, prior_weight
        self.margin = margin   # drafts only where the model predicts this much more than plain decoding
        self.request_decay, self.probe_every = request_decay, probe_every
        self.glob = Ewma(global_decay)
        self.per: dict[object, Ewma] = {}
        self.offers = Ewma(global_decay)          # asked for drafts, did the drafter offer any?
        self.offered: dict[object, Ewma] = {}
        self.shadow = shadow   # the decoder can score the drafter's first draft unverified at k = 0
        self.scored: set = set()   # the last `choose`'s requests at k = 0 whose first draft the decoder scores
        self.evidence = evidence if shadow else 0   # a shadow drafter's request drafts after this many measured
        self.measured: dict[object, int] = {}       # ... first drafts of its own (scored or verified)
        self.idle: dict[object, int] = {}
        # measured step time over the cost model's: steps without drafts or scores [0], with drafts [1],
        # with scored first drafts only [2]
        self.ratio, self.ratio_steps = [0.0, 0.0, 0.0], [0, 0, 0]
        self.steps = 0   # `choose` calls: the phase of `score_every`

    def observe_step(self, fed: int, drafted: int, chain: int, seconds: float, scored: int = 0) -> None:
        """A finished step's wall time: ``fed`` tokens in all (prefill too), ``drafted`` of
        them drafts, the longest chain ``chain``, ``scored`` first drafts scored unverified.
        What drafting costs beyond the profiled forward (verifying more rows, the drafter, its
        host work) shows as steps with drafts running slower than the model says, relative to
        steps without (a busy machine slows both alike); `draft_penalty` is that ratio, and
        `score_every` follows from the same for steps that only scored."""
        predicted = self.costs.cost(max(fed, 1), 0, chain)
        if predicted > 0 and seconds > 0:
            i = 1 if drafted > 0 else 2 if scored > 0 else 0
            a = 0.9 if self.ratio_steps[i] >= 8 else 1.0 - 1.0 / (self.ratio_steps[i] + 1)   # a mean, then an EWMA
            self.ratio[i] = a * self.ratio[i] + (1 - a) * seconds / predicted
            self.ratio_steps[i] += 1

    @property
    def draft_penalty(self) -> float:
        """How much slower than modelled a step with drafts runs, relative to one without
        (>= 1: it only ever makes drafting look dearer; 1 until both have 4 steps measured)."""
        if min(self.ratio_steps) < 4 or self.ratio[0] <= 0:
            return 1.0
        return max(1.0, self.ratio[1] / self.ratio[0])

    @property
    def score_every(self) -> int:
        """Steps between scorings of a greedy request's first draft at k = 0: 1 while scoring is
        unmeasured or as cheap as a plain step (n-gram lookup), else the fewest that keep its
        measured extra cost within ``LEARN_SHARE`` of the time, at most ``probe_every``."""
        if min(self.ratio_steps[0], self.ratio_steps[2]) < 4 or self.ratio[0] <= 0:
            return 1
        extra = self.ratio[2] / self.ratio[0] - 1
        return max(1, min(self.probe_every or 1, math.ceil(extra / LEARN_SHARE - 1e-9)))

    def acceptance(self, rid) -> float:
        return self._blend(self.glob, self.per, rid, self.prior)

    def offer_rate(self, rid) -> float:
        """The share of steps on which the drafter offered drafts when asked (1 until measured)."""
        return self._blend(self.offers, self.offered, rid, 1.0)

    def _blend(self, overall: Ewma, per: dict, rid, prior: float) -> float:
        """A request's rate, shrunk towards the overall rate (itself towards ``prior``)."""
        g = overall.rate(prior, 1.0)
        e = per.get(rid)
        return e.rate(g, self.prior_weight) if e else g

    def choose(self, states, budget: int | None = None) -> list[int]:
        """k per live request, from finished steps only (see the module docstring); with
        ``budget``, the tokens fed (one per request plus the drafts) stay within it.

        Drafts are added one at a time in order of marginal gain a_i^(k_i+1) up to every
        cap; the best point on that path wins (a first draft can cost more than later
        ones, e.g. when decode has a single-token fast path, so stopping early would be wrong),
        if its predicted rate beats plain decoding's by ``margin`` (the cost model is measured,
        so noisy: a predicted gain smaller than its error is not taken)."""
        n = len(states)
        caps = [max(0, min(self.max_k, state.req.k, draft_room(state))) for state in states]
        ctx = [len(state.tokens) for state in states]
        alpha = [self.acceptance(state.rid) for state in states]
        offer = [self.offer_rate(state.rid) for state in states]
        c = self.costs
        fed, attn, top = n, sum(ctx), 0
        tokens = float(n)
        best, best_at = tokens / c.cost(fed, attn, top), 0
        plain = best
        heap = [(-offer[i] * alpha[i], i, 1) for i in range(n) if caps[i] and self._known(states[i].rid)]
        heapq.heapify(heap)
        path, penalty = [], self.draft_penalty
        while heap and (budget is None or fed < budget):
            g, i, k = heapq.heappop(heap)
            tokens, fed, attn, top = tokens - g, fed + 1, attn + ctx[i], max(top, k)
            path.append(i)
            rate = tokens / (c.cost(fed, attn, top) * penalty)
            if rate > best:
                best, best_at = rate, len(path)
            if k < caps[i]:
                heapq.heappush(heap, (-offer[i] * alpha[i] ** (k + 1), i, k + 1))
        ks = [0] * n
        if best < plain * (1 + self.margin):
            best_at = 0
        for i in path[:best_at]:
            ks[i] += 1
        self._keep_learning(states, ks, caps, budget)
        return ks

    def _keep_learning(self, states, ks: list[int], caps: list[int], budget: int | None) -> None:
        """Requests at k = 0 keep being measured. A ``shadow`` drafter's first draft is scored by
        the decoder without verifying it (`scored`): a greedy request's every `score_every` steps
        (all at once; when that is every step, all but every ``QUIET``-th, a plain step that keeps
        the comparison measured) and on any step that drafts for another request (the drafter
        runs then anyway), a sampled one's when a probe is due, and any while not yet `_known`.
        Other drafters' idle requests are probed with one verified draft every `_probe_interval`
        plain steps."""
        self.scored, self.steps = set(), self.steps + 1
        interval = self.probe_every if self.shadow else self._probe_interval(states, ks, caps)
        every = self.score_every
        greedy = any(ks) or (self.steps % every == 0 if every > 1 else self.steps % QUIET != 0)
        for i, state in enumerate(states):
            rid = state.rid
            self.idle[rid] = 0 if ks[i] else self.idle.get(rid, 0) + 1
            if ks[i] or not caps[i]:
                continue
            due = bool(self.probe_every) and self.idle[rid] >= interval
            if self.shadow and ((state.req.temperature == 0 and greedy) or due or not self._known(rid)):
                self.scored.add(rid)
                if due:
                    self.idle[rid] = 0
            elif due and (budget is None or len(states) + sum(ks) < budget):
                ks[i], self.idle[rid] = 1, 0

    def _probe_interval(self, states, ks: list[int], caps: list[int]) -> int:
        """Plain steps between verified probes of an idle request: ``probe_every``, or up to four
        times that where the cost model says the idle requests' probes (one more fed token and a
        draft each, once per interval) would cost more than ``LEARN_SHARE`` of the time: on an
        AVX2-only CPU a verified draft at batch 4 costs a third of a step."""
        idle = sum(1 for k, cap in zip(ks, caps) if cap and not k)
        fed, top = len(states) + sum(ks), max(ks, default=0)
        base = self.costs.cost(fed, 0, top)
        if not self.probe_every or not idle or base <= 0:
            return self.probe_every
        extra = self.costs.cost(fed + 1, 0, max(top, 1)) - base
        return max(self.probe_every, min(4 * self.probe_every, math.ceil(idle * extra / (LEARN_SHARE * base))))

    def _known(self, rid) -> bool:
        """Whether a request has been measured enough to be drafted for (always, but for a shadow drafter's)."""
        return self.measured.get(rid, 0) >= self.evidence

    def observe(self, states, drafted: list[int], accepted: list[int]) -> None:
        for s, d, a in zip(states, drafted, accepted):
            if d:
                self.idle[s.rid] = 0
                self.measured[s.rid] = self.measured.get(s.rid, 0) + 1
                self.per.setdefault(s.rid, Ewma(self.request_decay)).add(d, a)
                self.glob.add(d, a)

    def observe_scores(self, states, scores: list[float]) -> None:
        """First drafts scored, not verified (`scored`): each accepted with probability ``scores[i]``."""
        for s, p in zip(states, scores):
            self.measured[s.rid] = self.measured.get(s.rid, 0) + 1
            self.per.setdefault(s.rid, Ewma(self.request_decay)).score(p)
            self.glob.score(p)

    def observe_offers(self, states, asked: list[int], offered: list[int]) -> None:
        """Where the drafter was asked for ``asked[i]`` > 0 drafts, did it offer any (``offered[i]``)?"""
        for s, a, o in zip(states, asked, offered):
            if a:
                self.offered.setdefault(s.rid, Ewma(self.request_decay)).add(1, int(o > 0))
                self.offers.add(1, int(o > 0))

    def release(self, state) -> None:
        self.per.pop(state.rid, None)
        self.measured.pop(state.rid, None)
        self.offered.pop(state.rid, None)
        self.idle.pop(state.rid, None)


def expected_tokens(alpha: float, k: int) -> float:
    """Leviathan's E(k): tokens per verify step at per-token acceptance ``alpha``."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@torch.inference_mode()   # as `SpeculativeDecoder.step` runs, so the costs are the step's
def profile_costs(target, drafter, pool, max_tokens: int = 72, context: int = 512, reps: int = 5,
                  profile_draft: bool = True, progress: bool = False):
    """A `hal.engine.router.CostModel` measured here and now in ``pool`` (a `hal.kv.KVPool` of
    ``target``'s; what it holds before is left as it was): the target forward over T fed
    tokens (T = 1 to 9, then either side of each chunk width up to ``max_tokens``, at a short context), the
    extra cost of ``context`` tokens of attention, and ``drafter``'s chain of k
    (``profile_draft=False``: not profiled, e.g. a remote drafter whose work overlaps).
    ``progress``: a bar (tqdm, stderr) over the points measured."""
    from hal.engine.forward import forward
    backends = {id(b): b for b in (target.be, capabilities(drafter).be) if b is not None}.values()

    def sync():
        for b in backends:
            b.synchronize()
    bs = pool.allocator.block_size  # stay inside the pool the plan gave us
    room = (pool.allocator.num_free - 4) * bs
    max_tokens = max(1, min(max_tokens, room // 2 - 16))
    context = max(16, min(context, room - max_tokens - 64))
    seqs = [pool.sequence(), pool.sequence()]
    try:
        for q, n in zip(seqs, (16, 16 + context)):
            forward(target, pool, [q], [[1] * n], False)
            q.commit(n)
        fwd = lambda T, q=seqs[0]: forward(target, pool, [q], [[1] * T], True)  # noqa: E731
        # every count up to 9 and both sides of the chunk widths a linear plan uses (2/4/8/16...): a
        # step's cost is a staircase, which sparse points would smooth over
        points = [p for p in (*range(1, 10), 12, 16, 17, 24, 32, 33, 48, 64, 65, 129, 257) if p <= max_tokens]
        bar = progress_bar(progress, len(points) + 2 + 4 * (drafter is not None and profile_draft),
                           "routing profile", "point")
        verify = profile(fwd, points, reps, sync, bar)
        # attention: the same 9-token verify at a short and a long context (a difference of two
        # noisy timings: a wide gap keeps it meaningful)
        n = min(9, max_tokens)
        long = profile(lambda _: forward(target, pool, [seqs[1]], [[1] * n], True), [1], reps, sync, bar)[1]
        short = profile(lambda _: forward(target, pool, [seqs[0]], [[1] * n], True), [1], reps, sync, bar)[1]
        per_context = max(0.0, long - short) / (n * context)
    finally:
        for q in seqs:
            q.free()
    draft = {}
    if drafter is not None and profile_draft:
        draft = profile_drafter(drafter, target.device, target.cfg.hidden, reps, sync, bar)
    bar.close()
    return CostModel(verify, draft, per_context)


PROFILE_TOKENS = tuple(range(1, 17))   # a drafter profile's request: 16 distinct ids, no n-gram repeats


def profile_drafter(drafter, device, hidden: int, reps: int = 5, sync=lambda: None, bar=NoBar(),
                    points=(1, 2, 4, 8)) -> dict[int, float]:
    """Seconds of one draft chain of k tokens (k in ``points``) for a request of 16 tokens on
    ``device`` (``hidden``: the target's width, for a drafter that reads its features).
    The request's tokens are `PROFILE_TOKENS`, which no n-gram lookup matches: a drafter that
    looks up first and falls back to a model (``ngram+eagle``) is timed on its model, the
    dearer path (a history of one repeated token had the lookup match, so the head's chain was
    costed as the lookup's)."""
    from hal.engine.drafting import DraftBatch, capabilities
    from hal.engine.requests import Request
    req = Request(list(PROFILE_TOKENS))
    h = torch.zeros(1, hidden, device=device)
    layers = capabilities(drafter).features
    feats = None if layers is None else torch.zeros(15, hidden * max(1, len(layers)), device=device)
    history = torch.tensor([PROFILE_TOKENS], dtype=torch.long, device=device)
    view = lambda k: DraftBatch(rids=(-1,), params=(req,), history=history,  # noqa: E731
                                num_tokens=torch.tensor([16], device=device), lengths=(16,), k=(k,), offsets=(0,),
                                hidden=h, features=feats, num_features=(0,) if feats is None else (15,))
    try:
        return profile(lambda k: drafter.propose(view(k)), list(points), reps, sync, bar)
    finally:
        drafter.release(-1)

