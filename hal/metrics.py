"""Speculative decoding counters, per request and global (as vLLM's SpecDecodingStats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable

from hal.errors import HalError, arg_error


@dataclass
class Counters:
    """``num_drafts`` counts verify steps that had at least one draft token."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)

    def add(self, k: int, accepted: int) -> None:
        if k <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for name, n in (("accepted_per_position", accepted), ("drafts_per_position", k)):
            counts = getattr(self, name)
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_by_position(self) -> list[float]:
        """P(draft j accepted | draft j proposed), per position j."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position + [0] * len(self.drafts_per_position),
                                                      self.drafts_per_position)]


class SpecDecodeMetrics:
    """Accumulates `Counters` globally and per request id."""

    def __init__(self) -> None:
        self.total = Counters()
        self.requests: dict[Hashable, Counters] = {}
        self.by_drafter: dict[str, Counters] = {}   # per drafting method (a drafter's ``kind``; NgramOrHead's rows
        #                                             by the method that drafted them)
        self.ttft: list[float] = []   # seconds from arrival to the first token, per finished request
        self.tpot: list[float] = []   # seconds per output token after the first, per finished request
        self.e2e: list[float] = []    # seconds from arrival to the last token
        self.draft_failures = 0       # the draft worker died or timed out; its requests fell back to plain decoding
        self.workers_lost = 0         # the link to the draft worker failed (a reset or a timeout)
        self.workers_rejoined = 0     # ... and the worker joined again by a new epoch
        self.stale_drafts = 0         # drafts dropped because they were not built on the committed prefix
        self.spec_cache_hits = 0      # a remote draft's requests answered from its speculation cache
        self.spec_cache_misses = 0    # ... drafted ahead, but their outcome was not among the branches
        self.fanout_branches = 0      # branches the draft worker drafted ahead (`hal.distributed.speculate`)
        self.pushed_rounds = 0        # rounds whose every draft the worker had offered (push: no wait for a reply)
        self.draft_ahead_seconds = 0.0   # the worker's drafting while the target verified (hidden)
        self.draft_inline_seconds = 0.0  # from a COMMIT's arrival to the reply (what the target waits, less the link)
        self.preemptions = 0          # running requests preempted when KV blocks ran out (recomputed later)
        self.acceptance_lengths: list[int] = []  # tokens emitted per request per verify step with drafts
        self._first: dict[Hashable, float] = {}
        self._keep: int | None = None

    def bound(self, n: int) -> "SpecDecodeMetrics":
        """Keep only the latest ``n`` samples and per-request counters (a server runs for
        days: the totals stay exact, the rest stops growing)."""
        from collections import deque
        self._keep = n
        for name in ("ttft", "tpot", "e2e", "acceptance_lengths"):
            setattr(self, name, deque(getattr(self, name), maxlen=n))
        return self

    def first_token(self, request_id: Hashable, seconds: float) -> None:
        self._first[request_id] = seconds
        self.ttft.append(seconds)

    def finished(self, request_id: Hashable, seconds: float, num_tokens: int) -> None:
        first = self._first.pop(request_id, seconds)
        self.e2e.append(seconds)
        if num_tokens > 1:
            self.tpot.append((seconds - first) / (num_tokens - 1))

    def observe(self, num_draft_tokens: Iterable[int], num_accepted: Iterable[int],
                request_ids: Iterable[Hashable] | None = None, drafters: Iterable[str] | None = None) -> None:
        """Record one verify step of a batch (tensors or lists, one entry per request; ``drafters``:
        the method that drafted each request's tokens, counted in `by_drafter`)."""
        ks = [int(v) for v in (num_draft_tokens.tolist() if hasattr(num_draft_tokens, "tolist") else num_draft_tokens)]
        acc = [int(v) for v in (num_accepted.tolist() if hasattr(num_accepted, "tolist") else num_accepted)]
        ids = list(request_ids) if request_ids is not None else list(range(len(ks)))
        kinds = list(drafters) if drafters is not None else [None] * len(ks)
        if not (len(ks) == len(acc) == len(ids) == len(kinds)):
            raise arg_error("num_accepted", f"one entry per request ({len(ks)})",
                            f"{len(acc)} (ids: {len(ids)}, drafters: {len(kinds)})")
        if any(not 0 <= a <= k for k, a in zip(ks, acc)):   # before anything is counted
            k, a = next((k, a) for k, a in zip(ks, acc) if not 0 <= a <= k)
            raise arg_error("num_accepted", f"0 <= accepted <= drafts ({k})", a)
        for rid, k, a, kind in zip(ids, ks, acc, kinds):
            self.total.add(k, a)
            if kind is not None and k > 0:
                self.by_drafter.setdefault(kind, Counters()).add(k, a)
            self.requests.setdefault(rid, Counters()).add(k, a)
            if self._keep is not None and len(self.requests) > self._keep:
                del self.requests[next(iter(self.requests))]   # the oldest
            if k > 0:
                self.acceptance_lengths.append(1 + a)

    @property
    def acceptance_rate(self) -> float:
        return self.total.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float:
        return self.total.mean_acceptance_length


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, -(-len(v) * q // 100) - 1))]


def require_prometheus():
    """The ``prometheus_client`` module, or a `HalError` saying how to install it."""
    try:
        import prometheus_client
    except ImportError as e:
        raise HalError("prometheus export: expected the optional dependency prometheus-client "
                       "(pip install 'spec-hal[metrics]'), got it missing") from e
    return prometheus_client


def prometheus_text(m: SpecDecodeMetrics, prefix: str = "spec_hal") -> str:
    """The metrics in Prometheus text format (needs the optional ``prometheus-client``):
    counters, acceptance rate and length, per-position acceptance, acceptance-length and
    TTFT/TPOT/end-to-end histograms, and their P50/P99."""
    pc = require_prometheus()
    reg = pc.CollectorRegistry()
    t = m.total
    for name, doc, v in (("drafts", "verify steps with at least one draft token", t.num_drafts),
                         ("draft_tokens", "draft tokens proposed", t.num_draft_tokens),
                         ("accepted_tokens", "draft tokens accepted", t.num_accepted_tokens),
                         ("draft_failures", "draft worker deaths or timeouts (fell back to plain decoding)",
                          m.draft_failures),
                         ("draft_workers_lost", "draft workers lost to the link (a reset or a timeout)", m.workers_lost),
                         ("draft_workers_rejoined", "draft workers that joined again by a new epoch",
                          m.workers_rejoined),
                         ("stale_drafts", "drafts dropped: not built on the committed prefix", m.stale_drafts),
                         ("spec_cache_hits", "requests answered from the draft worker's speculation cache",
                          m.spec_cache_hits),
                         ("spec_cache_misses", "requests drafted ahead whose outcome was not among the branches",
                          m.spec_cache_misses),
                         ("fanout_branches", "branches the draft worker drafted ahead", m.fanout_branches),
                         ("pushed_rounds", "rounds whose drafts the draft worker had all offered (no reply waited "
                          "for)", m.pushed_rounds),
                         ("draft_ahead_seconds", "the worker's drafting while the target verified (hidden)",
                          m.draft_ahead_seconds),
                         ("draft_inline_seconds", "the worker's time from a COMMIT to its reply (not hidden)",
                          m.draft_inline_seconds)):
        pc.Counter(f"{prefix}_{name}", doc, registry=reg).inc(v)
    pc.Gauge(f"{prefix}_acceptance_rate", "accepted / proposed draft tokens", registry=reg).set(m.acceptance_rate)
    pc.Gauge(f"{prefix}_mean_acceptance_length", "tokens per verify step", registry=reg).set(
        m.mean_acceptance_length)
    pos = pc.Gauge(f"{prefix}_acceptance_by_position", "P(draft j accepted | proposed)", ["position"], registry=reg)
    for j, a in enumerate(t.acceptance_by_position()):
        pos.labels(str(j)).set(a)
    drafts = pc.Counter(f"{prefix}_spec_decode_num_drafts", "verify steps with drafts, per drafting method",
                        ["drafter"], registry=reg)
    per_pos = pc.Counter(f"{prefix}_spec_decode_num_accepted_tokens_per_pos", "accepted draft tokens by position, "
                         "per drafting method (vLLM's name)", ["drafter", "position"], registry=reg)
    for kind, c in sorted(m.by_drafter.items()):
        drafts.labels(kind).inc(c.num_drafts)
        for j, n in enumerate(c.accepted_per_position):
            per_pos.labels(kind, str(j)).inc(n)
    hist = pc.Histogram(f"{prefix}_acceptance_length", "tokens emitted per request per verify step",
                        buckets=[float(b) for b in range(1, 18)], registry=reg)
    for a in m.acceptance_lengths:
        hist.observe(a)
    quant = pc.Gauge(f"{prefix}_latency_quantile_seconds", "P50/P99 latency", ["metric", "quantile"], registry=reg)
    for name, doc, values in (("time_to_first_token", "TTFT", m.ttft), ("time_per_output_token", "TPOT", m.tpot),
                              ("e2e_request_latency", "arrival to last token", m.e2e)):
        h = pc.Histogram(f"{prefix}_{name}_seconds", doc, buckets=LATENCY_BUCKETS, registry=reg)
        for v in values:
            h.observe(v)
        for q in (50, 99):
            quant.labels(name, f"0.{q}").set(percentile(values, q))
    return pc.generate_latest(reg).decode()
