"""The fan-out's host logic (`hal.distributed.speculate`): which outcomes are drafted ahead, in
what order, under which key, and what a COMMIT finds. The worker's use of it, end to end and
with the target's law checked, is in tests/launch/test_generate.py."""

from hal.distributed.protocol import history_hash
from hal.distributed.speculate import TOP, Drafted, FanOut

COMMITTED = [5, 6, 7, 5, 6]


def planned(alts=None, budget=64, accepted=None):
    fan = FanOut(budget)
    fan.observe(1, [], COMMITTED)
    hist = COMMITTED
    if accepted is not None:   # one earlier round: drafts [9, 9, 9], ``accepted`` of them kept
        fan.plan(1, hist, Drafted([9, 9, 9]))
        fan.observe(1, hist, [9] * accepted + [8])
        hist = hist + [9] * accepted + [8]
    fan.plan(1, hist, Drafted([7, 5, 6], alts=alts))
    return fan


def drain(fan):
    out = []
    while wave := fan.next_wave():
        out += wave
    return out


def test_every_accept_length_with_its_corrections_then_the_extension_in_rank_order():
    alts = [[(7, 0.6), (8, 0.3), (4, 0.1)], [(5, 0.5), (3, 0.5)], [(2, 0.7), (6, 0.2), (1, 0.1)]]
    branches = drain(planned(alts))
    base = COMMITTED
    scores = [-b.neg_score for b in branches]
    assert scores == sorted(scores, reverse=True)
    got = {(b.a, tuple(b.base[len(base):])) for b in branches}
    assert got == {(0, (8,)), (0, (4,)), (1, (7, 3)), (2, (7, 5, 2)), (2, (7, 5, 1)), (3, (7, 5, 6))}
    # a correction is never the draft at its slot (the target emits it only by accepting it)
    assert all(b.extend or b.base[-1] != [7, 5, 6][b.a] for b in branches)
    assert sum(b.extend for b in branches) == 1 and branches[[b.extend for b in branches].index(True)].a == 3


def test_the_measured_acceptance_ranks_long_outcomes_first_when_drafts_are_accepted():
    alts = [[(7, 0.5), (8, 0.5)]] * 3
    low = drain(planned(alts, accepted=0))     # alpha 1/3: a rejection at slot 0 is the likeliest
    high = drain(planned(alts, accepted=3))    # alpha 0.8: all accepted is
    assert low[0].a == 0 and high[0].extend


def test_without_the_drafters_distribution_corrections_come_from_what_followed_in_the_history():
    branches = drain(planned(None))
    # after 6 the history has 7, after 7: 5, after 5: 6, each the draft at that slot: no correction, the extension only
    assert [b.extend for b in branches] == [True]
    fan = FanOut(8)
    fan.observe(2, [], [1, 2, 1, 3, 1, 2])
    fan.plan(2, [1, 2, 1, 3, 1, 2], Drafted([4]))      # after 2 the history holds 1 (twice): the correction guessed at slot 0
    got = drain(fan)
    assert {tuple(b.base[6:]) for b in got if not b.extend} == {(1,)}


def test_the_budget_bounds_branches_per_request_and_a_wave_takes_one_each():
    alts = [[(t, 0.1) for t in range(10)]] * 3
    fan = planned(alts, budget=4)
    fan.observe(2, [], [1, 2, 3])
    fan.plan(2, [1, 2, 3], Drafted([4, 4], alts=[[(t, 0.1) for t in range(10)]] * 2))
    waves = []
    while wave := fan.next_wave():
        waves.append(sorted(b.rid for b in wave))
    assert waves == [[1, 2]] * 4
    assert len(drain(planned(alts, budget=64))) == 3 * TOP + 1


def test_a_commit_finds_its_outcomes_drafts_under_length_and_hash_and_the_rest_is_dropped():
    fan = planned([[(8, 1.0)]] * 3)
    wave = fan.next_wave()
    hist = [b for b in wave][0].base
    fan.store(wave, [Drafted([1, 2, 3])], 0.001)
    assert fan.branches == 1
    got, had = fan.lookup(1, len(hist), history_hash(hist), 2)
    assert had and got.drafts == [1, 2]                  # cut to this round's k
    assert fan.lookup(1, len(hist), history_hash(hist), 2) == (None, False)   # nothing left: all were stale
    fan = planned([[(8, 1.0)]] * 3)
    wave = fan.next_wave()
    fan.store(wave, [Drafted([1, 2, 3])], 0.001)
    other = COMMITTED + [7, 9]
    assert fan.lookup(1, len(other), history_hash(other), 2) == (None, True)   # a miss: drafted ahead, not this
    assert fan.lookup(1, len(hist), history_hash(hist), 4)[0] is None          # too few drafts for k: a miss too


def test_an_extension_keys_its_drafts_by_its_own_guess_and_offers_the_other_bonus_tokens():
    fan = planned([[(7, 1.0)], [(5, 1.0)], [(6, 1.0)]])   # the drafter is sure: only the extension is left
    (ext,) = fan.next_wave()
    assert ext.extend and ext.base == COMMITTED + [7, 5, 6]
    fan.store([ext], [Drafted([4, 1, 2, 3], alts=[[(4, 0.6), (2, 0.4)], [], [], []])], 0.001)
    hist = ext.base + [4]
    got, _ = FanOut.lookup(fan, 1, len(hist), history_hash(hist), 3)
    assert got.drafts == [1, 2, 3]
    fan = planned([[(7, 1.0)], [(5, 1.0)], [(6, 1.0)]])
    (ext,) = fan.next_wave()
    fan.store([ext], [Drafted([4, 1, 2, 3], alts=[[(4, 0.6), (2, 0.4)], [], [], []])], 0.001)
    (alt,) = fan.next_wave()
    assert alt.base == COMMITTED + [7, 5, 6, 2] and not alt.extend and alt.a == 3
