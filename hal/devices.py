"""Moving tensors between devices without blocking the host: `transfer` (one non-blocking
copy, staged through pinned host memory across vendors) and the sparse form of draft
probabilities that crosses a link (`sparse_q` / `dense_q`)."""

from __future__ import annotations

import torch
from torch import Tensor

from hal.errors import arg_error


def _pinned(shape, dtype) -> Tensor:
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError:  # no accelerator runtime here: pageable host memory is all there is
        return torch.empty(shape, dtype=dtype)


def transfer(t: Tensor, device: torch.device) -> Tensor:
    """Move ``t`` to ``device`` without blocking the host. Same device type: one
    non-blocking copy (peer copy on one vendor). Different accelerator vendors: staged
    through pinned host memory (device -> host, host -> device), both non-blocking."""
    if t.device == device:
        return t
    if t.device.type == "cpu" or device.type == "cpu" or t.device.type == device.type:
        src = t
        if t.device.type == "cpu" and not t.is_pinned() and device.type != "cpu":
            src = _pinned(t.shape, t.dtype).copy_(t)
        return src.to(device, non_blocking=True)
    host = _pinned(t.shape, t.dtype)
    host.copy_(t, non_blocking=True)
    return host.to(device, non_blocking=True)


def sparse_q(q: Tensor) -> tuple[Tensor, Tensor]:
    """Draft probabilities sampled with top-k (or top-p) are zero outside a few ids per row:
    send (indices [N, W] int32, values [N, W]) with W the largest non-zero count instead of
    [N, V]. Exact: every non-zero is kept (ties at a cutoff included)."""
    if q.dim() != 2:
        raise arg_error("q", "a [N, V] tensor", f"shape {list(q.shape)}")
    width = max(int((q > 0).sum(-1).max()), 1) if q.shape[0] else 1  # one sync: q is leaving the device
    vals, idx = q.topk(width, dim=-1)
    return idx.to(torch.int32), vals


def dense_q(indices: Tensor, values: Tensor, vocab: int) -> Tensor:
    """Rebuild [N, V] draft probabilities from `sparse_q` output, on the indices' device."""
    if indices.shape != values.shape or indices.dim() != 2:
        raise arg_error("values", f"the indices' shape {list(indices.shape)}", f"shape {list(values.shape)}")
    return torch.zeros(indices.shape[0], vocab, dtype=values.dtype, device=values.device).scatter_(
        1, indices.long(), values)
