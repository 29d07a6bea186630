"""What a step costs: the router's `CostModel` (a target forward over T fed tokens, attention
per context token, a drafter's chain of k), and how it is measured here and now
(`profile_costs`, `profile_drafter`): least-of-reps wall times, synchronised on each backend."""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from hal.engine.drafting import capabilities
from hal.models.progress import NoBar, bar as progress_bar


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
        # the router asks for the same few points every step: each is interpolated once (the
        # tables are not changed after construction)
        self._verify_at: dict[int, float] = {}
        self._draft_at: dict[int, float] = {}

    def cost(self, fed: int, fed_x_context: int, chain: int) -> float:
        """A step feeding ``fed`` tokens with ``fed_x_context`` (fed token x context) pairs
        and a draft chain of ``chain`` tokens."""
        verify = self.forward_at(fed)
        if not chain or not self.draft:
            return verify + self.per_context * fed_x_context
        return verify + self.per_context * fed_x_context + self.chain_at(chain)

    def forward_at(self, fed: int) -> float:
        """``verify`` at ``fed`` tokens (interpolated once per point)."""
        verify = self._verify_at.get(fed)
        if verify is None:
            verify = self._verify_at[fed] = interpolate(self.verify, fed)
        return verify

    def chain_at(self, chain: int) -> float:
        """``draft`` at a chain of ``chain`` (interpolated once per point; ``draft`` must not be empty)."""
        draft = self._draft_at.get(chain)
        if draft is None:
            draft = self._draft_at[chain] = interpolate(self.draft, chain)
        return draft

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


@torch.inference_mode()   # as `SpeculativeDecoder.step` runs, so the costs are the step's
def profile_costs(target, drafter, pool, max_tokens: int = 72, context: int = 512, reps: int = 5,
                  profile_draft: bool = True, progress: bool = False):
    """A `hal.engine.costs.CostModel` measured here and now in ``pool`` (a `hal.kv.KVPool` of
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
