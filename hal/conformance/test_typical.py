"""verify_typical (lossy by design): the acceptance rule, recovery and bonus."""

import math

import pytest
import torch

from hal.conformance._helpers import host, put, random_probs, ragged, seeds_offsets

pytestmark = pytest.mark.hal_op("verify_typical")


def spec(drafts, target, eps, delta):
    """Accepted counts and recovered tokens, by the definition, in a plain loop."""
    counts, recovered, row = [], [], 0
    for d in drafts:
        n = 0
        for j, x in enumerate(d):
            p = target[row + j].double()
            h = -sum(float(v) * math.log(float(v)) for v in p if v > 0)
            if float(p[x]) > min(eps, delta * math.exp(-h)):
                n += 1
            else:
                break
        counts.append(n)
        recovered.append(int(target[row + n].argmax()) if n < len(d) else None)
        row += len(d) + 1
    return counts, recovered


@pytest.mark.parametrize("eps,delta", [(0.09, 0.3), (0.3, 0.9), (0.01, 0.05)])
def test_acceptance_rule(backend, eps, delta):
    g = torch.Generator().manual_seed(31)
    sharp = torch.softmax(torch.randn(60, 12, generator=g) * 3, -1)
    drafts = [[int(t) for t in torch.randint(0, 12, (k,), generator=g)] for k in [0, 1, 2, 3, 4, 5, 3, 2, 1, 4]]
    N = sum(map(len, drafts))
    target = sharp[: N + len(drafts)]
    for r, d in enumerate(drafts):  # make early drafts likely: the argmax of their row
        row = sum(len(x) + 1 for x in drafts[:r])
        for j in range(len(d) // 2):
            d[j] = int(target[row + j].argmax())
    ids, cu = ragged(drafts)
    seeds, offsets = seeds_offsets(len(drafts))
    out, n = host(*backend.verify_typical(*put(backend, ids, cu, target, seeds, offsets), 5, eps, delta))
    counts, recovered = spec(drafts, target, eps, delta)
    assert n.tolist() == counts
    for r, d in enumerate(drafts):
        assert out[r, :counts[r]].tolist() == d[:counts[r]]
        if recovered[r] is not None:
            assert int(out[r, counts[r]]) == recovered[r]
        else:   # bonus: sampled from p at the bonus row
            row = sum(len(x) + 1 for x in drafts[:r]) + len(d)
            assert target[row, int(out[r, counts[r]])] > 0
        assert (out[r, counts[r] + 1:] == -1).all()


def test_one_hot_target_is_greedy(backend, oracle):
    g = torch.Generator().manual_seed(32)
    top = torch.randint(0, 6, (12,), generator=g)
    target = torch.eye(6)[top]
    drafts = [[int(top[0]), int(top[1]), 5], [int(top[4]), (int(top[5]) + 1) % 6], [int(top[7]), int(top[8]),
                                                                                   int(top[9]), int(top[10])]]
    ids, cu = ragged(drafts)
    seeds, offsets = seeds_offsets(3)
    out, n = host(*backend.verify_typical(*put(backend, ids, cu, target, seeds, offsets), 4, 0.09, 0.3))
    want = oracle.verify_greedy(ids, cu, torch.log(target.clamp(min=1e-30)), 4)
    assert torch.equal(out, want[0]) and torch.equal(n, want[1])


def test_bonus_is_seeded(backend):
    g = torch.Generator().manual_seed(33)
    target = random_probs(g, 1, 8).repeat(200, 1)
    ids, cu = ragged([[]] * 200)
    seeds, offsets = seeds_offsets(200)
    a = host(backend.verify_typical(*put(backend, ids, cu, target, seeds, offsets), 0, 0.09, 0.3)[0])
    b = host(backend.verify_typical(*put(backend, ids, cu, target, seeds, offsets), 0, 0.09, 0.3)[0])
    assert torch.equal(a, b) and len(set(a[:, 0].tolist())) > 3
