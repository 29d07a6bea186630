"""Rows in the cheapest chunks (`hal.models.linear_layout.chunks` with a plan's measured
costs): the least total cost, exact whatever the set (widths of one plan give a row the same
bits), kept with the plan in its cache, and refused there when malformed."""

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hal.errors import HalError
from hal.models import int4
from hal.models.linear_layout import LinearPlan, chunks
from hal.models.plan_check import int4_mm, usable_groups

WIDTHS = (1, 2, 4, 8)
INT4PACK = (4.5, 5.2, 7.4, 12.8)   # ms of one chunk at each width, measured for SmolLM2's int4 linears


def test_a_verify_of_five_rows_goes_in_four_plus_one_where_eight_costs_more():
    assert [chunks(WIDTHS, m, INT4PACK) for m in (1, 3, 5, 6, 8, 9, 16)] == \
        [[1], [4], [4, 1], [4, 2], [8], [8, 1], [8, 8]]
    assert [chunks(WIDTHS, m) for m in (5, 6)] == [[8], [8]]   # without costs: the narrowest that holds


def test_the_plan_multiplies_in_those_chunks():
    seen = []

    def layout(x, w):   # records each chunk's rows
        seen.append(x.shape[0])
        return x @ w.T
    plan = LinearPlan("mm", torch.float32, WIDTHS, fn=layout, costs=INT4PACK)
    plan.linear(torch.ones(5, 8), torch.ones(3, 8))
    assert seen == [4, 1]


def test_a_tie_goes_to_fewer_chunks():
    assert chunks(WIDTHS, 8, (1.0, 2.0, 4.0, 8.0)) == [8]
    assert chunks(WIDTHS, 5, (1.0, 2.0, 4.0, 5.0)) == [8]


def _brute(widths, costs, rows):
    best = None
    for n in range(1, rows + 1):
        for combo in itertools.combinations_with_replacement(range(len(widths)), n):
            if sum(widths[i] for i in combo) >= rows:
                cost = (sum(costs[i] for i in combo), n)
                best = cost if best is None or cost < best else best
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.5, 30.0), min_size=4, max_size=4), st.integers(1, 12))
def test_the_chunks_cost_least_and_hold_the_rows(costs, rows):
    got = chunks(WIDTHS, rows, tuple(costs))
    cost = {w: c for w, c in zip(WIDTHS, costs)}
    assert sum(got) >= rows and set(got) <= set(WIDTHS) and got == sorted(got, reverse=True)
    assert sum(cost[w] for w in got) == pytest.approx(_brute(WIDTHS, costs, rows)[0], rel=1e-12)


def test_rows_in_the_cheapest_chunks_have_the_bits_of_the_narrowest_rule():
    """int4 weights with bfloat16 rows (the plan's kernel), at widths this machine's self-check
    groups together: the two rules chunk 5 and 6 rows differently, and agree bit for bit."""
    shape = (48, 64)
    groups, _ = usable_groups(int4_mm, torch.bfloat16, [shape], int4_shapes=frozenset({shape}))
    group = max(groups, key=len)
    if not {1, 4, 8} <= set(group):
        pytest.skip(f"int4 rows at widths 1, 4 and 8 differ on this CPU (groups {groups})")
    widths = tuple(n for n in WIDTHS if n in group)
    g = torch.Generator().manual_seed(3)
    w, x = int4.random(*shape, g).pack(torch.bfloat16), torch.randn(9, 64, generator=g)
    plain = LinearPlan("mm", torch.bfloat16, widths, weights="int4")
    costed = LinearPlan("mm", torch.bfloat16, widths, weights="int4", costs=tuple(dict(zip(WIDTHS, INT4PACK))[n] for n in widths))
    assert chunks(widths, 5, costed.costs) != chunks(widths, 5)
    for m in (5, 6, 9):
        assert torch.equal(costed.linear(x[:m], w), plain.linear(x[:m], w))


def test_costs_round_trip_through_the_cache_and_bad_ones_are_refused():
    plan = LinearPlan("mm", torch.float32, WIDTHS, costs=INT4PACK)
    again = LinearPlan.from_json(plan.to_json())
    assert again == plan and again.costs == INT4PACK
    old = {k: v for k, v in plan.to_json().items() if k != "costs"}   # a cache written before costs
    assert LinearPlan.from_json(old).costs == ()
    for bad in ([1.0, 2.0], [1.0, 2.0, 3.0, -1.0], [1.0, 2.0, 3.0, "4"], [1.0, 2.0, 3.0, True],
                [1.0, 2.0, 3.0, float("inf")], "1,2,3,4"):
        with pytest.raises(HalError, match="costs"):
            LinearPlan.from_json({**plan.to_json(), "costs": bad})
    with pytest.raises(HalError, match="costs"):
        LinearPlan("mm", torch.float32, WIDTHS, costs=(1.0, 2.0))
