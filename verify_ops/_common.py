"""Shared helpers: ragged (CSR) layout, counter-based random numbers, sampling."""

from __future__ import annotations

import torch
from torch import Tensor

# Random streams: each op draws from its own, so draws never collide.
SAMPLE, ACCEPT, RECOVER, TYPICAL_BONUS, TREE_ACCEPT, TREE_FINAL = 1, 2, 3, 4, 5, 6

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687      # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685      # 0x94D049BB133111EB


def _lsr(x: Tensor, s: int) -> Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)  # logical shift right on int64


def _wrap(v: int) -> int:
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)  # a Python int as wrapped int64


def _mix(x: Tensor) -> Tensor:
    # splitmix64 finaliser; int64 multiplication wraps modulo 2^64
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def uniform(seeds: Tensor, offsets: Tensor, stream: int, index: Tensor) -> Tensor:
    """Uniforms in (0, 1), float64, ``[R, n]`` for ``index [n]`` (or ``[R, n]``):
    a pure function of (seed, offset, stream, index) per request."""
    key = _mix(_mix(seeds + _wrap(stream * _GOLDEN)) ^ offsets)
    x = _mix(key[:, None] + (index + 1) * _GOLDEN)
    return (_lsr(x, 11).double() + 0.5) * (2.0 ** -53)


def categorical(weights: Tensor, u: Tensor, block: int = 256) -> Tensor:
    """Inverse-CDF draw per row from unnormalised non-negative ``weights [R, V]``
    with uniforms ``u [R]``; never returns a zero-weight token of a non-zero row.

    Two levels, both in float64: find the block of ``block`` tokens holding the
    target mass, then the token inside it (one [R, V] pass instead of a cumsum)."""
    R, V = weights.shape
    block = min(block, V)
    w = torch.nn.functional.pad(weights, (0, (-V) % block)) if V % block else weights   # pad copies: only if needed
    w = w.view(R, w.shape[1] // block, block)
    bcdf = w.sum(-1, dtype=torch.float64).cumsum(-1)                    # [R, nb]
    target = u * bcdf[:, -1]
    bi = torch.searchsorted(bcdf, target[:, None], right=True)[:, 0]
    bi = torch.minimum(bi, _last_true(bcdf > torch.cat([bcdf.new_zeros(R, 1), bcdf[:, :-1]], 1)))
    before = torch.where(bi > 0, bcdf.gather(1, (bi - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = w[torch.arange(R, device=w.device), bi]                      # [R, block]
    j = torch.searchsorted(inner.double().cumsum(-1), (target - before)[:, None], right=True)[:, 0]
    return bi * block + torch.minimum(j, _last_true(inner > 0))


def _last_true(mask: Tensor) -> Tensor:
    return mask.shape[-1] - 1 - mask.flip(-1).int().argmax(-1)


def ragged_layout(cu: Tensor, max_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CSR drafts as padded ``[R, max_k]`` views.

    :returns: ``k [R]``, ``valid [R, max_k]``, ``draft_idx [R, max_k]`` (flat
        draft index, clamped) and ``rows [R, max_k+1]`` (flat target row
        ``cu[r] + r + j``, clamped to the bonus row ``j = k_r``).
    """
    cu = cu.long()
    R = cu.shape[0] - 1
    k = cu[1:] - cu[:-1]
    pos = torch.arange(max_k + 1, device=cu.device)
    valid = pos[None, :max_k] < k[:, None]
    draft_idx = torch.minimum(cu[:-1, None] + pos[:max_k], (cu[1:, None] - 1).clamp(min=0))
    rows = cu[:-1, None] + torch.arange(R, device=cu.device)[:, None] + torch.minimum(pos[None], k[:, None])
    return k, valid, draft_idx, rows


def emit(prefix: Tensor, n_acc: Tensor, last: Tensor, max_k: int) -> Tensor:
    """``[R, max_k+1]`` int32: ``prefix[:, :n_acc]``, then ``last``, then -1."""
    R = n_acc.shape[0]
    pos = torch.arange(max_k + 1, device=n_acc.device)[None]
    full = torch.cat([prefix.long(), torch.zeros(R, 1, dtype=torch.long, device=n_acc.device)], 1)
    out = torch.where(pos < n_acc[:, None], full, -1)
    return torch.where(pos == n_acc[:, None], last.long()[:, None], out).int()


def take(t: Tensor, idx: Tensor) -> Tensor:
    """``t[idx]``, or zeros of that shape when ``t`` is empty (no drafts at all)."""
    return t[idx] if t.shape[0] else t.new_zeros(tuple(idx.shape) + tuple(t.shape[1:]))


def exponential32(seeds: Tensor, offsets: Tensor, stream: int, index: Tensor) -> Tensor:
    """Exp(1) draws in float32 for devices without fp64: ``-log1p(-u)`` with ``u`` built
    from 64 random bits (``(hi + lo * 2^-32) * 2^-32``), so small draws, the ones that let
    a long-tail token win an exponential race, keep their resolution down to 2^-65."""
    key = _mix(_mix(seeds + _wrap(stream * _GOLDEN)) ^ offsets)
    x = _mix(key[:, None] + (index + 1) * _GOLDEN)
    hi, lo = _lsr(x, 32).float(), (x & 0xFFFFFFFF).float()
    u = ((hi + (lo + 0.5) * 2.0 ** -32) * 2.0 ** -32).clamp(max=1 - 2.0 ** -24)
    return -torch.log1p(-u)
