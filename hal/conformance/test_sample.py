"""sample: the processed distribution q, greedy rows, and draws distributed as q."""

import os

import pytest
import torch

from hal.conformance._helpers import assert_distribution, host, put, seeds_offsets

pytestmark = pytest.mark.hal_op("sample")


def params(R, temperature, top_k, top_p):
    return (torch.full((R,), temperature, dtype=torch.float32), torch.full((R,), top_k, dtype=torch.int32),
            torch.full((R,), top_p, dtype=torch.float32))


def expected_q(logits, temperature, top_k, top_p):
    """The definition, one row at a time in float64 (inputs without ties)."""
    z = logits.double() / temperature
    order = sorted(range(z.numel()), key=lambda v: -z[v].item())
    keep = order[:top_k] if 0 < top_k < z.numel() else order
    p = torch.softmax(z[keep], 0)
    kept, mass = [], 0.0
    for v, pv in zip(keep, p.tolist()):
        if mass >= top_p and kept:
            break
        kept.append(v)
        mass += pv
    out = torch.zeros_like(z)
    out[kept] = torch.softmax(z[kept], 0)
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 6, 0.7)])
def test_q_and_draws(backend, temperature, top_k, top_p):
    """100,000 draws of one row, or the backend's `draw_share` of them in a default run (the
    Triton interpreter: 25,000; ``--slow``: all). At alpha 1e-6 over 16 cells, 100,000 draws
    catch 4 times in 5 a 0.7-point shift of a 10% token's mass to the others (noncentral
    chi-square), and 25,000 a 1.4-point one."""
    g = torch.Generator().manual_seed(21)
    share = 1.0 if os.environ.get("HAL_SLOW") == "1" else backend.spec.draw_share
    V, R = 16, max(1000, int(100_000 * share))
    row = torch.randn(V, generator=g) * 1.5
    logits = row.repeat(R, 1)
    seeds, offsets = seeds_offsets(R, base=5)
    tok, q = host(*backend.sample(*put(backend, logits, *params(R, temperature, top_k, top_p), seeds, offsets)))
    want = expected_q(row, temperature, top_k, top_p)
    assert tok.shape == (R,) and tok.dtype == torch.int32 and q.shape == (R, V) and q.dtype == torch.float32
    torch.testing.assert_close(q[0].double(), want, atol=1e-5, rtol=0)
    assert torch.equal(q[0] == 0, want == 0), "filtered tokens must have q exactly 0"
    assert_distribution(tok, want, f"sample T={temperature} k={top_k} p={top_p}")


def test_greedy_rows_are_one_hot_argmax(backend):
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, -torch.inf, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    seeds, offsets = seeds_offsets(3)
    temp, top_k, top_p = params(3, 0.0, 2, 0.5)
    tok, q = host(*backend.sample(*put(backend, logits, temp, top_k, top_p, seeds, offsets)))
    assert tok.tolist() == [1, 0, 3]
    assert torch.equal(q, torch.eye(4)[[1, 0, 3]])


def test_ties_at_the_cutoff_are_kept(backend):
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    seeds, offsets = seeds_offsets(2)
    temp, top_k, top_p = params(2, 1.0, 2, 1.0)
    _, q = host(*backend.sample(*put(backend, logits, temp, top_k, top_p, seeds, offsets)))
    assert (q[0] > 0).tolist() == [True, False, True, True, False]
    assert bool((q[1] > 0).all()), "an all-tied row keeps every token"


def test_mixed_rows_and_determinism(backend):
    g = torch.Generator().manual_seed(22)
    logits = torch.randn(6, 50, generator=g)
    temp = torch.tensor([0.0, 1.0, 0.5, 0.0, 2.0, 1.0])
    top_k = torch.tensor([0, 10, -1, 3, 0, 1], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.2, 0.5, 1.0])
    seeds, offsets = seeds_offsets(6, base=9)
    args = put(backend, logits, temp, top_k, top_p, seeds, offsets)
    a, b = host(*backend.sample(*args)), host(*backend.sample(*args))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for r in range(6):
        if temp[r] == 0:
            assert int(a[0][r]) == int(logits[r].argmax())
        else:
            want = expected_q(logits[r], float(temp[r]), int(top_k[r]), float(top_p[r]))
            torch.testing.assert_close(a[1][r].double(), want, atol=1e-5, rtol=0)
            assert want[int(a[0][r])] > 0
    assert int(a[0][5]) == int(logits[5].argmax()), "top_k = 1 is argmax"
