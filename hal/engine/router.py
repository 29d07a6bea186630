"""Routing and adaptive k: per request, speculate or not, and how many drafts.

Leviathan et al.: with per-token acceptance a, k drafts yield E(k) = (1 - a^(k+1)) / (1 - a)
tokens per verify step. A step's cost is the target forward over all fed tokens (profiled at
start-up) plus the draft chain. The router adds drafts one at a time, to the request with the
largest marginal gain, while batch tokens per second ``sum E / cost`` still rises; so k
shrinks smoothly as the batch grows (no threshold cliff). A drafter that often offers nothing
gains only at its measured offer rate r: draft j is worth r * a^j.
Requests at k = 0 keep being measured (scored or probed), and steps that choose nothing
skip the walk: `hal.engine.route_cadence`.

A lookup drafter (n-gram lookup, alone or before a model drafter: ``lookup``, ``fallback``)
is routed on its host lookup (`hal.engine.lookup`): no match, nothing to offer (alone) or the
model's acceptance (``fallback``); a match, the acceptance of matches of that length, with no
model chain to pay, its first draft scored on the host for free (`Router.guess`), and its
drafts read on the host (`Router.continuation`). What was learned is kept for the next engine
(``memory``, `hal.engine.route_memory`).

Non-anticipating: `Router.choose` runs before anything is drafted and reads only finished
steps (EWMA acceptance), prompt and context lengths and the batch size, so the choice of k
never depends on this step's draws and the output distribution is unchanged
(tests/engine/test_router.py, with the DSpark counterexample).
"""

from __future__ import annotations

import heapq

from hal.engine.acceptance import Ewma
from hal.engine.costs import CostModel
from hal.engine.lookup import LookupIndex
from hal.engine.requests import draft_room
from hal.engine.route_cadence import QUIET, SPELL, RouteCadence
from hal.errors import arg_error

__all__ = ["QUIET", "Router"]


class Router(RouteCadence):
    """Chooses k per request (0 = plain decoding) to maximise expected tokens per second."""

    def __init__(self, costs: CostModel, max_k: int = 8, prior: float = 0.6, request_decay: float = 0.7,
                 global_decay: float = 0.95, prior_weight: float = 2.0, probe_every: int = 16, margin: float = 0.1,
                 shadow: bool = False, evidence: int = 2, lookup: tuple[int, int] | None = None,
                 fallback: bool = False, memory=None, spell: int = SPELL, match_decay: float = 0.85):
        if max_k < 0:
            raise arg_error("max_k", "an int >= 0", max_k)
        if not 0 <= margin < 10:
            raise arg_error("margin", "a number in [0, 10)", margin)
        if not 0 <= evidence <= 1000:
            raise arg_error("evidence", "an int in [0, 1000]", evidence)
        if not 0 <= spell <= 1000:
            raise arg_error("spell", "an int in [0, 1000]", spell)
        if not 0 <= match_decay < 1:
            raise arg_error("match_decay", "a number in [0, 1)", match_decay)
        self.costs, self.max_k, self.prior, self.prior_weight = costs, max_k, prior, prior_weight
        self.margin = margin   # drafts only where the model predicts this much more than plain decoding
        self.request_decay, self.probe_every = request_decay, probe_every
        # a request's own lookup matches decay slower: its rate is shrunk towards the overall one by
        # ``prior_weight`` trials, and at 0.7 (3.3 trials at most) open text's matches could never fall
        # below about 40% of a rate learned on copied text; at 0.85, 23%
        self.match_decay = match_decay
        self.glob = Ewma(global_decay)
        self.per: dict[object, Ewma] = {}
        self.offers = Ewma(global_decay)          # asked for drafts, did the drafter offer any?
        self.offered: dict[object, Ewma] = {}
        self.shadow = shadow   # the decoder can score the drafter's first draft unverified at k = 0
        self.scored: set = set()   # the last `choose`'s requests at k = 0 whose first draft the decoder scores
        # requests at k = 0 whose lookup match's first draft the router scores itself, from the token
        # the step commits (`_settle`): rid -> (its position, the draft, the overall rate it counts in)
        self.guesses: dict[object, tuple[int, int, Ewma]] = {}
        self.evidence = evidence if shadow else 0   # a shadow drafter's request drafts after this many measured
        self.measured: dict[object, int] = {}       # ... first drafts of its own (scored or verified)
        self.match_evidence = evidence if lookup else 0   # ... and any request's lookup matches (free to score)
        self.idle: dict[object, int] = {}
        # measured step time over the cost model's: steps without drafts or scores [0], with drafts [1]
        # (a model's among them), with scored first drafts only [2], with lookup matches' drafts only [3]
        self.ratio, self.ratio_steps = [0.0, 0.0, 0.0, 0.0], [0, 0, 0, 0]
        self._lookup_only = False   # the last `choose` drafted only where the lookup matched
        self.steps = 0   # `choose` calls: the phase of `score_every`
        self._every = 1  # `score_every` as the last `choose` found it
        # a lookup drafter (`hal.engine.drafting.DrafterCapabilities.lookup`): where its host lookup finds a match
        # this step, a request is routed on the lookup's own acceptance; where it finds none, on the model's
        # (``fallback``) or not at all (nothing would be drafted, so nothing is asked, scored or probed)
        self.lookup, self.fallback = lookup, fallback
        self.index: dict[object, LookupIndex] = {}
        self.matched: dict[object, int] = {}       # the length of this step's match (0: none)
        self.match_at: dict[object, tuple[int, int]] = {}   # (tokens looked up, end of the match) where it matched
        # acceptance of a lookup match's drafts, by match length (a 3-gram match in copied text
        # is accepted far more often than a 1-gram one in open text), greedy requests' and sampled
        # ones' apart (a sampled request keeps a match's token with the target's probability of it)
        self.found = {n: Ewma(global_decay) for n in range(lookup[0], lookup[1] + 1)} if lookup else {}
        self.found_sampled = {n: Ewma(global_decay) for n in self.found}
        self.sampled: dict[object, bool] = {}   # a matched request samples (temperature > 0)
        self.found_per: dict[object, Ewma] = {}
        self.found_measured: dict[object, int] = {}
        self.spell = spell       # steps a choice of nothing may be repeated without a walk (`choose`)
        self._quiet: tuple = ()  # the states of the current quiet spell, and its steps left
        self._quiet_left = 0
        self._interval = probe_every   # the last `_keep_learning`'s probe (or score) interval
        self.memory = memory   # a `hal.engine.route_memory.RouteMemory`: where this router starts, and keeps
        if memory is not None:
            memory.restore(self)

    def observe_step(self, fed: int, drafted: int, chain: int, seconds: float, scored: int = 0) -> None:
        """A finished decode step's wall time (the engine passes no step with a prefill chunk:
        it feeds more tokens than were profiled): ``fed`` tokens in all, ``drafted`` of
        them drafts, the longest chain ``chain``, ``scored`` first drafts scored unverified.
        What drafting costs beyond the profiled forward (verifying more rows, the drafter, its
        host work) shows as steps with drafts running slower than the model says, relative to
        steps without (a busy machine slows both alike); `draft_penalty` is that ratio, and
        `score_every` follows from the same for steps that only scored. Steps whose drafts were
        all lookup matches' (no model chain; the last `choose` says) are measured apart
        (`lookup_penalty`): a model's dear drafts never make free lookups look dear."""
        lookup = drafted > 0 and self._lookup_only
        predicted = self.costs.cost(max(fed, 1), 0, 0 if lookup else chain)
        if predicted > 0 and seconds > 0:
            i = 3 if lookup else 1 if drafted > 0 else 2 if scored > 0 else 0
            a = 0.9 if self.ratio_steps[i] >= 8 else 1.0 - 1.0 / (self.ratio_steps[i] + 1)   # a mean, then an EWMA
            self.ratio[i] = a * self.ratio[i] + (1 - a) * seconds / predicted
            self.ratio_steps[i] += 1

    @property
    def draft_penalty(self) -> float:
        """How much slower than modelled a step with drafts runs, relative to one without
        (>= 1: it only ever makes drafting look dearer; 1 until both have 4 steps measured; steps that
        only scored do not count: a drafter that is never scored has none)."""
        if min(self.ratio_steps[0], self.ratio_steps[1]) < 4 or self.ratio[0] <= 0:
            return 1.0
        return max(1.0, self.ratio[1] / self.ratio[0])

    @property
    def lookup_penalty(self) -> float:
        """`draft_penalty` of steps whose drafts were all lookup matches' (1 until both that kind and
        plain steps have 4 measured)."""
        if min(self.ratio_steps[0], self.ratio_steps[3]) < 4 or self.ratio[0] <= 0:
            return 1.0
        return max(1.0, self.ratio[3] / self.ratio[0])

    def acceptance(self, rid) -> float:
        overall, per, _ = self._source(rid)
        return self._blend(overall, per, rid, self.prior)

    def rates(self) -> dict[str, Ewma]:
        """The overall rates, by name: the drafter's acceptance (``glob``), its offer rate, and a
        lookup match's acceptance per match length (``found<n>``; sampled requests': ``sampled<n>``);
        what a route memory keeps."""
        return {"glob": self.glob, "offers": self.offers, **{f"found{n}": e for n, e in self.found.items()},
                **{f"sampled{n}": e for n, e in self.found_sampled.items()}}

    def _source(self, rid) -> tuple[Ewma, dict, dict]:
        """The overall and per-request acceptance, and the measured counts, of the method that drafts
        for ``rid`` this step: the lookup's where it found a match, else the drafter's."""
        n = self.matched.get(rid)
        if n:
            return (self.found_sampled if self.sampled.get(rid) else self.found)[n], self.found_per, self.found_measured
        return self.glob, self.per, self.measured

    def _look(self, states) -> list[bool]:
        """Whether each request has anything to be drafted from this step: where the drafter looks
        up first, its host lookup's answer (`hal.engine.lookup`) decides the source."""
        if self.lookup is None:
            return [True] * len(states)
        out = []
        for state in states:
            index = self.index.get(state.rid)
            if index is None:
                index = self.index[state.rid] = LookupIndex(*self.lookup)
            index.update(state.tokens)
            found = index.match(state.tokens)
            self.matched[state.rid] = 0 if found is None else found[0]
            if found is not None:
                self.match_at[state.rid] = (len(state.tokens), found[1])
                self.sampled[state.rid] = state.req.temperature > 0
            out.append(found is not None or self.fallback)
        return out

    def continuation(self, state, k: int) -> list[int] | None:
        """The drafts a lookup drafter proposes for ``state`` this step, up to ``k`` (the tokens after
        the match the last `choose` found, as `hal.ops.Ops.ngram_propose` drafts them), read on the
        host; None where that lookup found no match, or for tokens other than those it looked up."""
        if not self.matched.get(state.rid):
            return None
        n, end = self.match_at[state.rid]
        return state.tokens[end + 1:end + 1 + k] if n == len(state.tokens) else None

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
        self._settle(states)
        n, looked = len(states), self._look(states)
        if self._quiet_left and len(states) == len(self._quiet) and all(
                a is b and not self.matched.get(a.rid) for a, b in zip(states, self._quiet)):
            return self._quiet_step(states)
        caps = [max(0, min(self.max_k, state.req.k, draft_room(state))) if has else 0
                for state, has in zip(states, looked)]
        can = [i for i in range(n) if caps[i] and self._known(states[i].rid)]
        ks = [0] * n
        if not can:   # nobody to draft for: no walk (a step that drafts nothing costs next to nothing)
            return self._learned(states, ks, caps, budget)
        ctx = [len(state.tokens) for state in states]
        c = self.costs
        fed, attn, top = n, sum(ctx), 0
        tokens = float(n)
        best, best_at = tokens / c.cost(fed, attn, top), 0
        plain = best
        alpha, offer = {i: self.acceptance(states[i].rid) for i in can}, {i: self.offer_rate(states[i].rid) for i in can}
        path, penalty, free = [], self.draft_penalty, self.lookup_penalty
        heap = [(-offer[i] * alpha[i], i, 1) for i in can] if can and self._may_pay(
            states, can, caps, ctx, alpha, offer, plain, penalty) else []
        heapq.heapify(heap)
        while heap and (budget is None or fed < budget):
            g, i, k = heapq.heappop(heap)
            chain = 0 if self.matched.get(states[i].rid) else k   # a lookup match's drafts cost no model chain
            tokens, fed, attn, top = tokens - g, fed + 1, attn + ctx[i], max(top, chain)
            path.append(i)
            rate = tokens / (c.cost(fed, attn, top) * (penalty if top else free))   # top 0: lookup drafts alone
            if rate > best:
                best, best_at = rate, len(path)
            if k < caps[i]:
                heapq.heappush(heap, (-offer[i] * alpha[i] ** (k + 1), i, k + 1))
        if best < plain * (1 + self.margin):
            best_at = 0
        for i in path[:best_at]:
            ks[i] += 1
        return self._learned(states, ks, caps, budget)

    def _learned(self, states, ks: list[int], caps: list[int], budget: int | None) -> list[int]:
        """``ks`` once `_keep_learning` has had its say, and what `observe_step` reads of them."""
        self._keep_learning(states, ks, caps, budget)
        self._lookup_only = any(ks) and all(self.matched.get(states[i].rid) for i in range(len(ks)) if ks[i])
        self._quiet, self._quiet_left = tuple(states), self._spell_length(states, ks, caps)
        return ks

    def _may_pay(self, states, can: list[int], caps: list[int], ctx: list[int], alpha: dict, offer: dict,
                 plain: float, penalty: float) -> bool:
        """Whether any draft path of `choose` could beat plain decoding by ``margin``: every draft
        offered and accepted up to each cap, over the cheapest step with a draft (the cost model is
        non-decreasing in each argument), is a bound on every path's rate. False: `choose`'s walk
        would draft nothing, so it is skipped (a step that drafts nothing costs no walk)."""
        gain = sum(offer[i] * sum(alpha[i] ** j for j in range(1, caps[i] + 1)) for i in can)
        chain = 0 if any(self.matched.get(states[i].rid) for i in can) else 1
        if not chain:   # a lookup-only path pays the lookup steps' penalty, if that is the smaller
            penalty = min(penalty, self.lookup_penalty)
        n = len(states)
        cheapest = self.costs.cost(n + 1, sum(ctx) + min(ctx[i] for i in can), chain) * penalty
        return (n + gain) / cheapest * (1 + 1e-9) >= plain * (1 + self.margin)

    def _known(self, rid) -> bool:
        """Whether a request has been measured enough to be drafted for: a shadow drafter's after
        ``evidence`` of its first drafts; where its lookup matched, after ``evidence`` of its matches'
        (scored for free until then, sampled or greedy: a match's overall rate, learned on other
        text, says little of this request's); else always."""
        _, _, measured = self._source(rid)
        return measured.get(rid, 0) >= (self.match_evidence if measured is self.found_measured else self.evidence)

    def observe(self, states, drafted: list[int], accepted: list[int]) -> None:
        for s, d, a in zip(states, drafted, accepted):
            if d:
                self.idle[s.rid], self._quiet_left = 0, 0   # what was learned ends a quiet spell
                overall, per, measured = self._source(s.rid)
                measured[s.rid] = measured.get(s.rid, 0) + 1
                self._own(per, s.rid).add(d, a)
                overall.add(d, a)

    def observe_scores(self, states, scores: list[float]) -> None:
        """First drafts scored, not verified (`scored`): each accepted with probability ``scores[i]``."""
        for s, p in zip(states, scores):
            self._scored(s.rid, *self._source(s.rid), p)

    def _scored(self, rid, overall: Ewma, per: dict, measured: dict, p: float) -> None:
        """One first draft of ``rid`` scored ``p``: counted in its own rate and the overall one."""
        self._quiet_left = 0
        measured[rid] = measured.get(rid, 0) + 1
        self._own(per, rid).score(p)
        overall.score(p)

    def guess(self, state) -> bool:
        """Score a request's lookup match on the host: its first draft against the token this step
        commits, read by the next `choose` (`_settle`), with no drafts built, moved or compared on the
        device. Greedy, that is the decoder's score (is the draft the emitted token?). Sampled, the step
        at k = 0 draws that token from the target's distribution, so it is the draft with probability
        p(draft), the chance a verify accepts that deterministic draft: the decoder's score is p(draft)
        itself, this is an unbiased draw of it (tests/engine/test_host_drafts.py). False without a match."""
        if not self.matched.get(state.rid):
            return False
        n, end = self.match_at[state.rid]
        self.guesses[state.rid] = (n, state.tokens[end + 1], self._source(state.rid)[0])
        return True

    def _settle(self, states) -> None:
        """Score the `guess`es of requests whose next token is committed (1 if it is the draft), and
        count the offer, as `observe_scores` and `observe_offers` count a score on the device."""
        for state in states:
            at = self.guesses.get(state.rid)
            if at is not None and len(state.tokens) > at[0]:
                del self.guesses[state.rid]
                self._scored(state.rid, at[2], self.found_per, self.found_measured, float(state.tokens[at[0]] == at[1]))
                self._offered(state.rid, 1)   # a match offers

    def _own(self, per: dict, rid) -> Ewma:
        """``rid``'s own rate in ``per`` (made on first use): its lookup matches' (`found_per`), its
        drafter's acceptance or offer rate."""
        e = per.get(rid)
        if e is None:
            e = per[rid] = Ewma(self.match_decay if per is self.found_per else self.request_decay)
        return e

    def observe_offers(self, states, asked: list[int], offered: list[int]) -> None:
        """Where the drafter was asked for ``asked[i]`` > 0 drafts, did it offer any (``offered[i]``)?"""
        for s, a, o in zip(states, asked, offered):
            if a:
                self._offered(s.rid, int(o > 0))

    def _offered(self, rid, offered: int) -> None:
        """Asked for drafts, did ``rid``'s drafter offer any (1) or not (0)?"""
        self._quiet_left = 0
        self._own(self.offered, rid).add(1, offered)
        self.offers.add(1, offered)

    def release(self, state) -> None:
        self._settle([state])   # its last step's guess: the overall rate learns from it
        self._quiet, self._quiet_left = (), 0   # the batch changes: the spell ends, its states are not kept
        self.per.pop(state.rid, None)
        self.measured.pop(state.rid, None)
        self.offered.pop(state.rid, None)
        self.idle.pop(state.rid, None)
        for kept in (self.index, self.matched, self.match_at, self.sampled, self.found_per, self.found_measured,
                     self.guesses):
            kept.pop(state.rid, None)
        if self.memory is not None:
            self.memory.keep(self)
