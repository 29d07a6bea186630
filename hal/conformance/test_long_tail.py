"""The long tail is sampled at its rate (slow: ``python -m hal conformance --backend X --slow``).

p = 0.999 on one token and 1e-3 spread over the other 49,151 (each 2e-8 of the top). A
race whose exponentials come from a 24-bit uniform (E >= 6e-8) almost never emits the
tail; the contract says it is emitted 1e-3 of the time. 30,000 draws per op (30 expected),
chi-square on (top, tail) at alpha 1e-6, for `sample`, the bonus token of
`verify_rejection` (from probabilities and from logits) and the extra token of sampling `verify_tree`.

About 2e9 token evaluations per op: a minute on the cpu reference, seconds on a GPU,
hours under the Triton interpreter (there `tests/backends/test_random.py` checks the race's
exponentials directly)."""

import os

import pytest
import torch

from hal.conformance._helpers import assert_distribution, host, put

pytestmark = [pytest.mark.hal_op("sample", "verify_rejection", "verify_rejection_logits", "verify_tree"),
              pytest.mark.skipif(os.environ.get("HAL_SLOW") != "1", reason="slow: run with --slow (HAL_SLOW=1)")]
V, N, CHUNK = 49152, 30_000, 1000


def tail_probs():
    p = torch.full((V,), 1e-3 / (V - 1), dtype=torch.float64)
    p[0] = 0.999
    return p


@pytest.mark.parametrize("op", ["sample", "verify_rejection", "verify_rejection_logits", "verify_tree"])
def test_long_tail_mass(backend, op):
    p = tail_probs()
    pf = p.float()
    tokens = []
    for c in range(0, N, CHUNK):
        R = min(CHUNK, N - c)
        seeds, offs = torch.arange(c, c + R) * 7919 + 3, torch.full((R,), 5)
        if op == "sample":
            tok, _ = backend.sample(*put(backend, pf.log()[None].expand(R, V), torch.ones(R),
                                         torch.zeros(R, dtype=torch.int32), torch.ones(R), seeds, offs))
        else:
            ids, cu = torch.zeros(0, dtype=torch.long), torch.zeros(R + 1, dtype=torch.long)
            args = put(backend, ids, cu, pf[None].expand(R, V), seeds, offs)
            if op == "verify_rejection":
                out, _ = backend.verify_rejection(args[0], args[1], None, *args[2:], 0)
            elif op == "verify_rejection_logits":
                out, _ = backend.verify_rejection_logits(args[0], args[1], None, put(backend, pf.log()[None].expand(R, V)),
                                                         put(backend, torch.ones(R)), *args[3:], 0)
            else:
                out, _, _ = backend.verify_tree(args[0], args[1], args[0], args[2], None, *args[3:], 0)
            tok = out[:, 0]
        tokens.append(host(tok).long())
    tok = torch.cat(tokens)
    tail = (tok != 0).long()
    assert_distribution(tail, torch.tensor([p[0], 1 - p[0]]), f"{op}: long tail (emitted {int(tail.sum())}, "
                                                              f"expected {N * 1e-3:.0f})")
