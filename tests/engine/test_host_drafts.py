"""A lookup drafter's drafts read on the host (`hal.engine.proposals.host_drafts`, from the
router's host lookup, `hal.engine.router.Router.continuation`) are the drafts the drafter's
backend op proposes; a step that drafts only lookup matches calls no drafter."""

import random

import pytest
import torch

import hal
from hal.drafters.ngram import NgramDrafter
from hal.engine.costs import CostModel
from hal.engine.drafting import DraftBatch
from hal.engine.proposals import host_drafts
from hal.engine.requests import Request, State
from hal.engine.router import Router
from hal.kv import BlockAllocator, Sequence


def _states(rng, vocab):
    alloc = BlockAllocator(64, 16)
    out = []
    for rid in range(rng.randint(1, 4)):
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        out.append(State(Request(list(tokens), k=8), rid, tokens, Sequence(alloc)))
    return out


def _op_drafts(be, states, want):
    """What `NgramDrafter` (the backend's ``ngram_propose``) drafts: each row's valid drafts."""
    L = max(len(s.tokens) for s in states)
    history = torch.tensor([s.tokens + [0] * (L - len(s.tokens)) for s in states])
    lens = tuple(len(s.tokens) for s in states)
    batch = DraftBatch(rids=tuple(s.rid for s in states), params=tuple(s.req for s in states), history=history,
                       num_tokens=torch.tensor(lens), lengths=lens, k=tuple(want), offsets=(0,) * len(states))
    prop = NgramDrafter(be, 1, 3).propose(batch)
    ids, valid = prop.draft_token_ids.tolist(), want if prop.num_valid is None else prop.num_valid.tolist()
    at = [sum(want[:i]) for i in range(len(want))]
    return [ids[a:a + v] for a, v in zip(at, valid)]


def test_host_drafts_equal_the_backend_ops_where_the_router_matched():
    be, rng = hal.get_backend("cpu"), random.Random(7)
    drafter = NgramDrafter(be, 1, 3)
    compared = refused = 0
    for trial in range(200):
        states = _states(rng, rng.choice([2, 3, 6, 40]))
        router = Router(CostModel({1: 1.0, 9: 2.0}), max_k=8, shadow=True, lookup=(1, 3))
        router._look(states)   # what `choose` does first each step
        want = [rng.choice([0, 1, 3, 8]) for _ in states]
        prop = host_drafts(drafter, router.continuation, states, want, torch.device("cpu"))
        matched = [bool(router.matched.get(s.rid)) for s in states]
        if not all(m for m, w in zip(matched, want) if w):
            assert prop is None   # an asked request without a match: the drafter drafts
            refused += 1
            continue
        assert prop is not None and prop.cu_num_draft_tokens.tolist() == [sum(want[:i]) for i in range(len(want) + 1)]
        ids, valid = prop.draft_token_ids.tolist(), prop.num_valid.tolist()
        at = [sum(want[:i]) for i in range(len(want))]
        ours = [ids[a:a + v] for a, v in zip(at, valid)]
        ref = _op_drafts(be, states, want)
        assert ours == ref, (trial, [s.tokens for s in states], want)
        compared += 1
    assert compared > 50 and refused > 20   # both sides were exercised


def test_a_continuation_is_only_for_the_tokens_looked_up():
    router = Router(CostModel({1: 1.0}), lookup=(1, 2))
    state = State(Request([1, 2, 3, 1]), 0, [1, 2, 3, 1], Sequence(BlockAllocator(4, 4)))
    router._look([state])
    assert router.continuation(state, 2) == [2, 3]
    state.tokens.append(2)   # committed after the lookup: not what it found
    assert router.continuation(state, 2) is None


def test_a_lookup_only_step_calls_no_drafter():
    """On a copy of its own prompt a routed n-gram engine drafts from lookup matches; every step
    that drafts only those reads them on the host (the drafter is asked only for lookahead, never
    inline), and greedy output equals plain decoding's."""
    from hal.engine import Request as Req, SpeculativeDecoder
    from hal.launch.build import make_router
    from hal.models.llama import random_llama
    be = hal.get_backend("cpu")
    model = random_llama(32, 2, 4, 2, 8, 64, 64, seed=3, scale=0.15)

    class Counting(NgramDrafter):
        calls = 0

        def propose(self, b):
            Counting.calls += b.lengths is not None   # inline (a lookahead call has no host lengths)
            return super().propose(b)

    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    plain = SpeculativeDecoder(model, None).generate([Req(prompt, max_new_tokens=24, k=0)])[0]
    drafter = Counting(be, 1, 3)
    costs = CostModel({1: 1.0, 2: 1.01, 9: 1.05})   # drafts pay: the router drafts on every match
    dec = SpeculativeDecoder(model, drafter, router=make_router(costs, drafter, 4))
    out = dec.generate([Req(prompt, max_new_tokens=24, k=4)])[0]
    assert out == plain
    assert dec.metrics.total.num_draft_tokens > 0 and Counting.calls == 0, (dec.metrics.total, Counting.calls)


def test_a_request_with_many_pending_features_calls_the_drafter():
    """Features the drafter was not passed wait with the engine; past `PASS_BYTES` a lookup step
    calls the drafter after all (it holds or feeds them), so they never pile up without bound."""
    from hal.engine.proposals import PASS_BYTES
    be = hal.get_backend("cpu")
    state = State(Request([1, 2, 3, 1, 2]), 0, [1, 2, 3, 1, 2], Sequence(BlockAllocator(4, 4)))
    router = Router(CostModel({1: 1.0}), lookup=(1, 3))
    router._look([state])
    drafter = NgramDrafter(be, 1, 3)
    state.features = [torch.zeros(1, 4)] * (PASS_BYTES // 16 - 1)   # a float32 row of 16 bytes per step
    assert host_drafts(drafter, router.continuation, [state], [2], torch.device("cpu")) is not None
    state.features.append(torch.zeros(1, 4))
    assert host_drafts(drafter, router.continuation, [state], [2], torch.device("cpu")) is None


class _OnDevice(Router):
    """The decoder scores every match's first draft on the device (before stop 83)."""

    def guess(self, state):
        return False


def test_a_greedy_match_scored_on_the_host_learns_what_the_device_score_would():
    """A greedy request's lookup match at k = 0 is scored by the router from the token the step
    commits (`Router.guess`), not by the decoder on the device. Over requests on a small-vocabulary
    model (matches accepted and rejected, drafted and scored) it makes every choice and learns every
    rate as the decoder's score did (the device path: ``guess`` refused), and the decoder scores nothing.
    (Measured step times are not fed to the routers: they would move choices differently in each run.)"""
    from unittest import mock

    from hal.engine import Request as Req, SpeculativeDecoder, execution
    from hal.models.llama import random_llama
    be = hal.get_backend("cpu")
    model = random_llama(24, 2, 4, 2, 8, 64, 64, seed=5, scale=0.15)
    prompts = [[3, 4, 5, 3, 4, 6, 7, 3, 4], [1, 2, 1, 2, 1], list(range(20)), [9, 9, 8, 9, 9, 8, 9]]
    runs = []
    for kind in (Router, _OnDevice):
        router = kind(CostModel({1: 1.0, 2: 1.2, 9: 1.9}), max_k=4, lookup=(1, 3), probe_every=8)
        router.observe_step = lambda *a, **kw: None   # the cost model alone: wall times differ run to run
        dec = SpeculativeDecoder(model, NgramDrafter(be, 1, 3), router=router)
        with mock.patch.object(execution, "_shadow_scores", wraps=execution._shadow_scores) as scores:
            outs = [dec.generate([Req(p, max_new_tokens=40, k=4)])[0] for p in prompts]
        rates = {name: (e.accepted, e.trials) for name, e in router.rates().items()}
        runs.append((outs, rates, dec.metrics.total.num_drafts, dec.metrics.total.num_draft_tokens, scores.call_count))
    (outs, rates, drafts, tokens, host_calls), (outs2, rates2, drafts2, tokens2, device_calls) = runs
    assert outs == outs2 and drafts == drafts2 and tokens == tokens2
    for name in rates:
        assert rates[name] == pytest.approx(rates2[name], rel=1e-12, abs=1e-12), name
    assert rates["found1"][1] + rates["found2"][1] + rates["found3"][1] > 10   # greedy matches were measured
    assert drafts > 0 and host_calls == 0 < device_calls, (drafts, host_calls, device_calls)


class _Markov:
    """A target whose next token follows the last one by ``m`` (a stand-in for a network whose
    distribution depends on the context: a lookup's draft is often, not always, what it predicts)."""

    def __init__(self, be, m: torch.Tensor):
        from tests.engine.test_router import ToyConfig
        self.be, self.cfg, self.device, self.logm = be, ToyConfig(m.shape[0]), torch.device(be.device_type), m.log()

    def forward(self, batch, k_caches, v_caches, tree_mask=None):
        rows = batch.logits_rows
        return self.logm[batch.tokens[rows]].clone(), torch.zeros(rows.shape[0], 4)


class _Planted(Router):
    """PLANTED: the match's last token taken for its first draft (one position early)."""

    def guess(self, state):
        if not super().guess(state):
            return False
        n, _, rate = self.guesses[state.rid]
        self.guesses[state.rid] = (n, state.tokens[self.match_at[state.rid][1]], rate)
        return True


@pytest.mark.parametrize("host", [Router, _Planted])
def test_a_sampled_match_scored_on_the_host_is_an_unbiased_draw_of_the_device_score(host):
    """Sampled, the decoder scores a match's first draft as p(draft) under the step's target row;
    the router scores it as whether the step, which draws from that row, committed the draft: a draw
    whose mean is p(draft). Routed so that nothing is ever drafted (a match is scored whenever a
    probe is due, here every few steps), the two engines' mean scores over about 1,200 scorings each
    agree within 4 standard errors of the difference (fixed seeds; the device's scoring spends a
    draw's offset, so the two runs' tokens differ and are compared as two samples). A guess one
    position early (planted) is caught: its mean is near 0.1, the device's near 0.57."""
    import math

    from hal.engine import Request as Req, SpeculativeDecoder
    be = hal.get_backend("cpu")
    m = torch.tensor([[0.1, 0.7, 0.2], [0.2, 0.1, 0.7], [0.7, 0.2, 0.1]])
    scores = []
    for kind in (host, _OnDevice):
        never = CostModel({1: 1.0, 2: 9.0, 9: 90.0})   # drafts never pay: k = 0 on every step
        router = kind(never, max_k=4, lookup=(1, 3), probe_every=1)   # a sampled match: scored when a probe is due
        seen = []
        for rate in router.found_sampled.values():   # every sampled match's score, either path
            rate.score = (lambda f: lambda p: (seen.append(float(p)), f(p)))(rate.score)
        dec = SpeculativeDecoder(_Markov(be, m), NgramDrafter(be, 1, 3), num_blocks=256, router=router)
        dec.generate([Req([0, 1, 2], max_new_tokens=1200, temperature=1.0, seed=s, k=4) for s in range(4)])
        assert dec.metrics.total.num_drafts == 0
        scores.append(torch.tensor(seen, dtype=torch.float64))
    guessed, device = scores
    assert min(len(guessed), len(device)) > 1100, (len(guessed), len(device))
    err = 4 * math.sqrt(guessed.var() / len(guessed) + device.var() / len(device))
    gap = abs(guessed.mean() - device.mean())
    assert (gap <= err) == (host is Router), (float(gap), err)


def test_drafting_ahead_for_no_one_touches_no_drafter_or_tensor():
    """A lookup drafter's router forecasts no one (`Router.asks_next`: its matches are read on the host),
    so `lookahead` returns before any drafter call or tensor is made; with a request just prefilled
    (``first``) it drafts ahead for that one."""
    from hal.engine.history import HistoryBuffer
    from hal.engine.proposals import lookahead

    class Watched(NgramDrafter):
        calls = 0

        def propose(self, batch):
            Watched.calls += 1
            return super().propose(batch)

    be = hal.get_backend("cpu")
    alloc = BlockAllocator(8, 4)
    live = [State(Request([1, 2, 3, 1, 2], k=4), 0, [1, 2, 3, 1, 2], Sequence(alloc))]
    first = [State(Request([5, 6, 5], k=4), 1, [5, 6, 5], Sequence(alloc))]
    history = HistoryBuffer(torch.device("cpu"))
    for s in live + first:
        history.add(s.rid, s.tokens)
    drafter, acc, dev = Watched(be, 1, 3), torch.zeros(1, dtype=torch.long), torch.device("cpu")
    assert lookahead(drafter, history, live, [], [], "not a tensor", dev, [0], set()) is None
    assert Watched.calls == 0
    ahead = lookahead(drafter, history, live, first, [], acc, dev, [0], set())
    assert Watched.calls == 1 and ahead is not None and ahead.rids == [1]
