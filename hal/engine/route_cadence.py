"""The router's learning cadence: when a request at k = 0 is measured, and when a step may skip routing.

A free deterministic (``shadow``) drafter's request at k = 0 is measured without a verify: the
decoder scores its first draft against the step's own target row, as the emitted token
(greedy) or as p(draft) (sampled); it is drafted for only once ``evidence`` of its own first
drafts were measured, so the prior is never spent on a verify. Scoring is free for n-gram
lookup but not for an EAGLE head (docs/benchmarks.md, "Scoring a head's first drafts"): its
cost is measured, and a greedy request's first draft is scored every `score_every`
steps, as often as keeps that cost within ``LEARN_SHARE`` of the time. Other drafters' idle
requests are probed with one verified draft now and then, within the same share.

Between those, a step on which the router chose nothing is repeated for the same requests
without the walk (a quiet spell, `RouteCadence._spell_length`), so a step that drafts nothing
costs next to nothing. `RouteCadence` is `hal.engine.router.Router`'s base: it reads the
router's rates and counters, and its methods run as the router's.
"""

from __future__ import annotations

import math

from hal.engine.requests import draft_room


LEARN_SHARE = 0.01   # keeping requests at k = 0 measured (scores, probes) may cost this share of the time
QUIET = 8            # while scoring every step, every QUIET-th step scores nothing: a plain step to compare
SPELL = 8            # at most this many steps repeat a choice of nothing (`RouteCadence._spell_length`)


class RouteCadence:
    """When `hal.engine.router.Router`'s requests at k = 0 are scored or probed, and its quiet spells."""

    @property
    def score_every(self) -> int:
        """Steps between scorings of a greedy request's first draft at k = 0: the fewest that keep
        scoring's extra cost within ``LEARN_SHARE`` of the time, at most four times ``probe_every``
        (1 where it is as cheap as a plain step: n-gram lookup). The extra cost is measured (scored
        steps against plain ones), or until both have 4 steps, the profiled cost of a one-draft
        chain over a one-token step."""
        if min(self.ratio_steps[0], self.ratio_steps[2]) < 4 or self.ratio[0] <= 0:
            c = self.costs   # unmeasured: the profiled chain of one draft over a one-token step
            extra = c.chain_at(1) / c.forward_at(1) if c.draft and c.verify else 0.0
        else:
            extra = self.ratio[2] / self.ratio[0] - 1
        return max(1, min(4 * (self.probe_every or 1), math.ceil(extra / LEARN_SHARE - 1e-9)))

    def _spell_length(self, states, ks: list[int], caps: list[int]) -> int:
        """The steps after this one on which `choose` would again draft, score and probe nothing
        (the same requests running, no lookup match): none where this step did anything or matched, else
        until the first probe or score falls due (`_keep_learning`'s cadence), at most ``spell``.
        Those steps skip the walk and the cadence (`_quiet_step`): a step that drafts nothing costs
        next to nothing. Exact where context lengths and measured costs stay put
        (tests/engine/test_router_costs.py); where they move, a choice of nothing is at most ``spell`` steps old."""
        if any(ks) or self.scored or any(self.matched.get(state.rid) for state in states):
            return 0   # a match's rates are not the model's: a spell starts and holds with no match
        length, every, interval = self.spell, self._every, self._interval
        for state, cap in zip(states, caps):
            if not cap:
                continue
            left, rid = draft_room(state), state.rid
            first = max(1, interval - self.idle[rid])   # steps to its probe (a shadow drafter's: its score)
            if self.probe_every and left - first >= interval:
                length = min(length, first - 1)
            if self.shadow and state.req.temperature == 0:   # the next step of greedy scoring
                first = next(j for j in range(1, every + 2) if self._scoring_step(self.steps + j, every))
                if left - first >= every:
                    length = min(length, first - 1)
        return length

    def _quiet_step(self, states) -> list[int]:
        """A step of a quiet spell (`_spell_length`): nothing drafted, scored or probed, the requests'
        idle steps counted as `_keep_learning` counts them."""
        self._quiet_left -= 1
        self.steps += 1
        for state in states:
            self.idle[state.rid] += 1
        return [0] * len(states)

    def _keep_learning(self, states, ks: list[int], caps: list[int], budget: int | None) -> None:
        """Requests at k = 0 keep being measured. A ``shadow`` drafter's first draft is scored by
        the decoder without verifying it (`scored`): a greedy request's every `score_every` steps
        (all at once; when that is every step, all but every ``QUIET``-th, a plain step that keeps
        the comparison measured) and on any step that drafts for another request (the drafter
        runs then anyway), a sampled one's when a probe is due, and any while not yet `_known`. A
        greedy request whose lookup matched is scored every step; a sampled one as a shadow drafter's
        (scored on every step, its rate would learn most from the matches not worth drafting: the 1-gram
        ones). The router scores a match's first draft on the host (`guess`). Other drafters' idle
        requests are probed with one verified draft every `_probe_interval` plain steps. Scorings at
        the cadence and probes are for requests with at least a cadence's tokens left (`draft_room`):
        what they measure pays only over the tokens left to use it on."""
        self.scored, self.steps = set(), self.steps + 1
        every = self._every = self.score_every if self.shadow else 1   # asks_next reads it on the same step
        interval = self._interval = self._score_interval(every) if self.shadow else self._probe_interval(
            states, ks, caps)
        drafting, phase = any(ks), self._scoring_step(self.steps, every)
        for i, state in enumerate(states):
            rid = state.rid
            self.idle[rid] = 0 if ks[i] else self.idle.get(rid, 0) + 1
            if ks[i] or not caps[i]:
                continue
            left = draft_room(state)
            due = bool(self.probe_every) and self.idle[rid] >= interval and left >= interval
            greedy = drafting or (phase and left >= every)
            matched = self.matched.get(rid)   # a lookup match is free to score (no drafter runs): every step
            if (self.shadow or matched) and (
                    (state.req.temperature == 0 and (greedy or matched)) or due or self._wants_evidence(rid)):
                if not self.guess(state):   # a match's draft is scored on the host
                    self.scored.add(rid)
                if due:
                    self.idle[rid] = 0
            elif due and (budget is None or len(states) + sum(ks) < budget):
                ks[i], self.idle[rid] = 1, 0

    def asks_next(self, states, ks: list[int]) -> set:
        """The requests of ``states`` (this step's, at ``ks``) that the next `choose` is likely to
        ask for drafts or a score: those drafted for now, and those whose scoring or probe falls
        due. A lookahead drafter drafts ahead for these only (`hal.engine.proposals.lookahead`): on
        a step that drafts nothing, nothing is drafted ahead to be thrown away. None for a drafter
        with a host lookup: where the next step's lookup matches, its drafts are read on the host
        (`continuation`), and what it finds is not known yet. A forecast, not a promise: a request
        asked after all is drafted for inline, so a wrong forecast costs time, never output."""
        if self.lookup is not None:
            return set()
        every = self._every
        phase = self._scoring_step(self.steps + 1, every)
        interval = self._score_interval(every) if self.shadow else self.probe_every
        out = set()
        for state, k in zip(states, ks):
            rid = state.rid
            left = draft_room(state) - 1   # after this step
            due = bool(self.probe_every) and self.idle.get(rid, 0) + 1 >= interval and left >= interval
            if k or due or (self.shadow and (self._wants_evidence(rid) or (
                    phase and left >= every and state.req.temperature == 0))):
                out.add(rid)
        return out

    def _score_interval(self, every: int) -> int:
        """Idle steps before a shadow drafter's request is scored whatever the phase: as often as
        scoring is worth (`score_every`), at least every ``probe_every``."""
        return max(self.probe_every, every)

    @staticmethod
    def _scoring_step(step: int, every: int) -> bool:
        """Whether greedy requests at k = 0 are scored on ``step``: every ``every``-th, or where that
        is every step, all but every ``QUIET``-th (a plain step to compare)."""
        return step % every == 0 if every > 1 else step % QUIET != 0

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
        extra = self.costs.cost(fed + 1, 0, max(top, 1)) * self.draft_penalty - base   # as measured to run
        return max(self.probe_every, min(4 * self.probe_every, math.ceil(idle * extra / (LEARN_SHARE * base))))

    def _wants_evidence(self, rid) -> bool:
        """Whether a request not yet `_known` is scored now rather than at the usual cadence: a lookup
        match's first draft (cheap), or the drafter's while its overall rate is unmeasured or says a
        first draft may pay. Where the overall rate says it does not, learning the request first
        would cost more than it could return; it is still scored every `score_every` steps."""
        if self._known(rid):
            return False
        if self.matched.get(rid) or self.glob.trials < 4:
            return True
        a, c = self.glob.rate(self.prior, 1.0), self.costs
        return (1 + a) / (c.cost(2, 0, 1) * self.draft_penalty) > (1 + self.margin) / c.cost(1, 0, 0)
