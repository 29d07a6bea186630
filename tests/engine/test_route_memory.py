"""Routing where nothing pays costs nothing: a lookup drafter's request without a match is not
asked, scored or drafted ahead for; a match is routed on the lookup's own acceptance; and what a
router learned is kept for the next engine over the same machine, model and drafter
(`hal.engine.route_memory`), a damaged or foreign record ignored."""

import json

import pytest
import torch

import hal
from hal.conformance._helpers import assert_distribution
from hal.drafters.ngram import NgramDrafter
from hal.engine.costs import CostModel
from hal.engine.route_memory import RouteMemory, fingerprint
from hal.engine.router import Router
from hal.errors import HalError
from tests.engine.test_router import P2, _Counted, _S, emitted

COSTS = CostModel({1: 1.0, 2: 1.05, 9: 1.6, 64: 6.0})   # drafts pay from an acceptance of about 0.1


def _looked(rid, tokens, **kw):
    s = _S(rid, **kw)
    s.tokens = list(tokens)
    return s


def test_a_lookup_drafter_without_a_match_is_not_asked_scored_or_drafted_ahead():
    r = Router(COSTS, max_k=6, shadow=True, evidence=0, lookup=(1, 3), probe_every=4)
    none, hit = _looked("none", [1, 2, 3, 4, 5]), _looked("hit", [7, 8, 9, 7, 8])
    for _ in range(12):
        ks = r.choose([none, hit])
        assert ks[0] == 0 and "none" not in r.scored and "none" not in r.asks_next([none, hit], ks)
    assert ks[1] > 0   # the prior, for the matching one


def test_a_match_is_routed_on_the_lookups_acceptance_and_the_rest_on_the_models():
    r = Router(COSTS, max_k=6, shadow=True, evidence=0, lookup=(1, 3), fallback=True, prior=0.5)
    hit, miss = _looked("hit", [7, 8, 9, 7, 8]), _looked("miss", [1, 2, 3, 4, 5])
    r.choose([hit, miss])
    for _ in range(30):   # lookup matches are accepted, the model's drafts never
        r.observe([hit, miss], [4, 4], [4, 0])
    assert r.acceptance("hit") > 0.9 and r.acceptance("miss") < 0.1
    assert r.choose([hit, miss]) == [6, 0]
    hit.tokens.append(4)   # no match now: the model's rate routes it
    assert r.choose([hit])[0] == 0


def test_sampled_output_keeps_the_target_law_with_a_lookup_router():
    be = hal.get_backend("cpu")
    ngram = _Counted(NgramDrafter(be))
    router = Router(CostModel({1: 1.0, 2: 1.05, 9: 1.6}), max_k=6, probe_every=16, shadow=True,
                    lookup=ngram.inner.lookup)
    out, dec = emitted(be, P2, ngram, router, requests=6, tokens=120)
    assert_distribution(torch.tensor([t for o in out for t in o]), P2, "lookup-routed")
    assert dec.metrics.total.num_drafts > 0   # two tokens: the lookup matches, and its drafts are verified


def test_sampled_requests_matches_are_measured_apart_from_greedy_ones():
    """A sampled request keeps a match's token with the target's probability of it, a greedy one
    whenever it is the argmax: pooled, greedy matches' rates would draft for sampled requests
    where nothing pays."""
    r = Router(COSTS, max_k=6, shadow=True, evidence=0, lookup=(1, 3), prior=0.5)
    greedy, sampled = _looked("g", [7, 8, 9, 7, 8]), _looked("s", [7, 8, 9, 7, 8], temperature=0.8)
    r.choose([greedy, sampled])
    for _ in range(30):
        r.observe([greedy, sampled], [4, 4], [4, 0])
    assert r.rates()["found2"].rate(0.5, 1.0) > 0.95 and r.rates()["sampled2"].rate(0.5, 1.0) < 0.05
    assert r.choose([greedy, sampled]) == [6, 0]
    fresh = _looked("s2", [7, 8, 9, 7, 8], temperature=0.8)   # a new sampled request: the sampled rate
    assert r.choose([fresh]) == [0] and r.acceptance("s2") < 0.1
    r.release(sampled)
    assert "s" not in r.sampled


def _drive(r: Router, state, steps: int, score: float, keep, beside=lambda: None) -> int:
    """Route ``state`` alone for ``steps`` steps: a scored first draft scores ``score``, a verify
    keeps ``keep(ks)`` drafts, ``beside`` runs after each step. Returns the drafts chosen. A match
    scored on the host (`Router.guess`) is settled as the engine would: the step commits the draft
    (``score`` >= 1/2) or another token, which the history then drops (the text stays as it was)."""
    drafted = 0
    for _ in range(steps):
        ks = r.choose([state])
        if state.rid in r.guesses:
            _, draft, _ = r.guesses[state.rid]
            state.tokens.append(draft if score >= 0.5 else -1)
            r._settle([state])
            state.tokens.pop()
        elif state.rid in r.scored:
            r.observe_scores([state], [score])
        else:
            r.observe([state], ks, keep(ks))
        beside()
        drafted += ks[0]
    return drafted


@pytest.mark.parametrize("evidence", [2, 0])
def test_a_sampled_request_measures_its_own_matches_before_the_overall_rate_decides(evidence):
    """Matches in other text were rejected (the overall sampled rate is near 0); in this request's
    copied text they are accepted. A model drafter's router (not shadow, as ``ngram+dspark``'s) scores
    the request's first ``evidence`` matches for free (on the host) and then drafts on them. With
    ``evidence=0`` (before stop 82) the overall rate alone decided: no draft and no score until a probe
    fell due, so copy-heavy sampled text ran as plain decoding."""
    r = Router(COSTS, max_k=6, lookup=(1, 3), fallback=True, evidence=evidence, prior=0.5)
    other = _looked("other", [7, 8, 9, 7, 8], temperature=0.8)
    r.choose([other])
    for _ in range(30):
        r.observe([other], [4], [0])
    assert r.rates()["sampled2"].rate(0.5, 1.0) < 0.05
    copy = _looked("copy", [7, 8, 9, 7, 8], temperature=0.8)
    drafted = _drive(r, copy, 8, 0.95, lambda ks: ks)   # a verify of the copied text keeps every draft
    if evidence:
        assert drafted >= 6 * 5, drafted   # scored twice, then drafting
    else:
        assert drafted == 0


@pytest.mark.parametrize("match_decay", [0.85, 0.7])
def test_a_requests_rejected_matches_outweigh_a_rate_learned_on_copied_text(match_decay):
    """Matches in copied text were accepted (the overall rate of 2-gram matches near 1); in this
    request's open text every match is rejected. Its own rate is shrunk towards the overall one by
    ``prior_weight`` trials, so it must be able to hold more than that: at ``match_decay`` 0.85 it
    falls to a quarter of the overall rate and the request stops drafting; at 0.7 (before stop 82, as
    a request's model drafts decay) it stays near 0.3 and the request drafts on its matches."""
    costs = CostModel({1: 1.0, 2: 1.18, 9: 3.5})   # one draft pays from an acceptance of about 0.3
    r = Router(costs, max_k=6, shadow=True, lookup=(1, 3), fallback=True, prior=0.5, match_decay=match_decay)
    copy = _looked("copy", [7, 8, 9, 7, 8])
    r.choose([copy])
    for _ in range(40):
        r.observe([copy], [4], [4])
    assert r.rates()["found2"].rate(0.5, 1.0) > 0.95
    chat = _looked("chat", [1, 2, 3, 1, 2])   # copied text goes on elsewhere: the overall rate stays high
    drafted = _drive(r, chat, 30, 0.0, lambda ks: [0], beside=lambda: r.observe([copy], [4], [4]))
    if match_decay == 0.85:
        assert r.acceptance("chat") < 0.27 and r.choose([chat]) == [0]
    else:
        assert r.acceptance("chat") > 0.28 and drafted > 20, (r.acceptance("chat"), drafted)
    with pytest.raises(HalError, match="match_decay"):
        Router(COSTS, match_decay=1.0)


def _learned(memory=None, lookup=(1, 3)):
    r = Router(COSTS, max_k=6, shadow=True, lookup=lookup, fallback=True, memory=memory)
    a, b = _looked("a", [7, 8, 9, 7, 8]), _looked("b", [1, 2, 3])
    r.choose([a, b])
    for _ in range(10):
        r.observe([a, b], [4, 4], [3, 1])
        r.observe_step(2, 8, 4, 1.3)
        r.observe_step(2, 0, 0, 1.0)
        r.observe_step(2, 0, 0, 1.2, scored=1)
    return r, a, b


def test_what_a_router_learned_is_kept_and_restored(tmp_path):
    path = tmp_path / "router.json"
    memory = RouteMemory(path, {"key": 1})
    r, a, b = _learned(memory)
    r.release(a)
    memory.flush()   # written on a thread of its own
    fresh = Router(COSTS, max_k=6, shadow=True, lookup=(1, 3), fallback=True)
    restored = Router(COSTS, max_k=6, shadow=True, lookup=(1, 3), fallback=True, memory=RouteMemory(path, {"key": 1}))
    assert set(r.rates()) == {"glob", "offers", "found1", "found2", "found3", "sampled1", "sampled2", "sampled3"}
    for name, want in r.rates().items():
        got = restored.rates()[name]
        assert (got.accepted, got.trials) == pytest.approx((want.accepted, want.trials))
    assert r.rates()["found2"].trials > 0   # a's match: [7, 8] occurs earlier
    assert restored.ratio == pytest.approx(r.ratio) and restored.ratio_steps == [min(8, n) for n in r.ratio_steps]
    assert restored.ratio_steps[:3] == [8, 8, 8]
    assert restored.score_every == r.score_every > fresh.score_every == 1
    assert restored.acceptance("new") == pytest.approx(r.acceptance("new")) != fresh.acceptance("new")
    other = Router(COSTS, max_k=6, memory=RouteMemory(path, {"key": 2}))   # another machine, model or drafter
    assert other.glob.trials == 0 and other.ratio_steps == [0, 0, 0, 0]
    record = json.loads(path.read_text())   # a record from before lookup steps were measured apart
    path.write_text(json.dumps({**record, "ratio": record["ratio"][:3], "ratio_steps": record["ratio_steps"][:3]}))
    old = Router(COSTS, max_k=6, memory=RouteMemory(path, {"key": 1}))
    assert old.ratio[:3] == pytest.approx(r.ratio[:3]) and old.ratio[3] == 0.0 and old.ratio_steps[3] == 0


@pytest.mark.parametrize("damage", ["not json", "[]", '{"signature": {"key": 1}, "dtype": "routing"}',
                                    "trials", "ratio", "steps", "strings"])
def test_a_damaged_record_is_ignored(tmp_path, damage):
    path = tmp_path / "router.json"
    r, a, _ = _learned(RouteMemory(path, {"key": 1}))
    r.release(a)
    r.memory.flush()
    record = json.loads(path.read_text())
    if damage == "trials":
        record["rates"]["glob"] = [5.0, 1.0]     # more accepted than tried
    elif damage == "ratio":
        record["ratio"] = [float("nan"), 1.0, 1.0]
    elif damage == "steps":
        record["ratio_steps"] = [-1, 0, 0]
    elif damage == "strings":
        record["rates"]["glob"] = ["1", "2"]     # numbers as text
    text = json.dumps(record) if damage in ("trials", "ratio", "steps", "strings") else damage
    path.write_text(text)
    restored = Router(COSTS, max_k=6, memory=RouteMemory(path, {"key": 1}))
    assert restored.glob.trials == 0 and restored.ratio_steps == [0, 0, 0, 0]


def test_an_unwritable_memory_is_skipped(tmp_path):
    (tmp_path / "file").write_text("")
    r, a, _ = _learned(RouteMemory(tmp_path / "file" / "router.json", {"key": 1}))
    r.release(a)   # no error: the next engine learns afresh
    r.memory.flush()
    assert not (tmp_path / "file").read_text()


def test_the_key_tells_models_and_drafters_apart():
    be = hal.get_backend("cpu")
    assert fingerprint(NgramDrafter(be, 1, 3)) != fingerprint(NgramDrafter(be, 2, 3))

    class Model:
        cfg = "cfg"

        def __init__(self, scale):
            self.w = {"embed": torch.ones(4, 4) * scale}
    assert fingerprint(Model(1.0)) == fingerprint(Model(1.0)) != fingerprint(Model(2.0))


def test_off_and_folder_settings(monkeypatch, tmp_path):
    be = hal.get_backend("cpu")
    monkeypatch.setenv("HAL_ROUTE_MEMORY", "0")
    assert RouteMemory.for_engine(object(), NgramDrafter(be)).path is None
    monkeypatch.setenv("HAL_ROUTE_MEMORY", str(tmp_path))
    assert RouteMemory.for_engine(object(), NgramDrafter(be)).path.parent == tmp_path
