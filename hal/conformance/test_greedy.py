"""verify_greedy: bitwise golden cases and equality with the reference."""

import pytest
import torch

from hal.conformance._helpers import host, put, ragged
from hal.errors import HalError

pytestmark = pytest.mark.hal_op("verify_greedy")
V = 8


def logits_for(argmaxes: list[int], margin: float = 10.0) -> torch.Tensor:
    out = torch.full((len(argmaxes), V), -margin)
    out[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = margin
    return out


def run(be, drafts, logits, max_k, dtype=torch.float32):
    ids, cu = ragged(drafts)
    out, n = be.verify_greedy(*put(be, ids, cu, logits.to(dtype)), max_k)
    return host(out).tolist(), host(n).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_golden_cases(backend, dtype):
    cases = [  # (drafts, target argmax per row, expected row, expected num_accepted)
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], 3),        # perfect match: bonus token
        ([1, 2, 3], [1, 5, 3, 4], [1, 5, -1, -1], 1),      # early mismatch
        ([1, 2, 3], [6, 2, 3, 4], [6, -1, -1, -1], 0),     # first draft wrong
        ([], [2], [2, -1, -1, -1], 0),                     # no drafts: bonus only
        ([7], [7, 0], [7, 0, -1, -1], 1),                  # mixed lengths in one batch
    ]
    drafts = [c[0] for c in cases]
    logits = logits_for([t for c in cases for t in c[1]])
    out, n = run(backend, drafts, logits, 3, dtype)
    assert out == [c[2] for c in cases]
    assert n == [c[3] for c in cases]


def test_ties_go_to_lowest_id(backend):
    logits = torch.zeros(4, V)
    logits[0, [2, 5]] = 3.0      # tie 2/5: argmax 2, draft 5 rejected
    logits[1, [1, 4]] = 3.0
    logits[2, :] = 1.0           # all tied: 0; draft 0 accepted
    logits[3, [3, 6]] = 3.0      # bonus row of request 1
    out, n = run(backend, [[5], [0]], torch.stack([logits[0], logits[1], logits[2], logits[3]]), 1)
    assert out == [[2, -1], [0, 3]]
    assert n == [0, 1]


def test_neg_inf_rows(backend):
    logits = torch.full((4, V), -torch.inf)
    logits[0, 6] = 0.0           # only token 6 allowed
    logits[2, 3] = -1e30         # only token 3 finite
    # row 1 (bonus of request 0) is all -inf: argmax is token 0 by the tie rule
    out, n = run(backend, [[6], [3]], logits, 1)
    assert out == [[6, 0], [3, 0]] and n == [1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_on_random_inputs(backend, oracle, dtype):
    g = torch.Generator().manual_seed(1)
    R, V2, max_k = 37, 1000, 6
    ks = torch.randint(0, max_k + 1, (R,), generator=g).tolist()
    logits = (torch.randn(sum(ks) + R, V2, generator=g) * 3).to(dtype)
    if dtype == torch.bfloat16:   # coarse values: plenty of exact ties
        logits = logits.round()
    top = logits.float().argmax(-1)
    drafts, row = [], 0
    for k in ks:
        d = []
        for j in range(k):
            hit = torch.rand((), generator=g) < 0.8
            d.append(int(top[row + j]) if hit else int(torch.randint(0, V2, (), generator=g)))
        drafts.append(d)
        row += k + 1
    ids, cu = ragged(drafts)
    want = oracle.verify_greedy(ids, cu, logits, max_k)
    got = host(*backend.verify_greedy(*put(backend, ids, cu, logits), max_k))
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_reference_matches_plain_loop(oracle):
    """The oracle itself against the definition, written as a plain loop."""
    g = torch.Generator().manual_seed(2)
    drafts = [[int(t) for t in torch.randint(0, 4, (k,), generator=g)] for k in [0, 1, 3, 5, 2]]
    logits = torch.randint(0, 3, (sum(map(len, drafts)) + len(drafts), 4), generator=g).float()
    ids, cu = ragged(drafts)
    out, n = oracle.verify_greedy(ids, cu, logits, 5)
    row = 0
    for r, d in enumerate(drafts):
        want = []
        for j in range(len(d) + 1):
            best = max(range(4), key=lambda v: (logits[row + j, v].item(), -v))
            want.append(best)
            if j == len(d) or d[j] != best:
                break
        assert out[r].tolist() == want + [-1] * (6 - len(want))
        assert int(n[r]) == len(want) - 1
        row += len(d) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_is_verify_greedy_without_drafts(backend, oracle, dtype):
    """`Backend.greedy_rows` (a step that drafted nothing) emits what the oracle's verify_greedy
    emits with every k = 0, ties included; its value check and shape check refuse as the op's do."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(29, 1000, generator=g) * 3).to(dtype).round()   # coarse values: exact ties
    logits[4] = 1.0                                                        # a row all tied: token 0
    ids, cu = ragged([[] for _ in range(29)])
    want = oracle.verify_greedy(ids, cu, logits, 0)[0]
    got = host(backend.greedy_rows(put(backend, logits)))
    assert got.dtype == torch.int32 and torch.equal(got, want)
    with pytest.raises(HalError, match="target_logits"):
        backend.greedy_rows(put(backend, logits[0]))   # not [R, V]
    if backend.check_values:
        bad = logits.float().clone()
        bad[7, 3] = float("nan")
        with pytest.raises(HalError, match="row 7"):
            backend.greedy_rows(put(backend, bad))
