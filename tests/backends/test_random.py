"""The exponentials behind every sampling race keep their resolution near 0, where a
long-tail token wins (issue "Hardening", item 11). A race fed -log(u) with a float32
u <= 1 - 2^-24 only ever draws E on the grid -log(1 - m 2^-24): so 1 - exp(-E) is a whole
multiple of 2^-24. The real draws are not; a planted 24-bit version is caught.

The op-level check (the long tail's mass, chi-square) is the slow conformance test
`hal/conformance/test_long_tail.py` (``--slow``): too costly under the Triton interpreter."""

import os

import pytest
import torch

from verify_ops._common import _GOLDEN, _lsr, _mix, _wrap, exponential32

SMALL = 4e-4          # draws below this: about 100 of 2^18
GRID = 2.0 ** -24


def on_grid_share(e: torch.Tensor) -> float:
    """Share of the small draws whose 1 - exp(-E) sits within 1% of a multiple of 2^-24."""
    small = e[(e > 0) & (e < SMALL)].double()
    assert small.numel() > 50, f"test design: only {small.numel()} small draws"
    m = -torch.expm1(-small) / GRID
    return float(((m - m.round()).abs() < 0.01).double().mean())


def _exponential24(seeds, offsets, stream, index):
    """The old ascend draw: -log(u), u = (k + 0.5) 2^-24 in float32 (planted)."""
    key = _mix(_mix(seeds + _wrap(stream * _GOLDEN)) ^ offsets)
    x = _mix(key[:, None] + (index + 1) * _GOLDEN)
    return -torch.log((_lsr(x, 40).float() + 0.5) * 2.0 ** -24)


def test_ascend_exponentials_resolve_the_tail():
    idx = torch.arange(1 << 18)
    s, o = torch.tensor([11]), torch.tensor([3])
    real = exponential32(s, o, 1, idx)[0]
    assert real.dtype == torch.float32 and (real > 0).all() and torch.isfinite(real).all()
    assert abs(float(real.double().mean()) - 1) < 0.01        # Exp(1): mean 1 (sd 0.002 here)
    assert on_grid_share(real) < 0.2
    assert on_grid_share(_exponential24(s, o, 1, idx)[0]) > 0.9, "the planted 24-bit draw must be caught"


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:   # kernels see module globals only
    import triton
    import triton.language as tl

    from backends.cuda._common import exponential, uniform

    @triton.jit
    def _real_kernel(out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, exponential(tl.zeros([N], tl.int64) + 11, tl.zeros([N], tl.int64) + 3, 1, i))

    @triton.jit
    def _planted_kernel(out_ptr, N: tl.constexpr):   # the old race: -log(u), u from one float32 uniform
        i = tl.arange(0, N)
        tl.store(out_ptr + i, -tl.log(uniform(tl.zeros([N], tl.int64) + 11, tl.zeros([N], tl.int64) + 3, 1, i)))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (cuda kernels on CPU)")
def test_cuda_exponentials_resolve_the_tail():
    n = 1 << 18
    real, planted = torch.empty(n), torch.empty(n)
    _real_kernel[(1,)](real, n)
    _planted_kernel[(1,)](planted, n)
    assert (real > 0).all() and torch.isfinite(real).all()
    assert abs(float(real.double().mean()) - 1) < 0.01
    assert on_grid_share(real) < 0.2
    assert on_grid_share(planted) > 0.9, "the planted 24-bit draw must be caught"
