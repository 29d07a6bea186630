"""verify_rejection: exactness in distribution (chi-square, 10^5 draws per case,
fixed seeds) and the deterministic edge rules."""

import pytest
import torch

from hal.conformance._helpers import (accepted_length_probs, alpha, assert_distribution, chain_batch, host,
                                      put, random_probs, ragged, seeds_offsets)

pytestmark = pytest.mark.hal_op("verify_rejection")
R = 100_000


def draw(q_rows: torch.Tensor, seed: int) -> torch.Tensor:
    """Drafts x_j ~ q_j, independently for R requests: [R, k]."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q.double(), R, replacement=True, generator=g) for q in q_rows], 1)


def run(be, b, offset=3):
    seeds, offsets = seeds_offsets(R, base=11, offset=offset)
    out, n = be.verify_rejection(*put(be, b.draft_token_ids, b.cu, b.draft_probs, b.target_probs, seeds,
                                      offsets), b.k)
    return host(out), host(n)


def check_exact(out, n, p_rows, k, what):
    """Token j, given it was emitted (n >= j), is distributed as p_j."""
    assert out.shape == (R, k + 1) and out.dtype == torch.int32
    for j in range(k + 1):
        reached = n >= j
        assert int(reached.sum()) >= 1000, f"{what}: test design: too few samples reach position {j}"
        assert_distribution(out[reached, j], p_rows[j], f"{what}: position {j}")
    emitted = (out >= 0).sum(1)
    assert torch.equal(emitted, n.long() + 1), f"{what}: rows must hold n_accepted + 1 tokens"


CASES = {
    "dense": dict(V=6, k=3, zeros=0.0),
    "sparse": dict(V=8, k=3, zeros=0.4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exact_distribution_and_accepted_lengths(backend, case):
    c = CASES[case]
    g = torch.Generator().manual_seed(100 + len(case))
    p = random_probs(g, c["k"] + 1, c["V"], c["zeros"])
    q = random_probs(g, c["k"], c["V"], c["zeros"])
    out, n = run(backend, chain_batch(p, q, R, draw(q, 5)))
    check_exact(out, n, p, c["k"], case)
    assert_distribution(n, accepted_length_probs(alpha(p[:-1], q)), f"{case}: accepted lengths")


def test_one_hot_draft_probs(backend):
    g = torch.Generator().manual_seed(7)
    p = random_probs(g, 4, 6)
    q = torch.zeros(3, 6)
    q[torch.arange(3), p[:3].argmax(-1)] = 1.0
    out, n = run(backend, chain_batch(p, q, R, draw(q, 6)))
    check_exact(out, n, p, 3, "one-hot q")
    assert_distribution(n, accepted_length_probs(alpha(p[:-1], q)), "one-hot q: accepted lengths")


def test_q_equals_p_accepts_everything(backend):
    g = torch.Generator().manual_seed(8)
    p = random_probs(g, 4, 6, zeros=0.3)
    out, n = run(backend, chain_batch(p, p[:-1], R, draw(p[:-1], 7)))
    assert bool((n == 3).all()), "q == p must accept every draft"
    assert_distribution(out[:, 3], p[3], "q == p: bonus token")


def test_disjoint_supports_always_reject(backend):
    p = torch.tensor([[.5, .5, 0, 0], [.25, .25, .25, .25]])
    q = torch.tensor([[0, 0, .5, .5]])
    out, n = run(backend, chain_batch(p, q, R, draw(q, 8)))
    assert bool((n == 0).all())
    assert_distribution(out[:, 0], p[0], "disjoint supports: recovered token")


def test_no_draft_probs(backend):
    """Deterministic drafts: accept with probability p(x), recover from p without x."""
    g = torch.Generator().manual_seed(9)
    p = random_probs(g, 4, 5, zeros=0.2)
    picks = p[:3].argsort(-1, descending=True)[torch.arange(3), torch.tensor([0, 1, 0])]  # 1st, 2nd, 1st
    drafts = picks.repeat(R, 1)
    out, n = run(backend, chain_batch(p, None, R, drafts))
    check_exact(out, n, p, 3, "no draft probs")
    one_hot = torch.zeros(3, 5)
    one_hot[torch.arange(3), picks] = 1
    assert_distribution(n, accepted_length_probs(alpha(p[:-1], one_hot)), "no draft probs: accepted lengths")


def test_dspark_counterexample(backend):
    """Target (0.7, 0.3), draft (0.5, 0.5): the output must stay (0.7, 0.3)."""
    p = torch.tensor([[0.7, 0.3]] * 3)
    q = torch.tensor([[0.5, 0.5]] * 2)
    out, n = run(backend, chain_batch(p, q, R, draw(q, 10)))
    check_exact(out, n, p, 2, "DSpark")
    assert_distribution(n, accepted_length_probs(alpha(p[:-1], q)), "DSpark: accepted lengths")


def test_edge_rules_are_deterministic(backend):
    """q(x)=0<p(x) always accepts; p(x)=0 always rejects (also with q(x)=0); the
    recovered token always has positive residual weight."""
    M = 2000
    p = torch.tensor([[.3, .7, 0, 0], [.1, .2, .3, .4]])
    cases = [  # (q row, draft, accepted?)
        ([0, .5, .5, 0], 0, True),
        ([.25, .25, .25, .25], 2, False),
        ([.5, .5, 0, 0], 3, False),      # p(x) = q(x) = 0
    ]
    for q_row, x, accepted in cases:
        q = torch.tensor([q_row])
        b = chain_batch(p, q, M, torch.full((M, 1), x))
        seeds, offsets = seeds_offsets(M, base=3)
        out, n = host(*backend.verify_rejection(*put(backend, b.draft_token_ids, b.cu, b.draft_probs,
                                                      b.target_probs, seeds, offsets), 1))
        assert bool((n == int(accepted)).all()), f"q={q_row}, x={x}: accepted must be {accepted}"
        if not accepted:
            resid = (p[0] - q[0]).clamp(min=0)
            assert bool((resid[out[:, 0].long()] > 0).all()), "recovered a token of zero residual"


def test_residual_zero_falls_back_to_p(backend):
    """p == q on the support but x has p(x) = q(x) = 0: residual is all zero, sample p."""
    p = torch.tensor([[.6, .4, 0], [1., 0, 0]])
    q = torch.tensor([[.6, .4, 0]])
    M = 20_000
    b = chain_batch(p, q, M, torch.full((M, 1), 2))
    seeds, offsets = seeds_offsets(M)
    out, n = host(*backend.verify_rejection(*put(backend, b.draft_token_ids, b.cu, b.draft_probs,
                                                  b.target_probs, seeds, offsets), 1))
    assert bool((n == 0).all())
    assert_distribution(out[:, 0], p[0], "zero residual fallback")


def test_zero_drafts_and_mixed_batch(backend):
    g = torch.Generator().manual_seed(12)
    drafts = [[], [1, 2], [], [3]]
    ids, cu = ragged(drafts)
    target = random_probs(g, 4 + 3, 4)
    seeds, offsets = seeds_offsets(4)
    out, n = host(*backend.verify_rejection(*put(backend, ids, cu, None, target, seeds, offsets), 2))
    assert out.shape == (4, 3)
    assert n[0] == 0 and n[2] == 0 and out[0, 1:].tolist() == [-1, -1] and out[0, 0] >= 0


def test_same_seed_same_output_and_batch_invariance(backend):
    g = torch.Generator().manual_seed(13)
    drafts = [[1, 2, 3], [0], [], [2, 2]]
    ids, cu = ragged(drafts)
    target = random_probs(g, 6 + 4, 5)
    dprobs = random_probs(g, 6, 5)
    seeds, offsets = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 3])
    args = put(backend, ids, cu, dprobs, target, seeds, offsets)
    a = host(*backend.verify_rejection(*args, 3))
    b = host(*backend.verify_rejection(*args, 3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # request 1 alone gives the same answer as inside the batch
    alone = host(*backend.verify_rejection(*put(backend, torch.tensor([0]), torch.tensor([0, 1]), dprobs[3:4],
                                                target[4:6], seeds[1:2], offsets[1:2]), 3))
    assert torch.equal(alone[0][0], a[0][1]) and alone[1][0] == a[1][1]
    # and the offset matters: 40 offsets do not all give one answer
    outs = set()
    for off in range(40):
        o = host(backend.verify_rejection(*put(backend, ids, cu, dprobs, target, seeds,
                                               torch.full((4,), off)), 3)[0])
        outs.add(tuple(o.flatten().tolist()))
    assert len(outs) > 5
