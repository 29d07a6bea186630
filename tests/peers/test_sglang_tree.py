"""hal.integrations.sglang against SGLang's own expectations: the tree of
``sgl-kernel/tests/test_speculative_sampling.py::test_tree_speculative_sampling_target_only``
(its exact case, threshold_single = threshold_acc = 1), transcribed as data, on every backend,
greedy and sampling; both cases of ``sgl-kernel/tests/speculative/test_speculative_sampling.py``
(commit 120affb9613cc3f5bcd055ec09c7621d3ced0ebc), thresholds (1, 1) exact and (0, 0) SGLang's
relaxed acceptance (LOSSY, in the adapter only); children tried in SGLang's list order; the
``num_spec_step`` cap; the layout conversions both ways; planted layout slips. SGLang is not
installed or run here: its inputs and expected outputs are data, the code is ours."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hal
from hal.integrations.sglang import parents_to_sglang, sglang_to_parents, verify_tree_sglang

CANDIDATES = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
RETRIVE_INDEX = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
NEXT_TOKEN = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
NEXT_SIBLING = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
EXPECTED = ([3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2])


def target_logits():
    t = torch.full((2, 6, 20), 1.0)
    t[0, 0, 3] = t[0, 3, 4] = t[0, 4, 5] = t[1, 0, 11] = t[1, 4, 12] = 10
    for i in range(2):
        for j in range(6):
            if t[i, j].max() < 10:
                t[i, j, 18] = 10
    return t


def backends():
    return [b.name for b in hal.list_backends() if b.available and b.name in ("cpu", "cuda", "ascend")]


@pytest.mark.parametrize("greedy", [True, False])
def test_sglang_tree_case(greedy):
    logits = target_logits()
    target = logits if greedy else torch.softmax(logits / 0.01, -1)   # SGLang's temperature 0.01
    for name in backends():
        predicts, accept_index, num = verify_tree_sglang(CANDIDATES, RETRIVE_INDEX, NEXT_TOKEN, NEXT_SIBLING, target,
                                                         greedy=greedy, seeds=torch.tensor([1, 2]),
                                                         backend=hal.get_backend(name))
        assert predicts.tolist() == EXPECTED[0], name
        assert accept_index[:, :4].tolist() == EXPECTED[1] and num.tolist() == EXPECTED[2], name


def test_conversions():
    par = sglang_to_parents(NEXT_TOKEN, NEXT_SIBLING)
    assert par.tolist() == [[-1, 0, -1, 2, 3], [-1, 0, 1, -1, 3]]
    nt, ns = parents_to_sglang(par)
    assert sglang_to_parents(nt, ns).tolist() == par.tolist()


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(st.lists(st.lists(st.integers(0, 10 ** 6), max_size=9), min_size=1, max_size=3))
def test_parent_ids_round_trip(raw):
    m = min(len(r) for r in raw)
    par = torch.tensor([[(x % (i + 1)) - 1 for i, x in enumerate(r[:m])] for r in raw], dtype=torch.long)
    nt, ns = parents_to_sglang(par)
    assert torch.equal(sglang_to_parents(nt, ns), par)


@pytest.mark.parametrize("slip", ["swapped", "off_by_one"])
def test_planted_layout_slips_fail_the_case(slip):
    nt, ns = (NEXT_SIBLING, NEXT_TOKEN) if slip == "swapped" else (NEXT_TOKEN, NEXT_SIBLING)
    cands = CANDIDATES if slip == "swapped" else torch.roll(CANDIDATES, 1, 1)   # tokens shifted by one node
    try:
        out = verify_tree_sglang(cands, RETRIVE_INDEX, nt, ns, target_logits(), greedy=True,
                                 backend=hal.get_backend("cpu"))
    except hal.HalError:
        return
    assert out[0].tolist() != EXPECTED[0]


# sgl-kernel/tests/speculative/test_speculative_sampling.py (sgl-project/sglang, commit
# 120affb9613cc3f5bcd055ec09c7621d3ced0ebc): the same tree at (threshold_single, threshold_acc) =
# (1, 1) and (0, 0), num_spec_step = 4 (its accept_index width), temperature 0.01.
THRESHOLD_CASES = [
    (1, 1, [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2]),
    (0, 0, [1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18], [[0, 1, 2, -1], [6, 10, 11, -1]], [2, 2]),
]


@pytest.mark.parametrize("single,acc,predicts,accept_index,num", THRESHOLD_CASES)
def test_sglang_threshold_cases(single, acc, predicts, accept_index, num):
    """(0, 0) is SGLang's relaxed acceptance, LOSSY: every first child in list order is taken."""
    target = torch.softmax(target_logits() / 0.01, -1)
    for name in backends():
        got = verify_tree_sglang(CANDIDATES, RETRIVE_INDEX, NEXT_TOKEN, NEXT_SIBLING, target, seeds=torch.tensor([1, 2]),
                                 backend=hal.get_backend(name), num_spec_step=4, threshold_single=single,
                                 threshold_acc=acc)
        assert [g.tolist() for g in got] == [predicts, accept_index, num], (name, single, acc)


def test_children_are_tried_in_sglangs_list_order():
    """The root's children, listed 2 then 1, both carry the root's argmax (5); only node 2 has a
    matching child. SGLang's walk takes node 2 then node 3 (2 tokens); index order would take
    node 1 and stop (1 token)."""
    cands = torch.tensor([[0, 5, 5, 6]])
    nt, ns = torch.tensor([[2, -1, 3, -1]]), torch.tensor([[-1, -1, 1, -1]])
    logits = torch.zeros(1, 4, 10)
    logits[0, 0, 5] = logits[0, 2, 6] = logits[0, 1, 9] = logits[0, 3, 8] = 10
    for name in backends():
        pred, acc, num = verify_tree_sglang(cands, torch.arange(4)[None], nt, ns, logits, greedy=True,
                                            backend=hal.get_backend(name))
        assert num.tolist() == [2] and acc[0, :3].tolist() == [0, 2, 3], name
        assert pred[[0, 2, 3]].tolist() == [5, 6, 8]


@pytest.mark.parametrize("greedy", [True, False])
def test_num_spec_step_caps_the_accepted_length(greedy):
    """A fully matching chain of 8 drafts with num_spec_step 5: 4 accepted, as SGLang's loop
    ``for j in 1..num_spec_step-1`` bounds it; the next token comes from the 5th node's row."""
    n, V = 9, 12
    cands = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8]])
    nt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, -1]])
    ns = torch.full((1, n), -1)
    logits = torch.zeros(1, n, V)
    for i in range(n):
        logits[0, i, (i + 1) % V] = 20   # row i's argmax is node i + 1's token
    target = logits if greedy else torch.softmax(logits, -1)
    for name in backends():
        pred, acc, num = verify_tree_sglang(cands, torch.arange(n)[None], nt, ns, target, greedy=greedy,
                                            seeds=torch.tensor([3]), backend=hal.get_backend(name), num_spec_step=5)
        assert num.tolist() == [4] and acc.shape == (1, 5) and acc[0].tolist() == [0, 1, 2, 3, 4], name
        assert pred[4] == 5 or not greedy


def test_sglang_verify_tree_greedy_case():
    """sgl-kernel/tests/speculative/test_eagle_utils.py::test_verify_tree_greedy (commit
    120affb9613cc3f5bcd055ec09c7621d3ced0ebc): the same tree, argmax walk, num_spec_step 4."""
    for name in backends():
        got = verify_tree_sglang(CANDIDATES, RETRIVE_INDEX, NEXT_TOKEN, NEXT_SIBLING, target_logits(), greedy=True,
                                 backend=hal.get_backend(name), num_spec_step=4)
        assert [g.tolist() for g in got] == [EXPECTED[0], EXPECTED[1], EXPECTED[2]], name
