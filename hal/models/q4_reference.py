"""The q4q8 kernel's arithmetic written out in torch, step by step: the oracle its bit tests
compare against (`tests/models/test_q4_rows.py`). Every float step is one float32 rounding in
the kernel's order; the integer sums are exact (in float64, rounded once to float32, as the
kernel converts its int32 sums). See `hal.models.q4_rows` and `q4_rows.c`'s glossary."""

from __future__ import annotations

import torch
from torch import Tensor

from hal.models import int4


def reference_mm(x: Tensor, codes: Tensor, d: Tensor, m: Tensor | None, row_codes: int = 2) -> Tensor:
    """The kernel's arithmetic in torch, step by step (the oracle of the tests): ``x`` [T, K]
    float32 (already in the row dtype's values), ``codes`` [N, K] (Q4: 0..15; Q8: -128..127;
    Q6: -32..31), ``d``/``m`` [N, K/32] (``m`` None for Q8), or for Q6 ``d`` the scales
    [N, K/16] (and ``m`` None); ``row_codes``: the rows' int8 codes per input (2: hi and lo; 1: hi,
    lo = 0). float32 [T, N]."""
    T, K = x.shape
    if d.shape[1] == K // 16:
        return _reference_q6(x, codes, d, row_codes)
    return _reference_q4q8(x, codes, d, m, row_codes)


def _reference_q6(x: Tensor, codes: Tensor, s: Tensor, row_codes: int) -> Tensor:
    """Q6: per group, y = y + s0*(unit*isum0); y = y + s1*(unit*isum1) over its two halves."""
    T, K = x.shape
    G = K // int4.GROUP
    xq, unit = _quantized(x, row_codes)
    isum = torch.einsum("tgk,ngk->tng", xq.double().view(T, 2 * G, 16), codes.view(-1, 2 * G, 16).double()).float()
    y = torch.zeros(T, codes.shape[0])
    for h in range(2 * G):
        y = y + s[:, h] * (unit[:, h // 2:h // 2 + 1] * isum[:, :, h])
    return y


def _quantized(x: Tensor, row_codes: int) -> tuple[Tensor, Tensor]:
    """A row quantized as the kernel quantizes it: (128 hi + lo [T, G, 32], unit [T, G]); lo = 0
    for rows of one code."""
    T, K = x.shape
    G = K // int4.GROUP
    xv = x.float().view(T, G, int4.GROUP)
    amax = xv.abs().amax(-1)
    bad = ~torch.isfinite(xv).all(-1)
    c127 = torch.full_like(amax, 127.0)   # tensor / tensor: a true division (a scalar may become a reciprocal)
    inv = torch.where((amax > 0) & ~bad, c127 / torch.where(bad | (amax == 0), 1.0, amax), torch.zeros_like(amax))
    u = torch.where(bad[..., None], 0.0, xv) * inv[..., None]
    hi = torch.round(u).clamp(-127, 127)
    lo = torch.round((u - hi) * 128) if row_codes == 2 else torch.zeros_like(hi)
    xq = 128 * hi + lo                                                  # the row in units of `unit`
    unit = torch.where(bad, float("nan"), amax / c127 * 0.0078125)
    return xq, unit


def _reference_q4q8(x, codes, d, m, row_codes):
    T, K = x.shape
    G = K // int4.GROUP
    xq, unit = _quantized(x, row_codes)
    xs = unit * xq.sum(-1)
    isum = torch.einsum("tgk,ngk->tng", xq.double(), codes.view(-1, G, int4.GROUP).double()).float()   # exact, rounded once
    y = torch.zeros(T, codes.shape[0])
    for g in range(G):
        y = y + d[:, g] * (unit[:, g:g + 1] * isum[:, :, g])
        if m is not None:
            y = y + m[:, g] * xs[:, g:g + 1]
    return y
