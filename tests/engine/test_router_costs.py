"""The router's cost of deciding: the cost model's remembered points, the bound that skips the
walk where no draft can pay (the same choices), and the measured draft penalty of a drafter that
is never scored."""

import pytest
import torch

from hal.engine.costs import CostModel
from hal.engine.router import Router
from tests.engine.test_router import _S


def test_the_cost_model_remembers_points_it_interpolated_without_changing_them():
    """`CostModel.cost` keeps each interpolated point (the router asks for the same few every step):
    the values are the table's, first call or later, in range, between points and past the last."""
    from hal.engine.costs import interpolate
    verify, draft = {1: 1.0, 4: 1.6, 9: 3.0}, {1: 0.2, 4: 0.5}
    c = CostModel(dict(verify), dict(draft), per_context=0.01)
    for _ in range(2):
        for fed in (1, 2, 3, 4, 7, 9, 12):
            for chain in (0, 1, 3, 6):
                want = interpolate(verify, fed) + 0.01 * 5 * fed + (interpolate(draft, chain) if chain else 0.0)
                assert c.cost(fed, 5 * fed, chain) == pytest.approx(want, rel=0, abs=1e-12)
    assert CostModel({1: 1.0}).cost(3, 0, 2) == 3.0   # no draft table: a chain adds nothing


def test_skipping_the_walk_where_no_draft_can_pay_changes_no_choice():
    """`Router._may_pay` bounds every draft path's rate: where it says no path beats plain by the
    margin, the walk is skipped. On random cost models, acceptances, caps and batches the choices
    equal those of the walk always taken; a bound that forgets the offers' gains (a planted
    mutant) changes some."""
    import random
    rng = random.Random(5)

    def choices(may_pay, seed):
        g = random.Random(seed)
        out = []
        for _ in range(300):
            pts = sorted(g.sample(range(2, 40), 3))
            verify = {1: 1.0, **{p: 1.0 + g.uniform(0.02, 0.3) * (p - 1) for p in pts}}
            draft = {1: g.uniform(0.0, 0.6), 4: g.uniform(0.6, 1.5)}
            r = Router(CostModel(verify, draft, g.uniform(0, 1e-4)), max_k=g.randint(1, 8), probe_every=0,
                       prior=g.uniform(0.05, 0.95), margin=g.choice([0.0, 0.1]))
            if may_pay is not None:
                r._may_pay = may_pay(r)
            states = [_S(i, k=g.randint(0, 8), ctx=g.randint(1, 300), left=g.randint(1, 20)) for i in range(g.randint(1, 6))]
            for s in states:
                d = g.randint(1, 6)
                for _ in range(g.randint(0, 4)):
                    r.observe([s], [d], [g.randint(0, d)])
            out.append(r.choose(states))
        return out
    seeds = [rng.randrange(1 << 30) for _ in range(3)]
    for seed in seeds:
        assert choices(None, seed) == choices(lambda r: (lambda *a: True), seed)
    forgetful = lambda r: (lambda states, can, caps, ctx, alpha, offer, plain, penalty: Router._may_pay(   # noqa: E731
        r, states, can, caps, ctx, alpha, {i: 0.0 for i in offer}, plain, penalty))
    assert any(choices(None, s) != choices(forgetful, s) for s in seeds)
    assert sum(map(any, choices(None, seeds[0]))) > 30   # the cases draft often enough to matter


def test_a_drafter_that_is_never_scored_still_pays_its_measured_draft_penalty():
    """Steps with drafts that run 1.5x slower than modelled, against plain steps as modelled, make
    drafting 1.5x dearer in the router's model, whether or not the drafter is ever scored (a block
    drafter is not: its steps that only score are none); and its idle requests are probed less often."""
    costs = CostModel({1: 1.0, 2: 1.05, 9: 1.6}, {1: 0.2})
    r = Router(costs, max_k=4, probe_every=16)
    probes = r._probe_interval([_S("a")], [0], [4])
    for _ in range(6):
        r.observe_step(1, 0, 0, costs.cost(1, 0, 0))
        r.observe_step(3, 2, 2, 1.5 * costs.cost(3, 0, 2))
    assert r.ratio_steps[2] == 0 and r.draft_penalty == pytest.approx(1.5)
    assert r._probe_interval([_S("a")], [0], [4]) > probes


def test_lookup_matches_pay_the_penalty_measured_on_their_own_steps():
    """Steps whose drafts were all a lookup's matches are measured apart from steps with a model's
    drafts: a model's drafts measured 2x dearer than modelled (the drafter's forward beyond its
    profile) leave matched drafts at their own measured cost, so a well-accepted match is still
    drafted while the model's drafts at about the same acceptance are not (before stop 79 one penalty
    for both kept a copy-heavy request of ``ngram+eagle`` from drafting at all)."""
    costs = CostModel({1: 1.0, 2: 1.05, 9: 1.6}, {1: 0.2, 4: 0.5})
    r = Router(costs, max_k=4, probe_every=0, lookup=(2, 3), fallback=True, evidence=0)   # matches drafted at once
    copy = _S("copy")
    copy.tokens = [5, 6, 7, 8, 9] * 20            # the last tokens occurred before: a lookup match
    fresh = _S("fresh")
    fresh.tokens = list(range(100, 200))          # no match: the model would draft
    for _ in range(8):
        assert sum(r.choose([copy])) > 0 and r._lookup_only   # drafts where the lookup matched
        r.observe_step(5, 4, 4, costs.cost(5, 0, 0))
        r.choose([fresh])
        r.observe_step(5, 4, 4, 2.0 * costs.cost(5, 0, 4))
        r.observe_step(1, 0, 0, costs.cost(1, 0, 0))
        r.observe([copy], [4], [1])
    assert r.lookup_penalty == pytest.approx(1.0) and r.draft_penalty == pytest.approx(2.0, rel=0.01)
    for _ in range(20):
        r.observe([fresh], [4], [1])
    assert r.acceptance("fresh") == pytest.approx(r.acceptance("copy"), abs=0.05)   # the same acceptance
    assert sum(r.choose([copy])) > 0 and r.choose([fresh]) == [0]


def test_a_lookup_match_is_scored_every_step_and_such_steps_count_as_plain():
    """Scoring a lookup match's first draft runs no drafter, so a greedy request whose lookup
    matched is scored on every step at k = 0, however dear the model's scoring was measured
    (`score_every`), and a step that scores only such drafts is measured as a plain step.
    (Before stop 79 the demo's copy-heavy request under ``ngram+eagle`` drafted nothing after one
    rejected lookup draft: the head's scoring had set `score_every` to 64, and the matched request,
    at k = 0, was not measured again.)"""
    costs = CostModel({1: 1.0, 2: 2.0, 9: 9.0})   # drafts never pay: k = 0 throughout
    r = Router(costs, max_k=4, shadow=True, evidence=0, probe_every=16, lookup=(2, 3), fallback=True)
    plain = costs.cost(2, 0, 0)
    for _ in range(4):
        r.observe_step(2, 0, 0, plain)
        r.observe_step(2, 0, 0, 1.5 * plain, scored=2)   # the model's scoring: half a step more
    every = r.score_every
    assert every > 8
    copy, fresh = _S("copy"), _S("fresh")
    copy.tokens, fresh.tokens = [5, 6, 7, 8, 9] * 20, list(range(100, 200))   # a match; none
    before, dear = r.ratio_steps[2], 0
    for _ in range(every):
        assert r.choose([copy, fresh]) == [0, 0]
        assert "copy" in r.guesses and "copy" not in r.scored   # scored on the host (`Router.guess`)
        dear += "fresh" in r.scored
        r.observe_step(2, 0, 0, plain, scored=len(r.scored))
    assert dear <= 2 and r.ratio_steps[2] - before == dear   # its phase, or a probe fallen due


def test_no_probe_or_cadence_scoring_without_the_tokens_left_to_use_it_on():
    """A probe (or a scoring at the cadence) measures a request for the steps after it: a request
    with fewer tokens left than the interval is not probed or scored, one with more is."""
    from tests.engine.test_router import _S
    costs = CostModel({1: 1.0, 2: 1.001})   # probes cheap: every probe_every = 4 steps
    for left, probed in ((100, True), (4, False)):   # room: left - 1 drafts
        r = Router(costs, max_k=4, probe_every=4)
        s = _S("x", left=left)
        for _ in range(10):
            r.observe([s], [4], [0])
        assert any(r.choose([s])[0] for _ in range(8)) == probed, left
    dear = CostModel({1: 1.0, 2: 2.0, 9: 9.0})   # scoring measured at 5%: every 5th step
    for left, scored in ((100, True), (3, False)):
        r = Router(dear, max_k=4, shadow=True, evidence=0, probe_every=64)
        for _ in range(4):
            r.observe_step(2, 0, 0, dear.cost(2, 0, 0))
            r.observe_step(2, 0, 0, 1.05 * dear.cost(2, 0, 0), scored=2)
        assert r.score_every == 5
        seen = 0
        for _ in range(10):
            r.choose([_S("a", left=left), _S("b", left=left)])
            seen += len(r.scored)
        assert (seen > 0) == scored, left


def _spell_trace(spell: int, seed: int, mutant=None) -> tuple[list, int]:
    """Every choice and scoring of routers driven step by step over random drafters (a model's,
    a shadow one's, a lookup alone or before a model), costs, acceptances and batches, with
    ``spell`` (0: no quiet spells); and how many steps were quiet."""
    import random
    from hal.engine.requests import draft_room
    g, out, quiet = random.Random(seed), [], 0
    for case in range(80):
        kind = g.choice(["model", "shadow", "lookup", "fallback"])
        r = Router(CostModel({1: 1.0, 2: 1.0 + g.uniform(0.01, 0.6), 9: g.uniform(2.0, 7.0)},
                             {1: g.uniform(0.0, 0.4), 4: g.uniform(0.4, 1.5)}),
                   max_k=g.randint(1, 6), probe_every=g.choice([0, 3, 8, 16]), prior=g.uniform(0.05, 0.9),
                   shadow=kind != "model", evidence=g.choice([0, 2]), spell=spell,
                   lookup=(2, 3) if kind in ("lookup", "fallback") else None, fallback=kind == "fallback")
        if mutant is not None:
            r._spell_length = mutant(r)
        n = g.randint(1, 3)   # a batch's requests never run short of draft room (a shorter cap can make a walk pay)
        live = [_S(i, k=g.randint(1, 6), left=g.randint(4, 90) if n == 1 else 2000, temperature=g.choice([0.0, 0.7]))
                for i in range(n)]
        accept = {s.rid: g.random() for s in live}
        for s in live:
            s.tokens = [g.randrange(12) for _ in range(g.randint(1, 60))]
        for step in range(120):
            live = [s for s in live if draft_room(s) >= 0]
            if not live:
                break
            before = r._quiet_left
            ks = r.choose(live)
            quiet += bool(before) and r._quiet_left == before - 1
            out.append((case, step, tuple(ks), tuple(sorted(r.scored))))
            scored = [s for s in live if s.rid in r.scored]
            r.observe_scores(scored, [float(g.random() < accept[s.rid]) for s in scored])
            for s, k in zip(live, ks):
                a = next((j for j in range(k) if g.random() >= accept[s.rid]), k)
                r.observe([s], [k], [a])
                r.observe_offers([s], [k], [1])
                new = [g.randrange(12) for _ in range(a + 1)]
                s.tokens += new
                s.generated += new
    return out, quiet


def test_quiet_spells_change_no_choice_where_nothing_drifts():
    """After a step that drafts, scores and probes nothing, the router repeats that choice without
    the walk until the next probe or score falls due (`hal.engine.route_cadence`: a quiet spell).
    Where the costs have no context term and no step is timed, every choice and scoring equals the
    router's without spells (``spell=0``) over random drafters, costs, acceptances and batches, and
    most such steps were quiet; a spell that ignores the cadence (a planted mutant) changes some."""
    for seed in (1, 2):
        spelled, quiet = _spell_trace(8, seed)
        plain, none = _spell_trace(0, seed)
        assert spelled == plain and none == 0
        assert quiet > len(spelled) // 4, (quiet, len(spelled))
    deaf = lambda r: (lambda states, ks, caps: 0 if any(ks) or r.scored else r.spell)   # noqa: E731
    assert _spell_trace(8, 1, deaf)[0] != _spell_trace(0, 1)[0]
    from hal.errors import HalError
    for bad in (-1, 1001):
        with pytest.raises(HalError, match="spell"):
            Router(CostModel({1: 1.0}), spell=bad)


@pytest.mark.parametrize("spell", [8, 0])
def test_a_request_the_drafter_never_pays_for_walks_only_around_its_probes(spell):
    """An engine whose drafter's every draft is rejected: once the router has learned that, the
    request runs at k = 0, probed every `probe_every` steps or more (as the probes' measured cost
    allows). With quiet spells the router walks on the probe steps, the step after each, and every
    ``spell``-th step between: under a third of the steps; without (``spell=0``, the planted
    contrast) it walks on every step. The output is plain greedy's either way."""
    import hal
    from hal.engine import Request, SpeculativeDecoder
    from tests.engine.test_router import ToyTarget, constant_drafter
    be = hal.get_backend("cpu")
    p, q = torch.tensor([0.999, 0.001]), torch.tensor([0.001, 0.999])   # the drafter always says 1, the target 0
    router = Router(CostModel({1: 1.0, 8: 1.3, 64: 4.0}), max_k=4, probe_every=16, spell=spell)
    walks = []
    spell_length = router._spell_length
    router._spell_length = lambda *a: walks.append(1) or spell_length(*a)
    dec = SpeculativeDecoder(ToyTarget(be, p), constant_drafter(be, q), num_blocks=64, router=router)
    out = dec.generate([Request([0], max_new_tokens=240, temperature=0.0, k=4)])[0]
    assert out == [0] * 240
    assert 3 <= dec.metrics.total.num_drafts <= 20   # the prior's first drafts, then a probe every 16 to 64 steps
    if spell:
        assert len(walks) < 240 / 3, len(walks)
    else:
        assert len(walks) == dec.steps - 1   # every decode step (the first step prefills)
