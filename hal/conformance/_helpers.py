"""Shared helpers of the conformance suite: batch builders, device moves, statistics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import Tensor

from hal.ops import cumulative

# Every statistical test fails when its chi-square exceeds the 1 - ALPHA quantile.
ALPHA = 1e-6


def oracle_backend():
    """The `verify_ops` reference behind the usual argument checks."""
    import importlib

    from hal.backend import Backend, BackendSpec
    mod = importlib.import_module("backends.cpu.ops")
    return Backend(BackendSpec(name="oracle", device_type="cpu", load=lambda: mod,
                               always_check_values=True), mod)


def bs_of(be) -> int:
    """The smallest common KV block size the backend supports."""
    return next(b for b in (16, 32, 64, 128, 256) if b in be.spec.block_sizes)


def put(be, *ts):
    """Move tensors (None passes through) to the backend's device."""
    out = tuple(None if t is None else t.to(be.device_type) for t in ts)
    return out if len(out) > 1 else out[0]


def host(*ts):
    out = tuple(None if t is None else t.cpu() for t in ts)
    return out if len(out) > 1 else out[0]


def ragged(drafts: list[list[int]]) -> tuple[Tensor, Tensor]:
    """``(draft_token_ids [N] int64, cu_num_draft_tokens [R+1] int64)``."""
    flat = [t for d in drafts for t in d]
    cu = cumulative(len(d) for d in drafts)
    return torch.tensor(flat, dtype=torch.long), torch.tensor(cu, dtype=torch.long)


def seeds_offsets(R: int, base: int = 0, offset: int = 0) -> tuple[Tensor, Tensor]:
    return (torch.arange(R, dtype=torch.long) * 7919 + base, torch.full((R,), offset, dtype=torch.long))


def chi2_quantile(df: int, alpha: float = ALPHA) -> float:
    """Upper ``alpha`` quantile of chi-square(df), Wilson-Hilferty (no scipy needed)."""
    z = _norm_isf(alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _norm_isf(alpha: float) -> float:
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(mid / math.sqrt(2)) > alpha:
            lo = mid
        else:
            hi = mid
    return lo


def assert_distribution(samples: Tensor, probs: Tensor, what: str) -> None:
    """Chi-square goodness of fit of integer ``samples`` to ``probs`` (cells with
    expected count < 5 are pooled); a sample of probability 0 fails outright."""
    samples = samples.reshape(-1).long().cpu()
    probs = probs.double().cpu() / probs.double().sum()
    n = samples.numel()
    assert n > 0, f"{what}: no samples"
    assert int(samples.min()) >= 0 and int(samples.max()) < probs.numel(), f"{what}: token out of range"
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    impossible = (probs == 0) & (counts > 0)
    assert not bool(impossible.any()), f"{what}: drew tokens of probability 0: {impossible.nonzero().flatten().tolist()}"
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if exp.numel() < 2:
        return
    stat = float(((obs - exp) ** 2 / exp).sum())
    crit = chi2_quantile(exp.numel() - 1)
    assert stat < crit, (f"{what}: chi-square {stat:.1f} >= {crit:.1f} (df {exp.numel() - 1}, alpha {ALPHA}, "
                         f"n {n}); observed {(counts / n).numpy().round(4).tolist()} "
                         f"expected {probs.numpy().round(4).tolist()}")


def random_probs(g: torch.Generator, rows: int, V: int, zeros: float = 0.0) -> Tensor:
    """Random probability rows; a fraction ``zeros`` of entries set to 0 (never a whole row)."""
    p = torch.rand(rows, V, generator=g, dtype=torch.float64) ** 2 + 1e-3
    if zeros:
        z = torch.rand(rows, V, generator=g) < zeros
        z[:, 0] = False
        p = p.masked_fill(z, 0)
    return (p / p.sum(-1, keepdim=True)).float()


def chain_batch(p_rows: Tensor, q_rows: Tensor | None, R: int, drafts: Tensor):
    """``R`` identical-shape chain requests: ``p_rows [k+1, V]`` target rows,
    ``q_rows [k, V]`` draft rows, ``drafts [R, k]``."""
    k = drafts.shape[1]
    cu = torch.arange(R + 1, dtype=torch.long) * k
    target = p_rows.repeat(R, 1)
    draft_probs = None if q_rows is None else q_rows.repeat(R, 1)
    return SimpleNamespace(draft_token_ids=drafts.reshape(-1).long(), cu=cu, target_probs=target,
                           draft_probs=draft_probs, k=k)


def alpha(p: Tensor, q: Tensor) -> Tensor:
    """Acceptance rate sum_x min(p, q) per row."""
    return torch.minimum(p.double(), q.double()).sum(-1)


def accepted_length_probs(alphas: Tensor) -> Tensor:
    """P(num_accepted = n), n = 0..k, for per-position acceptance rates."""
    k = alphas.numel()
    out = torch.zeros(k + 1, dtype=torch.float64)
    reach = 1.0
    for j in range(k):
        out[j] = reach * (1 - float(alphas[j]))
        reach *= float(alphas[j])
    out[k] = reach
    return out
