"""Routing and adaptive k: the policy is non-anticipating, so the output distribution is
the target's (DSpark counterexample included, and a planted peeking policy is caught);
k follows acceptance and cost, and shrinks smoothly with batch size."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import hal
from hal.conformance._helpers import assert_distribution
from hal.engine import Request, SpeculativeDecoder
from tests.drafters.toy_heads import ToyEagleDrafter
from hal.engine.costs import CostModel
from hal.engine.acceptance import expected_tokens
from hal.engine.router import Router


@dataclass
class ToyConfig:
    vocab: int
    kv_heads: int = 1
    head_dim: int = 16
    layers: int = 1


class ToyTarget:
    """A target model whose next-token distribution is ``p`` at every position (the
    test's stand-in for a network; every op on the path is the backend's own)."""

    def __init__(self, be, p: torch.Tensor):
        self.be, self.cfg, self.device = be, ToyConfig(p.numel()), torch.device(be.device_type)
        self.logp = p.log()

    def forward(self, batch, k_caches, v_caches, tree_mask=None):
        n = batch.logits_rows.shape[0]
        return self.logp.expand(n, -1).clone(), torch.zeros(n, 4)


def constant_drafter(be, q: torch.Tensor) -> ToyEagleDrafter:
    """Drafts from ``q`` at every position (the DSpark draft), through the real drafter."""
    return ToyEagleDrafter(lambda h, x: (q.log().expand(len(x), -1), h), be)


class PeekingDrafter:
    """PLANTED non-anticipating violation: looks at the drafted tokens before deciding
    how many to verify (keeps drafts only up to the first token 1): DSpark's counterexample."""

    def __init__(self, inner):
        self.inner = inner

    def propose(self, batch):
        prop = self.inner.propose(batch)
        ids, cu = prop.draft_token_ids.tolist(), prop.cu_num_draft_tokens.tolist()
        rows = [ids[a:b] for a, b in zip(cu, cu[1:])]
        keep = tuple(d.index(1) if 1 in d else len(d) for d in rows)
        return dataclasses.replace(prop, num_valid=torch.tensor(keep))

    def commit(self, *a):
        pass

    def release(self, rid):
        self.inner.release(rid)


def emitted(be, p, drafter, router, requests=12, tokens=160, seed=0):
    target = ToyTarget(be, p)
    dec = SpeculativeDecoder(target, drafter, num_blocks=64 * requests, router=router)
    reqs = [Request([0], max_new_tokens=tokens, temperature=1.0, seed=seed * 1000 + i, k=6) for i in range(requests)]
    return dec.generate(reqs), dec


def adaptive_router(max_k=6):
    # verify cost grows slowly with fed tokens: the router speculates and moves k with the EWMA
    return Router(CostModel({1: 1.0, 8: 1.3, 64: 4.0}), max_k=max_k, request_decay=0.5)


P2, Q2 = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])


@pytest.mark.parametrize("policy", ["fixed-k", "adaptive"])
def test_dspark_counterexample_keeps_the_target_distribution(policy):
    be = hal.get_backend("cpu")
    router = adaptive_router() if policy == "adaptive" else None
    out, dec = emitted(be, P2, constant_drafter(be, Q2), router)
    toks = torch.tensor([t for o in out for t in o])
    assert_distribution(toks, P2, f"DSpark p=(0.7,0.3) q=(0.5,0.5), {policy}")
    pairs = torch.tensor([a * 2 + b for o in out for a, b in zip(o, o[1:])])
    assert_distribution(pairs, torch.outer(P2, P2).flatten(), f"consecutive pairs, {policy}")
    assert dec.metrics.total.num_draft_tokens > 500
    if router is not None:  # the router really varied k
        assert len(dec.metrics.total.drafts_per_position) >= 2


def test_planted_peeking_policy_is_caught():
    """At a fixed k = 6: the router learns that this drafter offers nothing on half its steps
    (its first draft is token 1) and asks it for less, which would blunt the planted bias."""
    be = hal.get_backend("cpu")
    out, _ = emitted(be, P2, PeekingDrafter(constant_drafter(be, Q2)), None)
    toks = torch.tensor([t for o in out for t in o])
    with pytest.raises(AssertionError, match="chi-square"):
        assert_distribution(toks, P2, "peeking policy")
    share = float((toks == 0).float().mean())
    assert 0.78 < share < 0.9, share  # DSpark: (0.7, 0.3) becomes about (0.85, 0.15)


def test_adaptive_k_on_a_wider_vocabulary():
    be = hal.get_backend("cpu")
    g = torch.Generator().manual_seed(3)
    p, q = torch.rand(6, generator=g) + 0.05, torch.rand(6, generator=g) + 0.05
    p, q = p / p.sum(), q / q.sum()
    out, dec = emitted(be, p, constant_drafter(be, q), adaptive_router(), seed=1)
    assert_distribution(torch.tensor([t for o in out for t in o]), p, "adaptive k, V=6")


class _S:  # the fields a router reads
    def __init__(self, rid, k=8, ctx=100, left=100, temperature=0.0):
        self.rid, self.tokens, self.generated = rid, [0] * ctx, []
        self.req = Request([0], max_new_tokens=left, k=k, temperature=temperature)


def test_router_follows_acceptance_and_respects_caps():
    costs = CostModel({1: 1.0, 2: 1.05, 9: 1.6, 64: 6.0})
    r = Router(costs, max_k=8)
    hi, lo = _S("hi"), _S("lo")
    for _ in range(20):
        r.observe([hi, lo], [4, 4], [4, 0])
    ks = r.choose([hi, lo])
    assert ks[0] >= 4 and ks[1] == 0, ks
    assert r.choose([_S("hi", k=2)])[0] <= 2                      # Request.k caps
    assert r.choose([_S("hi", left=3)])[0] <= 2                   # never past max_new_tokens
    assert Router(costs, max_k=0).choose([hi]) == [0]


def test_idle_requests_are_probed_as_often_as_the_probes_cost_allows():
    """A cheap probe (one more fed token costs 0.1% of a step): every ``probe_every`` plain steps.
    Dear ones (4 idle requests, each probe a quarter of a step, as a verified draft at batch 4 on
    an AVX2-only CPU costs): every ceil(4 x 1 / (LEARN_SHARE x 4)) = 100 steps, at most 4 x probe_every."""
    r = Router(CostModel({1: 1.0, 2: 1.001}), max_k=4, probe_every=4)
    s = _S("x")
    for _ in range(10):
        r.observe([s], [4], [0])
    ks = [r.choose([s])[0] for _ in range(8)]
    assert ks == [0, 0, 0, 1, 0, 0, 0, 1]
    dear = CostModel({1: 1.0, 4: 4.0, 5: 5.0, 9: 9.0})
    for every, want in ((16, 64), (4, 16)):
        r = Router(dear, max_k=4, probe_every=every)
        batch = [_S(f"r{i}") for i in range(4)]
        for _ in range(10):
            r.observe(batch, [4] * 4, [0] * 4)
        probes = [i for i in range(1, 2 * want + 1) if any(r.choose(batch))]
        assert probes[:2] == [want, 2 * want], (every, probes)


def test_a_drafter_that_rarely_offers_is_not_asked_but_probed():
    """N-gram lookup on open-ended text: asked for drafts, it finds no match on most steps.
    Drafts it does offer are accepted at 0.9, but at an offer rate of 1 in 10 the expected gain
    (0.1 x 0.9 tokens for the first draft) is within the margin, so k goes to 0. A shadow-scored
    drafter's requests are then never verified at k > 0: the decoder scores a greedy one's first
    draft on (nearly) every step and a sampled one's every `probe_every` plain steps (`Router.scored`); a
    drafter that cannot be scored has its sampled request probed with one verified draft."""
    costs = CostModel({1: 1.0, 2: 1.02, 9: 1.1, 64: 4.0})
    sampled, greedy = _S("t", temperature=0.7), _S("g")
    r = Router(costs, max_k=8, probe_every=4, shadow=True)
    assert r.choose([sampled])[0] == 0 and r.scored == {"t"}   # a shadow drafter's request: scored before drafted
    assert Router(costs, max_k=8, probe_every=4).choose([sampled])[0] >= 4   # another's: the prior, offers assumed
    for step in range(40):
        offered = int(step % 10 == 0)
        r.observe_offers([sampled, greedy], [8, 8], [offered * 8, offered * 8])
        r.observe([sampled, greedy], [offered * 8] * 2, [offered * 7] * 2)
    assert r.offer_rate("t") < 0.25 and r.acceptance("t") > 0.8, (r.offer_rate("t"), r.acceptance("t"))
    plain = Router(costs, max_k=8, probe_every=4)   # the same measurements, no shadow scoring
    plain.per, plain.glob, plain.offered, plain.offers = r.per, r.glob, r.offered, r.offers
    ks, scored = [], []
    for _ in range(8):
        ks.append(r.choose([sampled, greedy]))
        scored.append(sorted(r.scored))
    assert all(k == [0, 0] for k in ks), ks
    # "g" every step but the QUIET-th (the router's 8th call: a plain step to compare); "t" when due
    assert scored == [["g"], ["g"], ["g"], ["g", "t"], ["g"], ["g"], [], ["g", "t"]], scored
    assert [plain.choose([sampled, greedy])[0] for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1] and not plain.scored
    r.release(sampled)
    assert "t" not in r.offered
    always = Router(costs, max_k=8, probe_every=4, shadow=True)   # the same acceptance, always offered
    for _ in range(40):
        always.observe_offers([sampled], [8], [8])
        always.observe([sampled], [8], [7])
    assert always.choose([sampled])[0] >= 4


def test_scoring_that_costs_is_spread_over_steps_and_free_scoring_is_not():
    """Scoring measured at 5% over a plain step (an EAGLE head's feed and first draft): greedy
    requests at k = 0 are scored together every 5th step (5% / LEARN_SHARE); at 1% (n-gram
    lookup) on every step but every QUIET-th; unmeasured, like the latter. A probe that falls due
    is scored whatever the phase, and a step that drafts for one request scores the others."""
    from hal.engine.router import QUIET
    costs = CostModel({1: 1.0, 2: 2.0, 9: 9.0})   # drafts never pay: k = 0 throughout
    plain = costs.cost(2, 0, 0)
    for extra, every, want in ((0.05, 5, [0, 0, 0, 0, 2, 0, 0, 0, 0, 2, 0, 0, 0, 0, 2, 2]),
                               (0.01, 1, [2] * 7 + [0] + [2] * 8)):
        r = Router(costs, max_k=4, shadow=True, evidence=0, probe_every=2 * QUIET)
        assert r.score_every == 1
        for _ in range(4):
            r.observe_step(2, 0, 0, plain)
            r.observe_step(2, 0, 0, (1 + extra) * plain, scored=2)
        assert r.score_every == every
        seen = []
        for _ in range(2 * QUIET):
            assert r.choose([_S("a"), _S("b")]) == [0, 0]
            seen.append(len(r.scored))
        assert seen == want, (extra, seen)
    r = Router(CostModel({1: 1.0, 2: 1.5, 9: 5.0, 64: 40.0}), max_k=4, shadow=True, evidence=0)   # pays at a > 0.5
    r.steps, r.ratio, r.ratio_steps = 1, [1.0, 0.0, 1.5, 0.0], [8, 0, 8, 0]   # scoring measured dear: every 50th step
    good, poor = _S("good"), _S("poor")
    for _ in range(20):
        r.observe([good], [4], [4])
        r.observe_scores([poor], [0.0])
    assert r.choose([good, poor])[0] > 0 and r.scored == {"poor"}


def test_a_shadow_drafters_request_is_measured_before_the_prior_buys_a_verify():
    """A new request of a shadow (free, scored) drafter starts at k = 0 with its first drafts
    scored, whatever the prior promises, until ``evidence`` of its own are measured; then the
    router drafts where they were good and not where they were poor. A drafter that cannot be
    scored keeps the prior (its probes would cost verifies). On sampled open-ended chat the
    prior (0.6) had bought verifies of k = 3 at the start of requests whose drafts were then
    accepted at about a third: slower tokens than plain decoding at low load."""
    costs = CostModel({1: 1.0, 2: 1.3, 9: 3.0, 64: 20.0})   # each fed token costs: poor drafts do not pay
    for p, drafts in ((0.95, True), (0.05, False)):
        r = Router(costs, max_k=8, prior=0.6, shadow=True, evidence=2)
        s = _S(f"s{p}", temperature=0.7)
        for step in range(2):
            assert r.choose([s]) == [0] and r.scored == {s.rid}, step
            r.observe_scores([s], [p])
        assert (r.choose([s])[0] > 0) == drafts, p
    assert Router(costs, max_k=8, prior=0.6, evidence=2).choose([_S("v", temperature=0.7)])[0] > 0
    r = Router(costs, max_k=8, prior=0.6, shadow=True, evidence=0)   # evidence 0: the prior drafts at once
    assert r.choose([_S("z", temperature=0.7)])[0] > 0
    with pytest.raises(hal.HalError, match="evidence"):
        Router(costs, evidence=-1)


def test_a_scored_first_draft_counts_as_its_acceptance_probability():
    """A scored (unverified) first draft adds its acceptance probability p to the accepted
    count and one trial, so scores of p converge to an acceptance of p (0/1 scores are the
    same as a verified draft of one); the router then drafts where p is high."""
    costs = CostModel({1: 1.0, 2: 1.02, 9: 1.1, 64: 4.0})
    hi, lo = _S("hi", temperature=0.7), _S("lo", temperature=0.7)
    for s, p, want in ((hi, 0.9, lambda k: k >= 4), (lo, 0.05, lambda k: k == 0)):
        r = Router(costs, max_k=8, shadow=True)
        for _ in range(200):
            r.observe_scores([s], [p])
        assert r.acceptance(s.rid) == pytest.approx(p, abs=0.02)
        assert want(r.choose([s])[0]), (p, r.choose([s]))
    r, v = Router(costs, max_k=8, shadow=True), Router(costs, max_k=8)
    for a in (1, 0, 1, 1, 0):
        r.observe_scores([_S("x")], [float(a)])
        v.observe([_S("x")], [1], [a])
    assert (r.per["x"].accepted, r.per["x"].trials) == (v.per["x"].accepted, v.per["x"].trials)


def test_k_shrinks_smoothly_with_batch_size():
    # compute-bound verify: cost grows linearly past 16 fed tokens
    costs = CostModel({1: 1.0, 16: 1.2, 64: 4.8, 256: 19.2})
    r = Router(costs, max_k=8, prior=0.8)
    mean_k, tput = [], []
    for b in (1, 2, 4, 8, 16, 32):
        states = [_S(i) for i in range(b)]
        ks = r.choose(states)
        mean_k.append(sum(ks) / b)
        tput.append(sum(expected_tokens(r.acceptance(s.rid), k) for s, k in zip(states, ks))
                    / costs.step(ks, [100] * b))
    assert all(a >= b for a, b in zip(mean_k, mean_k[1:])), mean_k
    assert mean_k[0] >= 4 and mean_k[-1] <= 1, mean_k
    plain = [b / costs.step([0] * b, [100] * b) for b in (1, 2, 4, 8, 16, 32)]
    assert all(t >= p for t, p in zip(tput, plain)), (tput, plain)   # never worse than plain, by the model
    assert all(b >= 0.95 * a for a, b in zip(tput, tput[1:])), tput  # no cliff


def test_a_gain_within_the_margin_is_not_taken():
    """Speculating only where it pays: at acceptance 0.08 one draft is predicted 2.9% faster
    than plain decoding on this cost model (1.08 tokens for 1.05x the cost), within the
    router's 10% margin for the measured cost's error, so k is 0; with no margin it drafts,
    and a gain well past the margin (acceptance 0.9) is taken."""
    costs = CostModel({1: 1.0, 2: 1.05, 3: 1.1})
    low = _S("low", k=1)
    for margin, want in ((0.1, [0]), (0.0, [1])):
        r = Router(costs, max_k=1, prior=0.08, margin=margin, probe_every=0)   # nothing observed: the prior
        assert r.acceptance("low") == pytest.approx(0.08)
        assert r.choose([low]) == want, margin
    assert Router(costs, max_k=2, prior=0.9, probe_every=0).choose([_S("hi", k=2)]) == [2]


class _Counted:
    """N-gram lookup that counts how often it is asked to draft."""

    def __init__(self, inner):
        self.inner, self.calls, self.shadow, self.lookahead = inner, 0, inner.shadow, inner.lookahead

    def propose(self, batch):
        self.calls += 1
        return self.inner.propose(batch)

    def commit(self, *a):
        self.inner.commit(*a)

    def release(self, rid):
        self.inner.release(rid)


def test_sampled_requests_routed_to_plain_are_not_drafted_for_every_step():
    """A verify cost that grows one for one with fed tokens: drafts never pay, so sampled requests
    run at k = 0, and n-gram lookup (a lookahead drafter) is asked only by the router's probes
    (every 16 plain steps), not on each of the 160 steps; the output keeps the target's law."""
    from hal.drafters.ngram import NgramDrafter
    be = hal.get_backend("cpu")
    ngram = _Counted(NgramDrafter(be))
    router = Router(CostModel({1: 1.0, 2: 2.0, 9: 9.0}), max_k=6, probe_every=16, shadow=True)
    out, dec = emitted(be, P2, ngram, router, requests=4, tokens=160)
    assert_distribution(torch.tensor([t for o in out for t in o]), P2, "routed to plain")
    assert 0 < ngram.calls <= 2 * 160 // 16, ngram.calls


def test_scored_first_drafts_read_their_own_row_and_token():
    """`execution._shadow_scores`: a greedy request's first draft scores 1 or 0 (is it the
    emitted token?); a sampled one's scores p(draft) under its own target row's sampling
    distribution (temperature and top-k applied), read from that request's row of a ragged
    verify (here after another request's 2 verified drafts)."""
    from types import SimpleNamespace
    from hal.engine.execution import _shadow_scores
    g = torch.Generator().manual_seed(3)
    target = torch.randn(6, 10, generator=g)
    reqs = [Request([0], k=2), Request([0]), Request([0], temperature=1.0), Request([0], temperature=0.5, top_k=2)]
    live = [SimpleNamespace(req=r) for r in reqs]
    top2 = target[5].topk(2).indices
    guess = torch.tensor([5, 7, int(top2[1])])
    drafts = SimpleNamespace(shadow=[(1, 0), (2, 1), (3, 2)], counts=[2, 0, 0, 0],
                             proposal=SimpleNamespace(draft_token_ids=guess))
    out = torch.tensor([[1, 1, 1], [5, 0, 0], [3, 0, 0], [4, 0, 0]])
    scores = _shadow_scores(live, drafts, target, out)
    want_2 = torch.softmax(target[4], -1)[7]
    kept = target[5][top2] / 0.5
    want_3 = torch.softmax(kept, -1)[1]
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.stack([torch.tensor(1.0), want_2, want_3]), rtol=1e-5, atol=1e-6)
    out[1, 0] = 6
    assert _shadow_scores(live, drafts, target, out)[0] == 0.0


def test_sampled_requests_of_a_scored_drafter_are_measured_without_verifying():
    """Sampled requests routed to k = 0 with n-gram lookup (a shadow drafter): the router's
    probes verify nothing (no draft is ever fed to the target), yet the router learns from
    the scored first drafts; each score is one of the toy target's probabilities (0.7 or 0.3),
    and the output keeps the target's law."""
    from hal.drafters.ngram import NgramDrafter
    be = hal.get_backend("cpu")
    router = Router(CostModel({1: 1.0, 2: 2.0, 9: 9.0}), max_k=6, probe_every=16, shadow=True)
    seen = []
    observe = router.observe_scores
    router.observe_scores = lambda states, scores: (seen.extend(scores), observe(states, scores))
    out, dec = emitted(be, P2, NgramDrafter(be), router, requests=4, tokens=160)
    assert_distribution(torch.tensor([t for o in out for t in o]), P2, "scored, routed to plain")
    assert dec.metrics.total.num_draft_tokens == 0
    assert len(seen) >= 4 and all(min(abs(s - 0.7), abs(s - 0.3)) < 1e-5 for s in seen), seen
    assert router.glob.trials > 0
