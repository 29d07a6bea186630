"""verify_rejection_logits: exactness in distribution from logits at several temperatures,
-inf masks included (chi-square, 10^5 draws per case, fixed seeds); greedy requests mixed in
verify exactly as `verify_greedy`; the deterministic edge rules."""

import math

import pytest
import torch

from hal.conformance._helpers import (accepted_length_probs, alpha, assert_distribution, chain_batch, host, put,
                                      random_probs, ragged, seeds_offsets)
from hal.conformance.test_rejection import check_exact, draw

pytestmark = pytest.mark.hal_op("verify_rejection_logits")
R = 100_000


def logits_of(p: torch.Tensor, temperature: float, shift: float = 0.0) -> torch.Tensor:
    """Logits whose softmax at ``temperature`` is ``p`` (-inf where p == 0), shifted per row."""
    return torch.where(p > 0, p.double().log() * temperature + shift, -math.inf).float()


def run(be, b, logits, temperature, offset=3):
    seeds, offsets = seeds_offsets(b.cu.shape[0] - 1, base=11, offset=offset)
    temp = torch.full((b.cu.shape[0] - 1,), float(temperature))
    out, n = be.verify_rejection_logits(*put(be, b.draft_token_ids, b.cu, b.draft_probs, logits, temp, seeds,
                                             offsets), b.k)
    return host(out), host(n)


CASES = {  # V, k, fraction of masked (-inf) tokens, temperature, row shift
    "dense-T1": dict(V=6, k=3, zeros=0.0, T=1.0, shift=0.0),
    "masked-T0.6": dict(V=8, k=3, zeros=0.4, T=0.6, shift=40.0),
    "dense-T2.5": dict(V=7, k=2, zeros=0.0, T=2.5, shift=-25.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exact_distribution_and_accepted_lengths(backend, case):
    c = CASES[case]
    g = torch.Generator().manual_seed(200 + len(case))
    p = random_probs(g, c["k"] + 1, c["V"], c["zeros"])
    q = random_probs(g, c["k"], c["V"], c["zeros"])
    b = chain_batch(p, q, R, draw(q, 21))
    out, n = run(backend, b, logits_of(b.target_probs, c["T"], c["shift"]), c["T"])
    check_exact(out, n, p, c["k"], case)
    assert_distribution(n, accepted_length_probs(alpha(p[:-1], q)), f"{case}: accepted lengths")


def test_no_draft_probs(backend):
    """Deterministic drafts: accept with probability p(x), recover from p without x."""
    g = torch.Generator().manual_seed(19)
    p = random_probs(g, 4, 5, zeros=0.2)
    picks = p[:3].argsort(-1, descending=True)[torch.arange(3), torch.tensor([0, 1, 0])]
    b = chain_batch(p, None, R, picks.repeat(R, 1))
    out, n = run(backend, b, logits_of(b.target_probs, 0.8), 0.8)
    check_exact(out, n, p, 3, "no draft probs")
    one_hot = torch.zeros(3, 5)
    one_hot[torch.arange(3), picks] = 1
    assert_distribution(n, accepted_length_probs(alpha(p[:-1], one_hot)), "no draft probs: accepted lengths")


def test_greedy_requests_verify_as_verify_greedy(backend):
    """Greedy requests (temperature 0 or below SAMPLING_EPS) among sampled ones: bit-identical to
    `verify_greedy` on their rows, ties (lowest id) and -inf included; their draft_probs are ignored."""
    g = torch.Generator().manual_seed(23)
    M, V, k = 48, 9, 3
    ks = torch.randint(0, k + 1, (M,), generator=g).tolist()
    logits = torch.randint(-3, 3, (sum(ks) + M, V), generator=g).float()          # integer values: exact ties
    logits[torch.rand(logits.shape, generator=g) < 0.2] = -math.inf
    logits[:, 0] = logits[:, 0].clamp(min=-3)                                      # a finite logit per row
    top = logits.argmax(-1)
    cu = torch.tensor([0] + ks).cumsum(0)
    rows = [cu[r] + r + j for r in range(M) for j in range(ks[r])]
    # drafts: the argmax for a while, then a miss, so prefixes of every length occur
    ids = torch.stack([top[i] if torch.rand(1, generator=g) < 0.7 else (top[i] + 1) % V for i in rows]) \
        if rows else torch.zeros(0, dtype=torch.long)
    temp = torch.where(torch.arange(M) % 3 == 0, 0.0, torch.where(torch.arange(M) % 3 == 1, 1e-6, 0.9))
    q = random_probs(g, sum(ks), V)
    seeds, offsets = seeds_offsets(M, base=5)
    out, n = host(*backend.verify_rejection_logits(*put(backend, ids, cu, q, logits, temp, seeds, offsets), k))
    want_out, want_n = host(*backend.verify_greedy(*put(backend, ids, cu, logits), k))
    greedy = temp < 1e-5
    assert torch.equal(out[greedy], want_out[greedy]) and torch.equal(n[greedy], want_n[greedy]), \
        "greedy requests must verify exactly as verify_greedy"
    sampled = ~greedy
    assert bool((out[sampled] < V).all()) and bool(((out >= 0).sum(1) == n + 1).all())


def test_edge_rules_are_deterministic(backend):
    """q(x)=0<p(x) always accepts; p(x)=0 (a -inf logit) always rejects, also with q(x)=0;
    the recovered token always has positive residual weight."""
    M = 2000
    p = torch.tensor([[.3, .7, 0, 0], [.1, .2, .3, .4]])
    for q_row, x, accepted in [([0, .5, .5, 0], 0, True), ([.25, .25, .25, .25], 2, False), ([.5, .5, 0, 0], 3, False)]:
        q = torch.tensor([q_row])
        b = chain_batch(p, q, M, torch.full((M, 1), x))
        out, n = run(backend, b, logits_of(b.target_probs, 1.3, 7.0), 1.3)
        assert bool((n == int(accepted)).all()), f"q={q_row}, x={x}: accepted must be {accepted}"
        if not accepted:
            resid = (p[0] - q[0]).clamp(min=0)
            assert bool((resid[out[:, 0].long()] > 0).all()), "recovered a token of zero residual"


def test_residual_zero_falls_back_to_p(backend):
    p = torch.tensor([[.6, .4, 0], [1., 0, 0]])
    q = torch.tensor([[.6, .4, 0]])
    b = chain_batch(p, q, 20_000, torch.full((20_000, 1), 2))
    out, n = run(backend, b, logits_of(b.target_probs, 1.0), 1.0)
    assert bool((n == 0).all())
    assert_distribution(out[:, 0], p[0], "zero residual fallback")


def test_zero_drafts_seed_and_batch_invariance(backend):
    g = torch.Generator().manual_seed(29)
    ids, cu = ragged([[1, 2, 3], [0], [], [2, 2]])
    logits = torch.randn(6 + 4, 5, generator=g) * 3
    dprobs = random_probs(g, 6, 5)
    temp = torch.tensor([0.7, 1.5, 1.0, 0.0])
    seeds, offsets = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 3])
    args = put(backend, ids, cu, dprobs, logits, temp, seeds, offsets)
    a = host(*backend.verify_rejection_logits(*args, 3))
    b = host(*backend.verify_rejection_logits(*args, 3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[1][2] == 0 and a[0][2, 1:].tolist() == [-1, -1, -1] and 0 <= a[0][2, 0] < 5
    alone = host(*backend.verify_rejection_logits(*put(backend, torch.tensor([0]), torch.tensor([0, 1]), dprobs[3:4],
                                                       logits[4:6], temp[1:2], seeds[1:2], offsets[1:2]), 3))
    assert torch.equal(alone[0][0], a[0][1]) and alone[1][0] == a[1][1]
    outs = {tuple(host(backend.verify_rejection_logits(*put(backend, ids, cu, dprobs, logits, temp, seeds,
                                                            torch.full((4,), off)), 3)[0]).flatten().tolist())
            for off in range(40)}
    assert len(outs) > 5
    empty = host(*backend.verify_rejection_logits(*put(backend, torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                                       None, torch.zeros(0, 5), torch.zeros(0),
                                                       torch.zeros(0, dtype=torch.long),
                                                       torch.zeros(0, dtype=torch.long)), 2))
    assert empty[0].shape == (0, 3) and empty[1].shape == (0,)


def test_wide_vocabulary(backend):
    """V = 8195: the row max sits in a later vocabulary tile than other mass (kernels that tile
    the vocabulary must rescale their running sums), at temperature 1.25. The draft's acceptance
    rate is p(x); the bonus token falls on (spike, bump, rest) at their rates."""
    M, V, T = 1000, 8195, 1.25
    row = torch.zeros(2, V)
    row[0, 5000], row[0, 100] = 11.0, 3.0
    row[1, 8000], row[1, 7] = 9.0, 6.0
    p = (row / T).double().softmax(-1)
    b = chain_batch(row, None, M, torch.full((M, 1), 5000))
    out, n = run(backend, b, b.target_probs, T)
    assert_distribution(n, torch.stack([1 - p[0, 5000], p[0, 5000]]), "wide V: acceptance of the draft")
    bonus = out[n == 1, 1].long()
    cat = torch.where(bonus == 8000, 0, torch.where(bonus == 7, 1, 2))
    assert_distribution(cat, torch.stack([p[1, 8000], p[1, 7], 1 - p[1, 8000] - p[1, 7]]), "wide V: bonus token")
    residual = out[n == 0, 0].long()
    assert bool((residual != 5000).all()), "the rejected draft token was drawn again (one-hot q)"
