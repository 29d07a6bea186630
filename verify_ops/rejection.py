from __future__ import annotations

import torch
from torch import Tensor

from verify_ops._common import ACCEPT, RECOVER, categorical, emit, ragged_layout, take, uniform


def verify_rejection(draft_token_ids: Tensor, cu_num_draft_tokens: Tensor, draft_probs: Tensor | None,
                     target_probs: Tensor, seeds: Tensor, offsets: Tensor,
                     max_k: int) -> tuple[Tensor, Tensor]:
    # Accept x_j iff u_j * q_j(x_j) < p_j(x_j) (q one-hot at x_j when draft_probs is None).
    # At the first rejection j sample norm(max(p_j - q_j, 0)), or p_j if that is all zero;
    # after k acceptances sample the bonus token from p_k.
    k, valid, draft_idx, rows = ragged_layout(cu_num_draft_tokens, max_k)
    x = take(draft_token_ids.long(), draft_idx)
    p_x = target_probs[rows[:, :max_k], x].double()
    n_acc = accepted(p_x, x, draft_idx, draft_probs, valid, seeds, offsets, max_k)
    # The one distribution each request draws its last token from.
    p = target_probs[rows.gather(1, n_acc[:, None].long())[:, 0]].float()
    return emit(x, n_acc, recover(p, x, n_acc, k, draft_idx, draft_probs, seeds, offsets, max_k), max_k), n_acc.int()


def accepted(p_x: Tensor, x: Tensor, draft_idx: Tensor, draft_probs: Tensor | None, valid: Tensor, seeds: Tensor,
             offsets: Tensor, max_k: int) -> Tensor:
    """Accepted prefix lengths ``[R]``: accept draft j iff ``u_j * q_j(x_j) < p_j(x_j)``."""
    q_x = draft_probs[draft_idx, x].double() if draft_probs is not None and x.numel() and \
        draft_probs.shape[0] else torch.ones_like(p_x)
    u = uniform(seeds, offsets, ACCEPT, torch.arange(max_k, device=x.device))
    return ((u * q_x < p_x) & valid).int().cumprod(-1).sum(-1)


def recover(p: Tensor, x: Tensor, n_acc: Tensor, k: Tensor, draft_idx: Tensor, draft_probs: Tensor | None,
            seeds: Tensor, offsets: Tensor, max_k: int) -> Tensor:
    """Each request's last token from its last row ``p [R, V]``: norm(max(p - q, 0)) at a
    rejection (``p`` where that is all zero), ``p`` itself at the bonus row."""
    j = n_acc.long().clamp(max=max(max_k - 1, 0))[:, None]
    rejected = (n_acc < k)[:, None]
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(1, x.gather(1, j), 1.0) if max_k else torch.zeros_like(p)
    else:
        q = take(draft_probs, draft_idx.gather(1, j)[:, 0]).float() if max_k else torch.zeros_like(p)
    residual = (p - q * rejected).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    u_last = uniform(seeds, offsets, RECOVER, torch.zeros(1, dtype=torch.long, device=x.device))[:, 0]
    return categorical(residual, u_last)
