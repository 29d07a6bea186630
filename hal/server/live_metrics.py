"""Live Prometheus collectors for a serving engine, updated every step (vLLM's
``vllm:spec_decode_*`` families, renamed ``spec_hal:*``, plus latency histograms, queue
gauges, KV blocks per pool, faults and the router's k). Needs prometheus-client."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from hal.engine.drafting import capabilities

LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PER_TOKEN = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class LiveMetrics:
    """One registry; `step` folds one engine step in (deltas of the engine's counters)."""

    def __init__(self, max_k: int = 16):
        disable_created_metrics()   # as vLLM: no *_created series next to every counter
        self.registry = registry = CollectorRegistry()
        p = "spec_hal:"
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "verify steps with at least one draft",
                                  registry=registry)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "draft tokens proposed", registry=registry)
        self.num_accepted = Counter(p + "spec_decode_num_accepted_tokens", "draft tokens accepted", registry=registry)
        self.per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "accepted draft tokens by position, "
                               "per drafting method", ["drafter", "position"], registry=registry)
        self.drafts_by = Counter(p + "spec_decode_num_drafts_per_drafter", "verify steps with drafts, per drafting "
                                 "method (per_pos's denominator)", ["drafter"], registry=registry)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "arrival to the first token", buckets=LATENCY,
                              registry=registry)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "seconds per output token after the first",
                              buckets=PER_TOKEN, registry=registry)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "arrival to the last token", buckets=LATENCY,
                             registry=registry)
        self.running = Gauge(p + "num_requests_running", "requests decoding", registry=registry)
        self.waiting = Gauge(p + "num_requests_waiting", "requests queued or prefilling", registry=registry)
        self.in_flight = Gauge(p + "num_requests_in_flight", "requests accepted and not yet answered (the 503 "
                               "bound counts these)", registry=registry)
        self.kv_used = Gauge(p + "kv_blocks_used", "KV blocks in use", ["pool"], registry=registry)
        self.kv_free = Gauge(p + "kv_blocks_free", "KV blocks free", ["pool"], registry=registry)
        self.preemptions = Counter(p + "num_preemptions", "requests preempted (recomputed later)", registry=registry)
        self.draft_failures = Counter(p + "draft_failures", "draft worker deaths, hangs or bad replies",
                                      registry=registry)
        self.workers_lost = Counter(p + "draft_workers_lost", "draft workers lost to the link (a reset or a timeout)",
                                    registry=registry)
        self.workers_rejoined = Counter(p + "draft_workers_rejoined", "draft workers that joined again (a new epoch)",
                                        registry=registry)
        self.stale_drafts = Counter(p + "stale_drafts", "drafts dropped: not built on the committed prefix",
                                    registry=registry)
        self.spec_hits = Counter(p + "spec_cache_hits", "requests answered from the draft worker's speculation cache",
                                 registry=registry)
        self.spec_misses = Counter(p + "spec_cache_misses", "requests drafted ahead whose outcome was not among the "
                                   "branches", registry=registry)
        self.fanout = Counter(p + "fanout_branches", "branches the draft worker drafted ahead", registry=registry)
        self.pushed = Counter(p + "pushed_rounds", "rounds whose drafts the draft worker had all offered (no reply "
                              "waited for)", registry=registry)
        self.ahead = Counter(p + "draft_ahead_seconds", "the worker's drafting while the target verified (hidden)",
                             registry=registry)
        self.inline = Counter(p + "draft_inline_seconds", "the worker's time from a COMMIT to its reply (not hidden)",
                              registry=registry)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=registry)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "prompt tokens found in the prefix cache",
                                   registry=registry)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries so far",
                                     registry=registry)
        self.router_k = Histogram(p + "router_k", "k chosen per request and step", registry=registry,
                                  buckets=tuple(range(max_k + 1)))
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=registry)
        self.requests = Counter(p + "request_success", "requests finished", ["finished_reason"], registry=registry)
        self._last = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "pos": {}, "by": {}, "pre": 0, "fail": 0, "stale": 0,
                      "queries": 0, "hits": 0, "lost": 0, "rejoined": 0,
                      "spec_hits": 0, "spec_misses": 0, "fanout": 0, "pushed": 0, "ahead": 0.0, "inline": 0.0}

    def step(self, dec, out) -> None:
        """After ``out = dec.step()``: counters by delta, gauges set, router k observed."""
        m, last = dec.metrics, self._last
        t = m.total
        for name, counter, now in (("drafts", self.num_drafts, t.num_drafts),
                                   ("draft_tokens", self.num_draft_tokens, t.num_draft_tokens),
                                   ("accepted", self.num_accepted, t.num_accepted_tokens),
                                   ("pre", self.preemptions, dec.preemptions),
                                   ("fail", self.draft_failures, m.draft_failures),
                                   ("stale", self.stale_drafts, m.stale_drafts),
                                   ("lost", self.workers_lost, m.workers_lost),
                                   ("rejoined", self.workers_rejoined, m.workers_rejoined),
                                   ("spec_hits", self.spec_hits, m.spec_cache_hits),
                                   ("spec_misses", self.spec_misses, m.spec_cache_misses),
                                   ("fanout", self.fanout, m.fanout_branches),
                                   ("pushed", self.pushed, m.pushed_rounds),
                                   ("ahead", self.ahead, m.draft_ahead_seconds),
                                   ("inline", self.inline, m.draft_inline_seconds),
                                   ("queries", self.prefix_queries, dec.prefix_cache_stats[0]),
                                   ("hits", self.prefix_hits, dec.prefix_cache_stats[1])):
            if now > last[name]:
                counter.inc(now - last[name])
            last[name] = now
        for kind, c in m.by_drafter.items():
            seen = last["pos"].setdefault(kind, [])
            for j, n in enumerate(c.accepted_per_position):
                before = seen[j] if j < len(seen) else 0
                if n > before:
                    self.per_pos.labels(drafter=kind, position=str(j)).inc(n - before)
            last["pos"][kind] = list(c.accepted_per_position)
            if c.num_drafts > last["by"].get(kind, 0):
                self.drafts_by.labels(drafter=kind).inc(c.num_drafts - last["by"].get(kind, 0))
            last["by"][kind] = c.num_drafts
        if last["queries"]:
            self.prefix_hit_rate.set(last["hits"] / last["queries"])
        self.gauges(dec)
        for k in out.k.values():
            self.router_k.observe(k)
        self.generation_tokens.inc(sum(len(v) for v in out.tokens.values()))

    def watch(self, dec, loop) -> None:
        """Read the queue gauges at each scrape, from the engine and its loop themselves, so they
        always agree with them (`len` of a list is atomic; no step writes them)."""
        self.running.set_function(lambda: len(dec.running))
        self.waiting.set_function(lambda: len(dec.waiting) + len(dec.prefilling))
        self.in_flight.set_function(lambda: loop.in_flight)

    def gauges(self, dec) -> None:
        """KV blocks per pool, now (also after an abort outside a step)."""
        pools = [("target", dec.pool.allocator)]
        if (dp := capabilities(dec.drafter).pool) is not None:
            pools.append(("draft", dp.allocator))
        for name, a in pools:
            self.kv_used.labels(pool=name).set(a.num_blocks - a.num_free)
            self.kv_free.labels(pool=name).set(a.num_free)

    def finished(self, arrival: float, first: float | None, end: float, prompt: int, generated: int,
                 reason: str) -> None:
        """A request ended (times in seconds on one clock)."""
        self.requests.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt)
        if first is not None:
            self.e2e.observe(end - arrival)
            if generated > 1:
                self.tpot.observe((end - first) / (generated - 1))

    def first_token(self, arrival: float, at: float) -> None:
        self.ttft.observe(at - arrival)
